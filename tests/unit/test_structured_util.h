// Shared by the structured-output tests: the real k3-tiny vocabulary and seeded random walks through
// a matcher's masks.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "structured/json_schema_grammar.h"
#include "structured/matcher.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::structured::testing {

inline const tok::Tokenizer& k3_tokenizer() {
  static const tok::Tokenizer t = tok::Tokenizer::load(std::string(KESTREL_SOURCE_DIR) + "/models/k3-tiny");
  return t;
}

inline std::shared_ptr<const TokenVocab> k3_vocab() {
  static const auto v = std::make_shared<const TokenVocab>(k3_tokenizer());
  return v;
}

// Limits for tests: the defaults, but a compile-time limit that a -O0 sanitizer build does not reach
// (the limit itself is tested on its own).
inline SchemaLimits test_limits() {
  SchemaLimits l;
  l.max_compile_seconds = 900;
  return l;
}

struct Walk {
  std::vector<TokenId> ids;
  std::string text;       // bytes of the ordinary tokens
  bool finished = false;  // ended by the stop token or the grammar's end
  std::string failure;    // a broken invariant (mask/accept disagreement, dead end), empty if none
};

// One random walk: at each step a token is drawn uniformly from the mask, except that with
// probability 1/2 the stop token is taken once allowed, with probability `special_bias` the draw is
// among the allowed special tokens, and with probability `bias` among allowed tokens holding a byte of
// `closers` (so documents close). Every `check_every` steps the mask is compared with the exhaustive one.
inline Walk random_walk(const std::shared_ptr<const CompiledGrammar>& g, std::mt19937& rng, size_t max_steps,
                        const std::vector<TokenId>& stop, const std::string& closers = "\"]},",
                        double bias = 0.35, size_t check_every = 5, double special_bias = 0) {
  Walk w;
  Matcher m(g, stop);
  const TokenVocab& v = g->vocab();
  std::vector<uint32_t> mask(m.mask_words()), ref(m.mask_words());
  std::vector<TokenId> allowed, closing, specials;
  for (size_t step = 0; step < max_steps; ++step) {
    if (m.is_terminated()) {
      w.finished = true;
      return w;
    }
    const bool any = m.fill_mask(mask.data());
    if (check_every && step % check_every == 0) {
      m.fill_mask_exhaustive(ref.data());
      if (mask != ref) {
        w.failure = "table mask differs from the exhaustive mask after '" + w.text + "'";
        return w;
      }
    }
    if (!any) {
      w.failure = "no token allowed after '" + w.text + "'";
      return w;
    }
    allowed.clear();
    closing.clear();
    specials.clear();
    for (size_t i = 0; i < v.vocab_size(); ++i) {
      if (!mask_test(mask.data(), TokenId(i))) continue;
      allowed.push_back(TokenId(i));
      if (v.is_special(TokenId(i))) specials.push_back(TokenId(i));
      if (v.is_special(TokenId(i)) ||
          (v.in_vocab(TokenId(i)) && v.bytes(TokenId(i)).find_first_of(closers) != std::string::npos))
        closing.push_back(TokenId(i));
    }
    std::uniform_real_distribution<double> u(0, 1);
    TokenId pick = allowed[rng() % allowed.size()];
    bool stop_allowed = false;
    for (TokenId s : stop) stop_allowed = stop_allowed || mask_test(mask.data(), s);
    if (stop_allowed && u(rng) < 0.5) {
      for (TokenId s : stop)
        if (mask_test(mask.data(), s)) pick = s;
    } else if (!specials.empty() && u(rng) < special_bias) {
      pick = specials[rng() % specials.size()];
    } else if (!closing.empty() && u(rng) < bias) {
      pick = closing[rng() % closing.size()];
    }
    if (!m.accept(pick)) {
      w.failure = "an allowed token was not accepted after '" + w.text + "'";
      return w;
    }
    w.ids.push_back(pick);
    if (std::find(stop.begin(), stop.end(), pick) != stop.end()) {
      w.finished = true;
      return w;
    }
    if (!v.is_special(pick)) w.text += v.bytes(pick);
  }
  w.finished = m.is_terminated();
  return w;
}

}  // namespace kestrel::structured::testing
