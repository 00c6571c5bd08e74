// The sampling steps that runtime::Sampler (temperature, top-p, seeded draw) does not do, applied to
// one row of logits before it: repetition / presence / frequency penalties, top-k and min-p masks,
// and log-softmax for logprobs. CPU, FP32 in, used by the CPU engine adapter; the GPU engine will
// have its own kernels but must keep these semantics (vLLM's, which match OpenAI's where both define
// a field).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "server/engine_api.h"

namespace kestrel::server {

// token -> times generated so far (frequency/presence penalties count generated tokens only).
using TokenCounts = std::unordered_map<int32_t, int32_t>;

// In place on f32 [V]. Penalties: repetition divides positive / multiplies negative logits of every
// token seen in prompt or output; presence subtracts once per generated token, frequency per
// occurrence. Then top-k keeps the k largest (ties kept), min-p drops tokens whose probability at
// the request's temperature is below min_p × the best one's. Dropped logits become -inf.
void process_logits(std::span<float> logits, const SamplingParams& p, const TokenCounts& generated,
                    const std::vector<int32_t>& prompt);

// log_softmax(raw)[token] and the top n (largest first, ties to the lower id).
void compute_logprobs(std::span<const float> raw, int32_t token, int n, float& logprob,
                      std::vector<TokenLogprob>& top);

}  // namespace kestrel::server
