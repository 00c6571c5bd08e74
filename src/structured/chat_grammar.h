// The K3 chat-output grammar (MODEL.md §7): what the model may generate after the generation prompt,
// by request mode. The markers are special tokens by id (<|open|>, <|close|>, <|sep|>,
// <|end_of_msg|>); tag names and attributes are bytes in any tokenization, as the parser gathers
// them (src/tokenizer/parser.cpp).
//
//   [thinking]  FREE <|close|>think<|sep|> <|open|>response<|sep|>      (thinking off: starts here)
//   response    FREE | JSON                 then <|close|>response<|sep|>
//   tools       <|open|>tools<|sep|> CALL{1..n} <|close|>tools<|sep|>   (per tool_choice, below)
//   CALL        <|open|>call tool="NAME" index="i"<|sep|> ARG* <|close|>call<|sep|>
//   ARG         <|open|>argument key="K" type="T"<|sep|> VALUE <|close|>argument<|sep|>
//   end         <|close|>message<|sep|><|end_of_msg|>
//
// FREE is any run of ordinary tokens (reasoning is never constrained beyond that: vLLM's
// reasoning-aware structured output starts after it, and so do we). JSON is the response_format
// schema (json_object = {"type": "object"}). Tool sections by tool_choice: auto — optional, declared
// names only; required — mandatory; named function — mandatory, exactly one call of that function;
// none, or no tools — the section cannot open. With response_format and tools allowed, the answer is
// either the JSON or an empty response followed by the tools section. Arguments follow the function's
// `parameters`: declared keys in order, required ones present, additional ones only if the schema
// allows them; T is the XTML type of the value ("number" for integers too); a string value is the raw
// text (valid UTF-8), any other value JSON of that type, both valid against the property's schema.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "structured/json_schema_grammar.h"

namespace kestrel::structured {

struct ChatToolSpec {
  std::string name;
  // The function's JSON Schema (an object schema). Absent parameters mean no arguments; `{}` (the
  // schema true) admits any arguments.
  ojson parameters = ojson{{"type", "object"}, {"properties", ojson::object()}};
};

struct ChatGrammarSpec {
  enum class ToolChoice { kAuto, kNone, kRequired, kNamed };
  bool thinking = true;                    // the prompt ends inside <|open|>think<|sep|>
  std::optional<ojson> response_schema;    // JSON answer required (response_format)
  std::vector<ChatToolSpec> tools;
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string named_tool;                  // for kNamed
  size_t max_calls = 8;                    // calls in one tools section (auto / required)
};

// The spec of an OpenAI chat request (response_format, tools, tool_choice) with the prompt's thinking
// switch. Malformed fields: kestrel::Error (a 400).
ChatGrammarSpec chat_grammar_spec(const ojson& request, bool thinking);

// The grammar; schema errors name the tool or the response format.
Grammar chat_grammar(const tok::Tokenizer& tok, const ChatGrammarSpec& spec, const SchemaOptions& opt = {},
                     const SchemaLimits& limits = {});

std::shared_ptr<const CompiledGrammar> compile_chat_grammar(std::shared_ptr<const TokenVocab> vocab,
                                                            const ChatGrammarSpec& spec,
                                                            const SchemaOptions& opt = {},
                                                            const SchemaLimits& limits = {});

}  // namespace kestrel::structured
