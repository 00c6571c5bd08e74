// Row moves by index map on the GPU: the paged-cache glue of the GPU executor (docs/serving.md).
// A paged MLA cache stores token t of a request in row block_table[t / P]·P + t % P of a per-layer
// pool; new rows are scattered into it, and (until the attention kernels read block tables
// themselves) each step gathers a request's rows back into a contiguous scratch. The same launcher
// also picks the logits rows of a batch (the last token of each sequence) before lm_head.
// CPU twin: cpu_copy_rows below (a plain loop), tested in tests/gpu/test_ops_gpu.cpp.
// Index maps live in device memory, so a launch is capturable in a CUDA graph with fixed shapes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace kestrel::cuda {

// dst[dst_idx ? dst_idx[i] : i] = src[src_idx ? src_idx[i] : i] for i < n, rows of row_bytes bytes.
// row_bytes must be a multiple of 16 and src/dst 16-byte aligned; indices must be in range (the
// caller builds them from validated block tables). Rows written by two i must not overlap.
void copy_rows(const void* src /* u8 [*, row_bytes] */, const int32_t* src_idx /* i32 [n] or null */,
               void* dst /* u8 [*, row_bytes] */, const int32_t* dst_idx /* i32 [n] or null */, int64_t n,
               int64_t row_bytes, cudaStream_t stream);

inline void cpu_copy_rows(const void* src, const int32_t* src_idx, void* dst, const int32_t* dst_idx, int64_t n,
                          int64_t row_bytes) {
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(static_cast<char*>(dst) + (dst_idx ? dst_idx[i] : i) * row_bytes,
                static_cast<const char*>(src) + (src_idx ? src_idx[i] : i) * row_bytes, size_t(row_bytes));
}

// Several arrays' rows by one index map in ONE launch (DSpark's keep_verified: every KDA layer's recurrent
// state and conv history of every verify sequence, from the verify trace into the slots).
struct RowArrays {
  const void* src = nullptr;  // u8 [*, row_bytes], 16-byte aligned
  void* dst = nullptr;        // u8 [*, row_bytes], 16-byte aligned
  int64_t row_bytes = 0;      // a positive multiple of 16
};
// For every a < n_arrays and i < n: row dst_idx[i] of arrays[a].dst = row src_idx[i] of arrays[a].src.
// arrays: device RowArrays [n_arrays] (n_arrays ≤ 65535); src_idx, dst_idx: device i32 [n]; max_row_bytes
// ≥ every arrays[a].row_bytes (sizes the grid; the device checks nothing, the caller builds the table).
// Everything the launch reads is in device memory, so it is capturable in a CUDA graph. Rows written by two
// (a, i) must not overlap.
void copy_rows_multi(const RowArrays* arrays, int64_t n_arrays, int64_t max_row_bytes,
                     const int32_t* src_idx /* i32 [n] */, const int32_t* dst_idx /* i32 [n] */, int64_t n,
                     cudaStream_t stream);

// CPU twin of copy_rows_multi over host arrays.
inline void cpu_copy_rows_multi(const RowArrays* arrays, int64_t n_arrays, const int32_t* src_idx,
                                const int32_t* dst_idx, int64_t n) {
  for (int64_t a = 0; a < n_arrays; ++a)
    cpu_copy_rows(arrays[a].src, src_idx, arrays[a].dst, dst_idx, n, arrays[a].row_bytes);
}

// Run-ahead token ids (async scheduling; model/cuda/ahead.h): a step enqueued before the host has the previous
// step's sampled ids marks each such row's token as −2 − k, k the row of the previous step's ids that holds it.
// For i < n: ids[i] ≤ −2 becomes prev[−2 − ids[i]] (a negative one — the sampler's "host samples this row" —
// becomes 0, so the embedding gather stays in range; such a step's output for that row is never used); every other
// entry is left as it is. The host checked every k < n_prev when it built ids (the device checks nothing); one
// small launch, capturable (device memory only).
void resolve_pending_ids(int32_t* ids /* i32 [n] */, int64_t n, const int32_t* prev /* i32 [n_prev] */,
                         cudaStream_t stream);
constexpr int32_t pending_id(int32_t k) { return -2 - k; }  // the mark of "the previous step's id k"

inline void cpu_resolve_pending_ids(int32_t* ids, int64_t n, const int32_t* prev) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] <= -2) ids[i] = prev[-2 - int64_t(ids[i])] < 0 ? 0 : prev[-2 - int64_t(ids[i])];
}

}  // namespace kestrel::cuda
