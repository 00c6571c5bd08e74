// CPU kernels for the K3.1 text model: the reference-precision building blocks of MODEL.md §3.
//
// Every op is a plain function on raw pointers; bf16 values travel as their uint16_t bit patterns
// (core/dtype.h). Accumulation is FP32 throughout and each op rounds to BF16 at most once, at the
// point §3 names, so the model code decides every rounding explicitly. Ops are threaded over the
// process-wide pool (thread_pool.h) by independent outputs, never inside a reduction, and the SIMD
// path is chosen at run time (isa.h): results never depend on the thread count or on how many rows
// share a call (row invariance: the CPU engine's batch invariance rests on it).
//
// Summation order is part of the contract where tests rely on it (gemm_kernels.h): gemm_* sum each
// output sequentially over k with fma (ORDER_K; pairs inside vdpbf16ps on avx512bf16), mxfp4_gemm in
// ORDER16 (8 lanes, a fixed final tree); avx2 and portable are bit-identical; the tests' twins repeat
// the orders.
// Ops named *_fast are the vectorised versions of a scalar twin of the same name (exp/tanh within a
// few ulps, see simd_avx2.h); the twins stay the reference the GPU tests compare against.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>

#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }

void bf16_to_f32_n(const uint16_t* x /* bf16 [n] */, float* y /* f32 [n] */, int64_t n);
void f32_to_bf16_n(const float* x /* f32 [n] */, uint16_t* y /* bf16 [n] */, int64_t n);

// y = x·Wᵀ, FP32 accumulation, FP32 output (router, indexer weights_proj, lm_head). Any T: the same
// per-element arithmetic for every row count (gemm_bf16.cpp), so a row's result never depends on
// the other rows of the call.
void gemm_bf16_f32(const uint16_t* x /* bf16 [T, in], row stride ldx */, int64_t ldx,
                   const uint16_t* w /* bf16 [out, in], contiguous */,
                   float* y /* f32 [T, out], row stride ldy */, int64_t ldy, int64_t T, int64_t in, int64_t out);
// Lin(W)(x) of MODEL.md §3: the same product rounded once to BF16.
void gemm_bf16(const uint16_t* x /* bf16 [T, in], row stride ldx */, int64_t ldx,
               const uint16_t* w /* bf16 [out, in], contiguous */,
               uint16_t* y /* bf16 [T, out], row stride ldy */, int64_t ldy, int64_t T, int64_t in, int64_t out);
// The same with FP32 activations (ORDER_K on every ISA).
void gemm_f32_bf16w(const float* x /* f32 [T, in], row stride ldx */, int64_t ldx,
                    const uint16_t* w /* bf16 [out, in], contiguous */,
                    float* y /* f32 [T, out], row stride ldy */, int64_t ldy, int64_t T, int64_t in, int64_t out);
// Several weights applied to one input in one call (q/k/v/g of KDA, gate/up of an MLP): the input is
// prepared once and all outputs share one parallel region. Each output is exactly what gemm_bf16
// (y) or gemm_bf16_f32 (yf) would give.
struct GemmOut {
  const uint16_t* w = nullptr;  // bf16 W [out, in]: W[n, k] at w[n·ldw + k], or at w[k·ldw + n] if w_kmajor
  int64_t out = 0;
  uint16_t* y = nullptr;        // bf16 [T, out], row stride ldy, or
  float* yf = nullptr;          // f32 [T, out], row stride ldy
  int64_t ldy = 0;
  int64_t ldw = 0;              // 0: in (row-major) or out (k-major), i.e. contiguous
  bool w_kmajor = false;
};
void gemm_bf16_multi(const uint16_t* x /* bf16 [T, in], row stride ldx */, int64_t ldx, int64_t T, int64_t in,
                     std::span<const GemmOut> outs);
// The general form: activations bf16 (xb) or f32 (xf), exactly one of them.
void gemm_multi(const uint16_t* xb /* bf16 [T, in] */, const float* xf /* f32 [T, in] */, int64_t ldx, int64_t T,
                int64_t in, std::span<const GemmOut> outs);

// Packed weights (gemm_kernels.h panels) for one set of model weights, packed on first use while a
// PackedScope names them on the calling thread. The CPU executor holds one for its model: every
// weight is then transposed once, not once per call. Results are the same with or without.
// Entries are keyed by the weight's address and shape: the object must not outlive the weights.
class PackedWeights {
 public:
  PackedWeights();
  ~PackedWeights();
  PackedWeights(const PackedWeights&) = delete;
  PackedWeights& operator=(const PackedWeights&) = delete;
  int64_t bytes() const;  // packed so far
  struct Impl;
  Impl* impl() { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};
class PackedScope {
 public:
  explicit PackedScope(PackedWeights* p);  // null: no cache
  ~PackedScope();
  PackedScope(const PackedScope&) = delete;
  PackedScope& operator=(const PackedScope&) = delete;

 private:
  PackedWeights* prev_;
};

// y = x·Wᵀ for an MXFP4 weight (MODEL.md §4) straight from packed nibbles and e8m0 scales: each
// row is decoded once per call and applied to all T inputs; no full dequantised matrix ever exists.
// FP32 output, no rounding, ORDER16.
void mxfp4_gemm(const uint8_t* packed /* u8 [out, in/2] */, const uint8_t* scale /* e8m0 [out, in/32] */,
                const float* x /* f32 [T, in] */, float* y /* f32 [T, out] */, int64_t T, int64_t out, int64_t in);

// PTPC FP8 (--quantization ptpc-fp8; fp8_ptpc.cpp). Each row r (a weight's output channel, or a token of
// an activation) gets scale[r] = amax_r / 448 (amax_r = max |x[r, :]|; 1 for an all-zero or non-finite
// row), q[r, c] = e4m3(x[r, c] / scale[r]) rounded to nearest even, saturating at ±448 (FP32 division).
void quantize_fp8_rows(const uint16_t* x /* bf16 [R, C], row stride ldx */, int64_t ldx, int64_t R, int64_t C,
                       uint8_t* q /* e4m3 [R, C] */, float* scale /* f32 [R] */);
// y[t, n] = bf16((Σ_k xq[t, k]·wq[n, k])·ws[n]·xs[t]): e4m3 products (exact in FP32) summed in FP32 in k
// order, scaled by the weight's then the token's scale, rounded once.
void gemm_ptpc_fp8(const uint8_t* xq /* e4m3 [T, K] */, const float* xs /* f32 [T] */,
                   const uint8_t* wq /* e4m3 [N, K] */, const float* ws /* f32 [N] */,
                   uint16_t* y /* bf16 [T, N], row stride ldy */, int64_t ldy, int64_t T, int64_t K, int64_t N);

// MODEL.md §3 conventions: y = w ⊙ bf16(x · rsqrt(mean(x²) + eps)), normalise in FP32, round, then
// multiply by the weight and round again.
void rmsnorm_bf16(const uint16_t* x /* bf16 [T, n] */, const uint16_t* w /* bf16 [n] */,
                  uint16_t* y /* bf16 [T, n] */, int64_t T, int64_t n, float eps);

// SiTU-GLU (MODEL.md §3.6 step 3): a = β·tanh(g/β)·σ(g) · βl·tanh(u/βl), FP32, one BF16 rounding.
void situ_glu(const uint16_t* g /* bf16 [n] */, const uint16_t* u /* bf16 [n] */, uint16_t* a /* bf16 [n] */,
              int64_t n, float beta, float linear_beta);
void situ_glu_fast(const uint16_t* g /* bf16 [n] */, const uint16_t* u /* bf16 [n] */, uint16_t* a /* bf16 [n] */,
                   int64_t n, float beta, float linear_beta);
// y = bf16(a + b), element-wise (AttnRes P := P + y, MoE routed + shared); y may alias a or b.
void add_bf16(const uint16_t* a /* bf16 [n] */, const uint16_t* b /* bf16 [n] */, uint16_t* y /* bf16 [n] */,
              int64_t n);
// o = bf16(o · σ(g)) (MLA output gate, §3.4 step 5), vector sigmoid.
void sigmoid_gate_bf16(uint16_t* o /* bf16 [n], in/out */, const uint16_t* g /* bf16 [n] */, int64_t n);
// AttnRes Mix (MODEL.md §3.2) per token over n sources: ℓ_i = (v_i·u)·rsqrt(mean(v_i²) + eps) in FP64,
// α = softmax(ℓ), h = bf16(Σ_i α_i v_i) (FP32, sources in order); a single source is copied exactly.
void attn_res_mix_rows(const uint16_t* const* src /* n × bf16 [T, D] */, int64_t n, const float* u /* f32 [D] */,
                       float eps, int64_t T, int64_t D, uint16_t* out /* bf16 [T, D] */);

// Numerically stable softmax over n values, in place, FP32.
void softmax_inplace(float* x /* f32 [n] */, int64_t n);

// Indices of the k largest values, best first; exact ties go to the lower index (MODEL.md §0.8).
// NaN ranks below every number. k must be <= n.
void topk(const float* x /* f32 [n] */, int64_t n, int64_t k, int32_t* idx /* i32 [k] */);

}  // namespace kestrel::cpu
