// The OpenAI protocol, apart from HTTP: request validation (field types and ranges, OpenAI's error
// object), per-choice output shaping (parser deltas -> chunk deltas, stop strings, tool-call ids,
// logprobs, token counts) and the final response bodies. Pure functions and small classes with no
// I/O, so unit tests can drive them with hand-made engine events.
//
// Stop strings live here (StopMatcher): the engine only knows stop token ids. They apply to the
// text a client sees as the answer: `text` of /v1/completions, `content` of chat (not reasoning
// and not tool-call arguments). Text that might be the start of a stop string is held back until
// it is resolved, so a stop string never leaks into a stream.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/check.h"
#include "server/engine_api.h"
#include "tokenizer/parser.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::server {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// An error with an HTTP status, rendered as OpenAI's {"error": {message, type, param, code}}.
class ApiError : public Error {
 public:
  ApiError(int status, const std::string& msg, std::string param = {})
      : Error(msg), status(status), param(std::move(param)) {}
  int status;
  std::string param;
};

// "invalid_request_error" for 4xx (OpenAI's), "authentication_error" for 401, etc.
std::string error_type(int status);
std::string error_body(int status, const std::string& message, const std::string& param = {});

enum class Api { kChat, kCompletion };

struct GenParams {
  bool stream = false;
  bool include_usage = false;
  int n = 1;
  std::optional<int> max_tokens;   // max_completion_tokens wins over max_tokens
  SamplingParams sampling;         // max_tokens resolved later against the context
  std::vector<std::string> stop;
  bool logprobs = false;
  int top_logprobs = 0;
  std::optional<std::string> model;
};

// Validates the generation fields shared by both endpoints (types and ranges); throws ApiError 400.
GenParams parse_gen_params(const ojson& body, Api api);

// Holds back text that may begin a stop string.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  // Appends text; returns what is safe to emit now. On a match, returns the text before it and
  // sets matched(); everything after is dropped.
  std::string push(const std::string& text);
  std::string flush();  // end of output: the held-back tail
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
};

// One choice of one request: engine events in, deltas out.
class ChoiceStream {
 public:
  struct Delta {
    std::string reasoning, content;  // content = `text` for completions
    json tool_calls = json::array(); // OpenAI streaming shape: [{index, id?, type?, function{name?, arguments}}]
    json logprobs;                   // null, or the entries for the tokens since the last delta
    std::optional<std::string> finish_reason;
    std::string error;               // engine failure
    bool cancel_engine = false;      // a stop string matched: the caller cancels the engine request
    bool empty() const {
      return reasoning.empty() && content.empty() && tool_calls.empty() && !finish_reason && error.empty();
    }
  };

  // thinking/tools: from the ChatPrompt (chat only).
  ChoiceStream(Api api, const tok::Tokenizer& tok, bool thinking, std::vector<std::string> tools,
               std::vector<std::string> stop, bool logprobs);

  Delta on_event(const TokenEvent& ev);
  bool done() const { return done_; }

  // Totals, for usage and non-streaming bodies.
  int completion_tokens() const { return completion_tokens_; }
  int reasoning_tokens() const { return reasoning_tokens_; }
  int prompt_tokens() const { return prompt_tokens_; }
  int cached_tokens() const { return cached_tokens_; }
  const std::string& reasoning() const { return reasoning_; }
  const std::string& content() const { return content_; }
  const std::string& finish_reason() const { return finish_reason_; }
  json tool_calls_message() const;   // [{id, type, function{name, arguments}}]
  const json& logprobs_all() const { return logprobs_all_; }

 private:
  void absorb(const tok::ParseDelta& pd, Delta& d);
  json logprob_entry(const TokenEvent& ev) const;
  std::string token_text(int32_t id) const;

  Api api_;
  const tok::Tokenizer* tok_;
  std::optional<tok::OutputParser> parser_;
  std::optional<tok::StreamDecoder> decoder_;
  StopMatcher stop_;
  bool logprobs_;
  bool done_ = false;
  int completion_tokens_ = 0, reasoning_tokens_ = 0, prompt_tokens_ = 0, cached_tokens_ = 0;
  std::string reasoning_, content_, finish_reason_;
  std::vector<std::string> call_ids_;
  json logprobs_all_ = json::array();
  json pending_logprobs_ = json::array();
};

// Stop token ids of K3 output (<|end_of_msg|>, [EOS], [EOT], whichever the tokenizer has).
std::vector<int32_t> stop_token_ids(const tok::Tokenizer& tok);

std::string random_id(const std::string& prefix);  // "chatcmpl-<24 hex>" etc.

// SSE framing: "data: <payload>\n\n".
inline std::string sse(const std::string& payload) { return "data: " + payload + "\n\n"; }

json usage_json(int prompt, int completion, int reasoning, int cached);

}  // namespace kestrel::server
