// Row copies by index map (see rows.h): one 16-byte vector per thread step, grid-stride.
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rows.h"

namespace kestrel::cuda {
namespace {

__global__ void copy_rows_kernel(const uint4* src, const int32_t* src_idx, uint4* dst, const int32_t* dst_idx,
                                 int64_t n, int64_t row_vecs) {
  const int64_t total = n * row_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row_vecs, c = i % row_vecs;
    const int64_t s = src_idx ? src_idx[r] : r, d = dst_idx ? dst_idx[r] : r;
    dst[d * row_vecs + c] = src[s * row_vecs + c];
  }
}

}  // namespace

void copy_rows(const void* src, const int32_t* src_idx, void* dst, const int32_t* dst_idx, int64_t n,
               int64_t row_bytes, cudaStream_t stream) {
  KCUDA_REQUIRE(n >= 0 && row_bytes > 0 && row_bytes % 16 == 0,
                "copy_rows: n " + std::to_string(n) + ", row_bytes " + std::to_string(row_bytes) +
                    " (a positive multiple of 16)");
  KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0,
                std::string("copy_rows: src and dst must be 16-byte aligned"));
  if (n == 0) return;
  const int64_t vecs = n * (row_bytes / 16);
  const unsigned grid = unsigned(std::min<int64_t>((vecs + 255) / 256, 132 * 16));
  copy_rows_kernel<<<grid, 256, 0, stream>>>(static_cast<const uint4*>(src), src_idx, static_cast<uint4*>(dst),
                                             dst_idx, n, row_bytes / 16);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
