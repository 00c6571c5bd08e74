// Request bodies of the OpenAI endpoints into the engine's Request: field types, the protocol's own
// rules and the list of fields each endpoint honours (value ranges are validate()'s,
// request/request.h). A field the engine would not honour is refused with a 400 naming it — never
// accepted and ignored. docs/api.md lists every field and what it does.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>

#include "server/openai.h"

namespace kestrel::server {

// One generation request as the protocol states it: the engine Request (prompt still empty) and the
// protocol's own fields.
struct GenParams {
  Request request;                // sampling, stop strings and ids, ignore_eos, logprobs, seed
  std::optional<int> max_tokens;  // absent: the rest of the context (max_completion_tokens wins); 0: no output
  bool stream = false;
  bool include_usage = false;
  bool continuous_usage = false;  // stream_options.continuous_usage_stats (vLLM): usage in every chunk
  int n = 1;
  std::optional<std::string> model;
  bool echo = false;                 // completions: the prompt is part of the text (and of the logprobs)
  bool keep_special = false;         // skip_special_tokens = false
  bool parallel_tool_calls = true;   // false: at most one tool call per answer
  bool logprobs() const { return request.sampling.logprobs >= 0; }
};

// Reads the generation fields of /v1/chat/completions or /v1/completions (the Responses API's body comes
// here as a chat body, renamed by responses.h); throws ApiError 400 for an unknown field, a wrong type or
// a protocol rule broken (top_logprobs without logprobs, stream_options without stream, n outside
// [1, 16], best_of != n, echo in chat). No seed: a fresh random one (the engine's draws are a function of
// the seed). `completion_tokens_field`: what the client called the body's max_completion_tokens (the
// Responses API: max_output_tokens, its only budget field, which then names the budget even when absent);
// it and the budget's errors name the field that way (Request::max_tokens_field).
GenParams parse_gen_params(const ojson& body, Api api,
                           const std::string& completion_tokens_field = "max_completion_tokens");

// reasoning_effort as clients send it, onto the model's levels (MODEL.md §7: low, medium, high,
// max; thinking off): "none" → thinking off, "minimal" → low, "low"/"medium"/"high" as they are,
// "xhigh" and "max" → max. Rewrites the body's field in place; other values are left for the chat
// encoder to refuse.
void map_reasoning_effort(ojson& body);

}  // namespace kestrel::server
