// Output-parser tests: well-formed K3 assistant output (reasoning, content, tool calls with typed
// arguments), streaming token by token under different tokenizations, truncation at every token,
// malformed output, random token streams, and round trips through the chat encoder.
#include <gtest/gtest.h>

#include <random>

#include "tokenizer/chat.h"
#include "tokenizer/parser.h"
#include "chat_markers.h"

using namespace kestrel::tok;

namespace {

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::load(std::string(KESTREL_SOURCE_DIR) + "/tests/data/tok_golden");
  return t;
}

using kestrel::chat_markers::C;
using kestrel::chat_markers::O;
using kestrel::chat_markers::S;

// Model output as text, tokenized three ways: as the encoder would (specials allowed), one token
// per byte (markers split as finely as possible), and in random-sized ordinary chunks.
std::vector<std::vector<TokenId>> tokenizations(const std::string& text) {
  std::vector<std::vector<TokenId>> out;
  out.push_back(tok().encode(text, true));
  std::vector<TokenId> bytes;
  for (TokenId id : out[0]) {
    if (tok().is_special(id)) {
      bytes.push_back(id);
      continue;
    }
    for (char c : tok().token_bytes(id)) bytes.push_back(*tok().base_id(std::string(1, c)));
  }
  out.push_back(bytes);
  return out;
}

struct ParseRun {
  ParsedOutput result;
  ParseDelta streamed;  // all deltas concatenated
};

ParseRun parse(const std::vector<TokenId>& ids, bool thinking, FinishCause cause, std::vector<std::string> tools = {}) {
  OutputParser p(tok(), thinking, std::move(tools));
  ParseRun r;
  auto add = [&](ParseDelta d) {
    r.streamed.reasoning += d.reasoning;
    r.streamed.content += d.content;
    for (auto& c : d.tool_calls) {
      if (r.streamed.tool_calls.size() <= c.index) r.streamed.tool_calls.resize(c.index + 1);
      if (c.name) r.streamed.tool_calls[c.index].name = c.name;
      r.streamed.tool_calls[c.index].arguments += c.arguments;
      r.streamed.tool_calls[c.index].index = c.index;
    }
  };
  for (TokenId id : ids) add(p.push(id));
  add(p.finish(cause));
  r.result = p.result();
  return r;
}

void expect_stream_matches(const ParseRun& r) {
  EXPECT_EQ(r.streamed.reasoning, r.result.reasoning);
  EXPECT_EQ(r.streamed.content, r.result.content);
  ASSERT_EQ(r.streamed.tool_calls.size(), r.result.tool_calls.size());
  for (size_t i = 0; i < r.result.tool_calls.size(); ++i) {
    EXPECT_EQ(r.streamed.tool_calls[i].name.value_or(""), r.result.tool_calls[i].name);
    EXPECT_EQ(r.streamed.tool_calls[i].arguments, r.result.tool_calls[i].arguments);
  }
}

const std::string kToolOutput =
    "Let me check the weather in Köln 🌧." + C + "think" + S + O + "response" + S + "Checking…" + C + "response" + S + O +
    "tools" + S + O + "call tool=\"get_weather\" index=\"1\"" + S + O + "argument key=\"city\" type=\"string\"" + S +
    "Köln \"Altstadt\"\n" + C + "argument" + S + O + "argument key=\"days\" type=\"number\"" + S + "3" + C + "argument" +
    S + O + "argument key=\"opts\" type=\"object\"" + S + "{\"units\":\"C\",\"hours\":[6, 12]}" + C + "argument" + S + C +
    "call" + S + O + "call tool=\"a&amp;b\" index=\"2\"" + S + O + "json type=\"object\"" + S + "{\"raw\": true}" + C +
    "json" + S + C + "call" + S + O + "call tool=\"noargs\" index=\"3\"" + S + C + "call" + S + C + "tools" + S + C +
    "message" + S + "<|end_of_msg|>";

}  // namespace

TEST(Parser, ReasoningAndContent) {
  const std::string out = "I think. 中文" + C + "think" + S + O + "response" + S + "Answer: 42 ✓" + C + "response" + S + C +
                          "message" + S + "<|end_of_msg|>";
  for (const auto& ids : tokenizations(out)) {
    ParseRun r = parse(ids, true, FinishCause::kStop);
    EXPECT_EQ(r.result.reasoning, "I think. 中文");
    EXPECT_EQ(r.result.content, "Answer: 42 ✓");
    EXPECT_TRUE(r.result.tool_calls.empty());
    EXPECT_EQ(r.result.finish_reason, "stop");
    EXPECT_TRUE(r.result.errors.empty());
    expect_stream_matches(r);
  }
}

TEST(Parser, NonThinkingStartsInResponse) {
  ParseRun r = parse(tok().encode("plain" + C + "response" + S + C + "message" + S, true), false, FinishCause::kStop);
  EXPECT_EQ(r.result.content, "plain");
  EXPECT_EQ(r.result.reasoning, "");
}

TEST(Parser, ToolCallsWithTypedArguments) {
  for (const auto& ids : tokenizations(kToolOutput)) {
    ParseRun r = parse(ids, true, FinishCause::kStop, {"get_weather", "a&b", "noargs"});
    ASSERT_EQ(r.result.tool_calls.size(), 3u);
    const auto& c0 = r.result.tool_calls[0];
    EXPECT_EQ(c0.name, "get_weather");
    EXPECT_EQ(c0.model_index, 1);
    EXPECT_EQ(c0.arguments, R"({"city": "Köln \"Altstadt\"\n", "days": 3, "opts": {"units": "C", "hours": [6, 12]}})");
    EXPECT_TRUE(c0.complete);
    EXPECT_EQ(r.result.tool_calls[1].name, "a&b");
    EXPECT_EQ(r.result.tool_calls[1].arguments, "{\"raw\": true}");
    EXPECT_EQ(r.result.tool_calls[2].arguments, "{}");
    EXPECT_EQ(r.result.content, "Checking…");
    EXPECT_EQ(r.result.reasoning, "Let me check the weather in Köln 🌧.");
    EXPECT_EQ(r.result.finish_reason, "tool_calls");
    EXPECT_TRUE(r.result.errors.empty()) << r.result.errors[0];
    expect_stream_matches(r);
  }
}

TEST(Parser, StreamingHoldsBackPartialMarkers) {
  OutputParser p(tok(), true);
  std::string seen;
  auto ids = tokenizations("abc" + C + "think" + S + O + "response" + S + "x")[1];  // byte tokens
  for (TokenId id : ids) {
    ParseDelta d = p.push(id);
    seen += d.reasoning;
    // While the close marker's name is still arriving, nothing of it is emitted.
    EXPECT_EQ(seen.find("<|"), std::string::npos);
  }
  EXPECT_EQ(seen, "abc");
}

TEST(Parser, TruncationAtEveryToken) {
  for (const auto& ids : tokenizations(kToolOutput)) {
    const ParseRun full = parse(ids, true, FinishCause::kStop);
    for (size_t k = 0; k <= ids.size(); ++k) {
      std::vector<TokenId> prefix(ids.begin(), ids.begin() + k);
      ParseRun r = parse(prefix, true, FinishCause::kLength, {"get_weather", "a&b", "noargs"});
      EXPECT_EQ(r.result.finish_reason, "length");
      expect_stream_matches(r);
      // Nothing is lost: what was emitted is a prefix of the full parse, or the full value plus
      // the text of a marker the cut left unfinished; a character cut in half ends as U+FFFD.
      std::string a = r.result.reasoning;
      if (a.size() >= 3 && a.compare(a.size() - 3, 3, "\xEF\xBF\xBD") == 0 && full.result.reasoning.rfind(a, 0) != 0)
        a.resize(a.size() - 3);
      EXPECT_TRUE(full.result.reasoning.rfind(a, 0) == 0 || a.rfind(full.result.reasoning, 0) == 0) << k << " " << a;
      for (size_t i = 0; i < r.result.tool_calls.size(); ++i) {
        const auto& c = r.result.tool_calls[i];
        const auto& f = full.result.tool_calls[i];
        EXPECT_EQ(c.name, f.name);
        if (c.complete) {
          EXPECT_EQ(c.arguments, f.arguments);
        } else {
          EXPECT_EQ(c.error, "truncated");
        }
      }
    }
  }
}

TEST(Parser, TruncatedInsideStringArgumentKeepsText) {
  auto ids = tok().encode(C + "think" + S + O + "tools" + S + O + "call tool=\"f\" index=\"1\"" + S + O +
                              "argument key=\"q\" type=\"string\"" + S + "half a senten",
                          true);
  ParseRun r = parse(ids, true, FinishCause::kLength);
  ASSERT_EQ(r.result.tool_calls.size(), 1u);
  EXPECT_EQ(r.result.tool_calls[0].arguments, "{\"q\": \"half a senten");
  EXPECT_FALSE(r.result.tool_calls[0].complete);
  EXPECT_EQ(r.result.finish_reason, "length");
}

TEST(Parser, MalformedOutputDegrades) {
  // Unclosed think: everything is reasoning; no crash.
  ParseRun a = parse(tok().encode("thinking forever", true), true, FinishCause::kStop);
  EXPECT_EQ(a.result.reasoning, "thinking forever");
  EXPECT_EQ(a.result.finish_reason, "stop");
  // Unknown marker inside the response: kept as literal text.
  ParseRun b = parse(tok().encode(C + "think" + S + O + "response" + S + "a" + O + "bogus x=\"1\"" + S + "b" + C + "response" + S, true),
                true, FinishCause::kStop);
  EXPECT_EQ(b.result.content, "a<|open|>bogus x=\"1\"<|sep|>b");
  // Unclosed marker header followed by another special: header text kept.
  ParseRun c = parse(tok().encode(C + "think" + S + O + "response" + S + "x" + C + "resp" + "[EOS]", true), true, FinishCause::kStop);
  EXPECT_EQ(c.result.content, "x<|close|>resp");
  // Unknown tool and bad JSON in a typed argument: reported, call kept, text kept.
  ParseRun d = parse(tok().encode(C + "think" + S + O + "tools" + S + O + "call tool=\"rm\" index=\"1\"" + S + O +
                                 "argument key=\"n\" type=\"number\"" + S + "12 apples" + C + "argument" + S + C + "call" + S +
                                 C + "tools" + S,
                             true),
                true, FinishCause::kStop, {"get_weather"});
  ASSERT_EQ(d.result.tool_calls.size(), 1u);
  EXPECT_EQ(d.result.tool_calls[0].arguments, "{\"n\": \"12 apples\"}");
  EXPECT_NE(d.result.tool_calls[0].error.find("unknown tool"), std::string::npos);
  EXPECT_EQ(d.result.errors.size(), 2u);
  EXPECT_EQ(d.result.finish_reason, "tool_calls");
  // Content outside any block is not dropped.
  ParseRun e = parse(tok().encode(C + "think" + S + "stray" + O + "response" + S + "ok" + C + "response" + S, true), true,
                FinishCause::kStop);
  EXPECT_EQ(e.result.content, "strayok");
  // A split UTF-8 character cut by the token limit becomes U+FFFD, never a broken sequence.
  const std::string euro = "\xE2\x82\xAC";
  ParseRun f = parse({*tok().base_id(euro.substr(0, 1)), *tok().base_id(euro.substr(1, 1))}, false, FinishCause::kLength);
  EXPECT_EQ(f.result.content, "\xEF\xBF\xBD");
}

TEST(Parser, RandomTokenStreamsNeverThrow) {
  std::mt19937 rng(5);
  const std::vector<TokenId> specials = {tok().require_special("<|open|>"), tok().require_special("<|close|>"),
                                         tok().require_special("<|sep|>"), tok().require_special("<|end_of_msg|>")};
  const auto pieces = tok().encode("think response tools call argument json message key=\"k\" type=\"number\" tool=\"f\" 1 {\"a\": x", false);
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<TokenId> ids;
    const int n = rng() % 60;
    for (int i = 0; i < n; ++i) {
      const unsigned r = rng() % 10;
      ids.push_back(r < 4 ? specials[rng() % specials.size()]
                    : r < 8 ? pieces[rng() % pieces.size()]
                            : static_cast<TokenId>(rng() % (tok().vocab_size() + 3)));
    }
    ParseRun r = parse(ids, rng() % 2, rng() % 2 ? FinishCause::kStop : FinishCause::kLength, {"f"});
    expect_stream_matches(r);
  }
}

TEST(Parser, RoundTripThroughChatEncoder) {
  // An assistant message rendered by the encoder, parsed back, gives the same fields.
  const std::string req = R"({"messages":[{"role":"assistant","reasoning_content":"why","content":"hello",
      "tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"s\": \"v\", \"n\": 1.5, \"l\": [true, null]}"}}]}],
      "add_generation_prompt":false})";
  ChatPrompt p = ChatEncoder(tok()).encode_request(nlohmann::ordered_json::parse(req));
  // Drop the `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` prefix: the generation prompt.
  const std::string prefix = O + "message role=\"assistant\"" + S + O + "think" + S;
  ASSERT_EQ(p.text.rfind(prefix, 0), 0u);
  ParseRun r = parse(tok().encode(p.text.substr(prefix.size()), true), true, FinishCause::kStop);
  EXPECT_EQ(r.result.reasoning, "why");
  EXPECT_EQ(r.result.content, "hello");
  ASSERT_EQ(r.result.tool_calls.size(), 1u);
  EXPECT_EQ(r.result.tool_calls[0].arguments, R"({"s": "v", "n": 1.5, "l": [true, null]})");
  EXPECT_EQ(r.result.finish_reason, "tool_calls");
  EXPECT_TRUE(r.result.errors.empty());
}
