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

}  // namespace kestrel::cuda
