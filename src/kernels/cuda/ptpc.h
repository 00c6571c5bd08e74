// PTPC FP8 quantisation on the GPU (--quantization ptpc-fp8): per-row scales (a token of an activation, an
// output channel of a weight) and e4m3 codes, bit-identical to the CPU twin cpu::quantize_fp8_rows
// (kernels/cpu/cpu_ops.h): scale = amax/448 (1 for an all-zero row), q = e4m3_satfinite(x/scale), RNE.
// The GEMMs that consume them: gemm_skinny_fp8 (T ≤ 64) and GemmLt::fp8_ptpc (cuBLASLt, OUTER_VEC_32F scales).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// One CTA per row (PDL launch). C a multiple of 8; x and q rows 16-byte aligned (ldx % 8 == 0, C % 16 == 0
// for q when the rows are to feed the skinny GEMM — q rows are C bytes apart).
void quantize_fp8_rows(const uint16_t* x /* bf16 [R, C], row stride ldx */, int64_t ldx, int64_t R, int64_t C,
                       uint8_t* q /* e4m3 [R, C] */, float* scale /* f32 [R] */, cudaStream_t stream);

}  // namespace kestrel::cuda
