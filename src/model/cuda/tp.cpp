// Tensor parallelism in the GPU forward (docs/parallel.md §3 and §8; CPU twin: model/tp.cpp): the two
// collectives the layers call at their sublayer ends, through the rank's Comm (NCCL across GPUs, or the
// same-device comm of the tests), enqueued on / synchronous with the model's stream.
//
// Numerics: a row-parallel projection's partial output is rounded to BF16 on each rank (the GEMM's
// epilogue) and the all-reduce sums the N partials in FP32 and rounds once more, so a TP result carries
// one extra BF16 rounding per sublayer against TP1 (the CPU twin keeps the partials in FP32); BF16 noise.
#include <cuda_runtime.h>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "model/cuda/layers.h"
#include "parallel/comm.h"

namespace kestrel::model::gpu {

void tp_all_reduce(Context& x, u16* y, int64_t n) {
  if (!x.split() || n == 0) return;
  x.tp.comm->all_reduce_sum(y, size_t(n), DType::bf16);
}

void tp_gather_columns(Context& x, const void* local, int64_t T, int64_t w, DType dt, void* full) {
  const size_t esz = dtype_size(dt), row = size_t(w) * esz;
  if (T == 0 || w == 0) return;
  if (!x.split()) {
    KCUDA_CHECK(cudaMemcpyAsync(full, local, size_t(T) * row, cudaMemcpyDeviceToDevice, x.stream));
    return;
  }
  const int N = x.tp.size;
  // dt [N, T, w]: rank p's block at p·T·w, then each block's rows into its column range of the full rows.
  auto* blocks = x.tmp<uint8_t>(int64_t(size_t(N) * size_t(T) * row));
  x.tp.comm->all_gather(local, blocks, size_t(T * w), dt);
  for (int p = 0; p < N; ++p)
    KCUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint8_t*>(full) + size_t(p) * row, size_t(N) * row,
                                  blocks + size_t(p) * size_t(T) * row, row, row, size_t(T), cudaMemcpyDeviceToDevice,
                                  x.stream));
}

}  // namespace kestrel::model::gpu
