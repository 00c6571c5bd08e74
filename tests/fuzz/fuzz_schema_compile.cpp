// Fuzz target: the structured-output schema compiler and matcher (src/structured). The input is any
// JSON text, compiled as a schema under small limits; a refusal must be a kestrel::Error. A compiled
// schema is then walked a few steps through its masks (token choices drawn from the input's hash)
// over a small vocabulary of all single bytes plus JSON-ish pieces, checking at every step that the
// table mask equals the exhaustive one, that allowed tokens are accepted and a refused one is not,
// and that a finished document is JSON the validator (src/evalclient) finds valid whenever the
// validator supports the schema.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/check.h"
#include "evalclient/json_schema.h"
#include "structured/json_schema_grammar.h"

using namespace kestrel::structured;

namespace {

std::shared_ptr<const TokenVocab> vocab() {
  static const auto tok = [] {
    std::vector<std::string> ranks;
    for (int b = 0; b < 256; ++b) ranks.push_back(std::string(1, char(b)));
    for (const char* s : {"{\"", "\":", "\",", "\"}", "\"]", " \"", "\": \"", "true", "false", "null", "[]", "{}",
                          "12", "-1", ".5", "e+", "\\u", "\\ud83d", "ab", "\xC3\xA9", "\xE4\xB8", "\xAD", "  ", "\n ",
                          "2024-", "-01", "T12:", ":00", "Z\"", "@x.", "com\"", "00000000", "\"a\"", "\"b\""})
      ranks.push_back(s);
    const TokenId n = TokenId(ranks.size());
    return std::make_shared<const kestrel::tok::Tokenizer>(kestrel::tok::Tokenizer::from_ranks(
        ranks, {{"<|end_of_msg|>", n}, {"<|open|>", n + 1}, {"<|close|>", n + 2}, {"<|sep|>", n + 3}}));
  }();
  static const auto v = std::make_shared<const TokenVocab>(*tok);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const auto schema = ojson::parse(in, nullptr, false);
  if (schema.is_discarded()) return 0;
  SchemaLimits lim;
  lim.max_compile_seconds = 2;
  lim.max_states = 20'000;
  lim.max_nfa_nodes = 200'000;
  lim.max_enum_values = 500;
  lim.max_repeat = 64;
  lim.max_properties = 64;
  lim.max_schema_depth = 24;
  lim.max_stack_depth = 24;
  std::shared_ptr<const CompiledGrammar> g;
  try {
    g = compile_json_schema(vocab(), schema, {}, lim);
  } catch (const kestrel::Error&) {
    return 0;
  }
  std::unique_ptr<kestrel::eval::JsonSchema> validator;
  try {
    kestrel::eval::SchemaOptions vo;
    vo.allow_patterns = false;
    validator = std::make_unique<kestrel::eval::JsonSchema>(nlohmann::json::parse(in), vo);
  } catch (const kestrel::Error&) {
  }
  const TokenId stop = *vocab()->special("<|end_of_msg|>");
  uint64_t h = 1469598103934665603ull;
  for (uint8_t c : in) h = (h ^ c) * 1099511628211ull;
  std::vector<uint32_t> mask(vocab()->mask_words()), ref(vocab()->mask_words());
  for (int walk = 0; walk < 3; ++walk) {
    Matcher m(g, {stop});
    std::string text;
    for (int step = 0; step < 40; ++step) {
      const bool any = m.fill_mask(mask.data());
      m.fill_mask_exhaustive(ref.data());
      if (mask != ref) std::abort();
      if (!any) break;  // only possible at the nesting limit
      std::vector<TokenId> allowed, refused;
      for (size_t i = 0; i < vocab()->vocab_size(); ++i)
        (mask_test(mask.data(), TokenId(i)) ? allowed : refused).push_back(TokenId(i));
      h = h * 6364136223846793005ull + 1442695040888963407ull;
      if (!refused.empty() && m.accept(refused[(h >> 33) % refused.size()])) std::abort();
      // Prefer the stop token when allowed so some walks finish.
      TokenId pick = allowed[(h >> 17) % allowed.size()];
      if (mask_test(mask.data(), stop) && (h & 1)) pick = stop;
      if (!m.accept(pick)) std::abort();
      if (pick == stop) {
        const auto doc = nlohmann::json::parse(text, nullptr, false);
        if (doc.is_discarded()) std::abort();
        if (validator && !validator->is_valid(doc)) std::abort();
        break;
      }
      text += vocab()->bytes(pick);
    }
    if (m.num_accepted() > 2) m.rollback(2);
  }
  return 0;
}
