// OutputConstraint <-> compiler specs (see constraint.h).
#include "structured/constraint.h"

#include <fmt/format.h>

#include "core/check.h"

namespace kestrel::structured {
namespace {

std::string text_of(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

ojson parse(const std::string& text, const std::string& what) {
  ojson j = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{} is not valid JSON", what);
  return j;
}

}  // namespace

OutputConstraint::Format response_format_of(const ojson& body) {
  if (!body.is_object() || !body.contains("response_format") || body["response_format"].is_null())
    return OutputConstraint::Format::text;
  const ojson& rf = body["response_format"];
  const std::string type = rf.is_object() && rf.contains("type") && rf["type"].is_string() ? rf["type"].get<std::string>()
                           : rf.is_string() ? rf.get<std::string>() : "";
  if (type == "text") return OutputConstraint::Format::text;
  if (type == "json_object") return OutputConstraint::Format::json_object;
  if (type == "json_schema") return OutputConstraint::Format::json_schema;
  fail("unsupported response_format type '{}'", type);
}

OutputConstraint constraint_of(const ChatGrammarSpec& spec, OutputConstraint::Format format) {
  using TC = ChatGrammarSpec::ToolChoice;
  OutputConstraint c;
  c.chat = true;
  c.thinking = spec.thinking;
  c.format = format;
  if (format == OutputConstraint::Format::json_schema && spec.response_schema) c.schema = text_of(*spec.response_schema);
  for (const ChatToolSpec& t : spec.tools) c.tools.push_back({t.name, text_of(t.parameters)});
  c.tool_choice = spec.tool_choice == TC::kNone       ? OutputConstraint::ToolChoice::none
                  : spec.tool_choice == TC::kRequired ? OutputConstraint::ToolChoice::required
                  : spec.tool_choice == TC::kNamed    ? OutputConstraint::ToolChoice::named
                                                      : OutputConstraint::ToolChoice::automatic;
  c.named_tool = spec.named_tool;
  c.max_calls = spec.max_calls;
  return c;
}

OutputConstraint document_constraint(OutputConstraint::Format format, const ojson& schema) {
  OutputConstraint c;
  c.chat = false;
  c.thinking = false;
  c.format = format;
  if (format == OutputConstraint::Format::json_schema) c.schema = text_of(schema);
  return c;
}

namespace {
ojson response_schema(const OutputConstraint& c) {
  return c.format == OutputConstraint::Format::json_schema ? parse(c.schema, "the response_format schema")
                                                           : ojson{{"type", "object"}};
}
}  // namespace

ChatGrammarSpec chat_spec(const OutputConstraint& c) {
  using TC = OutputConstraint::ToolChoice;
  KCHECK(c.chat, "chat_spec of a document constraint");
  ChatGrammarSpec s;
  s.thinking = c.thinking;
  if (c.format != OutputConstraint::Format::text) s.response_schema = response_schema(c);
  for (size_t i = 0; i < c.tools.size(); ++i) {
    ChatToolSpec t;
    t.name = c.tools[i].name;
    if (!c.tools[i].parameters.empty()) t.parameters = parse(c.tools[i].parameters, fmt::format("tools[{}] parameters", i));
    s.tools.push_back(std::move(t));
  }
  s.tool_choice = c.tool_choice == TC::none       ? ChatGrammarSpec::ToolChoice::kNone
                  : c.tool_choice == TC::required ? ChatGrammarSpec::ToolChoice::kRequired
                  : c.tool_choice == TC::named    ? ChatGrammarSpec::ToolChoice::kNamed
                                                  : ChatGrammarSpec::ToolChoice::kAuto;
  s.named_tool = c.named_tool;
  s.max_calls = c.max_calls;
  return s;
}

ojson document_schema(const OutputConstraint& c) {
  KCHECK(!c.chat, "document_schema of a chat constraint");
  return response_schema(c);
}

std::shared_ptr<const CompiledGrammar> compile(GrammarCache& cache, const OutputConstraint& c) {
  return c.chat ? cache.chat(chat_spec(c)) : cache.json_schema(document_schema(c));
}

std::shared_ptr<const CompiledGrammar> find(GrammarCache& cache, const OutputConstraint& c) {
  return c.chat ? cache.find_chat(chat_spec(c)) : cache.find_json_schema(document_schema(c));
}

}  // namespace kestrel::structured
