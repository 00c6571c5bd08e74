// CPU kernels for the K3.1 text model: the reference-precision building blocks of MODEL.md §3.
//
// Every op is a plain function on raw pointers; bf16 values travel as their uint16_t bit patterns
// (core/dtype.h). Accumulation is FP32 throughout and each op rounds to BF16 at most once, at the
// point §3 names, so the model code decides every rounding explicitly. Ops are threaded with OpenMP
// over independent output rows, never over a reduction, so results do not depend on the thread count.
//
// Summation order is part of the contract where tests rely on it: mxfp4_gemm accumulates each output
// in 8 interleaved FP32 lanes (element c goes to lane c mod 8, blocks in order) combined as
// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); its dequantise-then-multiply twin in the tests repeats that.
#pragma once

#include <cmath>
#include <cstdint>

namespace kestrel::cpu {

// Smallest amount of work (multiply-adds) worth an OpenMP parallel region. Below it the fork/join and,
// on a loaded machine, spinning team threads cost more than they save (nano layers measured 50x
// slower with 2 threads on a busy 2-core box); every full-size K3.1 GEMM is far above it.
inline constexpr int64_t kParallelMinWork = int64_t(1) << 20;

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }

void bf16_to_f32_n(const uint16_t* x /* bf16 [n] */, float* y /* f32 [n] */, int64_t n);
void f32_to_bf16_n(const float* x /* f32 [n] */, uint16_t* y /* bf16 [n] */, int64_t n);

// y = x·Wᵀ, FP32 accumulation, FP32 output (router, indexer weights_proj, lm_head).
// T == 1 runs a vectorised GEMV (AVX2/FMA when the CPU has it); T > 1 converts W in row blocks to
// f32 and calls OpenBLAS sgemm, so the two paths may differ in the last bits of the sum.
void gemm_bf16_f32(const uint16_t* x /* bf16 [T, in], row stride ldx */, int64_t ldx,
                   const uint16_t* w /* bf16 [out, in], contiguous */,
                   float* y /* f32 [T, out], row stride ldy */, int64_t ldy, int64_t T, int64_t in, int64_t out);
// Lin(W)(x) of MODEL.md §3: the same product rounded once to BF16.
void gemm_bf16(const uint16_t* x /* bf16 [T, in], row stride ldx */, int64_t ldx,
               const uint16_t* w /* bf16 [out, in], contiguous */,
               uint16_t* y /* bf16 [T, out], row stride ldy */, int64_t ldy, int64_t T, int64_t in, int64_t out);
// Row-invariant mode for the calling thread: gemm_bf16* runs the T == 1 GEMV for every row, so a
// token's result never depends on how many tokens share the call. The serving executor needs this:
// chunked prefill, preemption (re-prefill of prompt + outputs) and batching must not change a
// request's tokens, and sgemm and the GEMV differ in the last bits. Costs the BLAS speed-up of prefill.
class RowInvariantScope {
 public:
  explicit RowInvariantScope(bool on);
  ~RowInvariantScope();
  RowInvariantScope(const RowInvariantScope&) = delete;
  RowInvariantScope& operator=(const RowInvariantScope&) = delete;

 private:
  bool prev_;
};
// Which GEMV path gemm_bf16* takes for T == 1 on this machine ("avx2-fma" or "portable").
const char* gemv_isa();
// Tests force the portable GEMV to compare both paths; not for production use.
void gemv_force_portable(bool on);

// y = x·Wᵀ for an MXFP4 weight (MODEL.md §4) straight from packed nibbles and e8m0 scales: each
// 32-element block of a row is dequantised into registers and applied to all T inputs; no full
// dequantised matrix ever exists. FP32 output, no rounding.
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

// Numerically stable softmax over n values, in place, FP32.
void softmax_inplace(float* x /* f32 [n] */, int64_t n);

// Indices of the k largest values, best first; exact ties go to the lower index (MODEL.md §0.8).
// NaN ranks below every number. k must be <= n.
void topk(const float* x /* f32 [n] */, int64_t n, int64_t k, int32_t* idx /* i32 [k] */);

}  // namespace kestrel::cpu
