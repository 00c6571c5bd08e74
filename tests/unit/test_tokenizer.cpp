// Tokenizer unit tests: vocabulary loading (incl. a synthetic file with the real K3 size and id
// layout), UTF-8 handling, the pre-tokenizer's piece boundaries, BPE and streaming decode.
// Exactness against tiktoken on a large corpus lives in tests/py/test_tokenizer_golden.py.
#include <gtest/gtest.h>

#include <random>

#include "core/check.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

using namespace kestrel::tok;

namespace {

std::vector<std::string> pieces(const std::string& s) { return pretokenize(s); }

}  // namespace

TEST(Pretokenize, EnglishAndContractions) {
  EXPECT_EQ(pieces("Hello world, it's 12345 dogs!!\n\n"),
            (std::vector<std::string>{"Hello", " world", ",", " it's", " ", "123", "45", " dogs", "!!\n\n"}));
  EXPECT_EQ(pieces("HELLO WORLD HelloWorld camelCase"),
            (std::vector<std::string>{"HELLO", " WORLD", " Hello", "World", " camel", "Case"}));
  EXPECT_EQ(pieces("I'LL WE'VE they'Re"), (std::vector<std::string>{"I'LL", " WE'VE", " they'Re"}));
}

TEST(Pretokenize, HanIsSeparateFromOtherLetters) {
  EXPECT_EQ(pieces("中文abc日本語かな"), (std::vector<std::string>{"中文", "abc", "日本語", "かな"}));
}

TEST(Pretokenize, WhitespaceRules) {
  EXPECT_EQ(pieces("a   b"), (std::vector<std::string>{"a", "  ", " b"}));
  EXPECT_EQ(pieces("a  \n  b"), (std::vector<std::string>{"a", "  \n", " ", " b"}));
  EXPECT_EQ(pieces("x   "), (std::vector<std::string>{"x", "   "}));
  EXPECT_EQ(pieces("\t\tfoo"), (std::vector<std::string>{"\t", "\tfoo"}));
}

TEST(Utf8, SanitizeUsesMaximalSubparts) {
  EXPECT_EQ(utf8_sanitize("a\xE2\x82"), "a\xEF\xBF\xBD");
  EXPECT_EQ(utf8_sanitize("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_sanitize("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(utf8_sanitize("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Utf8, StreamEqualsWholeForEverySplit) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s;
    const int len = rng() % 12;
    for (int i = 0; i < len; ++i) {
      const char* pool[] = {"a", "\xC3\xA9", "\xE4\xB8\xAD", "\xF0\x9F\x98\x80", "\x80", "\xE4", "\xF0\x9F", "\xFF"};
      s += pool[rng() % 8];
    }
    Utf8Stream st;
    std::string out;
    size_t i = 0;
    while (i < s.size()) {
      size_t k = 1 + rng() % 3;
      out += st.push(s.substr(i, k));
      i += k;
    }
    out += st.finish();
    EXPECT_EQ(out, utf8_sanitize(s)) << trial;
  }
}

namespace {

// A byte-level vocabulary: all 256 bytes, then some merges, then named specials.
Tokenizer small_tokenizer() {
  std::vector<std::string> ranks;
  for (int b = 0; b < 256; ++b) ranks.push_back(std::string(1, static_cast<char>(b)));
  for (const char* m : {"he", "ll", "hell", "hello", " w", "or", " wor", "ld", " world", "in", "ing"}) ranks.push_back(m);
  const TokenId base = static_cast<TokenId>(ranks.size());
  return Tokenizer::from_ranks(ranks, {{"<|open|>", base}, {"<|close|>", base + 1}, {"[EOS]", base + 2}});
}

}  // namespace

TEST(Tokenizer, BpeMergesLowestRankFirst) {
  Tokenizer t = small_tokenizer();
  auto ids = t.encode("hello world");
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(t.token_bytes(ids[0]), "hello");
  EXPECT_EQ(t.token_bytes(ids[1]), " world");
  EXPECT_EQ(t.decode(t.encode("singing hellos")), "singing hellos");
}

TEST(Tokenizer, SpecialsOnlyWhenAllowed) {
  Tokenizer t = small_tokenizer();
  const std::string s = "a<|open|>b[EOS]";
  auto plain = t.encode(s, false);
  auto special = t.encode(s, true);
  EXPECT_EQ(special.size(), 4u);
  EXPECT_EQ(special[1], *t.special_id("<|open|>"));
  EXPECT_EQ(special[3], *t.special_id("[EOS]"));
  for (TokenId id : plain) EXPECT_FALSE(t.is_special(id));
  EXPECT_EQ(t.decode(plain), s);
  EXPECT_EQ(t.decode(special), s);
}

TEST(Tokenizer, LongPieceHeapMerge) {
  // Pieces of 128+ bytes take the heap merge path; a run of one letter is a single piece and must
  // merge pairwise from the left exactly as the linear scan would. (Exactness of both paths against
  // tiktoken on long Han/letter/digit runs is in tests/py/test_tokenizer_golden.py.)
  Tokenizer t = small_tokenizer();
  std::string s(1000, 'l');
  auto ids = t.encode(s);
  EXPECT_EQ(ids.size(), 500u);  // "ll" merges pairwise left to right
  EXPECT_EQ(t.decode(ids), s);
}

TEST(Tokenizer, InvalidUtf8IsReplacedBeforeEncoding) {
  Tokenizer t = small_tokenizer();
  EXPECT_EQ(t.decode(t.encode("ab\xFF" "cd")), "ab\xEF\xBF\xBD" "cd");
}

TEST(Tokenizer, StreamDecoderHoldsPartialCharacters) {
  Tokenizer t = small_tokenizer();
  StreamDecoder d(t);
  const std::string euro = "\xE2\x82\xAC";
  EXPECT_EQ(d.push(static_cast<unsigned char>(euro[0])), "");
  EXPECT_EQ(d.push(static_cast<unsigned char>(euro[1])), "");
  EXPECT_EQ(d.push(static_cast<unsigned char>(euro[2])), euro);
  EXPECT_EQ(d.push(static_cast<unsigned char>(euro[0])), "");
  EXPECT_EQ(d.finish(), "\xEF\xBF\xBD");
}

TEST(Tokenizer, LoadsRealSizedFileAndSpecialsFromConfig) {
  // Synthetic file with the real layout: 163,584 base ranks (all bytes + distinct byte strings),
  // specials 163584..163839 named by tokenizer_config.json, the rest reserved.
  std::string model;
  std::mt19937 rng(1);
  auto b64 = [](const std::string& s) {
    static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string o;
    size_t i = 0;
    for (; i + 2 < s.size(); i += 3) {
      uint32_t v = (uint8_t)s[i] << 16 | (uint8_t)s[i + 1] << 8 | (uint8_t)s[i + 2];
      o += a[v >> 18]; o += a[(v >> 12) & 63]; o += a[(v >> 6) & 63]; o += a[v & 63];
    }
    if (s.size() - i == 1) {
      uint32_t v = (uint8_t)s[i] << 16;
      o += a[v >> 18]; o += a[(v >> 12) & 63]; o += "==";
    } else if (s.size() - i == 2) {
      uint32_t v = (uint8_t)s[i] << 16 | (uint8_t)s[i + 1] << 8;
      o += a[v >> 18]; o += a[(v >> 12) & 63]; o += a[(v >> 6) & 63]; o += '=';
    }
    return o;
  };
  for (int r = 0; r < 163584; ++r) {
    std::string bytes;
    if (r < 256) {
      bytes = std::string(1, static_cast<char>(r));
    } else {
      // Unique by construction: a 3-byte big-endian counter with a random-length tail.
      bytes = {static_cast<char>(0x80 | (r >> 14)), static_cast<char>(r >> 7 & 0x7F), static_cast<char>(r & 0x7F)};
      bytes += std::string(rng() % 4, 'x');
    }
    model += b64(bytes) + " " + std::to_string(r) + "\n";
  }
  const std::string config = R"({"added_tokens_decoder": {
    "163584": {"content": "[BOS]", "special": true}, "163585": {"content": "[EOS]", "special": true},
    "163586": {"content": "<|end_of_msg|>", "special": true}, "163587": {"content": "<|open|>", "special": true},
    "163588": {"content": "<|close|>", "special": true}, "163589": {"content": "<|sep|>", "special": true},
    "163605": {"content": "<|media_pad|>", "special": true}, "163839": {"content": "[PAD]", "special": true}}})";
  Tokenizer t = Tokenizer::from_strings(model, config);
  EXPECT_EQ(t.num_base_tokens(), 163584u);
  EXPECT_EQ(t.vocab_size(), 163840u);
  EXPECT_EQ(t.require_special("<|end_of_msg|>"), 163586u);
  EXPECT_EQ(t.require_special("<|media_pad|>"), 163605u);
  EXPECT_EQ(t.require_special("[PAD]"), 163839u);
  EXPECT_EQ(t.require_special("<|reserved_token_163590|>"), 163590u);
  EXPECT_EQ(t.encode("<|open|>x<|sep|>", true).front(), 163587u);
  EXPECT_EQ(t.decode({163587, 'x', 163589}), "<|open|>x<|sep|>");
}

TEST(Tokenizer, BadFilesAreErrorsNotCrashes) {
  EXPECT_THROW(Tokenizer::from_strings("", ""), kestrel::Error);
  EXPECT_THROW(Tokenizer::from_strings("QQ== x\n", ""), kestrel::Error);
  EXPECT_THROW(Tokenizer::from_strings("QQ== 0\nQQ== 1\n", ""), kestrel::Error);  // same bytes twice
  EXPECT_THROW(Tokenizer::from_strings("QQ== 1\n", ""), kestrel::Error);          // gap at 0
  EXPECT_THROW(Tokenizer::from_strings("QQ== 0\n", R"({"added_tokens_decoder": {"5000": {"content": "x"}}})"),
               kestrel::Error);
  EXPECT_THROW(Tokenizer::from_strings("QQ== 0\n", "{not json"), kestrel::Error);
  Tokenizer t = Tokenizer::from_strings("QQ== 0\n", "");
  EXPECT_THROW(t.token_bytes(100000), kestrel::Error);
  EXPECT_THROW(t.encode("B"), kestrel::Error);  // byte not in vocabulary
}
