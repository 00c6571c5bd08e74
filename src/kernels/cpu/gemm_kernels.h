// Internal to kernels/cpu: the GEMM's packed-weight layout, its per-ISA micro-kernels, and the
// summation orders the kernels promise.
//
// bf16 GEMMs (gemm_bf16.cpp) sum each output in ORDER_K: y = fma(x_{K−1}, w_{K−1}, … fma(x_0, w_0, +0)),
// sequentially over k, in FP32, on avx2 and portable alike (bit-identical). Vectors run across 16
// outputs at a time (a "panel"), the activation broadcast: the classic outer-product micro-kernel
// (6 rows × 16 outputs, 12 accumulators), which needs W transposed — hence packing. The order
// depends on K alone, never on how many rows a call has, which tile or thread computes an element:
// every GEMM is row-invariant (a token's result is the same in any batch) and thread-count invariant.
// avx512bf16 sums in ORDER_K2: pairs (2p, 2p+1) inside vdpbf16ps, sequentially over p (also a
// function of K alone; different bits from ORDER_K).
//
// Panel layouts (16 outputs n0..n0+15 of W [N, K]; outputs past N are zero):
//   kAvx2:   K rows of 8 dwords; dword j of row k = bf16 W[n0+j, k] | bf16 W[n0+8+j, k] << 16, so
//            `v << 16` gives outputs 0..7 as f32 and `v & 0xFFFF0000` outputs 8..15 (two ALU ops).
//   kPairs:  ⌈K/2⌉ rows of 16 dwords; dword j of row p = bf16 W[n0+j, 2p] | W[n0+j, 2p+1] << 16 (the
//            operand vdpbf16ps wants; an odd K pads with a zero weight).
// A panel is 32·K (kAvx2) or 64·⌈K/2⌉ (kPairs) bytes: the weight's own size, so a packed weight
// costs as much memory as the bf16 original, and decode reads as many bytes as before.
//
// ORDER16 (the MXFP4 expert product, mxfp4_gemm.cpp): 8 lanes over k; per group g of 16 consecutive
// k, lane j takes fma(x[16g+2j], w[16g+2j]) and then fma(x[16g+2j+1], w[16g+2j+1]); the lanes combine
// as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); the K mod 16 tail follows with fma one by one. Decoded MXFP4
// rows split into even and odd elements for free (low and high nibbles), hence this order there;
// activations are laid out to match once per call ("permuted": per 16-group the 8 even elements,
// then the 8 odd ones; the tail as is).
//
// ORDER_B32 (the MXFP4 expert product on avx512bf16, mxfp4_avx512.cpp): 16 lanes over k; per 32-block
// b, lane i adds the pair (x[32b+2i]·w[32b+2i], x[32b+2i+1]·w[32b+2i+1]) inside vdpbf16ps, blocks in
// order; the lanes then fold as lane i + lane i+8, then +4, +2, +1. Bf16 activations, natural order.
#pragma once

#include <cstdint>

namespace kestrel::cpu::gemm_detail {

enum class PanelFormat : uint8_t { kAvx2, kPairs };

// A weight in panels: panel i (outputs 16i..16i+15) starts at data + i·stride (dwords).
struct PackedView {
  const uint32_t* data = nullptr;
  int64_t N = 0, K = 0, stride = 0;
  PanelFormat format = PanelFormat::kAvx2;
};

int64_t panel_dwords(PanelFormat f, int64_t K);  // stride of one panel
// Packs W (bf16 [N, K] row-major with row stride ldw, or k-major: W[n, k] at w[k·ldw + n]) into
// ⌈N/16⌉ panels at out (ceil(N/16)·panel_dwords dwords).
void pack(const uint16_t* w, int64_t ldw, bool kmajor, int64_t N, int64_t K, PanelFormat f, uint32_t* out);

// Rows [0, M) of the output block: y[m, n] = Σ_k x[m, k] · W[n0 + n, k] for panels
// [p0, p0 + np) of `w` (n counted from the first of them), written as f32 or rounded to bf16.
struct PanelBlock {
  const float* x = nullptr;     // f32 [M, K], row stride ldx (ORDER_K paths)
  const uint16_t* xb = nullptr; // bf16 [M, Kp], Kp = K rounded up to even, row stride ldx; for odd K a
                                // zero at column K (kPairs)
  int64_t ldx = 0, M = 0;
  PackedView w;
  int64_t p0 = 0, np = 0;
  float* y = nullptr;           // f32 [M, N] row stride ldy, or
  uint16_t* yb = nullptr;       // bf16 [M, N] row stride ldy; both already offset to output n0 = 16·p0
  int64_t ldy = 0;
};
void panels_portable(const PanelBlock& b);
void panels_avx2(const PanelBlock& b);
void panels_avx512bf16(const PanelBlock& b);

// ---- ORDER16 (MXFP4) --------------------------------------------------------------------------

// Rows [0, M) × columns [0, N): y[m, n] = Σ_k x[m, k] · w[n, k] with permuted f32 weights rows.
struct Block {
  const float* xp = nullptr;    // f32 [M, K] permuted (ORDER16), row stride ldx
  int64_t ldx = 0;
  const float* wp = nullptr;    // f32 [N, K] permuted rows (decoded MXFP4), row stride ldw
  int64_t ldw = 0;
  int64_t M = 0, N = 0, K = 0;
  float* y = nullptr;           // f32 [M, N] row stride ldy, or
  uint16_t* yb = nullptr;       // bf16 [M, N] row stride ldy (rounded once)
  int64_t ldy = 0;
};
void block_portable(const Block& b);
void block_avx2(const Block& b);

// y = x·Wᵀ for an MXFP4 weight (packed u8 [out, in/2], e8m0 [out, in/32]) and permuted f32 inputs
// xp [T, in]; writes f32 y or bf16 yb [T, out] (row stride ldy). Threaded over 16-row panels.
void mxfp4_rows(const uint8_t* packed, const uint8_t* scale, const float* xp, int64_t T, int64_t out, int64_t in,
                float* y, uint16_t* yb, int64_t ldy);

// The same product in ORDER_B32 from bf16 activations x [T, in] (row stride ldx); avx512bf16 CPUs only.
void mxfp4_rows_bf16(const uint8_t* packed, const uint8_t* scale, const uint16_t* x, int64_t ldx, int64_t T,
                     int64_t out, int64_t in, float* y, uint16_t* yb, int64_t ldy);

// x (bf16 or f32 [K]) → the permuted f32 row of ORDER16.
void permute_row_bf16(const uint16_t* x, int64_t K, float* xp);
void permute_row_bf16_avx2(const uint16_t* x, int64_t K, float* xp);  // same result, AVX2 CPUs only
void permute_row_f32(const float* x, int64_t K, float* xp);

}  // namespace kestrel::cpu::gemm_detail
