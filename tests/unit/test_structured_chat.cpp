// The K3 chat-output grammar (src/structured/chat_grammar.h): random walks through its masks over the
// real k3-tiny vocabulary, each finished output parsed by src/tokenizer/parser into the shape the
// request mode demands (declared tool names only, arguments valid against the function's parameters
// by our validator, JSON answers valid against the response schema, no tools section where none may
// open), and hand-written outputs in the exact format of the chat encoder accepted or refused.
#include <gtest/gtest.h>

#include <random>

#include "core/check.h"
#include "evalclient/json_schema.h"
#include "structured/chat_grammar.h"
#include "test_structured_util.h"
#include "tokenizer/parser.h"

namespace kestrel::structured {
namespace {

using testing::k3_tokenizer;
using testing::k3_vocab;
using testing::random_walk;
using json = nlohmann::json;

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
    "parameters": {"type": "object", "properties": {
      "city": {"type": "string", "minLength": 1, "maxLength": 24},
      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
      "days": {"type": "integer", "minimum": 1, "maximum": 7},
      "at": {"type": ["string", "null"], "format": "date"}},
      "required": ["city"]}}},
  {"type": "function", "function": {"name": "set_alarm",
    "parameters": {"type": "object", "properties": {
      "hour": {"type": "integer", "minimum": 0, "maximum": 23},
      "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
      "repeat": {"type": "object", "properties": {"days": {"type": "array", "items": {"enum": ["mon", "tue"]},
                  "maxItems": 2}}, "required": ["days"], "additionalProperties": false},
      "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
      "required": ["hour", "repeat"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "ping"}}])";

struct Mode {
  std::string name;
  std::string request;  // extra request fields (JSON object body without braces)
  bool thinking;
};

json parse_args(const std::string& s) { return json::parse(s, nullptr, false); }

// Runs walks for one request and checks every finished output's parse.
void check_mode(const Mode& mode, int walks, uint32_t seed) {
  SCOPED_TRACE(mode.name);
  const ojson req = ojson::parse("{" + mode.request + "}");
  const ChatGrammarSpec spec = chat_grammar_spec(req, mode.thinking);
  const auto g = compile_chat_grammar(k3_vocab(), spec, {}, testing::test_limits());
  std::vector<std::string> names;
  std::map<std::string, std::unique_ptr<eval::JsonSchema>> params;
  for (const auto& t : spec.tools) {
    names.push_back(t.name);
    params[t.name] = std::make_unique<eval::JsonSchema>(json::parse(t.parameters.dump()));
  }
  std::unique_ptr<eval::JsonSchema> answer;
  if (spec.response_schema) answer = std::make_unique<eval::JsonSchema>(json::parse(spec.response_schema->dump()));
  using TC = ChatGrammarSpec::ToolChoice;
  const bool tools_allowed = !spec.tools.empty() && spec.tool_choice != TC::kNone;
  const bool tools_required = spec.tool_choice == TC::kRequired || spec.tool_choice == TC::kNamed;
  std::mt19937 rng(seed);
  int finished = 0, with_calls = 0;
  for (int i = 0; i < walks; ++i) {
    const auto w = random_walk(g, rng, 600, {}, "\"]},", 0.3, 29, 0.15);
    ASSERT_TRUE(w.failure.empty()) << w.failure;
    if (!w.finished) continue;
    ++finished;
    tok::OutputParser parser(k3_tokenizer(), mode.thinking, names);
    parser.push(w.ids);
    parser.finish(tok::FinishCause::kStop);
    const tok::ParsedOutput& out = parser.result();
    const std::string text = k3_tokenizer().decode(w.ids);
    EXPECT_TRUE(out.errors.empty()) << out.errors.front() << "\n" << text;
    EXPECT_EQ(w.ids.back(), k3_tokenizer().require_special("<|end_of_msg|>"));
    if (!tools_allowed) {
      EXPECT_TRUE(out.tool_calls.empty()) << text;
    }
    if (tools_required) {
      EXPECT_FALSE(out.tool_calls.empty()) << text;
    }
    if (spec.tool_choice == TC::kNamed) {
      EXPECT_EQ(out.tool_calls.size(), 1u) << text;
    }
    with_calls += !out.tool_calls.empty();
    EXPECT_EQ(out.finish_reason, out.tool_calls.empty() ? "stop" : "tool_calls");
    for (size_t c = 0; c < out.tool_calls.size(); ++c) {
      const auto& call = out.tool_calls[c];
      EXPECT_TRUE(call.complete && call.error.empty()) << call.error;
      EXPECT_EQ(call.model_index, int(c + 1));
      ASSERT_TRUE(params.count(call.name)) << "undeclared tool " << call.name;
      if (spec.tool_choice == TC::kNamed) {
        EXPECT_EQ(call.name, spec.named_tool);
      }
      const json args = parse_args(call.arguments);
      ASSERT_FALSE(args.is_discarded()) << call.arguments;
      EXPECT_EQ(params[call.name]->validate(args), "") << call.name << " " << call.arguments;
    }
    if (answer && out.tool_calls.empty()) {
      const json a = json::parse(out.content, nullptr, false);
      ASSERT_FALSE(a.is_discarded()) << "answer is not JSON: " << out.content;
      EXPECT_EQ(answer->validate(a), "") << out.content;
    }
    if (!mode.thinking) {
      EXPECT_TRUE(out.reasoning.empty());
    }
  }
  EXPECT_GT(finished, walks / 2);
  if (tools_required) {
    EXPECT_EQ(with_calls, finished);
  }
  std::printf("chat grammar %-34s %d walks, %d finished, %d with tool calls, %zu states\n", mode.name.c_str(), walks,
              finished, with_calls, g->stats().states);
}

TEST(StructuredChat, WalksParseIntoTheShapeEachModeDemands) {
  const std::string tools = std::string("\"tools\": ") + kTools;
  const std::vector<Mode> modes = {
      {"tools, auto", tools, true},
      {"tools, auto, thinking off", tools, false},
      {"tools, required", tools + ", \"tool_choice\": \"required\"", true},
      {"tools, named set_alarm", tools + R"(, "tool_choice": {"type": "function", "function": {"name": "set_alarm"}})", true},
      {"tools, none", tools + ", \"tool_choice\": \"none\"", true},
      {"no tools", "\"messages\": []", true},
      {"json_object", R"("response_format": {"type": "json_object"})", true},
      {"json_schema, thinking off",
       R"("response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema":
          {"type": "object", "properties": {"answer": {"type": "integer"}, "why": {"type": "string", "maxLength": 20}},
           "required": ["answer", "why"], "additionalProperties": false}}})",
       false},
      {"json_schema and tools, auto",
       tools + R"(, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array",
          "items": {"type": "boolean"}, "minItems": 1}}})",
       true},
  };
  uint32_t seed = 11;
  for (const Mode& m : modes) check_mode(m, 40, seed++);
}

// What the engine relies on to take a sampled token without stepping the matcher (runtime/constraints.h
// SeqConstraint::take): the mask is exact — a bit is set exactly when accept() takes the id — along
// seeded walks through a chat grammar (think section, tools, JSON answer) and a document grammar with a
// stop token; in free text every ordinary id is taken; and an ordinary token never leaves these
// matchers terminated (token_may_terminate is false for it), while a grammar that can end on bytes
// (a bare document without stop tokens) says so.
TEST(StructuredChat, MaskIsExactAndOrdinaryTokensNeverTerminate) {
  const TokenVocab& v = *k3_vocab();
  const TokenId end = *k3_tokenizer().special_id("<|end_of_msg|>");
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
      "s": {"type": "string", "maxLength": 6}, "t": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
      "required": ["n", "s", "t"], "additionalProperties": false})");
  const std::string tools = std::string(R"({"tools": )") + kTools + "}";
  struct Case {
    std::string name;
    std::shared_ptr<const CompiledGrammar> g;
    std::vector<TokenId> stop;
  };
  const std::vector<Case> cases = {
      {"chat, tools, thinking", compile_chat_grammar(k3_vocab(), chat_grammar_spec(ojson::parse(tools), true), {},
                                                     testing::test_limits()), {}},
      {"chat, json_schema", compile_chat_grammar(k3_vocab(), chat_grammar_spec(ojson::parse(
           std::string(R"({"response_format": {"type": "json_schema", "json_schema": {"schema": )") + schema.dump() +
           "}}}"), false), {}, testing::test_limits()), {}},
      {"document + stop", compile_json_schema(k3_vocab(), schema, {}, testing::test_limits()), {end}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    if (c.stop.empty()) EXPECT_FALSE(c.g->bytes_may_terminate());
    Matcher m(c.g, c.stop);
    std::mt19937 rng(7);
    std::vector<uint32_t> mask(m.mask_words());
    size_t free_steps = 0, steps = 0;
    for (; steps < 40 && !m.is_terminated(); ++steps) {
      ASSERT_TRUE(m.fill_mask(mask.data()));
      const bool free = m.free_text();
      free_steps += free;
      std::vector<TokenId> allowed, closing;
      for (TokenId id = 0; id < v.vocab_size(); ++id) {
        const bool bit = mask_test(mask.data(), id);
        ASSERT_EQ(m.accept(id), bit) << "id " << id << " after " << steps << " tokens";
        if (!bit) continue;
        if (!m.token_may_terminate(id)) ASSERT_FALSE(m.is_terminated()) << "id " << id;
        m.rollback(1);
        if (free) ASSERT_TRUE(v.is_ordinary(id) || v.is_special(id)) << id;
        allowed.push_back(id);
        if (v.is_special(id) || (v.is_ordinary(id) && v.bytes(id).find_first_of("\"]}>") != std::string::npos))
          closing.push_back(id);
      }
      if (free)
        for (TokenId id = 0; id < v.vocab_size(); ++id)
          if (v.is_ordinary(id)) ASSERT_TRUE(mask_test(mask.data(), id)) << "free text refuses ordinary id " << id;
      const auto& from = !closing.empty() && rng() % 2 ? closing : allowed;
      ASSERT_TRUE(m.accept(from[rng() % from.size()]));
    }
    std::printf("%s: %zu steps checked over %zu ids, %zu in free text\n", c.name.c_str(), steps, v.vocab_size(),
                free_steps);
  }
  // A bare integer document without stop tokens ends after its 16th trailing space: bytes may end it.
  const auto num = compile_json_schema(k3_vocab(), ojson::parse(R"({"type": "integer"})"), {}, testing::test_limits());
  EXPECT_TRUE(num->bytes_may_terminate());
  Matcher m(num);
  ASSERT_TRUE(m.accept_bytes("7"));
  const TokenId space = *k3_tokenizer().base_id(" ");
  EXPECT_TRUE(m.token_may_terminate(space));
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(m.accept(space)) << i;
  EXPECT_TRUE(m.is_terminated());
  EXPECT_FALSE(Matcher(num, {end}).token_may_terminate(space));
}

// The exact text the chat encoder writes for an assistant turn (MODEL.md §7), tokenised with specials.
bool accepts(const ChatGrammarSpec& spec, const std::string& text) {
  Matcher m(compile_chat_grammar(k3_vocab(), spec, {}, testing::test_limits()));
  for (TokenId id : k3_tokenizer().encode(text, true))
    if (!m.accept(id)) return false;
  return m.is_terminated();
}

TEST(StructuredChat, EncoderFormatAcceptedAndViolationsRefused) {
  const ojson req = ojson::parse(std::string(R"({"tools": )") + kTools + "}");
  const ChatGrammarSpec spec = chat_grammar_spec(req, true);
  const std::string head = "Oslo it is.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>";
  const std::string end = "<|close|>message<|sep|><|end_of_msg|>";
  const std::string call =
      R"(<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>)"
      R"(<|open|>argument key="city" type="string"<|sep|>Oslo "old town"<|close|>argument<|sep|>)"
      R"(<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>)"
      R"(<|open|>argument key="at" type="null"<|sep|>null<|close|>argument<|sep|><|close|>call<|sep|>)";
  EXPECT_TRUE(accepts(spec, head + call + "<|close|>tools<|sep|>" + end));
  EXPECT_TRUE(accepts(spec, "<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>" + end));
  const std::string alarm =
      R"(<|open|>call tool="set_alarm" index="2"<|sep|><|open|>argument key="hour" type="number"<|sep|>7<|close|>argument<|sep|>)"
      R"(<|open|>argument key="repeat" type="object"<|sep|>{"days": ["mon", "tue"]}<|close|>argument<|sep|><|close|>call<|sep|>)";
  EXPECT_TRUE(accepts(spec, head + call + alarm + "<|close|>tools<|sep|>" + end));
  // Refused: an undeclared tool, a missing required argument, a wrong index, a value of another type,
  // an out-of-range number, an argument out of declaration order.
  auto swap = [&](std::string s, const std::string& a, const std::string& b) { return s.replace(s.find(a), a.size(), b); };
  EXPECT_FALSE(accepts(spec, head + swap(call, "get_weather", "get_time") + "<|close|>tools<|sep|>" + end));
  EXPECT_FALSE(accepts(spec, head + swap(call, R"(key="city")", R"(key="town")") + "<|close|>tools<|sep|>" + end));
  EXPECT_FALSE(accepts(spec, head + swap(call, R"(index="1")", R"(index="2")") + "<|close|>tools<|sep|>" + end));
  EXPECT_FALSE(accepts(spec, head + swap(call, R"(type="number"<|sep|>3)", R"(type="string"<|sep|>3)") +
                                 "<|close|>tools<|sep|>" + end));
  EXPECT_FALSE(accepts(spec, head + swap(call, "<|sep|>3<|close|>", "<|sep|>8<|close|>") + "<|close|>tools<|sep|>" + end));
  const std::string reordered =
      R"(<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>)"
      R"(<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>)"
      R"(<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|><|close|>call<|sep|>)";
  EXPECT_FALSE(accepts(spec, head + reordered + "<|close|>tools<|sep|>" + end));
  // No tools section with tool_choice none or without tools; a tools section is required with "required".
  const ChatGrammarSpec none = chat_grammar_spec(ojson::parse(std::string(R"({"tool_choice": "none", "tools": )") + kTools + "}"), true);
  EXPECT_FALSE(accepts(none, head + call + "<|close|>tools<|sep|>" + end));
  EXPECT_TRUE(accepts(none, "<|close|>think<|sep|><|open|>response<|sep|>No.<|close|>response<|sep|>" + end));
  const ChatGrammarSpec req_spec =
      chat_grammar_spec(ojson::parse(std::string(R"({"tool_choice": "required", "tools": )") + kTools + "}"), true);
  EXPECT_FALSE(accepts(req_spec, "<|close|>think<|sep|><|open|>response<|sep|>No.<|close|>response<|sep|>" + end));
  EXPECT_TRUE(accepts(req_spec, head + call + "<|close|>tools<|sep|>" + end));
  // Thinking off: the output starts inside the response.
  const ChatGrammarSpec off = chat_grammar_spec(ojson::parse(R"({"response_format": {"type": "json_object"}})"), false);
  EXPECT_TRUE(accepts(off, R"({"a": [1, 2]})" "<|close|>response<|sep|>" + end));
  EXPECT_FALSE(accepts(off, R"([1, 2])" "<|close|>response<|sep|>" + end));
  EXPECT_FALSE(accepts(off, "<|close|>think<|sep|>"));
}

TEST(StructuredChat, SpecFromRequestRefusesMalformedFields) {
  for (const char* r : {R"({"tool_choice": "sometimes"})", R"({"tool_choice": "required"})",
                        R"({"tools": [{"type": "function", "function": {"name": "a"}}], "tool_choice": {"function": {"name": "b"}}})",
                        R"({"response_format": {"type": "xml"}})", R"({"response_format": {"type": "json_schema"}})",
                        R"({"tools": [{"function": {}}]})"}) {
    SCOPED_TRACE(r);
    EXPECT_THROW(chat_grammar_spec(ojson::parse(r), true), Error);
  }
  // A tool whose parameters use an unsupported keyword: the error names the tool and the keyword.
  const ChatGrammarSpec s = chat_grammar_spec(
      ojson::parse(R"({"tools": [{"function": {"name": "f", "parameters": {"type": "object", "properties":
                      {"x": {"type": "string", "pattern": "^a"}}}}}]})"),
      true);
  try {
    chat_grammar(k3_tokenizer(), s, {}, testing::test_limits());
    ADD_FAILURE();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'f'"), std::string::npos) << what;
    EXPECT_NE(what.find("'pattern'"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace kestrel::structured
