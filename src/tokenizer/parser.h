// Incremental parser of K3 model output (MODEL.md §7 "Parsing output"): generated token ids in,
// reasoning text, response content and tool calls out, token by token for streaming.
//
// Markers are recognised by their special-token ids (<|open|>, <|close|>, <|sep|>); the tag text
// between them is accumulated from the following ordinary tokens, so a marker whose name is split
// over several tokens is still found, and nothing of a possible marker is emitted until it is
// resolved (held back). Text is emitted only in complete UTF-8 characters. Malformed output never
// throws and never loses text: an unknown or misplaced marker, an unclosed header, or a bad
// argument value is passed through as text (or kept raw in the call's arguments) and reported in
// `errors`. With keep_special off (the text stream's default, vLLM's skip_special_tokens) special
// tokens are never text: a complete marker that does not apply and a marker left unfinished when the
// output ends are dropped whole; a marker cut short mid-output (another special, an oversize header)
// loses its special and keeps its ordinary text; other specials are dropped.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kestrel::tok {

struct ToolCallDelta {
  size_t index = 0;                 // position of the call in this message, 0-based
  std::optional<std::string> name;  // set on the call's first delta
  std::string arguments;            // next fragment of the arguments JSON text
};

struct ParseDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct ParsedToolCall {
  std::string name;
  std::optional<int> model_index;  // the `index` attribute the model wrote (1-based), if any
  // One JSON object, Python json.dumps style: {"key": "raw string", "n": 3}. String arguments
  // are the model's text verbatim (JSON-escaped); other types are parsed and re-serialised.
  std::string arguments;
  bool complete = false;           // the call's closing marker was seen
  std::string error;               // empty when the call is well-formed
};

struct ParsedOutput {
  std::string reasoning;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
  std::string finish_reason;       // "stop", "length" or "tool_calls" once finished
  std::vector<std::string> errors; // malformed-output reports (never fatal)
};

enum class FinishCause { kStop, kLength };

// The specials that end a K3 turn (<|end_of_msg|>, [EOS], [EOT]: whichever the tokenizer has). They are
// end-of-sequence ids for the engine and never part of the parsed text.
std::vector<TokenId> end_of_turn_ids(const Tokenizer& tok);

class OutputParser {
 public:
  // thinking: the prompt ended inside <|open|>think<|sep|> (else inside <|open|>response<|sep|>).
  // known_tools: declared tool names; a call to another name is reported (empty: no check).
  // keep_special: malformed markup and stray specials stay in the text as written (see the header).
  OutputParser(const Tokenizer& tok, bool thinking, std::vector<std::string> known_tools = {},
               bool keep_special = true);

  ParseDelta push(TokenId id);
  ParseDelta push(const std::vector<TokenId>& ids);
  // Ends the output: flushes held-back text and sets finish_reason. kStop = a stop token ended
  // generation, kLength = the token limit did.
  ParseDelta finish(FinishCause cause);

  const ParsedOutput& result() const { return out_; }

 private:
  enum class Where { kTop, kThink, kResponse, kTools, kCall, kArg, kJson, kDone };
  struct Header {
    bool active = false;
    bool is_open = false;
    std::string bytes;
  };

  void on_text(const std::string& bytes, ParseDelta& d);
  void on_special(TokenId id, ParseDelta& d);
  void emit_text(const std::string& text, ParseDelta& d);  // complete UTF-8 text into the current sink
  void flush_utf8(ParseDelta& d);
  void abort_header(ParseDelta& d);
  bool apply_marker(bool is_open, const std::string& header, ParseDelta& d);
  void emit_args(const std::string& frag, ParseDelta& d);
  void close_argument(ParseDelta& d, bool truncated);
  void close_call(ParseDelta& d, bool complete);
  void error(std::string msg);

  const Tokenizer* tok_;
  std::vector<std::string> known_tools_;
  bool keep_special_ = true;
  TokenId open_, close_, sep_;
  std::vector<TokenId> terminators_;  // end_of_turn_ids()
  Where where_;
  Header header_;
  Utf8Stream utf8_;
  // Current argument.
  bool arg_is_string_ = false;
  bool call_has_args_ = false;
  bool call_has_json_ = false;
  std::string arg_key_;
  std::string arg_raw_;  // typed value text, parsed when the argument closes
  ParsedOutput out_;
};

}  // namespace kestrel::tok
