// The OpenAI protocol, apart from HTTP: request bodies into the engine's Request (field types and
// the protocol's own rules; value ranges are validate()'s, request/request.h), per-choice output
// shaping (the shared text stream's deltas -> chunk deltas, tool-call ids, logprobs, token counts)
// and the JSON of chunks, final bodies, usage and errors. Pure functions and small classes with no
// I/O, so unit tests can drive them with hand-made engine events.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/check.h"
#include "request/request.h"
#include "tokenizer/text_stream.h"
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

// One generation request as the protocol states it: the engine Request (prompt still empty) and the
// protocol's own fields.
struct GenParams {
  Request request;               // sampling, stop strings and ids, ignore_eos, logprobs, seed
  std::optional<int> max_tokens; // absent: the rest of the context (max_completion_tokens wins)
  bool stream = false;
  bool include_usage = false;
  int n = 1;
  std::optional<std::string> model;
  bool logprobs() const { return request.sampling.logprobs >= 0; }
};

// Reads the generation fields shared by both endpoints; throws ApiError 400 for a wrong type or a
// protocol rule broken (top_logprobs without logprobs, stream_options without stream, n outside
// [1, 16]). No seed: a fresh random one (the engine's draws are a function of the seed).
GenParams parse_gen_params(const ojson& body, Api api);

// A RequestError from the engine's validate() as the OpenAI error: 400 with the field as `param`
// (the prompt is `messages` in chat).
ApiError api_error(const RequestError& e, Api api);

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
  const std::string& reasoning() const { return text_.reasoning(); }
  const std::string& content() const { return text_.content(); }
  const std::string& finish_reason() const { return finish_reason_; }
  json tool_calls_message() const;   // [{id, type, function{name, arguments}}]
  const json& logprobs_all() const { return logprobs_all_; }

 private:
  void absorb(tok::TextDelta&& td, Delta& d);
  json logprob_entry(const TokenEvent& ev) const;
  std::string token_text(int32_t id) const;

  const tok::Tokenizer* tok_;
  tok::TextStream text_;
  bool logprobs_;
  bool done_ = false;
  int completion_tokens_ = 0, reasoning_tokens_ = 0, prompt_tokens_ = 0, cached_tokens_ = 0;
  std::string finish_reason_;
  std::vector<std::string> call_ids_;
  json logprobs_all_ = json::array();
  json pending_logprobs_ = json::array();
};

// The identity every chunk and body of one response repeats.
struct ResponseHead {
  Api api = Api::kChat;
  std::string id, model;
  int64_t created = 0;
  bool include_usage = false;  // streaming: every chunk carries "usage": null, then a usage chunk
};

json chat_chunk(const ResponseHead& h, size_t index, json delta, json finish, json logprobs);
json completion_chunk(const ResponseHead& h, size_t index, const std::string& text, json finish, json logprobs);
// The SSE payloads streamed for one delta (none when it carries nothing; an engine error is an error
// object); `text_offset` is the choice's running offset for completions logprobs.
std::vector<std::string> delta_payloads(const ResponseHead& h, size_t index, const ChoiceStream::Delta& d,
                                        size_t& text_offset);
// The final streamed chunk with usage (no choices).
json usage_chunk(const ResponseHead& h, const json& usage);
// The non-streaming body of all choices.
json response_body(const ResponseHead& h, const std::vector<ChoiceStream>& choices, const json& usage);
// Usage over all choices: the prompt counted once (OpenAI), completions and reasoning summed.
json usage_of(const std::vector<ChoiceStream>& choices);
json usage_json(int prompt, int completion, int reasoning, int cached);

std::string random_id(const std::string& prefix);  // "chatcmpl-<24 hex>" etc.
// SSE framing: "data: <payload>\n\n".
inline std::string sse(const std::string& payload) { return "data: " + payload + "\n\n"; }
std::string dumps(const json& j);  // compact, invalid UTF-8 replaced

}  // namespace kestrel::server
