// PeerAllReduceGroup and its comm decorator; see peer_allreduce.h.
#include "parallel/peer_allreduce.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "core/check.h"
#include "kernels/cuda/allreduce.h"
#include "kernels/cuda/cuda_check.h"

namespace kestrel::parallel {

namespace {

// Restores the calling thread's current device on scope exit (the constructor visits every rank's device).
struct DeviceGuard {
  int saved = 0;
  DeviceGuard() { KCUDA_CHECK(cudaGetDevice(&saved)); }
  ~DeviceGuard() { cudaSetDevice(saved); }
};
}  // namespace

struct PeerAllReduceGroup::Impl {
  std::vector<int> devices;
  bool one_device = false;     // every rank on one GPU: each call fenced by two barriers (peer_allreduce.h)
  cuda::OneShotBuffers b;
  std::vector<void*> own;      // per rank: u8 [cuda::kOneShotControlBytes + 2·max_bytes] on its device
  std::vector<void*> staging;  // per rank: u8 [max_bytes], for messages whose buffer is not 16-byte aligned
  std::atomic<int64_t> calls{0};
};

PeerAllReduceGroup::PeerAllReduceGroup(const std::vector<int>& devices, size_t max_bytes)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  const int n = int(devices.size());
  if (n < 1 || n > cuda::kOneShotMaxRanks)
    fail("--enable-custom-all-reduce supports 1 to {} ranks, got {}", cuda::kOneShotMaxRanks, n);
  m.devices = devices;
  max_bytes = (max_bytes + 15) / 16 * 16;
  m.b.n = n;
  m.b.half_bytes = max_bytes;
  m.b.blocks = cuda::one_shot_blocks(max_bytes);
  const bool one_device = std::all_of(devices.begin(), devices.end(), [&](int d) { return d == devices[0]; });
  m.one_device = one_device && n > 1;
  DeviceGuard guard;
  if (m.one_device) {
    // All ranks' spinning blocks on one device: at most N·G <= SMs / 2 (peer_allreduce.h, the one-device case).
    int sms = 0;
    KCUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, devices[0]));
    m.b.blocks = std::max(1, std::min(m.b.blocks, sms / 2 / n));
  }
  // Peer access both ways between every pair of distinct devices (kernels read and write peers' buffers).
  for (int a = 0; a < n; ++a)
    for (int c = 0; c < n; ++c) {
      const int da = devices[size_t(a)], dc = devices[size_t(c)];
      if (da == dc) continue;
      int can = 0;
      KCUDA_CHECK(cudaDeviceCanAccessPeer(&can, da, dc));
      if (!can)
        fail("--enable-custom-all-reduce: GPU {} (rank {}) cannot access GPU {} (rank {}) as a peer "
             "(cudaDeviceCanAccessPeer); the one-shot all-reduce needs peer access between every pair — run without "
             "the flag (NCCL)",
             da, a, dc, c);
      KCUDA_CHECK(cudaSetDevice(da));
      const cudaError_t e = cudaDeviceEnablePeerAccess(dc, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        (void)cudaGetLastError();  // another group enabled it: fine; clear the recorded error
      else
        KCUDA_CHECK(e);
    }
  for (int r = 0; r < n; ++r) {
    KCUDA_CHECK(cudaSetDevice(devices[size_t(r)]));
    void* p = nullptr;
    void* s = nullptr;
    KCUDA_CHECK(cudaMalloc(&p, cuda::kOneShotControlBytes + 2 * max_bytes));
    m.own.push_back(p);
    KCUDA_CHECK(cudaMalloc(&s, max_bytes));
    m.staging.push_back(s);
    KCUDA_CHECK(cudaMemset(p, 0, cuda::kOneShotControlBytes));
    KCUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any rank's first launch (on another stream) reads it
    m.b.flags[r] = static_cast<uint32_t*>(p);
    m.b.data[r] = static_cast<char*>(p) + cuda::kOneShotControlBytes;
  }
}

PeerAllReduceGroup::~PeerAllReduceGroup() {
  if (!impl_) return;
  int saved = 0;
  cudaGetDevice(&saved);
  for (size_t r = 0; r < impl_->own.size(); ++r) {
    cudaSetDevice(impl_->devices[r]);
    cudaFree(impl_->own[r]);  // synchronises with work still using it
    cudaFree(impl_->staging[r]);
  }
  cudaSetDevice(saved);
}

int PeerAllReduceGroup::size() const { return impl_->b.n; }
size_t PeerAllReduceGroup::max_bytes() const { return impl_->b.half_bytes; }
int PeerAllReduceGroup::blocks() const { return impl_->b.blocks; }
int64_t PeerAllReduceGroup::calls() const { return impl_->calls.load(); }

bool PeerAllReduceGroup::takes(size_t count, DType dt) const {
  if (dt != DType::f32 && dt != DType::bf16) return false;
  const size_t bytes = count * dtype_size(dt);
  return count > 0 && bytes % 16 == 0 && bytes <= impl_->b.half_bytes;
}

// Rank r's comm: the one-shot path for what takes() accepts, `inner` for everything else.
class OneShotComm final : public Comm {
 public:
  OneShotComm(PeerAllReduceGroup& g, std::unique_ptr<Comm> inner, int rank, cudaStream_t stream)
      : g_(g), inner_(std::move(inner)), rank_(rank), stream_(stream) {}

  int rank() const override { return rank_; }
  int size() const override { return g_.size(); }
  std::string backend() const override { return inner_->backend() + "+one-shot"; }
  Device device() const override { return Device::cuda; }

  void all_reduce_sum(void* buf, size_t count, DType dt) override {
    if (!g_.takes(count, dt)) return inner_->all_reduce_sum(buf, count, dt);
    PeerAllReduceGroup::Impl& m = *g_.impl_;
    const bool bf16 = dt == DType::bf16;
    const size_t bytes = count * dtype_size(dt);
    // The kernel reads and writes 16-byte vectors: a misaligned message is staged (same call on every rank).
    const bool staged = reinterpret_cast<uintptr_t>(buf) % 16 != 0;
    void* data = staged ? m.staging[size_t(rank_)] : buf;
    if (staged) KCUDA_CHECK(cudaMemcpyAsync(data, buf, bytes, cudaMemcpyDeviceToDevice, stream_));
    if (m.one_device) inner_->barrier();  // every rank's stream drained: the device is idle
    cuda::one_shot_all_reduce(m.b, rank_, data, data, count, bf16, stream_);
    if (m.one_device) inner_->barrier();  // every rank's kernel enqueued before anything else is
    if (staged) KCUDA_CHECK(cudaMemcpyAsync(buf, data, bytes, cudaMemcpyDeviceToDevice, stream_));
    m.calls.fetch_add(1);
  }
  void all_gather(const void* send, void* recv, size_t count, DType dt) override {
    inner_->all_gather(send, recv, count, dt);
  }
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dt) override {
    inner_->reduce_scatter_sum(send, recv, count, dt);
  }
  void broadcast(void* buf, size_t count, DType dt, int root) override { inner_->broadcast(buf, count, dt, root); }
  void all_to_all(const void* send, void* recv, size_t count, DType dt) override {
    inner_->all_to_all(send, recv, count, dt);
  }
  void barrier() override { inner_->barrier(); }

 private:
  PeerAllReduceGroup& g_;
  std::unique_ptr<Comm> inner_;
  int rank_;
  cudaStream_t stream_;
};

std::unique_ptr<Comm> PeerAllReduceGroup::wrap(std::unique_ptr<Comm> inner, int rank, void* stream) {
  KCHECK(inner && inner->size() == size() && inner->rank() == rank && inner->device() == Device::cuda,
         "PeerAllReduceGroup::wrap: rank {} of {} needs a device comm of the same rank and size", rank, size());
  return std::make_unique<OneShotComm>(*this, std::move(inner), rank, static_cast<cudaStream_t>(stream));
}

}  // namespace kestrel::parallel
