// MXFP4 -> BF16 dequantisation on the GPU (MODEL.md §4). CPU twin: mxfp4_dequantize_row in
// core/dtype.h. Used to check the checkpoint upload and as the oracle-friendly first kernel of the
// CUDA backend; the grouped expert GEMM reads nibbles directly and never calls this on the hot path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// out[r, c] = e2m1(packed[r, c/2] nibble) * 2^(scale[r, c/32] - 127), rounded to bf16 (exact: every
// MXFP4 value with a scale in bf16 range is representable). cols must be a multiple of 32.
void mxfp4_dequant_bf16(const uint8_t* packed /* u8 [rows, cols/2], row stride ld_packed bytes */,
                        int64_t ld_packed,
                        const uint8_t* scale /* e8m0 [rows, cols/32], row stride ld_scale bytes */,
                        int64_t ld_scale, uint16_t* out /* bf16 [rows, cols], row stride ld_out elems */,
                        int64_t ld_out, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace kestrel::cuda
