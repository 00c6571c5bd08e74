// The DSpark draft's own GPU ops (MODEL.md §5; the draft's GPU forward is model/cuda/dspark.h): interleaved
// RoPE (at consecutive or per-row positions), the non-causal naive MLA attention over context + block (one
// request, or varlen over a batch of requests), the SwiGLU of its MLP, and the greedy Markov chain. Everything else
// of the draft reuses the target's kernels (GEMMs, RMSNorm, embedding gather, row copies).
// CPU twins: model::rope_interleaved and model::draft_attend (model/dspark.h), the SwiGLU loop of
// model::Draft::block; tested in tests/gpu/test_spec_gpu.cpp (GpuSpec.DraftOpsMatchTwins).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// Rotates pairs (2i, 2i+1) of the R values at x + t·ld + h·head_stride, h < heads, by the angle
// (pos0 + t)·inv_freq[i] — or pos[t]·inv_freq[i] when pos is given (the batched draft: rows of several
// requests at their own positions) —: cos and sin in FP32 times cos_sin_mul, the results rounded to BF16.
// R even, ≤ 256.
void dspark_rope_interleaved(uint16_t* x /* bf16, rows of ld elements */, int64_t ld, int64_t T, int64_t heads,
                             int64_t head_stride, int64_t pos0, const float* inv_freq /* device f32 [R/2] */,
                             float cos_sin_mul, int64_t R, cudaStream_t stream,
                             const int32_t* pos = nullptr /* device i32 [T] or null */);

// Non-causal attention of T queries over S keys (naive form, §3.4 steps 3–4): score = scale · (q_nope·k_nope +
// q_pe·k_pe) in FP32, softmax over all S keys, o_h = Σ p·v in FP32 rounded to BF16. kv holds each key's
// [k_nope | v] per head, latent its [ĉ | k_pe]. scratch: device f32 [T, Hm, S].
void dspark_attend(const uint16_t* q /* bf16 [T, Hm, N+R] */, const uint16_t* kv /* bf16 [S, Hm, N+Dv] */,
                   const uint16_t* latent /* bf16 [S, C+R] */, int64_t T, int64_t S, int64_t Hm, int64_t N, int64_t R,
                   int64_t Dv, int64_t C, float scale, float* scratch /* f32 [T, Hm, S] */,
                   uint16_t* o /* bf16 [T, Hm·Dv] */, cudaStream_t stream);

// The same for query rows of several requests (the batched draft): row t attends over the keys
// [kbeg[t], kbeg[t] + klen[t]) of kv / latent (its request's context + block rows), klen[t] in [1, Smax];
// per row the same arithmetic in the same order as dspark_attend over that request's keys alone.
void dspark_attend_varlen(const uint16_t* q /* bf16 [T, Hm, N+R] */, const uint16_t* kv /* bf16 [Sk, Hm, N+Dv] */,
                          const uint16_t* latent /* bf16 [Sk, C+R] */, int64_t T, const int32_t* kbeg /* i32 [T] */,
                          const int32_t* klen /* i32 [T] */, int64_t Smax, int64_t Hm, int64_t N, int64_t R,
                          int64_t Dv, int64_t C, float scale, float* scratch /* f32 [T, Hm, Smax] */,
                          uint16_t* o /* bf16 [T, Hm·Dv] */, cudaStream_t stream);

// a = bf16(silu(g)·u) elementwise, FP32 arithmetic (silu(x) = x·σ(x)).
void dspark_swiglu(const uint16_t* g /* bf16 [n] */, const uint16_t* u /* bf16 [n] */, uint16_t* a /* bf16 [n] */,
                   int64_t n, cudaStream_t stream);

// x = bf16(f32(x)·s) elementwise, in place (the absorbed draft attention: the draft's softmax scale, YaRN's
// mscale² included, folded into q, since mla_decode_paged scales by (N+R)^−½). CPU twin: the loop in
// tests/gpu/test_spec_absorbed_gpu.cpp (core/dtype.h's conversions; nothing else runs it on the host).
void dspark_scale_bf16(uint16_t* x /* bf16 [n] */, int64_t n, float s, cudaStream_t stream);

// The Markov chain of greedy draft picks (§5, no top-k) for n requests: for i < steps,
// logits_i = base[b, i] + W2·W1[prev] and prev = ids[b, i] = argmax_v logits_i, prev starting at anchors[b].
// Two launches a step, the vocabulary split over CTAs (dspark.cu). The CPU twin's bits
// (model::Draft::markov_logits, then std::max_element): each v's sum over k in order from 0 in FP32 with separate
// rounded multiplies and adds (no fused multiply-add), the first maximum on a tie. workspace: at least
// dspark_markov_greedy_workspace_bytes(n, V), device memory (the CTAs' bests of a step).
size_t dspark_markov_greedy_workspace_bytes(int64_t n, int64_t V);
void dspark_markov_greedy(const float* base /* f32 [n, Nb, V] */, int64_t Nb, const uint16_t* w1 /* bf16 [V, r] */,
                          const uint16_t* w2 /* bf16 [V, r] */, const int32_t* anchors /* i32 [n] */, int64_t n,
                          int64_t V, int64_t r, int64_t steps, int32_t* ids /* i32 [n, steps] */, void* workspace,
                          cudaStream_t stream);

}  // namespace kestrel::cuda
