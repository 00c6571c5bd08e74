// Token sampler: greedy, temperature, top-k, top-p, min-p, repetition / presence / frequency
// penalties, a per-request seed, logprobs with top_logprobs.
//
// sample_token() is a pure function of (params, logits, the request's prompt and output so far):
// the random draw for output token i comes from a counter-based generator keyed by (seed, i), so a
// request's tokens never depend on what else shares the batch, on preemption, or on the order in
// which the engine samples requests (the "same seed ⇒ same tokens whatever the batch" rule).
//
// Order of operations (vLLM's): logit_bias added to the raw logits, stop ids set to −inf while the
// output is shorter than min_tokens, then penalties → greedy argmax if temperature == 0
// (ties to the lower id) → divide by temperature → softmax (FP64) → min-p (drop p < min_p · p_max) →
// top-k → top-p (shortest most-likely prefix whose mass reaches top_p, ties by lower id) → draw.
// Penalties: repetition r over prompt + output tokens (logit > 0 ? logit / r : logit · r);
// frequency f and presence p over output tokens (logit −= f · count + p · [count > 0]).
// Logprobs are of the raw model distribution (log-softmax of the unpenalised logits, vLLM's default
// "raw_logprobs"), so they describe the model, not the sampling knobs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "request/request.h"

namespace kestrel::runtime {

// The sampler's knobs and logprob entries are the request vocabulary's (request/request.h); the
// ranges validate() enforces are this function's preconditions.
using kestrel::SamplingParams;
using kestrel::PromptLogprob;
using kestrel::TokenLogprob;

// The greedy token: std::max_element's answer over non-empty `x` (the first largest, so ties go to the lower
// id; a NaN wins only in first place). The speculative verifier uses it too.
int32_t argmax(std::span<const float> x);

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;              // of `token` (only when params.logprobs >= 0)
  std::vector<TokenLogprob> top;     // params.logprobs entries, most likely first, ties by lower id
};

// `index` is the output index of the token being drawn (output.size() in normal use); `stop_ids` the
// ids min_tokens holds back (the request's end-of-sequence and stop ids; none under ignore_eos).
SampleResult sample_token(const SamplingParams& p, std::span<const float> logits /* f32 [V] */,
                          std::span<const int32_t> prompt, std::span<const int32_t> output, uint64_t index,
                          std::span<const int32_t> stop_ids = {});

// The logprob of `token` under the raw logits (log-softmax in FP64) and the n most likely tokens
// (most likely first, ties by lower id): what sample_token reports, for prompt positions too.
PromptLogprob token_logprobs(std::span<const float> logits /* f32 [V] */, int32_t token, int32_t n);

// The uniform draw in [0, 1) for (seed, index): SplitMix64 of the pair, 53 bits.
double sample_uniform(uint64_t seed, uint64_t index);

}  // namespace kestrel::runtime
