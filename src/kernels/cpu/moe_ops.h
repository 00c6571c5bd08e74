// MoE router and routed-expert product (MODEL.md §3.6 steps 1, 3 and 4), the CPU twins of the CUDA
// kernels in kernels/cuda/moe.h. Moved here verbatim from model/moe.cpp so the model and the GPU op
// tests share one implementation.
#pragma once

#include <cstdint>

namespace kestrel::cpu {

// Step 1 after the FP32 router GEMM: s = σ(logits); selection on s + bias with top-k (exact ties to
// the lower expert index, NaN below every number); weights are the un-biased s, optionally
// renormalised (w / (Σw + 1e-20)), times `scaling`.
void moe_route(const float* logits /* f32 [T, X] */, const float* bias /* f32 [X] */, int64_t T, int64_t X,
               int64_t K, bool renormalize, float scaling, int32_t* ids /* i32 [T, K] */,
               float* weights /* f32 [T, K] */);

// One MXFP4 matrix (MODEL.md §4): packed u8 [rows, cols/2] and e8m0 scales u8 [rows, cols/32].
struct Mxfp4Ptr {
  const uint8_t* packed = nullptr;
  const uint8_t* scale = nullptr;
};
struct ExpertPtrs {
  Mxfp4Ptr w1;  // gate, logical [I, Lt]
  Mxfp4Ptr w3;  // up,   logical [I, Lt]
  Mxfp4Ptr w2;  // down, logical [Lt, I]
};

// Steps 3–4: for each (token, slot) the selected expert computes [g | u] = z·[W1; W3]ᵀ (each rounded
// to BF16), a = bf16(SiTU-GLU(g, u)), y = bf16(a·W2ᵀ); then ũ = bf16(Σ_k w_k·y_k) accumulated in FP32
// in top-k order. Tokens are grouped by expert so each block is decoded once per call.
void moe_experts(const uint16_t* z /* bf16 [T, Lt] */, const int32_t* ids /* i32 [T, K] */,
                 const float* weights /* f32 [T, K] */, const ExpertPtrs* experts /* [X] */, int64_t T, int64_t X,
                 int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                 uint16_t* ut /* bf16 [T, Lt] */);
// The same sum left in FP32 (no final rounding), for one rank of a split MoE (model/moe.cpp): experts
// whose w1.packed is null belong to another rank (expert parallelism) and add nothing; with
// round_y == false the per-expert y is not rounded either, because under an intermediate-dimension
// split it is only this rank's partial sum of a·W2ᵀ (rounded once, after the all-reduce).
void moe_experts_f32(const uint16_t* z /* bf16 [T, Lt] */, const int32_t* ids /* i32 [T, K] */,
                     const float* weights /* f32 [T, K] */, const ExpertPtrs* experts /* [X] */, int64_t T, int64_t X,
                     int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta, bool round_y,
                     float* ut /* f32 [T, Lt] */);

// The same as the engine runs it: experts in parallel over the thread pool, the vector SiTU-GLU
// (situ_glu_fast), the same combine order; the MXFP4 products in ORDER16 as moe_experts, except on
// avx512bf16 CPUs: ORDER_B32 (kernels/cpu/gemm_kernels.h), the same products summed in another order.
void moe_experts_fast(const uint16_t* z, const int32_t* ids, const float* weights, const ExpertPtrs* experts,
                      int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                      uint16_t* ut);
// The same left in FP32, as moe_experts_f32 (experts with a null w1.packed skipped; round_y as there):
// one rank of a split MoE layer on the fast path.
void moe_experts_fast_f32(const uint16_t* z, const int32_t* ids, const float* weights, const ExpertPtrs* experts,
                          int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, float situ_beta,
                          float situ_linear_beta, bool round_y, float* ut /* f32 [T, Lt] */);

}  // namespace kestrel::cpu
