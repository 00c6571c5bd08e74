// The OpenAI protocol, apart from HTTP: per-choice output shaping (the shared text stream's deltas -> chunk deltas, tool-call ids, logprobs, token counts)
// and the JSON of chunks, final bodies, usage and errors (request bodies: params.h; the Responses
// API: responses.h). Pure functions and small classes with no I/O, so unit tests can drive them with
// hand-made engine events.
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

// 400 naming the request field at fault: "'<field>' <msg>", with the field as the error's `param`.
[[noreturn]] inline void bad_field(const std::string& field, const std::string& msg) {
  throw ApiError(400, "'" + field + "' " + msg, field);
}

// "invalid_request_error" for 4xx (OpenAI's), "authentication_error" for 401, etc.
std::string error_type(int status);
std::string error_body(int status, const std::string& message, const std::string& param = {});

enum class Api { kChat, kCompletion };

// A RequestError from the engine's validate() as the OpenAI error: 400 with the field as `param`
// (the prompt is `messages` in chat).
ApiError api_error(const RequestError& e, Api api);

// How one choice's output is shaped.
struct ChoiceOptions {
  bool thinking = false;             // chat: the prompt ended inside a think block (ChatPrompt)
  std::vector<std::string> tools{};  // chat: declared tool names
  std::vector<std::string> stop{};   // stop strings
  bool logprobs = false;             // per-token logprobs entries
  bool keep_special = false;         // skip_special_tokens = false
  bool single_tool_call = false;     // parallel_tool_calls = false: the answer ends at a second call
  bool discard_output = false;       // max_tokens 0: the engine's one token is not part of the answer
  std::string echo{};                // completions echo: the prompt's text, before the output
  std::vector<int32_t> echo_ids{};   // and its ids (for the prompt's logprobs entries)
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

  ChoiceStream(Api api, const tok::Tokenizer& tok, ChoiceOptions o);

  Delta on_event(const TokenEvent& ev);
  bool done() const { return done_; }

  // Totals, for usage and non-streaming bodies.
  int completion_tokens() const { return completion_tokens_; }
  int reasoning_tokens() const { return reasoning_tokens_; }
  int prompt_tokens() const { return prompt_tokens_; }
  void set_prompt_tokens(int n) { prompt_tokens_ = n; }  // known before the first event (the request's)
  int cached_tokens() const { return cached_tokens_; }
  const std::string& reasoning() const { return text_.reasoning(); }
  std::string content() const { return echo_ + text_.content(); }
  const std::string& finish_reason() const { return finish_reason_; }
  json tool_calls_message() const;   // [{id, type, function{name, arguments}}]
  const json& logprobs_all() const { return logprobs_all_; }

 private:
  void absorb(tok::TextDelta&& td, Delta& d);
  void end(const std::string& reason, Delta& d);
  json logprob_entry(int32_t token, float logprob, const std::vector<TokenLogprob>& top) const;
  std::string token_text(int32_t id) const;

  const tok::Tokenizer* tok_;
  tok::TextStream text_;
  bool logprobs_, single_tool_call_, discard_;
  std::string echo_;
  std::vector<int32_t> echo_ids_;
  bool started_ = false;  // the first event (it brings the prompt counts and logprobs) is in
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
  bool include_usage = false;     // streaming: every chunk carries "usage": null, then a usage chunk
  bool continuous_usage = false;  // streaming: every chunk carries its choice's usage so far (vLLM)
  int n = 1;                      // choices per prompt (the usage counts each prompt once)
};

json chat_chunk(const ResponseHead& h, size_t index, json delta, json finish, json logprobs);
json completion_chunk(const ResponseHead& h, size_t index, const std::string& text, json finish, json logprobs);
// The SSE payloads streamed for one delta of choice `c` (none when it carries nothing; an engine
// error is an error object); `text_offset` is the choice's running offset for completions logprobs.
std::vector<std::string> delta_payloads(const ResponseHead& h, size_t index, const ChoiceStream& c,
                                        const ChoiceStream::Delta& d, size_t& text_offset);
// The final streamed chunk with usage (no choices).
json usage_chunk(const ResponseHead& h, const json& usage);
// The non-streaming body of all choices.
json response_body(const ResponseHead& h, const std::vector<ChoiceStream>& choices, const json& usage);
// Usage over all choices: each prompt counted once (choices i·n … i·n + n − 1 share prompt i, as
// OpenAI counts one prompt for n choices), completions and reasoning summed.
json usage_of(const std::vector<ChoiceStream>& choices, int n = 1);
json usage_json(int prompt, int completion, int reasoning, int cached);

std::string random_id(const std::string& prefix);  // "chatcmpl-<24 hex>" etc.
// SSE framing: "data: <payload>\n\n".
inline std::string sse(const std::string& payload) { return "data: " + payload + "\n\n"; }
std::string dumps(const json& j);  // compact, invalid UTF-8 replaced

}  // namespace kestrel::server
