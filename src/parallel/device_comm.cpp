// Same-device communicator (see device_comm.h).
#include "parallel/device_comm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/allreduce.h"
#include "parallel/inproc_comm.h"

namespace kestrel::parallel {
namespace {

void check_cuda_dc(cudaError_t e, const char* call) {
  if (e != cudaSuccess) fail("same-device comm: {} failed: {}", call, cudaGetErrorString(e));
}
#define KDC(call) check_cuda_dc((call), #call)

enum class Op : uint64_t { all_reduce = 1, all_gather, reduce_scatter, broadcast, all_to_all, barrier };

// What a rank publishes for one collective: the call (compared across ranks) and its buffer.
struct Desc {
  uint64_t op = 0, count = 0, dt = 0, root = 0;
  uint64_t ptr = 0;  // the rank's send (or in-place) buffer
};

}  // namespace

struct SameDeviceGroup::Impl {
  int size, device;
  size_t chunk;  // bytes per reduction piece, a multiple of 16
  InProcessGroup host;
  cuda::OneShotBuffers bufs;    // the one-shot kernel's exchange buffers and flags, per rank
  std::vector<void*> staging;   // u8 [chunk] per rank: the message piece, reduced in place
  std::vector<cudaStream_t> streams;
  Impl(int n, int dev, size_t max_bytes) : size(n), device(dev), chunk(max_bytes), host(n) {}
};

class SameDeviceComm final : public Comm {
 public:
  SameDeviceComm(SameDeviceGroup::Impl& g, int rank, cudaStream_t stream)
      : g_(g), host_(g.host.comm(rank)), rank_(rank), stream_(stream) {}

  int rank() const override { return rank_; }
  int size() const override { return g_.size; }
  std::string backend() const override { return "same-device"; }
  Device device() const override { return Device::cuda; }

  void all_reduce_sum(void* buf, size_t count, DType dt) override {
    check_reduce_dtype(dt, "all_reduce_sum");
    const size_t bytes = comm_bytes(count, dt);
    exchange(Op::all_reduce, buf, count, dt, 0);  // the call matches on every rank
    for (size_t off = 0; off < bytes; off += g_.chunk) {
      const size_t n = std::min(g_.chunk, bytes - off), padded = (n + 15) / 16 * 16;
      auto* mine = static_cast<uint8_t*>(g_.staging[size_t(rank_)]);
      KDC(cudaMemcpyAsync(mine, static_cast<uint8_t*>(buf) + off, n, cudaMemcpyDeviceToDevice, stream_));
      if (padded > n) KDC(cudaMemsetAsync(mine + n, 0, padded - n, stream_));  // zeros add nothing
      KDC(cudaStreamSynchronize(stream_));
      host_->barrier();  // every rank's piece staged
      if (rank_ == 0) {
        std::vector<const void*> in(g_.staging.begin(), g_.staging.end());
        std::vector<void*> out(g_.staging.begin(), g_.staging.end());
        cuda::one_shot_all_reduce_emulated(g_.bufs, in.data(), out.data(), padded / dtype_size(dt), dt == DType::bf16,
                                           stream_);
        KDC(cudaStreamSynchronize(stream_));
      }
      host_->barrier();  // reduced into every staging buffer
      KDC(cudaMemcpyAsync(static_cast<uint8_t*>(buf) + off, mine, n, cudaMemcpyDeviceToDevice, stream_));
      KDC(cudaStreamSynchronize(stream_));
      // The next piece overwrites only this rank's staging buffer, after this copy; rank 0 reduces it only
      // once every rank has staged again (the first barrier), so no third barrier is needed.
    }
  }

  void all_gather(const void* send, void* recv, size_t count, DType dt) override {
    const size_t b = comm_bytes(count, dt);
    const std::vector<Desc> all = exchange(Op::all_gather, send, count, dt, 0);
    for (int p = 0; p < size(); ++p)
      copy(static_cast<uint8_t*>(recv) + size_t(p) * b, all[size_t(p)].ptr, b);
    finish();
  }

  void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dt) override {
    check_reduce_dtype(dt, "reduce_scatter_sum");
    // Not on the forward's path: the whole [size, count] message all-reduced in a scratch copy.
    const size_t b = comm_bytes(count, dt), all_b = b * size_t(size());
    void* tmp = nullptr;
    KDC(cudaMalloc(&tmp, std::max<size_t>(all_b, 16)));
    try {
      KDC(cudaMemcpyAsync(tmp, send, all_b, cudaMemcpyDeviceToDevice, stream_));
      all_reduce_sum(tmp, count * size_t(size()), dt);
      KDC(cudaMemcpyAsync(recv, static_cast<uint8_t*>(tmp) + size_t(rank_) * b, b, cudaMemcpyDeviceToDevice, stream_));
      KDC(cudaStreamSynchronize(stream_));
    } catch (...) {
      cudaFree(tmp);
      throw;
    }
    KDC(cudaFree(tmp));
  }

  void broadcast(void* buf, size_t count, DType dt, int root) override {
    KCHECK(root >= 0 && root < size(), "broadcast root {} outside [0, {})", root, size());
    const std::vector<Desc> all = exchange(Op::broadcast, buf, count, dt, root);
    if (rank_ != root) copy(buf, all[size_t(root)].ptr, comm_bytes(count, dt));
    finish();
  }

  void all_to_all(const void* send, void* recv, size_t count, DType dt) override {
    const size_t b = comm_bytes(count, dt);
    const std::vector<Desc> all = exchange(Op::all_to_all, send, count, dt, 0);
    for (int p = 0; p < size(); ++p)
      copy(static_cast<uint8_t*>(recv) + size_t(p) * b, all[size_t(p)].ptr + uint64_t(rank_) * b, b);
    finish();
  }

  void barrier() override {
    exchange(Op::barrier, nullptr, 0, DType::u8, 0);
  }

 private:
  // Waits for this rank's stream (its buffer is final), then publishes the call and the buffer and
  // returns every rank's; a call that differs between ranks is the same Error on every rank.
  std::vector<Desc> exchange(Op op, const void* ptr, size_t count, DType dt, int root) {
    KDC(cudaStreamSynchronize(stream_));
    Desc mine;
    mine.op = uint64_t(op), mine.count = count, mine.dt = uint64_t(dt), mine.root = uint64_t(root);
    mine.ptr = uint64_t(reinterpret_cast<uintptr_t>(ptr));
    std::vector<Desc> all(static_cast<size_t>(size()));
    host_->all_gather(&mine, all.data(), sizeof(Desc), DType::u8);
    for (const Desc& d : all)
      if (d.op != mine.op || d.count != mine.count || d.dt != mine.dt || d.root != mine.root)
        fail("same-device comm: ranks disagree on a collective (op {} count {} dtype {} root {} vs op {} count {} "
             "dtype {} root {})",
             all[0].op, all[0].count, all[0].dt, all[0].root, d.op, d.count, d.dt, d.root);
    return all;
  }
  void copy(void* dst, uint64_t src, size_t n) {
    if (n == 0) return;
    KDC(cudaMemcpyAsync(dst, reinterpret_cast<const void*>(uintptr_t(src)), n, cudaMemcpyDeviceToDevice, stream_));
  }
  // Waits for this rank's copies, then for every rank's: only then may a peer reuse the buffer it sent.
  void finish() {
    KDC(cudaStreamSynchronize(stream_));
    host_->barrier();
  }

  SameDeviceGroup::Impl& g_;
  std::unique_ptr<Comm> host_;
  int rank_;
  cudaStream_t stream_;
};

SameDeviceGroup::SameDeviceGroup(int size, int device, size_t max_bytes) {
  KCHECK(size >= 1 && size <= cuda::kOneShotMaxRanks, "same-device comm: {} ranks (1..{})", size,
         cuda::kOneShotMaxRanks);
  KCHECK(max_bytes >= 16 && max_bytes % 16 == 0, "same-device comm: piece size {} must be a positive multiple of 16",
         max_bytes);
  impl_ = std::make_unique<Impl>(size, device, max_bytes);
  KDC(cudaSetDevice(device));
  cuda::OneShotBuffers& b = impl_->bufs;
  b.n = size;
  b.blocks = cuda::one_shot_blocks(max_bytes);
  b.half_bytes = max_bytes;
  try {
    for (int p = 0; p < size; ++p) {
      KDC(cudaMalloc(&b.data[p], 2 * max_bytes));
      void* f = nullptr;
      KDC(cudaMalloc(&f, cuda::kOneShotFlagBytes));
      KDC(cudaMemset(f, 0, cuda::kOneShotFlagBytes));  // the protocol's epochs and flags start at zero
      b.flags[p] = static_cast<uint32_t*>(f);
      void* s = nullptr;
      KDC(cudaMalloc(&s, max_bytes));
      impl_->staging.push_back(s);
    }
    KDC(cudaDeviceSynchronize());
  } catch (...) {
    for (int p = 0; p < size; ++p) cudaFree(b.data[p]), cudaFree(b.flags[p]);
    for (void* s : impl_->staging) cudaFree(s);
    throw;
  }
}

SameDeviceGroup::~SameDeviceGroup() {
  cuda::OneShotBuffers& b = impl_->bufs;
  for (int p = 0; p < impl_->size; ++p) cudaFree(b.data[p]), cudaFree(b.flags[p]);
  for (void* s : impl_->staging) cudaFree(s);
}

int SameDeviceGroup::size() const { return impl_->size; }

std::unique_ptr<Comm> SameDeviceGroup::comm(int rank, void* stream) {
  KCHECK(rank >= 0 && rank < impl_->size, "same-device comm: rank {} outside [0, {})", rank, impl_->size);
  return std::make_unique<SameDeviceComm>(*impl_, rank, static_cast<cudaStream_t>(stream));
}

void SameDeviceGroup::abort(const std::string& why) { impl_->host.abort(why); }

}  // namespace kestrel::parallel
