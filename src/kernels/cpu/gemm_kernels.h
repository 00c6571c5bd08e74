// Internal to kernels/cpu: the per-ISA blocks of the GEMM driver (gemm_bf16.cpp) and the MXFP4
// expert product (mxfp4_gemm.cpp), and the summation order they share.
//
// ORDER16 (avx2 and portable): an output y = Σ_k x_k·w_k is summed in 8 FP32 lanes. For each group g
// of 16 consecutive k, in order, lane j takes fma(x[16g+2j], w[16g+2j]) and then
// fma(x[16g+2j+1], w[16g+2j+1]); the lanes combine as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); the K mod 16
// tail elements follow one by one with fma. The order depends on K alone, never on how many rows or
// columns a call has or which tile or thread computes the element: that is what makes every GEMM
// row-invariant (a token's result is the same in any batch) and thread-count invariant.
// Why this order: a 256-bit load of 16 bf16 weights splits into the even elements (shift left 16) and
// the odd ones (mask the high half) in one instruction each, and the 16 e2m1 nibbles of 8 packed
// MXFP4 bytes split the same way (low nibbles = even, high = odd). The activations are laid out to
// match once per call ("permuted": per 16-group, the 8 even elements then the 8 odd ones; the tail as is).
//
// AVX512BF16: vdpbf16ps over 32-element groups, 16 lanes (each takes its pair of products), the
// K mod 32 tail through zero-masked loads; lanes combine as (l_i + l_{i+8}) and then the 8-lane tree
// above. Again a function of K alone.
#pragma once

#include <cstdint>

namespace kestrel::cpu::gemm_detail {

// Rows [0, M) × columns [0, N) of one output block: y[m, n] = Σ_k x[m, k] · w[n, k].
struct Block {
  const float* xp = nullptr;    // f32 [M, K] permuted (ORDER16), row stride ldx (avx2 / portable)
  const uint16_t* xb = nullptr; // bf16 [M, K] as given, row stride ldx (avx512bf16)
  int64_t ldx = 0;
  const uint16_t* w = nullptr;  // bf16 [N, K] row stride ldw (bf16 weights), or
  const float* wp = nullptr;    // f32 [N, K] permuted rows, row stride ldw (decoded MXFP4 rows)
  int64_t ldw = 0;
  int64_t M = 0, N = 0, K = 0;
  float* y = nullptr;           // f32 [M, N] row stride ldy, or
  uint16_t* yb = nullptr;       // bf16 [M, N] row stride ldy (rounded once)
  int64_t ldy = 0;
};

void block_portable(const Block& b);
void block_avx2(const Block& b);
void block_avx512bf16(const Block& b);  // b.xb and b.w only

// y = x·Wᵀ for an MXFP4 weight (packed u8 [out, in/2], e8m0 [out, in/32]) and permuted f32 inputs
// xp [T, in]; writes f32 y or bf16 yb [T, out] (row stride ldy). Threaded over 16-row panels.
void mxfp4_rows(const uint8_t* packed, const uint8_t* scale, const float* xp, int64_t T, int64_t out, int64_t in,
                float* y, uint16_t* yb, int64_t ldy);

// x (bf16 or f32 [K]) → the permuted f32 row of ORDER16.
void permute_row_bf16(const uint16_t* x, int64_t K, float* xp);
void permute_row_bf16_avx2(const uint16_t* x, int64_t K, float* xp);  // same result, AVX2 CPUs only
void permute_row_f32(const float* x, int64_t K, float* xp);

}  // namespace kestrel::cpu::gemm_detail
