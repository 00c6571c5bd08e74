// The `random` dataset of `kestrel bench`: prompts of chosen token lengths with meaningless content.
//
// With a tokenizer, a prompt is a string of random vocabulary tokens, decoded, and its length is
// the length the server's tokenizer will see: the tokens are drawn from those whose bytes are one
// space and lowercase ASCII letters (" the", " ing"), which the pre-tokenizer always keeps apart,
// so encoding the decoded text gives back exactly the drawn ids; the result is re-encoded to check,
// and adjusted if some vocabulary breaks that rule. Without a tokenizer, prompts are random
// lowercase words and the requested length is only an estimate (about one token per word).
//
// Lengths follow vLLM's --random-range-ratio r: uniform integers in [floor(L(1-r)), ceil(L(1+r))].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace kestrel::bench {

struct SampleRequest {
  std::string prompt;
  int prompt_len = 0;        // tokens (exact with a tokenizer)
  int output_len = 0;        // max_tokens asked for
};

struct RandomDatasetOptions {
  int num_prompts = 0;
  int input_len = 0;
  int output_len = 0;
  double range_ratio = 0;
  uint64_t seed = 0;
};

// `tok` may be null (random words).
std::vector<SampleRequest> random_dataset(const RandomDatasetOptions& o, const tok::Tokenizer* tok);

}  // namespace kestrel::bench
