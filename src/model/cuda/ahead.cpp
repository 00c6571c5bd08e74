// Run-ahead sampling's ids (see ahead.h).
#include "model/cuda/ahead.h"

#include <algorithm>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"

namespace kestrel::model::gpu {

AheadIds::~AheadIds() {
  for (Slot& s : slot_) {
    if (s.pin) cudaFreeHost(s.pin);
    if (s.sampled) cudaEventDestroy(s.sampled);
    if (s.copied) cudaEventDestroy(s.copied);
  }
  if (side_) cudaStreamDestroy(side_);
}

void AheadIds::release(cuda::CachingAllocator& a) {
  if (side_) KCUDA_CHECK(cudaStreamSynchronize(side_));
  for (Slot& s : slot_) {
    a.free(s.dev);
    s.dev = nullptr, s.cap = 0, s.n = 0, s.outstanding = false;
    if (s.pin) KCUDA_CHECK(cudaFreeHost(s.pin));
    s.pin = nullptr;
  }
}

int32_t* AheadIds::begin(cuda::CachingAllocator& a, int64_t n) {
  KCHECK(n > 0, "sample_ahead: {} rows", n);
  Slot& s = slot_[issued_ % 2];
  KCHECK(!s.outstanding, "sample_ahead: ticket {} was never taken (at most two tickets outstanding)", s.ticket);
  if (!side_) KCUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  if (!s.sampled) {
    KCUDA_CHECK(cudaEventCreateWithFlags(&s.sampled, cudaEventDisableTiming));
    KCUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
  }
  if (n > s.cap) {
    // Nothing reads the old buffers any more: the slot's last ticket was taken (its side copy done), and the
    // model's stream reuses a freed device buffer only for later work (the caching allocator's stream order).
    a.free(s.dev);
    if (s.pin) KCUDA_CHECK(cudaFreeHost(s.pin));
    s.dev = nullptr, s.pin = nullptr, s.cap = 0;
    const int64_t cap = std::max<int64_t>(n, 64);
    s.dev = static_cast<int32_t*>(a.alloc(size_t(cap) * 4));
    KCUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.pin), size_t(cap) * 4, cudaHostAllocDefault));
    s.cap = cap;
  }
  s.n = n;
  s.ticket = issued_++;
  s.outstanding = true;
  return s.dev;
}

void AheadIds::end(cudaStream_t stream) {
  KCHECK(issued_ > 0, "AheadIds::end without begin");
  Slot& s = slot_[(issued_ - 1) % 2];
  KCUDA_CHECK(cudaEventRecord(s.sampled, stream));
  KCUDA_CHECK(cudaStreamWaitEvent(side_, s.sampled, 0));
  KCUDA_CHECK(cudaMemcpyAsync(s.pin, s.dev, size_t(s.n) * 4, cudaMemcpyDeviceToHost, side_));
  KCUDA_CHECK(cudaEventRecord(s.copied, side_));
}

void AheadIds::take(int64_t k, int32_t* host) {
  KCHECK(k >= 0 && k < issued_, "take_ids: ticket {} was never issued ({} so far)", k, issued_);
  Slot& s = slot_[k % 2];
  KCHECK(s.ticket == k && s.outstanding, "take_ids: ticket {} was already taken", k);
  KCUDA_CHECK(cudaEventSynchronize(s.copied));
  std::copy(s.pin, s.pin + s.n, host);
  s.outstanding = false;
}

}  // namespace kestrel::model::gpu
