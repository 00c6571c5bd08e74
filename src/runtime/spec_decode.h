// DSpark speculative decoding of one request on the CPU (MODEL.md §5), outside the batching engine: the
// reference loop the serving path must reproduce, and the test that greedy speculation changes no token.
//
// One step: the draft (its caches hold the context positions [0, ctx)) proposes γ tokens after the anchor;
// the target runs [anchor, x̂_1..x̂_γ] in ONE forward (row-invariant, recurrent KDA, absorbed MLA: the
// serving executor's settings, so every row's logits equal those of token-by-token decoding); the
// verification rule (spec_verify.h) keeps τ draft tokens and draws one more; the τ+1 kept positions' taps
// are injected into the draft's caches. KDA rollback without recompute: the verification forward traces the
// KDA state after every block position (KdaStateView's trace) and the state after position τ is kept
// (model::kda_keep_position), as the serving executor does. MLA rows past the kept prefix are simply
// overwritten. draft_pick and verify_step are the per-request rules the serving executor shares.
//
// Sampled requests: temperature, top_k, top_p, min_p as the sampler applies them (p_i), the draft samples
// from softmax(logits_i / T) (q_i; "probabilistic") or takes its argmax ("greedy", q one-hot). Penalties,
// logprobs and structured output are not supported here (kestrel::Error).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/dspark.h"
#include "request/request.h"
#include "runtime/spec_verify.h"

namespace kestrel::runtime {

struct SpecDecodeOptions {
  int num_speculative_tokens = 7;  // γ ≤ the draft's block size
  RejectionMethod rejection = RejectionMethod::block;
  bool draft_greedy = false;       // draft_sample_method "greedy" (else "probabilistic")
  int draft_topk = 0;              // dspark_draft_topk (0: off)
  int32_t stop_token = -1;         // generation ends after emitting it (-1: none)
  // Test hook: a draft that always agrees. When set, draft slot i of the step whose anchor is output token j
  // proposes (*oracle)[j + 1 + i] (one-hot q) instead of the draft model's token, while the draft model still runs.
  const std::vector<int32_t>* oracle = nullptr;
};

struct SpecDecodeStats {
  int64_t drafts = 0;           // verification steps (vllm:spec_decode_num_drafts)
  int64_t draft_tokens = 0;     // proposed tokens (vllm:spec_decode_num_draft_tokens)
  int64_t accepted_tokens = 0;  // accepted draft tokens (vllm:spec_decode_num_accepted_tokens)
  double acceptance_length() const { return drafts ? 1.0 + double(accepted_tokens) / double(drafts) : 0.0; }
};

// Draft slot i's token from the draft's logits_i for the step whose anchor is output token out_index − 1
// (out_index = output tokens so far): argmax for greedy requests and draft_sample_method "greedy", else a
// draw from softmax(logits_i / T) seeded by (seed, out_index, i). qi (f64 [V], zeroed by the caller) gets
// the distribution the token came from (one-hot for argmax).
int32_t draft_pick(const SamplingParams& params, bool draft_greedy, uint64_t out_index, int i,
                   std::span<const float> logits /* f32 [V] */, double* qi /* f64 [V] */);
// The verification of one step from the target's γ+1 rows (greedy: verify_greedy; else the rule `m` on the
// request's sampling distributions, draws seeded by (seed, out_index)).
VerifyOutcome verify_step(const SamplingParams& params, RejectionMethod m, const float* logits /* f32 [γ+1, V] */,
                          const double* q /* f64 [γ, V] */, std::span<const int32_t> drafted /* [γ] */, int64_t V,
                          uint64_t out_index);
// Whether speculation serves a request with these parameters exactly: no penalties, logit bias, min_tokens,
// logprobs or prompt logprobs (the rules above do not apply them). The engine serves others without it.
bool speculation_supports(const SamplingParams& p);

// Up to max_tokens output tokens after `prompt`.
std::vector<int32_t> spec_generate(const ModelWeights& w, const ModelConfig& c, const model::Draft& draft,
                                   std::span<const int32_t> prompt, int max_tokens, const SamplingParams& params,
                                   const SpecDecodeOptions& opt, SpecDecodeStats* stats = nullptr);

// The same request without speculation, one token per forward with the same forward settings (baseline).
std::vector<int32_t> plain_generate(const ModelWeights& w, const ModelConfig& c, std::span<const int32_t> prompt,
                                    int max_tokens, const SamplingParams& params, int32_t stop_token = -1);

// The target's sampling distribution for one row (f64 [V]): softmax(logits / T), then min-p, top-k and
// top-p as sample_token() applies them, renormalised. temperature must be > 0.
void target_distribution(const SamplingParams& p, std::span<const float> logits, double* out /* f64 [V] */);

}  // namespace kestrel::runtime
