// KDA (MODEL.md §3.3) on the GPU: short conv + SiLU (prefill and decode), q/k L2-norm and gates,
// the recurrent delta-rule scan over a state pool (decode for many requests at once, and varlen
// prefill through the same recurrence), and the output RMSNorm ⊙ gate.
// CPU twins: cpu::kda_conv_silu, kda_qk_norm_gates, kda_out_norm_gate (kernels/cpu/kda_ops.h) and
// cpu::kda_scan_recurrent (kernels/cpu/kda_scan.h).
//
// Layouts: q/k/v channels are head-major (c = h·Dk + i). The conv runs on any channel count C, so the
// caller may convolve q|k|v concatenated ([T, 3·H·Dk] with weights [3·H·Dk, W]) in one launch.
// State pools are indexed by a per-request slot id; the slots of one launch must be distinct.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// Prefill of one request: y[t, c] = bf16(SiLU(Σ_{j<W-1} w[c, j]·hist[j, c] (for the first tokens) /
// x[t-W+1+j, c] + w[c, W-1]·x[t, c])), then the history becomes the last W−1 inputs. W ≤ 8.
void kda_conv_prefill(const uint16_t* x /* bf16 [T, C], row stride ldx */, int64_t ldx,
                      const float* w /* f32 [C, W] */, uint16_t* hist /* bf16 [W-1, C], in/out */,
                      uint16_t* y /* bf16 [T, C], row stride ldy */, int64_t ldy, int64_t T, int64_t C, int64_t W,
                      cudaStream_t stream);

// Decode: one token for each of B requests; request b uses and shifts hist_pool[slots[b]].
void kda_conv_decode(const uint16_t* x /* bf16 [B, C], row stride ldx */, int64_t ldx, const float* w /* f32 [C, W] */,
                     uint16_t* hist_pool /* bf16 [n_slots, W-1, C], in/out */, const int32_t* slots /* i32 [B] */,
                     uint16_t* y /* bf16 [B, C], row stride ldy */, int64_t ldy, int64_t B, int64_t C, int64_t W,
                     cudaStream_t stream);

// Steps 3–5: q_out = q/√(Σq² + 1e-6)·Dk^−½, k_out = k/√(Σk² + 1e-6) per (token, head);
// g = lower·σ(exp(a_log[h])·(z + dt_bias)); beta = σ(b). Dk ≤ 1024 and a multiple of 32.
void kda_qk_norm_gates(const uint16_t* q /* bf16 [T, H*Dk], row stride ld_in */,
                       const uint16_t* k /* bf16 [T, H*Dk], row stride ld_in */, int64_t ld_in,
                       const uint16_t* z /* bf16 [T, H*Dk], contiguous */, const float* dt_bias /* f32 [H*Dk] */,
                       const float* a_log /* f32 [>= H] */, const uint16_t* b /* bf16 [T, H], contiguous */,
                       float lower, float* q_out /* f32 [T, H*Dk] */, float* k_out /* f32 [T, H*Dk] */,
                       float* g /* f32 [T, H*Dk] */, float* beta /* f32 [T, H] */, int64_t T, int64_t H, int64_t Dk,
                       cudaStream_t stream);

// Step 6, recurrent form, B requests at once: request b owns tokens cu_seqlens[b] .. cu_seqlens[b+1]
// (decode: cu_seqlens = 0, 1, .., B) and the state S = state_pool[slots[b]] (f32 [H, Dk(key), Dk(value)]),
// updated in place. Per token: S ← diag(exp g) S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq.
// q, k, v, g, o share the row stride ld (elements); beta has row stride ld_beta. Dk ∈ {32, 64, 128}.
void kda_recurrent(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                   const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                   const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                   const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                   float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);
// The same over an FP16 state pool (--kda-state-dtype f16): each request's state is widened to FP32 when
// the launch reads it and rounded to nearest even when it writes it back, as model/kda.cpp does.
void kda_recurrent(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                   const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                   const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                   const int32_t* slots /* i32 [B] */, uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */,
                   float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);

// Step 6, chunked WY/UT form (MODEL.md §3.3, chunk 64; CPU twin cpu::kda_scan_chunked, oracle
// cpu::kda_scan_recurrent): the same contract as kda_recurrent (varlen via cu_seqlens, state in
// state_pool[slots[b]], f32 [H, Dk(key), Dk(value)], read at the start and written back at the end).
// For prefill: the chunk-level products are matrix-shaped and the value columns are split across
// blocks, so one request keeps several SMs busy. Dk ∈ {32, 64, 128}; q, k, v, g 16-byte aligned and
// ld a multiple of 4 (16-byte row loads); g > −5 per token (the §3.3 gate bound; see kda.cu).
void kda_chunked(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                 const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                 const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                 const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                 float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);

// Step 7: ohat = bf16(RMSNorm_{o_norm, eps}(o) ⊙ σ(gate)) per (token, head). Dk ≤ 1024, multiple of 32.
void kda_out_norm_gate(const float* o /* f32 [T, H*Dk] */, const uint16_t* gate /* bf16 [T, H*Dk] */,
                       const float* o_norm /* f32 [Dk] */, float eps, uint16_t* ohat /* bf16 [T, H*Dk] */, int64_t T,
                       int64_t H, int64_t Dk, cudaStream_t stream);

}  // namespace kestrel::cuda
