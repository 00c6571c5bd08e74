// The datasets of `kestrel bench`.
//
// `random`: prompts of chosen token lengths with meaningless content.
// With a tokenizer, a prompt is a string of random vocabulary tokens, decoded, and its length is
// the length the server's tokenizer will see: the tokens are drawn from those whose bytes are one
// space and lowercase ASCII letters (" the", " ing"), which the pre-tokenizer always keeps apart,
// so encoding the decoded text gives back exactly the drawn ids; the result is re-encoded to check,
// and adjusted if some vocabulary breaks that rule. Without a tokenizer, prompts are random
// lowercase words and the requested length is only an estimate (about one token per word).
//
// Lengths follow vLLM's --random-range-ratio r: uniform integers in [floor(L(1-r)), ceil(L(1+r))].
//
// `custom` (vLLM's --dataset-name custom --dataset-path FILE): real prompts from a JSONL file, one request per
// line: {"prompt": "..."} as vLLM's, or {"messages": [...]} (a whole chat), or a `kestrel eval` set line
// ({"request": {"messages": [...]}, ...}) — so a benchmark can run on the prompts a model was made for, which is
// what speculative decoding's acceptance depends on (random words are its worst case). Lines are shuffled by
// the seed and repeated in that order until there are num_prompts; each asks for output_len tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace kestrel::bench {

struct SampleRequest {
  std::string prompt;
  int prompt_len = 0;        // tokens (exact with a tokenizer; for chats, of the messages' contents only)
  int output_len = 0;        // max_tokens asked for
  std::string messages;      // custom chats: the JSON array of messages sent as is (chat endpoint only)
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

struct CustomDatasetOptions {
  std::string path;
  int num_prompts = 0;
  int output_len = 0;
  uint64_t seed = 0;
};

// `tok` may be null (prompt lengths then count whitespace-separated words). A line that is not one of the
// three forms fails with its line number; so do an empty file and an unreadable one.
std::vector<SampleRequest> custom_dataset(const CustomDatasetOptions& o, const tok::Tokenizer* tok);

}  // namespace kestrel::bench
