// KDA per-token ops around the delta-rule scan (MODEL.md §3.3 steps 2, 3–5 and 7), the CPU twins of
// the CUDA kernels in kernels/cuda/kda.h. Moved here verbatim from model/kda.cpp so the model and the
// GPU op tests share one implementation (one rounding point each, as §3.3 names them).
#pragma once

#include <cstdint>

namespace kestrel::cpu {

// Step 2 for one request: causal depthwise conv over [W−1 history inputs, current input] per channel,
// then SiLU, rounded to BF16 (returned as f32 values). The history (the last W−1 pre-conv inputs,
// oldest first) is updated in place, token by token.
void kda_conv_silu(const uint16_t* x /* bf16 [T, C] row stride ldx, pre-conv */, int64_t ldx,
                   const float* w /* f32 [C, W] */, uint16_t* hist /* bf16 [W-1, C], in/out */,
                   float* y /* f32 [T, C] row stride ldy, bf16-valued */, int64_t ldy, int64_t T, int64_t C, int64_t W);

// Steps 3–5 for every token and head: q ← q/√(Σq² + 1e-6)·Dk^−½, k ← k/√(Σk² + 1e-6) in place;
// g = lower·σ(exp(A_log[h])·(z + dt_bias)); β = σ(b). All FP32.
void kda_qk_norm_gates(float* q /* f32 [T, H*Dk], in/out */, float* k /* f32 [T, H*Dk], in/out */,
                       const uint16_t* z /* bf16 [T, H*Dk] */, const float* dt_bias /* f32 [H*Dk] */,
                       const float* a_log /* f32 [>= H] */, const uint16_t* b /* bf16 [T, H] */, float lower,
                       float* g /* f32 [T, H*Dk] */, float* beta /* f32 [T, H] */, int64_t T, int64_t H, int64_t Dk);

// Step 7: ô = RMSNorm_{o_norm, eps}(o) ⊙ σ(gate) per head, FP32, one rounding to BF16.
void kda_out_norm_gate(const float* o /* f32 [T, H*Dk] */, const uint16_t* gate /* bf16 [T, H*Dk] */,
                       const float* o_norm /* f32 [Dk] */, float eps, uint16_t* ohat /* bf16 [T, H*Dk] */, int64_t T,
                       int64_t H, int64_t Dk);

// The AVX2 versions the CPU engine runs (kda_fast.cpp): the same arguments and roundings, vector
// exp/sigmoid and 8-lane sums (a few ulps from the twins above, tested); the twins without AVX2.
void kda_conv_silu_fast(const uint16_t* x, int64_t ldx, const float* w, uint16_t* hist, float* y, int64_t ldy,
                        int64_t T, int64_t C, int64_t W);
void kda_qk_norm_gates_fast(float* q, float* k, const uint16_t* z, const float* dt_bias, const float* a_log,
                            const uint16_t* b, float lower, float* g, float* beta, int64_t T, int64_t H, int64_t Dk);
void kda_out_norm_gate_fast(const float* o, const uint16_t* gate, const float* o_norm, float eps, uint16_t* ohat,
                            int64_t T, int64_t H, int64_t Dk);

}  // namespace kestrel::cpu
