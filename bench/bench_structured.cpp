// Structured-output mask cost: compile time and µs per mask for a 30-property schema, at batch 1 and
// 64 (64 matchers filled one after another on one thread, as a CPU worker would between two decode
// steps), over (a) the real k3-tiny vocabulary (12,256 ids) and (b) a K3-sized vocabulary of 163,840
// ids. The real K3.1 tokenizer file is not in this repository (models/k3-tiny ships its own 12,000-
// token BPE), so (b) is synthesised: k3-tiny's tokens, every byte, pseudo-words with and without a
// leading space and capital, numbers, punctuation runs, whitespace runs, CJK characters and pairs,
// Cyrillic/Greek words — the classes a real BPE vocabulary holds, in roughly its proportions.
//
// Each matcher walks a fixed valid document (Python-style separators, tokenised by the vocabulary's
// own BPE); a mask is filled before every token, as the sampler would need it.
//
// Budget-aware completion (Matcher::fill_mask(words, budget), docs/structured-outputs.md "Finishing
// within max_tokens") at every position of the same walk: "far" = a budget 10,000 tokens beyond the
// document's end (the tables' bound suffices: the plain mask plus the bound), "near" = the tightest
// budget, min_completion() + 1 (the bound does not suffice wherever some allowed token would leave more
// to finish: an exact walk of the vocabulary with distances), and min_completion() itself.
//   bench_structured [--model DIR] [--vocab N] [--reps R]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <set>

#include "structured/json_schema_grammar.h"

using namespace kestrel;
using namespace kestrel::structured;
using Clock = std::chrono::steady_clock;

namespace {

const char* kSchema = R"({"type": "object", "additionalProperties": false, "properties": {
  "id": {"type": "string", "format": "uuid"}, "name": {"type": "string", "maxLength": 40},
  "email": {"type": "string", "format": "email"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "height_m": {"type": "number", "minimum": 0.3, "maximum": 2.8}, "active": {"type": "boolean"},
  "role": {"enum": ["admin", "editor", "viewer", "guest"]}, "created": {"type": "string", "format": "date-time"},
  "birthday": {"type": "string", "format": "date"}, "score": {"type": "number"},
  "rank": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
  "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "country": {"type": "string", "minLength": 2, "maxLength": 2},
  "city": {"type": "string"}, "street": {"type": "string"}, "zip": {"type": "string"},
  "phone": {"type": "string"}, "website": {"type": "string", "format": "uri"}, "verified": {"type": "boolean"},
  "balance": {"type": "number", "exclusiveMinimum": -1000000}, "currency": {"enum": ["USD", "EUR", "JPY", "GBP"]},
  "notes": {"type": "string"}, "level": {"type": "integer", "minimum": 1, "maximum": 10},
  "ratios": {"type": "array", "items": {"type": "number"}}, "manager": {"anyOf": [{"type": "string"}, {"type": "null"}]},
  "address": {"type": "object", "properties": {"line": {"type": "string"}, "floor": {"type": "integer"}},
              "required": ["line", "floor"], "additionalProperties": false},
  "last_login": {"type": "string", "format": "date-time"}, "locale": {"type": "string"}, "timezone": {"type": "string"}},
  "required": ["id", "name", "email", "age", "height_m", "active", "role", "created", "birthday", "score", "rank",
    "tags", "nickname", "country", "city", "street", "zip", "phone", "website", "verified", "balance", "currency",
    "notes", "level", "ratios", "manager", "address", "last_login", "locale", "timezone"]})";

const char* kDocument = R"({"id": "123e4567-e89b-12d3-a456-426614174000", "name": "Ada Lovelace", "email": "ada@example.org", "age": 36, "height_m": 1.65, "active": true, "role": "editor", "created": "2024-03-01T09:30:00Z", "birthday": "1815-12-10", "score": 98.5, "rank": 3, "tags": ["math", "engines", "poetry"], "nickname": null, "country": "GB", "city": "London", "street": "12 St James's Square", "zip": "SW1Y 4JH", "phone": "+44 20 7946 0958", "website": "https://example.org/ada", "verified": false, "balance": 1024.75, "currency": "GBP", "notes": "First to publish an algorithm intended for a machine; wrote about the Analytical Engine.", "level": 7, "ratios": [0.25, 0.5, 1.0], "manager": "Charles Babbage", "address": {"line": "12 St James's Square", "floor": 2}, "last_login": "2024-06-01T18:00:00+01:00", "locale": "en-GB", "timezone": "Europe/London"})";

std::vector<std::string> synthetic_vocab(const tok::Tokenizer& base, size_t n_base) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  auto add = [&](std::string s) {
    if (out.size() < n_base && !s.empty() && seen.insert(s).second) out.push_back(std::move(s));
  };
  for (int b = 0; b < 256; ++b) add(std::string(1, char(b)));
  for (size_t i = 0; i < base.num_base_tokens(); ++i) add(base.token_bytes(tok::TokenId(i)));
  for (int n = 1; n <= 64; ++n) add(std::string(n, ' '));
  for (int n = 0; n <= 32; ++n) add("\n" + std::string(n, ' ')), add("\n" + std::string(n / 4, '\t'));
  for (int i = 0; i < 1000; ++i) add(std::to_string(i)), add(" " + std::to_string(i));
  const std::string punct = "{}[]\":,.()'<>=;!?-_/*#";
  for (char a : punct)
    for (char b : punct) {
      add(std::string{a, b});
      add(std::string{' ', a, b});
      for (char c : std::string("\":,}]")) add(std::string{a, b, c});
    }
  auto utf8 = [](uint32_t cp) {
    std::string s;
    if (cp < 0x800) {
      s += char(0xC0 | (cp >> 6));
    } else {
      s += char(0xE0 | (cp >> 12));
      s += char(0x80 | ((cp >> 6) & 63));
    }
    s += char(0x80 | (cp & 63));
    return s;
  };
  for (uint32_t cp = 0x4E00; cp < 0x4E00 + 18000; ++cp) add(utf8(cp));
  std::mt19937 rng(42);
  for (int i = 0; i < 12000; ++i) add(utf8(0x4E00 + rng() % 6000) + utf8(0x4E00 + rng() % 6000));
  for (int i = 0; i < 9000; ++i) {  // Cyrillic and Greek words
    const uint32_t base_cp = (i & 1) ? 0x430 : 0x3B1;
    std::string w = (i % 3 == 0) ? " " : "";
    for (int k = 0, len = 2 + int(rng() % 6); k < len; ++k) w += utf8(base_cp + rng() % 24);
    add(w);
  }
  const char* syl[] = {"a", "an", "ar", "ba", "be", "ca", "co", "de", "di", "el", "en", "er", "es", "fo", "ga",
                       "he", "in", "is", "ka", "la", "le", "li", "lo", "ma", "me", "mi", "na", "ne", "no", "on",
                       "or", "pa", "pe", "ra", "re", "ri", "ro", "sa", "se", "si", "so", "ta", "te", "ti", "to",
                       "tr", "un", "ur", "va", "ve", "wa", "we", "xi", "yo", "za", "ing", "ion", "ent", "est", "ous"};
  while (out.size() < n_base) {
    std::string w;
    for (int k = 0, len = 1 + int(rng() % 4); k < len; ++k) w += syl[rng() % (sizeof(syl) / sizeof(*syl))];
    const int form = int(rng() % 6);
    if (form == 1 || form == 3) w[0] = char(std::toupper(uint8_t(w[0])));
    if (form >= 2) w = " " + w;
    if (form == 5) w = "_" + w.substr(1);
    add(w);
  }
  return out;
}

struct Result {
  double compile_ms = 0, mask_us_b1 = 0, p50_us_b1 = 0, p99_us_b1 = 0, step_us_b64 = 0, accept_us = 0;
  double far_us = 0, far_p99 = 0, near_us = 0, near_p50 = 0, near_p99 = 0, dist_us = 0;
  size_t tokens = 0, states = 0, memory = 0;
};

Result run(const std::shared_ptr<const TokenVocab>& vocab, int reps) {
  Result r;
  const auto t0 = Clock::now();
  const auto g = compile_json_schema(vocab, ojson::parse(kSchema));
  r.compile_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  r.states = g->stats().states;
  r.memory = g->stats().memory_bytes;
  const std::vector<tok::TokenId> doc = vocab->tokenizer().encode(kDocument);
  r.tokens = doc.size();
  const tok::TokenId stop = vocab->tokenizer().require_special("<|end_of_msg|>");
  std::vector<uint32_t> mask(vocab->mask_words());
  // Batch 1: one matcher, a mask before every token.
  std::vector<double> per;
  double accept_total = 0;
  for (int rep = 0; rep < reps; ++rep) {
    Matcher m(g, {stop});
    for (tok::TokenId id : doc) {
      const auto a = Clock::now();
      m.fill_mask(mask.data());
      const auto b = Clock::now();
      if (!(mask[id >> 5] >> (id & 31) & 1) || !m.accept(id)) {
        fmt::print(stderr, "the benchmark document was refused at token {}\n", id);
        std::exit(1);
      }
      accept_total += std::chrono::duration<double, std::micro>(Clock::now() - b).count();
      per.push_back(std::chrono::duration<double, std::micro>(b - a).count());
    }
  }
  std::sort(per.begin(), per.end());
  double sum = 0;
  for (double x : per) sum += x;
  r.mask_us_b1 = sum / per.size();
  r.p50_us_b1 = per[per.size() / 2];
  r.p99_us_b1 = per[size_t(per.size() * 0.99)];
  r.accept_us = accept_total / per.size();
  // Budgeted masks at every position (the document's tokens are accepted whatever the near mask allows:
  // this measures the cost, not a walk within the budget).
  std::vector<double> far, near;
  double dist_total = 0;
  for (int rep = 0; rep < reps; ++rep) {
    Matcher m(g, {stop});
    for (size_t k = 0; k < doc.size(); ++k) {
      const auto a = Clock::now();
      m.fill_mask(mask.data(), uint32_t(doc.size() - k + 10000));
      const auto b = Clock::now();
      const uint32_t d = m.min_completion();
      const auto c = Clock::now();
      m.fill_mask(mask.data(), d + 1);
      const auto e = Clock::now();
      far.push_back(std::chrono::duration<double, std::micro>(b - a).count());
      dist_total += std::chrono::duration<double, std::micro>(c - b).count();
      near.push_back(std::chrono::duration<double, std::micro>(e - c).count());
      m.accept(doc[k]);
    }
  }
  auto stats = [](std::vector<double>& v, double& mean, double* p50, double& p99) {
    std::sort(v.begin(), v.end());
    double t = 0;
    for (double x : v) t += x;
    mean = t / double(v.size());
    if (p50) *p50 = v[v.size() / 2];
    p99 = v[size_t(double(v.size()) * 0.99)];
  };
  stats(far, r.far_us, nullptr, r.far_p99);
  stats(near, r.near_us, &r.near_p50, r.near_p99);
  r.dist_us = dist_total / double(far.size());
  // Batch 64: 64 matchers at staggered positions of the document, all 64 masks per step.
  const size_t B = 64;
  std::vector<Matcher> ms;
  std::vector<size_t> pos(B);
  for (size_t i = 0; i < B; ++i) {
    ms.emplace_back(g, std::vector<tok::TokenId>{stop});
    pos[i] = (i * doc.size()) / B;
    for (size_t k = 0; k < pos[i]; ++k) ms[i].accept(doc[k]);
  }
  std::vector<uint32_t> masks(B * vocab->mask_words());
  const int steps = std::max(20, reps * 10);
  double step_total = 0;
  for (int s = 0; s < steps; ++s) {
    const auto a = Clock::now();
    for (size_t i = 0; i < B; ++i) ms[i].fill_mask(masks.data() + i * vocab->mask_words());
    step_total += std::chrono::duration<double, std::micro>(Clock::now() - a).count();
    for (size_t i = 0; i < B; ++i) {
      if (pos[i] == doc.size()) {
        ms[i].reset();
        pos[i] = 0;
      }
      ms[i].accept(doc[pos[i]++]);
    }
  }
  r.step_us_b64 = step_total / steps;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "models/k3-tiny";
  size_t vocab_size = 163840;
  int reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    else if (!std::strcmp(argv[i], "--vocab")) vocab_size = std::stoul(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::stoi(argv[i + 1]);
  }
  try {
    const tok::Tokenizer real = tok::Tokenizer::load(model);
    std::vector<std::pair<std::string, tok::TokenId>> specials;
    const size_t n_base = vocab_size - tok::Tokenizer::kNumReservedSpecial;
    for (size_t i = real.num_base_tokens(); i < real.vocab_size(); ++i)
      specials.push_back({real.token_bytes(tok::TokenId(i)), tok::TokenId(n_base + i - real.num_base_tokens())});
    const tok::Tokenizer big = tok::Tokenizer::from_ranks(synthetic_vocab(real, n_base), specials);
    fmt::print("30-property schema, {} reps; a whole-vocabulary mask filled before every token of a {}-byte document\n",
               reps, std::strlen(kDocument));
    fmt::print("{:<34} {:>7} {:>7} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>13} {:>9}\n", "vocabulary", "ids", "states",
               "compile", "tokens", "mask µs", "p50 µs", "p99 µs", "accept µs", "B=64 step µs", "tables");
    for (const auto* t : {&real, &big}) {
      const auto v = std::make_shared<const TokenVocab>(*t);
      const Result r = run(v, reps);
      fmt::print("{:<34} {:>7} {:>7} {:>7.0f}ms {:>8} {:>8.1f} {:>8.1f} {:>8.1f} {:>10.2f} {:>13.0f} {:>7.1f}MB\n",
                 t == &real ? model + " (real)" : "synthetic K3-sized", t->vocab_size(), r.states, r.compile_ms,
                 r.tokens, r.mask_us_b1, r.p50_us_b1, r.p99_us_b1, r.accept_us, r.step_us_b64, r.memory / 1e6);
      fmt::print("  budget masks: far {:.1f} µs mean, {:.1f} p99; near (min_completion + 1) {:.1f} µs mean, {:.1f} p50, "
                 "{:.1f} p99; min_completion() {:.2f} µs\n",
                 r.far_us, r.far_p99, r.near_us, r.near_p50, r.near_p99, r.dist_us);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
