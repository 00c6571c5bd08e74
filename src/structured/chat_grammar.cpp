// K3 chat-output grammar (chat_grammar.h). The argument list of a call uses the same junction
// construction as JSON objects (schema_compiler.cpp): declared keys in order, a later key reachable
// only if no required key lies between, the close marker only once no required key remains.
#include "structured/chat_grammar.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"

namespace kestrel::structured {

using Frag = GrammarBuilder::Frag;
using detail::StrMode;

namespace {

std::string escape_attr(std::string_view v) {
  std::string out;
  for (char c : v) out += c == '&' ? "&amp;" : c == '"' ? "&quot;" : std::string(1, c);
  return out;
}

struct Markup {
  GrammarBuilder& b;
  TokenId open, close, sep, end_of_msg;
  // <|open|>header<|sep|> and <|close|>tag<|sep|>
  Frag opening(const std::string& header) { return b.seq({b.special(open), b.literal(header), b.special(sep)}); }
  Frag closing(const std::string& tag) { return b.seq({b.special(close), b.literal(tag), b.special(sep)}); }
  Frag free_text() { return b.star(b.byte_range(0x00, 0xFF)); }
};

// The arguments of one tool: a rule of its own.
uint32_t arguments_rule(GrammarBuilder& b, JsonRules& rules, Markup& mk, const ChatToolSpec& tool, size_t index,
                        const SchemaLimits& limits) {
  const std::string where = fmt::format("tools[{}] ('{}') function.parameters", index, tool.name);
  const uint32_t r = b.add_rule("arguments of " + tool.name);
  SchemaCompiler sc(rules, tool.parameters, limits, where);
  const SchemaCompiler::ObjectShape sh = sc.object_shape(tool.parameters, "");
  const size_t P = sh.properties.size();
  // One argument: header with key and type, then the value of that type, then the close marker.
  auto argument = [&](const Frag& key_text, const ojson& schema, const std::string& ptr) {
    std::vector<Frag> forms;
    for (JsonType t : sc.types(schema, ptr)) {
      const Frag value = sc.typed_value(schema, ptr, t, StrMode::kRaw);
      forms.push_back(b.seq({b.literal(fmt::format("\" type=\"{}\"", json_type_name(t))), b.special(mk.sep), value}));
    }
    return b.seq({b.special(mk.open), b.literal("argument key=\""), key_text, b.alt(forms), mk.closing("argument")});
  };
  std::vector<bool> req(P + 1, false), required_after(P + 1, false);
  for (size_t j = 0; j < P; ++j) req[j + 1] = sh.required.count(sh.properties[j].first) > 0;
  for (size_t i = P; i-- > 0;) required_after[i] = required_after[i + 1] || req[i + 1];
  std::vector<Frag> S(P + 1), K(P + 1);
  for (size_t i = 0; i <= P; ++i) S[i] = b.empty(), K[i] = b.empty();
  for (size_t j = 1; j <= P; ++j) {
    const Frag a = argument(b.literal(escape_attr(sh.properties[j - 1].first)), sh.properties[j - 1].second,
                            sh.property_ptrs[j - 1]);
    b.link(K[j], a);
    b.link(a, S[j]);
  }
  const Frag end = b.empty();
  Frag X = b.empty();
  if (sh.additional) {
    std::vector<std::string> names;
    for (const auto& p : sh.properties) names.push_back(p.first);
    // key_not_in writes the delimiting quotes; the header's `key="` already has the opening one.
    const Frag key = detail::key_not_in(b, names, true);
    const Frag a = b.seq({b.special(mk.open), b.literal("argument key="), key,
                          b.alt([&] {
                            std::vector<Frag> forms;
                            for (JsonType t : sc.types(*sh.additional, "/additionalProperties"))
                              forms.push_back(b.seq({b.literal(fmt::format(" type=\"{}\"", json_type_name(t))),
                                                     b.special(mk.sep),
                                                     sc.typed_value(*sh.additional, "/additionalProperties", t,
                                                                    StrMode::kRaw)}));
                            return forms;
                          }()),
                          mk.closing("argument")});
    b.link(X, a);
    b.link(a, X);
    b.link(X, end);
  }
  for (size_t i = 0; i <= P; ++i) {
    for (size_t j = i + 1; j <= P; ++j) {
      b.link(S[i], K[j]);
      if (req[j]) break;
    }
    if (!required_after[i]) {
      b.link(S[i], end);
      if (sh.additional) b.link(S[i], X);
    }
  }
  b.set_body(r, {S[0].in, end.out});
  return r;
}

}  // namespace

ChatGrammarSpec chat_grammar_spec(const ojson& req, bool thinking) {
  ChatGrammarSpec spec;
  spec.thinking = thinking;
  if (!req.is_object()) fail("the chat request must be a JSON object");
  if (req.contains("tools") && !req["tools"].is_null()) {
    const ojson& tools = req["tools"];
    if (!tools.is_array()) fail("'tools' must be an array");
    for (size_t i = 0; i < tools.size(); ++i) {
      const ojson& t = tools[i];
      const ojson& fn = t.is_object() && t.contains("function") ? t["function"] : t;
      if (!fn.is_object() || !fn.contains("name") || !fn["name"].is_string()) fail("tools[{}] needs function.name", i);
      ChatToolSpec ts;
      ts.name = fn["name"].get<std::string>();
      if (fn.contains("parameters") && !fn["parameters"].is_null()) ts.parameters = fn["parameters"];
      spec.tools.push_back(std::move(ts));
    }
  }
  if (req.contains("tool_choice") && !req["tool_choice"].is_null()) {
    const ojson& tc = req["tool_choice"];
    if (tc.is_string()) {
      const std::string s = tc.get<std::string>();
      if (s == "required") spec.tool_choice = ChatGrammarSpec::ToolChoice::kRequired;
      else if (s == "none") spec.tool_choice = ChatGrammarSpec::ToolChoice::kNone;
      else if (s != "auto") fail("unsupported tool_choice '{}'", s);
    } else if (tc.is_object()) {
      const ojson& fn = tc.contains("function") ? tc["function"] : tc;
      if (!fn.is_object() || !fn.contains("name") || !fn["name"].is_string()) fail("tool_choice object needs function.name");
      spec.tool_choice = ChatGrammarSpec::ToolChoice::kNamed;
      spec.named_tool = fn["name"].get<std::string>();
      if (std::none_of(spec.tools.begin(), spec.tools.end(), [&](const auto& t) { return t.name == spec.named_tool; }))
        fail("tool_choice names '{}', which is not among the declared tools", spec.named_tool);
    } else {
      fail("tool_choice must be a string or an object");
    }
  }
  if ((spec.tool_choice == ChatGrammarSpec::ToolChoice::kRequired) && spec.tools.empty())
    fail("tool_choice 'required' needs at least one tool");
  if (req.contains("response_format") && !req["response_format"].is_null()) {
    const ojson& rf = req["response_format"];
    const std::string type = rf.is_object() && rf.contains("type") && rf["type"].is_string() ? rf["type"].get<std::string>()
                             : rf.is_string() ? rf.get<std::string>() : "";
    if (type == "json_object") {
      spec.response_schema = ojson{{"type", "object"}};
    } else if (type == "json_schema") {
      // Where the chat encoder finds it: json_schema.schema, json_schema.json_schema, or json_schema.
      ojson schema;
      if (rf.is_object() && rf.contains("json_schema") && !rf["json_schema"].is_null()) {
        const ojson& js = rf["json_schema"];
        schema = js.is_object() && js.contains("schema") ? js["schema"]
                 : js.is_object() && js.contains("json_schema") ? js["json_schema"] : js;
      }
      if (schema.is_null()) fail("response_format json_schema needs a schema");
      spec.response_schema = schema;
    } else if (type != "text") {
      fail("unsupported response_format type '{}'", type);
    }
  }
  return spec;
}

Grammar chat_grammar(const tok::Tokenizer& tok, const ChatGrammarSpec& spec, const SchemaOptions& opt,
                     const SchemaLimits& limits) {
  using TC = ChatGrammarSpec::ToolChoice;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::microseconds(int64_t(limits.max_compile_seconds * 1e6));
  GrammarBuilder b(BuildLimits{limits.max_nfa_nodes, limits.max_states, deadline});
  Markup mk{b, tok.require_special("<|open|>"), tok.require_special("<|close|>"), tok.require_special("<|sep|>"),
            tok.require_special("<|end_of_msg|>")};
  JsonRules rules(b, opt);
  const uint32_t root = b.add_rule("assistant message");

  const bool tools_allowed = !spec.tools.empty() && spec.tool_choice != TC::kNone;
  const bool tools_required = spec.tool_choice == TC::kRequired || spec.tool_choice == TC::kNamed;
  if (spec.tool_choice == TC::kNamed &&
      std::none_of(spec.tools.begin(), spec.tools.end(), [&](const auto& t) { return t.name == spec.named_tool; }))
    fail("tool_choice names '{}', which is not among the declared tools", spec.named_tool);

  Frag tools_section = b.nothing();
  if (tools_allowed) {
    std::vector<uint32_t> args(spec.tools.size(), kDead);
    for (size_t i = 0; i < spec.tools.size(); ++i)
      if (spec.tool_choice != TC::kNamed || spec.tools[i].name == spec.named_tool)
        args[i] = arguments_rule(b, rules, mk, spec.tools[i], i, limits);
    const size_t calls = spec.tool_choice == TC::kNamed ? 1 : std::max<size_t>(1, spec.max_calls);
    auto call = [&](size_t position) {  // position is 1-based
      std::vector<Frag> by_name;
      for (size_t i = 0; i < spec.tools.size(); ++i) {
        if (args[i] == kDead) continue;
        by_name.push_back(b.seq({b.literal(escape_attr(spec.tools[i].name)),
                                 b.literal(fmt::format("\" index=\"{}\"", position)), b.special(mk.sep),
                                 b.call(args[i])}));
      }
      return b.seq({b.special(mk.open), b.literal("call tool=\""), b.alt(by_name), mk.closing("call")});
    };
    Frag more = b.empty();
    for (size_t p = calls; p >= 2; --p) more = b.opt(b.seq(call(p), more));
    tools_section = b.seq({mk.opening("tools"), call(1), more, mk.closing("tools")});
  }
  const Frag end = b.seq(mk.closing("message"), b.special(mk.end_of_msg));

  Frag response;
  if (spec.response_schema) {
    SchemaCompiler sc(rules, *spec.response_schema, limits, "response_format schema");
    Frag json = b.seq({rules.ws(), sc.value(*spec.response_schema, ""), rules.ws(), mk.closing("response")});
    std::vector<Frag> alts;
    if (!tools_required) alts.push_back(b.seq(json, end));
    if (tools_allowed) alts.push_back(b.seq({mk.closing("response"), tools_section, end}));
    response = b.alt(alts);
  } else {
    Frag after = tools_required ? b.seq(tools_section, end)
                 : tools_allowed ? b.alt({end, b.seq(tools_section, end)}) : end;
    response = b.seq({mk.free_text(), mk.closing("response"), after});
  }
  Frag body = spec.thinking ? b.seq({mk.free_text(), mk.closing("think"), mk.opening("response"), response}) : response;
  b.set_body(root, body);
  return b.build(root);
}

std::shared_ptr<const CompiledGrammar> compile_chat_grammar(std::shared_ptr<const TokenVocab> vocab,
                                                            const ChatGrammarSpec& spec, const SchemaOptions& opt,
                                                            const SchemaLimits& limits) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::microseconds(int64_t(limits.max_compile_seconds * 1e6));
  Grammar g = chat_grammar(vocab->tokenizer(), spec, opt, limits);
  return std::make_shared<const CompiledGrammar>(std::move(vocab), std::move(g), limits.max_stack_depth, deadline);
}

}  // namespace kestrel::structured
