// The random and custom datasets: see dataset.h.
#include "benchclient/dataset.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
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

namespace {

int count_tokens(const std::string& text, const tok::Tokenizer* t) {
  if (t) return int(t->encode(text).size());
  int words = 0;
  bool in_word = false;
  for (char c : text) {
    const bool space = c == ' ' || c == '\n' || c == '\t' || c == '\r';
    words += !space && !in_word;
    in_word = !space;
  }
  return words;
}

// One line of the file as a request (output_len left to the caller).
SampleRequest parse_custom_line(const std::string& line, size_t lineno, const std::string& path,
                                const tok::Tokenizer* t) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) fail("{}:{}: not a JSON object", path, lineno);
  SampleRequest r;
  const nlohmann::json* msgs = nullptr;
  if (auto it = j.find("prompt"); it != j.end()) {
    if (!it->is_string()) fail("{}:{}: \"prompt\" must be a string", path, lineno);
    r.prompt = it->get<std::string>();
    r.prompt_len = count_tokens(r.prompt, t);
    return r;
  }
  if (auto it = j.find("messages"); it != j.end()) {
    msgs = &*it;
  } else if (auto rq = j.find("request"); rq != j.end() && rq->is_object()) {
    if (auto m = rq->find("messages"); m != rq->end()) msgs = &*m;
  }
  if (!msgs) fail("{}:{}: expected \"prompt\", \"messages\" or \"request\": {{\"messages\": ...}}", path, lineno);
  if (!msgs->is_array() || msgs->empty()) fail("{}:{}: \"messages\" must be a non-empty array", path, lineno);
  int len = 0;
  for (const auto& m : *msgs) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      fail("{}:{}: every message needs a string \"role\"", path, lineno);
    if (auto c = m.find("content"); c != m.end() && c->is_string()) len += count_tokens(c->get<std::string>(), t);
  }
  r.messages = msgs->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  r.prompt_len = len;
  return r;
}

}  // namespace

std::vector<SampleRequest> custom_dataset(const CustomDatasetOptions& o, const tok::Tokenizer* t) {
  if (o.num_prompts < 1) fail("--num-prompts must be at least 1 (got {})", o.num_prompts);
  if (o.output_len < 1) fail("--output-len must be at least 1 (got {})", o.output_len);
  if (o.path.empty()) fail("--dataset custom needs --dataset-path FILE (JSONL)");
  std::ifstream f(o.path);
  if (!f) fail("--dataset-path {}: cannot open", o.path);
  std::vector<SampleRequest> lines;
  std::string line;
  for (size_t n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines
    lines.push_back(parse_custom_line(line, n, o.path, t));
  }
  if (lines.empty()) fail("--dataset-path {}: no requests in the file", o.path);
  std::vector<size_t> order(lines.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::mt19937_64 rng(o.seed);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<SampleRequest> out;
  out.reserve(size_t(o.num_prompts));
  for (int i = 0; i < o.num_prompts; ++i) {
    SampleRequest r = lines[order[size_t(i) % order.size()]];
    r.output_len = o.output_len;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kestrel::bench
