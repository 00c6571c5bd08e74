// RMSNorm and the fused AttnRes Mix + RMSNorm (MODEL.md §3 conventions, §3.2), and the DSA indexer's key
// LayerNorm (§3.5 step 2) on the GPU. CPU twins: cpu::rmsnorm_bf16 (kernels/cpu/cpu_ops.h),
// model::attn_res_mix (model/attn_res.h) and cpu::indexer_key_norm (kernels/cpu/mla_ops.h).
// One thread block per token; the RMSNorm rows are read with 16-byte loads, so their row length must be a
// multiple of 8 and every row start 16-byte aligned (checked).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// y = w ⊙ bf16(x · rsqrt(mean(x²) + eps)), normalised in FP32, rounded, times the weight, rounded.
// y may be x itself (same rows and strides): normalised in place.
void rmsnorm_bf16(const uint16_t* x /* bf16 [T, n], row stride ldx */, int64_t ldx, const uint16_t* w /* bf16 [n] */,
                  uint16_t* y /* bf16 [T, n], row stride ldy */, int64_t ldy, int64_t T, int64_t n, float eps,
                  cudaStream_t stream);

inline constexpr int kAttnResMaxSources = 16;

// h = Mix([B_0..B_{nb-1}, P]; mix_norm_w, mix_proj_w) rounded to BF16 (the reference's rounding point),
// then y = RMSNorm_{rms_w, eps}(h), all in one pass per token:
//   u = mix_norm_w ⊙ mix_proj_w;  ℓ_i = (v_i·u)·rsqrt(mean(v_i²) + eps);  α = softmax(ℓ);  h = Σ α_i v_i.
// Source i < nb is blocks + i·block_stride + t·ld; source nb is partial + t·ld. h_out may be null.
void attn_res_mix_rmsnorm(const uint16_t* blocks /* bf16 [nb, T, D], block i at i·block_stride, row stride ld */,
                          int64_t block_stride, int nb, const uint16_t* partial /* bf16 [T, D], row stride ld */,
                          int64_t ld, const uint16_t* mix_norm_w /* bf16 [D] */,
                          const uint16_t* mix_proj_w /* bf16 [D] */, const uint16_t* rms_w /* bf16 [D] */, float eps,
                          uint16_t* h_out /* bf16 [T, D] row stride ldy, or null */,
                          uint16_t* y /* bf16 [T, D], row stride ldy */, int64_t ldy, int64_t T, int64_t D,
                          cudaStream_t stream);

// One AttnRes point of the stream (MODEL.md §3.2), fused into one kernel per call (contiguous rows, ld = D):
//  1. the partial sum is brought up to date: P := bf16(P + a) (add), P := a (replace), or left (none); with
//     a_ids (replace only) token t's row of a is row a_ids[t] — the first point gathers P from the embedding
//     table itself (§3.1), one launch fewer than embed_gather and a point (the same bits);
//  2. if store_block is non-null the updated P is copied there (a write layer's new block — stored after
//     this call's own Mix, so the Mix below still sees nb blocks);
//  3. y = RMSNorm_{rms_w}(Mix([B_0..B_{nb−1}, P])), as attn_res_mix_rmsnorm;
//  4. if q8 is non-null, the PTPC FP8 codes of y as well (quantize_fp8_rows' rule): the next GEMM's input.
// Small batches (T ≤ attn_res_cluster_max_t()): a token's row over a cluster of up to 8 CTAs, every source
// held in registers, the reductions exchanged through distributed shared memory; otherwise one CTA per token
// (attn_res.cu). PDL launch.
enum class AttnResAdd : uint8_t { none, add, replace };
void attn_res_step(const uint16_t* blocks /* bf16 [nb, T, D], block i at i·block_stride */, int64_t block_stride,
                   int nb, uint16_t* partial /* bf16 [T, D], in/out */, const uint16_t* a /* bf16 [T, D] or null */,
                   AttnResAdd mode, uint16_t* store_block /* bf16 [T, D] or null */,
                   const uint16_t* mix_norm_w /* bf16 [D] */, const uint16_t* mix_proj_w /* bf16 [D] */,
                   const uint16_t* rms_w /* bf16 [D] */, float eps, uint16_t* y /* bf16 [T, D] */,
                   uint8_t* q8 /* e4m3 [T, D] or null */, float* q_scale /* f32 [T] */, int64_t T, int64_t D,
                   cudaStream_t stream, const int32_t* a_ids = nullptr /* i32 [T] rows of a, or null */);

// The most tokens for which attn_res_step takes the cluster kernel (0..64; the default from the measured
// crossover, or KESTREL_ATTNRES_CLUSTER_MAX_T). The setter is for tests and benchmarks (both kernels).
int attn_res_cluster_max_t();
void set_attn_res_cluster_max_t(int t);

// Indexer §3.5 step 2: out = bf16(LayerNorm_{1e-6}(kraw)·w + b) per row (b null = 0). Di ≤ 1024.
void indexer_key_norm(const uint16_t* kraw /* bf16 [T, Di] */, const uint16_t* w /* bf16 [Di] */,
                      const uint16_t* b /* bf16 [Di] or null */, int64_t T, int64_t Di,
                      uint16_t* out /* bf16 [T, Di], row stride Di */, cudaStream_t stream);

}  // namespace kestrel::cuda
