// CUDA-IPC setup for the one-shot all-reduce; see ipc_allreduce.h.
#include "parallel/ipc_allreduce.h"

#include <cuda_runtime.h>

#include <vector>

#include "core/check.h"
#include "kernels/cuda/allreduce.h"
#include "kernels/cuda/cuda_check.h"

namespace kestrel::parallel {

struct IpcAllReduce::Impl {
  cuda::OneShotBuffers b;
  void* own = nullptr;              // this rank's allocation: control words, then data
  std::vector<void*> opened;        // peers' mappings, closed in the destructor
};

IpcAllReduce::IpcAllReduce(Comm& bootstrap, size_t max_bytes) : impl_(std::make_unique<Impl>()) {
  rank_ = bootstrap.rank();
  size_ = bootstrap.size();
  max_bytes_ = (max_bytes + 15) / 16 * 16;
  if (bootstrap.device() != Device::cpu)
    fail("IpcAllReduce needs a host bootstrap comm (MPI or in-process), not {}", bootstrap.backend());
  if (size_ > cuda::kOneShotMaxRanks)
    fail("IpcAllReduce supports at most {} ranks, got {}", cuda::kOneShotMaxRanks, size_);
  Impl& m = *impl_;
  m.b.n = size_;
  m.b.blocks = cuda::one_shot_blocks(max_bytes_);
  m.b.half_bytes = max_bytes_;
  KCUDA_CHECK(cudaMalloc(&m.own, cuda::kOneShotControlBytes + 2 * max_bytes_));
  KCUDA_CHECK(cudaMemset(m.own, 0, cuda::kOneShotControlBytes));
  KCUDA_CHECK(cudaDeviceSynchronize());

  std::vector<cudaIpcMemHandle_t> handles(static_cast<size_t>(size_));
  if (size_ > 1) {
    cudaIpcMemHandle_t mine{};
    KCUDA_CHECK(cudaIpcGetMemHandle(&mine, m.own));
    bootstrap.all_gather(&mine, handles.data(), sizeof(mine), DType::u8);
  }
  for (int p = 0; p < size_; ++p) {
    void* base = m.own;
    if (p != rank_) {
      KCUDA_CHECK(cudaIpcOpenMemHandle(&base, handles[size_t(p)], cudaIpcMemLazyEnablePeerAccess));
      m.opened.push_back(base);
    }
    m.b.flags[p] = static_cast<uint32_t*>(base);
    m.b.data[p] = static_cast<char*>(base) + cuda::kOneShotControlBytes;
  }
  bootstrap.barrier();
}

IpcAllReduce::~IpcAllReduce() {
  if (!impl_) return;
  for (void* p : impl_->opened) cudaIpcCloseMemHandle(p);
  if (impl_->own) cudaFree(impl_->own);
}

bool IpcAllReduce::supports(size_t count, DType dt) const {
  if (dt != DType::f32 && dt != DType::bf16) return false;
  const size_t bytes = count * dtype_size(dt);
  return bytes % 16 == 0 && bytes <= max_bytes_;
}

void IpcAllReduce::all_reduce_sum(void* buf, size_t count, DType dt, void* stream) {
  if (!supports(count, dt))
    fail("IpcAllReduce: {} elements of {} are not a multiple of 16 bytes or exceed {} bytes", count, dtype_name(dt),
         max_bytes_);
  cuda::one_shot_all_reduce(impl_->b, rank_, buf, buf, count, dt == DType::bf16, static_cast<cudaStream_t>(stream));
}

}  // namespace kestrel::parallel
