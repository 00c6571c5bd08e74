// Row copies by index map (see rows.h): one 16-byte vector per thread step, grid-stride; and the run-ahead
// ids' resolution (one CTA).
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

// blockIdx.y: the array; x: grid-stride over its n rows' 16-byte vectors.
__global__ void copy_rows_multi_kernel(const RowArrays* arrays, const int32_t* src_idx, const int32_t* dst_idx,
                                       int64_t n) {
  const RowArrays a = arrays[blockIdx.y];
  const int64_t row_vecs = a.row_bytes / 16, total = n * row_vecs;
  const uint4* src = static_cast<const uint4*>(a.src);
  uint4* dst = static_cast<uint4*>(a.dst);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row_vecs, c = i % row_vecs;
    dst[int64_t(dst_idx[r]) * row_vecs + c] = src[int64_t(src_idx[r]) * row_vecs + c];
  }
}

__global__ void resolve_pending_ids_kernel(int32_t* ids, int64_t n, const int32_t* prev) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t v = ids[i];
    if (v <= -2) ids[i] = max(prev[-2 - int64_t(v)], 0);
  }
}

}  // namespace

void resolve_pending_ids(int32_t* ids, int64_t n, const int32_t* prev, cudaStream_t stream) {
  KCUDA_REQUIRE(n >= 0 && (n == 0 || (ids != nullptr && prev != nullptr)),
                "resolve_pending_ids: n " + std::to_string(n) + " with a null ids or prev");
  if (n == 0) return;
  // One CTA: a decode batch's ids (≤ a few hundred) are one or two loads per thread.
  resolve_pending_ids_kernel<<<1, 256, 0, stream>>>(ids, n, prev);
  KCUDA_CHECK_LAUNCH();
}

void copy_rows_multi(const RowArrays* arrays, int64_t n_arrays, int64_t max_row_bytes, const int32_t* src_idx,
                     const int32_t* dst_idx, int64_t n, cudaStream_t stream) {
  KCUDA_REQUIRE(n >= 0 && n_arrays >= 0 && n_arrays <= 65535 && max_row_bytes > 0 && max_row_bytes % 16 == 0,
                "copy_rows_multi: n " + std::to_string(n) + ", arrays " + std::to_string(n_arrays) +
                    ", max_row_bytes " + std::to_string(max_row_bytes) + " (a positive multiple of 16)");
  KCUDA_REQUIRE(arrays != nullptr && src_idx != nullptr && dst_idx != nullptr,
                std::string("copy_rows_multi: null table or index map"));
  if (n == 0 || n_arrays == 0) return;
  // About 16 blocks of 256 threads per SM in all, split over the arrays; at least one block per array.
  const int64_t vecs = n * (max_row_bytes / 16);
  const unsigned gx = unsigned(std::max<int64_t>(1, std::min<int64_t>((vecs + 255) / 256, 132 * 16 / n_arrays)));
  copy_rows_multi_kernel<<<dim3(gx, unsigned(n_arrays)), 256, 0, stream>>>(arrays, src_idx, dst_idx, n);
  KCUDA_CHECK_LAUNCH();
}

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
