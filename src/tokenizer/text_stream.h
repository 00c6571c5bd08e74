// TextStream: one request's generated ids in, its text out, incrementally — the one place output
// is detokenised, stop strings are matched and K3 output is parsed, for `kestrel generate` and for
// both OpenAI endpoints of the server (src/server/openai.h wraps it with the protocol's shapes).
//
//   plain: every token is text (generate, /v1/completions); stop strings apply to all of it.
//   chat:  the K3 output parser (parser.h) splits reasoning, content and tool calls; stop strings
//          apply to the content only (not to reasoning, not to tool-call arguments).
//
// Stop strings: text that might be the start of one is held back until it is resolved, so a stop
// string never leaks into a stream; on a match the text ends right before it, nothing after it
// counts (tool calls included), and stop_matched() tells the caller to cancel generation.
// Stop tokens (request.h: end-of-sequence ids and the request's stop_token_ids) are never text: the
// caller does not push the token that ended generation, it calls finish(kStop).
// Ids outside the tokenizer's table (a padded vocabulary) have no text. Special tokens are not text
// either unless keep_special is set (vLLM's skip_special_tokens = false): plain streams drop them,
// chat streams drop stray specials and broken or unfinished markup (parser.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tokenizer/parser.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::tok {

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

struct TextDelta {
  std::string reasoning, content;
  std::vector<ToolCallDelta> tool_calls;  // chat only, as the parser streams them
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class TextStream {
 public:
  static TextStream plain(const Tokenizer& tok, std::vector<std::string> stop, bool keep_special = false);
  // thinking / tools: from the ChatPrompt (the prompt ended inside a think block; declared tools).
  static TextStream chat(const Tokenizer& tok, bool thinking, std::vector<std::string> tools,
                         std::vector<std::string> stop, bool keep_special = false);

  // A generated token that did not end generation.
  TextDelta push(TokenId id);
  // Generation ended: kStop by a stop token (not pushed), kLength at max_tokens. Flushes what was held.
  TextDelta finish(FinishCause cause);

  bool done() const { return done_; }                 // finished, or a stop string matched
  bool stop_matched() const { return stop_.matched(); }
  const std::string& finish_reason() const { return finish_reason_; }  // once done: stop | length | tool_calls
  bool is_chat() const { return parser_.has_value(); }
  // Everything so far (after the stop-string cut).
  const std::string& reasoning() const { return reasoning_; }
  const std::string& content() const { return content_; }
  const std::vector<ParsedToolCall>& tool_calls() const;  // chat: the parser's calls; plain: none

 private:
  TextStream(const Tokenizer& tok, std::vector<std::string> stop);
  void add_content(const std::string& text, TextDelta& d);
  void absorb(ParseDelta&& pd, TextDelta& d);
  void end(std::string reason);

  const Tokenizer* tok_;
  std::optional<OutputParser> parser_;    // chat
  std::optional<StreamDecoder> decoder_;  // plain
  StopMatcher stop_;
  bool keep_special_ = false;
  bool done_ = false;
  std::string reasoning_, content_, finish_reason_;
};

}  // namespace kestrel::tok
