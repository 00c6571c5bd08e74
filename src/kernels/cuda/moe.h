// MoE on the GPU (MODEL.md §3.6 steps 1, 3, 4): the sigmoid router's top-k, and the routed MXFP4
// experts W4A16 (packed E2M1 nibbles + e8m0 scales read directly, MODEL.md §4), grouped by expert.
// CPU twins: cpu::moe_route and cpu::moe_experts (kernels/cpu/moe_ops.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// After the FP32 router GEMM: s = σ(logits); top-k of s + bias (exact ties to the lower expert
// index; NaN ranks lowest); w = s[idx], renormalised (w/(Σw + 1e-20)) if asked, times `scaling`.
// One block per token. X ≤ 8192, K ≤ 64.
void moe_route(const float* logits /* f32 [T, X] */, const float* bias /* f32 [X] */, int64_t T, int64_t X, int64_t K,
               bool renormalize, float scaling, int32_t* ids /* i32 [T, K] */, float* weights /* f32 [T, K] */,
               cudaStream_t stream);

// All experts' MXFP4 weights stored back to back (expert e at e·stride bytes from each base):
//   w1, w3: packed u8 [X, I, Lt/2], scales e8m0 [X, I, Lt/32];  w2: packed u8 [X, Lt, I/2], scales [X, Lt, I/32].
struct MoeExpertWeights {
  const uint8_t* w1_packed;
  const uint8_t* w1_scale;
  const uint8_t* w3_packed;
  const uint8_t* w3_scale;
  const uint8_t* w2_packed;
  const uint8_t* w2_scale;
  int64_t w13_packed_stride, w13_scale_stride;  // bytes between experts (≥ I·Lt/2, ≥ I·Lt/32)
  int64_t w2_packed_stride, w2_scale_stride;    // bytes between experts (≥ Lt·I/2, ≥ Lt·I/32)
};

// Device scratch for moe_experts_mxfp4, in bytes (256-byte aligned pieces).
size_t moe_experts_workspace_bytes(int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I);

// For each (token t, slot k): [g | u] = z_t·[W1; W3]ᵀ (FP32 sums, each rounded to BF16),
// a = bf16(SiTU-GLU(g, u)), y = bf16(a·W2ᵀ); then ũ_t = bf16(Σ_k w_k·y_k) in top-k order.
// Tokens are grouped by expert (a counting sort on the device, no host round trip); each warp
// decodes one 32-element MXFP4 block per lane with one 16-byte load.
// Lt and I must be multiples of 32; z rows 16-byte aligned.
void moe_experts_mxfp4(const uint16_t* z /* bf16 [T, Lt], contiguous */, const int32_t* ids /* i32 [T, K] */,
                       const float* weights /* f32 [T, K] */, const MoeExpertWeights& w, int64_t T, int64_t X,
                       int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                       void* workspace /* moe_experts_workspace_bytes(...) bytes */, uint16_t* ut /* bf16 [T, Lt] */,
                       cudaStream_t stream);

}  // namespace kestrel::cuda
