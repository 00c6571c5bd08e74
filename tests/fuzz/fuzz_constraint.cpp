// Fuzz target: a chat request body as the server turns it into a structured-output constraint
// (structured/constraint.h, issue #20 phase 2). The input's first byte picks thinking on/off, the rest
// is the body's JSON. A malformed body must be a kestrel::Error; otherwise the OutputConstraint
// (request.h) must convert back to the same compiler spec (same cache key), and a compiled chat grammar
// is walked a few steps checking the engine's reasoning-aware shortcut: wherever Matcher::free_text()
// says free text, the mask allows every ordinary token (so sampling without it is safe), and every
// allowed token is accepted.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/check.h"
#include "structured/constraint.h"

using namespace kestrel;
using namespace kestrel::structured;

namespace {

std::shared_ptr<const TokenVocab> vocab() {
  static const auto tok = [] {
    std::vector<std::string> ranks;
    for (int b = 0; b < 256; ++b) ranks.push_back(std::string(1, char(b)));
    for (const char* s : {"{\"", "\":", "\",", "\"}", "true", "false", "null", "12", "think", "response", "call",
                          " tool=\"", "\" index=\"", "argument", " key=\"", " type=\"", "string", "number", "tools",
                          "message", "ab"})
      ranks.push_back(s);
    const TokenId n = TokenId(ranks.size());
    return std::make_shared<const tok::Tokenizer>(tok::Tokenizer::from_ranks(
        ranks, {{"<|end_of_msg|>", n}, {"<|open|>", n + 1}, {"<|close|>", n + 2}, {"<|sep|>", n + 3}}));
  }();
  static const auto v = std::make_shared<const TokenVocab>(*tok);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool thinking = data[0] & 1;
  const auto body = ojson::parse(std::string(reinterpret_cast<const char*>(data) + 1, size - 1), nullptr, false);
  if (body.is_discarded()) return 0;
  OutputConstraint c;
  try {
    c = constraint_of(chat_grammar_spec(body, thinking), response_format_of(body));
  } catch (const Error&) {
    return 0;
  }
  if (GrammarCache::chat_key(chat_spec(c)) != GrammarCache::chat_key(chat_grammar_spec(body, thinking))) {
    // json_object becomes {"type": "object"} either way; anything else must round-trip exactly.
    std::abort();
  }
  SchemaLimits lim;
  lim.max_compile_seconds = 2;
  lim.max_states = 20'000;
  lim.max_nfa_nodes = 200'000;
  lim.max_enum_values = 200;
  lim.max_repeat = 32;
  lim.max_properties = 32;
  lim.max_schema_depth = 16;
  lim.max_stack_depth = 24;
  GrammarCache cache(vocab(), 4, {}, lim);
  try {
    c.grammar = compile(cache, c);
  } catch (const Error&) {
    return 0;
  }
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 1099511628211ull;
  std::vector<uint32_t> mask(vocab()->mask_words());
  Matcher m(c.grammar);
  for (int step = 0; step < 60 && !m.is_terminated(); ++step) {
    if (!m.fill_mask(mask.data())) break;  // only at the nesting limit
    std::vector<TokenId> allowed;
    for (size_t i = 0; i < vocab()->vocab_size(); ++i)
      if (mask_test(mask.data(), TokenId(i))) allowed.push_back(TokenId(i));
    if (m.free_text())
      for (size_t i = 0; i < vocab()->vocab_size(); ++i)
        if (!vocab()->is_special(TokenId(i)) && !mask_test(mask.data(), TokenId(i))) std::abort();
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    // Prefer special tokens now and then so walks leave the free sections.
    TokenId pick = allowed[(h >> 17) % allowed.size()];
    if ((h & 3) == 0)
      for (TokenId t : allowed)
        if (vocab()->is_special(t)) pick = t;
    if (!m.accept(pick)) std::abort();
  }
  return 0;
}
