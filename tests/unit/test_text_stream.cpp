// TextStream (tokenizer/text_stream.h), the one text path of `kestrel generate` and the server: stop
// strings held back across tokens and cut exactly, stop tokens never text, the flush at the end, and
// chat output where stop strings apply to the content only.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tokenizer/text_stream.h"
#include "chat_markers.h"

namespace kestrel::tok {
namespace {

const Tokenizer& T() {
  static const Tokenizer t = Tokenizer::load(std::string(KESTREL_SOURCE_DIR) + "/tests/data/tok_golden");
  return t;
}

std::vector<TokenId> ids(const std::string& text) { return T().encode(text, /*allow_special=*/true); }

using kestrel::chat_markers::C;
using kestrel::chat_markers::O;
using kestrel::chat_markers::S;
using kestrel::chat_markers::END;

TEST(StopMatcher, HoldsBackPrefixesAndCutsAtTheMatch) {
  StopMatcher m({"STOP", "xy"});
  EXPECT_EQ(m.push("abc S"), "abc ");
  EXPECT_EQ(m.push("T"), "");
  EXPECT_EQ(m.push("O!"), "STO!");  // not a stop after all: released
  EXPECT_EQ(m.push("fooST"), "foo");
  EXPECT_EQ(m.push("OP tail"), "");
  EXPECT_TRUE(m.matched());
  EXPECT_EQ(m.push("more"), "");
  EXPECT_EQ(m.flush(), "");
  StopMatcher n({"zz"});
  EXPECT_EQ(n.push("az"), "a");
  EXPECT_EQ(n.flush(), "z");
}

// Pushes every id one at a time; returns the streamed content.
std::string stream_all(TextStream& s, const std::vector<TokenId>& in) {
  std::string out;
  for (TokenId id : in) {
    if (s.done()) break;
    out += s.push(id).content;
  }
  return out;
}

TEST(TextStream, PlainTextStopStringAcrossTokens) {
  const std::string text = "The quick brown fox jumps over the lazy dog";
  // Every split point of a stop string that starts mid-word: the text ends right before it.
  for (const std::string stop : {"quick", "ck bro", "fox j", "dog"}) {
    TextStream s = TextStream::plain(T(), {stop});
    const std::string got = stream_all(s, ids(text));
    EXPECT_TRUE(s.stop_matched()) << stop;
    EXPECT_TRUE(s.done());
    EXPECT_EQ(s.finish_reason(), "stop");
    EXPECT_EQ(got, text.substr(0, text.find(stop))) << stop;
    EXPECT_EQ(s.content(), got);
    EXPECT_TRUE(s.finish(FinishCause::kLength).empty());  // nothing after the match
  }
  // No match: everything, the held-back tail released at the end.
  TextStream s = TextStream::plain(T(), {"dogs"});
  std::string got = stream_all(s, ids(text));
  EXPECT_FALSE(s.done());
  EXPECT_EQ(text.substr(0, got.size()), got);
  EXPECT_LT(got.size(), text.size());  // "dog" may be the start of "dogs": held
  got += s.finish(FinishCause::kLength).content;
  EXPECT_EQ(got, text);
  EXPECT_EQ(s.finish_reason(), "length");
}

TEST(TextStream, StopTokenIsNeverText) {
  TextStream s = TextStream::plain(T(), {});
  std::string got = stream_all(s, ids("hello"));
  got += s.finish(FinishCause::kStop).content;  // the end-of-turn token that ended it is not pushed
  EXPECT_EQ(got, "hello");
  EXPECT_EQ(s.finish_reason(), "stop");
  EXPECT_TRUE(s.tool_calls().empty());
}

TEST(TextStream, ChatStopStringsApplyToContentOnly) {
  const auto script = ids("a STOP in thought" + C + "think" + S + O + "response" + S + "Hi STOP there" + C + "response" + S);
  TextStream s = TextStream::chat(T(), /*thinking=*/true, {}, {"STOP"});
  std::string reasoning, content;
  for (TokenId id : script) {
    if (s.done()) break;
    const TextDelta d = s.push(id);
    reasoning += d.reasoning;
    content += d.content;
  }
  EXPECT_EQ(reasoning, "a STOP in thought");  // reasoning is not cut
  EXPECT_EQ(content, "Hi ");
  EXPECT_TRUE(s.stop_matched());
  EXPECT_EQ(s.finish_reason(), "stop");
  EXPECT_EQ(s.reasoning(), reasoning);
  EXPECT_EQ(s.content(), "Hi ");
}

TEST(TextStream, ChatToolCallFinishes) {
  const auto script = ids(O + "tools" + S + O + "call tool=\"f\"" + S + O + "argument key=\"x\" type=\"number\"" + S +
                          "3" + C + "argument" + S + C + "call" + S + C + "tools" + S);
  TextStream s = TextStream::chat(T(), /*thinking=*/false, {"f"}, {});
  stream_all(s, script);
  s.finish(FinishCause::kStop);
  EXPECT_EQ(s.finish_reason(), "tool_calls");
  ASSERT_EQ(s.tool_calls().size(), 1u);
  EXPECT_EQ(s.tool_calls()[0].name, "f");
  EXPECT_EQ(s.tool_calls()[0].arguments, "{\"x\": 3}");
}

}  // namespace
}  // namespace kestrel::tok
