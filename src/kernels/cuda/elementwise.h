// Small elementwise ops of the GPU forward pass (MODEL.md §3 conventions: FP32 arithmetic on BF16
// inputs, one BF16 rounding). CPU counterparts are the inline loops of model/*.cpp and
// cpu::situ_glu (kernels/cpu/cpu_ops.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// out[t] = table[ids[t]] (rows of D bf16 values). D a multiple of 8.
void embed_gather(const uint16_t* table /* bf16 [V, D] */, const int32_t* ids /* i32 [T] */, int64_t T, int64_t D,
                  uint16_t* out /* bf16 [T, D] */, cudaStream_t stream);
// out = bf16(a + b); out may alias a.
void add_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n, cudaStream_t stream);
// a[t, f] = bf16(SiTU-GLU(gu[t, f], gu[t, F + f])), gu rows of ld elements (the [gate | up] GEMM output).
void situ_glu_bf16(const uint16_t* gu /* bf16 [T, ld] */, int64_t ld, int64_t T, int64_t F, float beta,
                   float linear_beta, uint16_t* a /* bf16 [T, F] */, cudaStream_t stream);
// The same over the 8-interleaved [gate | up] output of a stacked GEMM (gemm_skinny.h GemmEpi::situ_glu8):
// gate f at column 16·(f/8) + f%8, up f at 16·(f/8) + 8 + f%8 of each gu row. F a multiple of 8.
void situ_glu_i8_bf16(const uint16_t* gu /* bf16 [T, ld] */, int64_t ld, int64_t T, int64_t F, float beta,
                      float linear_beta, uint16_t* a /* bf16 [T, F], row stride lda */, int64_t lda, cudaStream_t stream);
// o = bf16(o · σ(g)) (MLA output gate, §3.4 step 5).
void sigmoid_gate_bf16(uint16_t* o, const uint16_t* g, int64_t n, cudaStream_t stream);
// y[t, c] = float(x[t, c]) for c < C (x rows of ldx elements, y contiguous).
void bf16_to_f32_2d(const uint16_t* x, int64_t ldx, int64_t T, int64_t C, float* y, cudaStream_t stream);

}  // namespace kestrel::cuda
