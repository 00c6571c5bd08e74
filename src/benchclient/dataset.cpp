// The random dataset: see dataset.h.
#include "benchclient/dataset.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/check.h"

namespace kestrel::bench {

namespace {

// Ids whose bytes are " " followed by 2+ lowercase ASCII letters: one pre-token each, whatever
// precedes or follows them, so a run of them encodes back to itself.
std::vector<tok::TokenId> word_tokens(const tok::Tokenizer& t) {
  std::vector<tok::TokenId> ids;
  for (size_t id = 0; id < t.num_base_tokens(); ++id) {
    const std::string& b = t.token_bytes(tok::TokenId(id));
    if (b.size() < 3 || b[0] != ' ') continue;
    if (std::all_of(b.begin() + 1, b.end(), [](char c) { return c >= 'a' && c <= 'z'; })) ids.push_back(tok::TokenId(id));
  }
  return ids;
}

// The text of `ids`, re-encoded and adjusted until it encodes to exactly `target` tokens (or as
// close as a few rounds get); returns the text and its true length.
std::pair<std::string, int> exact_prompt(const tok::Tokenizer& t, std::vector<tok::TokenId> ids, int target,
                                         std::mt19937_64& rng, const std::vector<tok::TokenId>& pool) {
  std::string text = t.decode(ids);
  std::vector<tok::TokenId> enc = t.encode(text);
  for (int round = 0; round < 10 && int(enc.size()) != target; ++round) {
    if (int(enc.size()) > target) {
      enc.resize(size_t(target));
    } else {
      std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
      while (int(enc.size()) < target) enc.push_back(pool[pick(rng)]);
    }
    text = t.decode(enc);
    enc = t.encode(text);
  }
  return {text, int(enc.size())};
}

std::string random_word(std::mt19937_64& rng) {
  static const char* const kSyllables[] = {"ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "da",
                                           "fu", "go", "hi", "ja", "pe", "zo", "an", "el", "or", "us"};
  std::uniform_int_distribution<int> n(1, 3), s(0, int(std::size(kSyllables)) - 1);
  std::string w;
  for (int i = n(rng); i > 0; --i) w += kSyllables[s(rng)];
  return w;
}

std::vector<int> sample_lengths(int n, int len, double ratio, std::mt19937_64& rng) {
  const int lo = std::max(1, int(std::floor(len * (1 - ratio))));
  const int hi = std::max(lo, int(std::ceil(len * (1 + ratio))));
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<int> out(static_cast<size_t>(n));
  for (int& x : out) x = ratio > 0 ? d(rng) : std::max(1, len);
  return out;
}

}  // namespace

std::vector<SampleRequest> random_dataset(const RandomDatasetOptions& o, const tok::Tokenizer* t) {
  if (o.num_prompts < 1) fail("--num-prompts must be at least 1 (got {})", o.num_prompts);
  if (o.input_len < 1) fail("--input-len must be at least 1 (got {})", o.input_len);
  if (o.output_len < 1) fail("--output-len must be at least 1 (got {})", o.output_len);
  if (!(o.range_ratio >= 0 && o.range_ratio < 1)) fail("--range-ratio must be in [0, 1) (got {})", o.range_ratio);
  std::mt19937_64 rng(o.seed);
  const std::vector<int> in_lens = sample_lengths(o.num_prompts, o.input_len, o.range_ratio, rng);
  const std::vector<int> out_lens = sample_lengths(o.num_prompts, o.output_len, o.range_ratio, rng);

  std::vector<tok::TokenId> pool;
  if (t) {
    pool = word_tokens(*t);
    if (pool.size() < 16) fail("the tokenizer has too few ' word' tokens ({}) to build random prompts", pool.size());
  }
  std::vector<SampleRequest> out;
  out.reserve(size_t(o.num_prompts));
  for (int i = 0; i < o.num_prompts; ++i) {
    SampleRequest r;
    r.output_len = out_lens[size_t(i)];
    const int n = in_lens[size_t(i)];
    if (t) {
      std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
      std::vector<tok::TokenId> ids(static_cast<size_t>(n));
      for (auto& id : ids) id = pool[pick(rng)];
      std::tie(r.prompt, r.prompt_len) = exact_prompt(*t, std::move(ids), n, rng, pool);
    } else {
      for (int w = 0; w < n; ++w) {
        if (w) r.prompt += ' ';
        r.prompt += random_word(rng);
      }
      r.prompt_len = n;
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kestrel::bench
