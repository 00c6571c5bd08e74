// DSpark draft on the CPU (MODEL.md §5): context projection of the target's AttnRes taps, KV injection into
// the draft's own paged MLA caches, Ld dense decoder layers (MLA with interleaved DeepSeek-YaRN RoPE, no gate;
// SwiGLU MLP) over a non-causal block of Nb tokens, final norm, the target's lm_head and the Markov head.
//
// Cache: per draft layer one paged MlaCacheView (bf16 latent rows [ĉ (C) | RoPE(k_pe) (R)], no index keys),
// holding the context positions [0, ctx_len) — the tokens whose target states exist. The block's own rows
// (anchor at ctx_len, mask ids after it) are computed per call and attended to but never written: after
// verification the caller injects the real rows of the accepted positions, so nothing is rolled back.
//
// Numerics follow the target's conventions (§3): BF16 Lin outputs with FP32 accumulation, RMSNorm in FP32
// rounded twice, RoPE angle and cos/sin in FP32 (inv_freq from FP64, rounded once), attention scores and
// softmax in FP32 with scale (N+R)^−½·mscale², residual sums rounded to BF16, logits FP32.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "loader/dspark.h"
#include "loader/weights.h"
#include "model/cache_view.h"
#include "model/common.h"

namespace kestrel::model {

// RoPE of the draft (§5): inv_freq [R/2] after YaRN, the cos/sin multiplier and the softmax scale.
struct DraftRope {
  std::vector<float> inv_freq;  // f32 [R/2]
  float cos_sin_mul = 1.0f;     // mscale(factor, mscale) / mscale(factor, mscale_all_dim)
  float softmax_scale = 0.0f;   // (N+R)^−½ · mscale(factor, mscale_all_dim)² (when mscale_all_dim is set)
};
DraftRope draft_rope(const DraftConfig& c);
// Rotates pairs (2i, 2i+1) of each row's R values at x + t·ld by angle pos0+t times inv_freq[i].
void rope_interleaved(const DraftRope& r, uint16_t* x /* bf16 [T, ·], R rotated values per row */, int64_t ld,
                      int64_t T, int64_t pos0, int64_t R);

// Non-causal MLA attention of the draft block, naive form (§3.4 steps 3–4): every query sees every one of
// the S keys (context rows, then the whole block); scores and softmax FP32, each head's output rounded to BF16.
// (The CPU twin of kernels/cuda/dspark.h dspark_attend.)
void draft_attend(int64_t Hm, int64_t N, int64_t R, int64_t Dv, int64_t C, float scale,
                  const uint16_t* q /* bf16 [T, Hm, N+R] */, const uint16_t* kv /* bf16 [S, Hm, N+Dv] */,
                  const uint16_t* latent /* bf16 [S, C+R] */, int64_t T, int64_t S, uint16_t* o /* bf16 [T, Hm*Dv] */);

// The draft bound to its weights and to the target's embedding and lm_head.
struct Draft {
  const DraftConfig* cfg = nullptr;
  const DraftWeights* w = nullptr;
  const ModelWeights* target = nullptr;  // embed, lm_head
  DraftRope rope;
  TextConfig mla_cfg;                     // the draft's MLA shapes (cache views)

  Draft(const DraftConfig& c, const DraftWeights& w, const ModelWeights& target);

  // Context injection: taps of positions [pos0, pos0+T) → H_ctx → every layer's cache rows.
  void inject(std::span<const MlaCacheView> caches /* one per draft layer */, int64_t pos0,
              const uint16_t* taps /* bf16 [T, n·Dt] */, int64_t T, const Probe& probe = {}) const;
  // The block at positions [ctx_len, ctx_len+T) over caches holding [0, ctx_len): final-normed hidden states.
  void block(std::span<const MlaCacheView> caches, int64_t ctx_len, std::span<const int32_t> tokens /* [T] */,
             uint16_t* hn /* bf16 [T, D] */, const Probe& probe = {}) const;
  // lm_head(hn) for T rows: f32 [T, V].
  void base_logits(const uint16_t* hn /* bf16 [T, D] */, int64_t T, float* out /* f32 [T, V] */) const;
  // §5 Markov head on one row: base + W2·W1[prev]; topk > 0 keeps only the base top-k (others −inf).
  void markov_logits(const float* base /* f32 [V] */, int32_t prev, int topk, float* out /* f32 [V] */) const;

  // One drafting step: block [anchor, mask × (Nb−1)] at ctx_len, then the sequential Markov chain; `pick`
  // chooses draft token i+1 from logits_i (greedy or a seeded draw; it may keep the distribution for
  // verification). Writes the Nb draft tokens.
  using Pick = std::function<int32_t(int i, std::span<const float> logits /* f32 [V] */)>;
  void draft(std::span<const MlaCacheView> caches, int64_t ctx_len, int32_t anchor, int topk, const Pick& pick,
             int32_t* tokens /* i32 [Nb] */, const Probe& probe = {}) const;
  // draft()'s sequential Markov chain from the block's base logits (lm_head of the final-normed states,
  // computed elsewhere: the GPU draft, model/cuda/dspark.h).
  void draft_from_base(const float* base /* f32 [Nb, V] */, int32_t anchor, int topk, const Pick& pick,
                       int32_t* tokens /* i32 [Nb] */) const;
};

// A single request's draft caches that own their pages (tests, CLI-free callers).
struct DraftState {
  std::vector<MlaCache> layers;
  int64_t len = 0;  // context positions injected
  explicit DraftState(const DraftConfig& c) : layers(size_t(c.num_hidden_layers)) {}
  // Views covering n positions (grows the pages).
  std::vector<MlaCacheView> views(const TextConfig& mla_cfg, int64_t n);
};

}  // namespace kestrel::model
