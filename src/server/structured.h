// Structured outputs at the server (docs/structured-outputs.md): what a request's body constrains —
// response_format, tools, tool_choice, parallel_tool_calls and the thinking switch — as the request
// vocabulary's OutputConstraint (request/request.h), compiled once through the process-wide
// GrammarCache. A compile that is not cached runs on one of this service's worker threads, never on
// an I/O thread (it may take up to the compile-time limit); cached grammars and cached refusals are
// answered at once.
//
// Which requests are constrained:
//   - chat with a generation prompt: always the K3 chat-output grammar, so tools can be called only
//     when declared (and as tool_choice says) and every call's arguments are valid against its
//     parameters; a JSON response_format makes the answer that JSON. The one exception is a plain
//     request (no response_format, tools or tool_choice) with ignore_eos, a benchmark knob that asks
//     for tokens past the end of the message;
//   - chat without a generation prompt: none (a JSON response_format or a forced tool_choice is then
//     a 400: the grammar starts at the assistant's opening);
//   - completions: one JSON document when response_format is json_object / json_schema.
// Compile errors are 400s naming the keyword and its place (param "response_format" or "tools").
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "request/request.h"
#include "server/openai.h"
#include "structured/cache.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::server {

struct StructuredOptions {
  size_t cache_entries = 256;           // compiled grammars kept (least recently used dropped)
  int compile_threads = 2;              // workers compiling grammars that are not cached
  structured::SchemaLimits limits;      // schema and compile limits (time, states, nesting)
  // json_object / json_schema answers complete within max_tokens unless a request says
  // "complete_within_max_tokens": false (OutputConstraint::complete_within_max_tokens).
  bool complete_within_max_tokens = true;
};

class GrammarService {
 public:
  GrammarService(const tok::Tokenizer& tok, StructuredOptions opt);
  ~GrammarService();
  GrammarService(const GrammarService&) = delete;
  GrammarService& operator=(const GrammarService&) = delete;

  // The constraint a request states (its grammar not attached yet), or none. ApiError 400 when malformed.
  static std::optional<OutputConstraint> chat_constraint(const ojson& body, const tok::ChatPrompt& prompt,
                                                         bool ignore_eos);
  static std::optional<OutputConstraint> completion_constraint(const ojson& body);
  // Budget-aware completion for a JSON response_format: the body's "complete_within_max_tokens"
  // (a boolean; 400 otherwise), else `server_default`. Text formats and tool calls are never forced
  // closed: a cut text is honestly finish_reason "length".
  static void set_completion(std::optional<OutputConstraint>& c, const ojson& body, bool server_default);

  // The compiled grammar for a model of `vocab_size` logits if it is cached (nullptr if not); a
  // cached refusal is an ApiError 400.
  std::shared_ptr<const structured::CompiledGrammar> find(const OutputConstraint& c, int64_t vocab_size);
  // Compiles on a worker, then calls done(grammar, error) there (error set: a 400 to send).
  using Done = std::function<void(std::shared_ptr<const structured::CompiledGrammar>, std::optional<ApiError>)>;
  void compile_async(OutputConstraint c, int64_t vocab_size, Done done);

  structured::GrammarCache::Stats stats() const;

 private:
  std::shared_ptr<structured::GrammarCache> cache(int64_t vocab_size);  // built on first use (a worker)
  void work();

  const tok::Tokenizer& tok_;
  StructuredOptions opt_;
  mutable std::mutex cache_mu_;
  std::shared_ptr<structured::GrammarCache> cache_;
  int64_t cache_vocab_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kestrel::server
