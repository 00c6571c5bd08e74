// Vocabulary loading, the chunking rules, special-token splitting and byte-pair merging.
//
// The merge loop reproduces tiktoken's: repeatedly merge the adjacent pair whose concatenated bytes
// have the lowest rank, the leftmost one on ties, until no pair is in the vocabulary. Short pieces
// use tiktoken's linear scan; long ones (long Han runs are single pieces) use a heap keyed by
// (rank, byte position), which picks the same pair at every step because the leftmost pair is the
// one with the smallest position.
#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <queue>
#include <sstream>

#include "core/check.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/unicode_class.h"

namespace kestrel::tok {
namespace {

constexpr uint32_t kNone = UINT32_MAX;

uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull ^ n;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 0x100000001b3ull;
  return h ^ (h >> 29);
}

int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool b64_decode(std::string_view s, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (unsigned char c : s) {
    if (c == '=') {
      ++pad;
      continue;
    }
    if (pad) return false;
    const int v = b64_value(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return pad <= 2 && (s.size() % 4 == 0 || pad == 0);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open {}", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& dir) {
  const std::string model = read_file(dir + "/tiktoken.model");
  std::string config;
  std::ifstream probe(dir + "/tokenizer_config.json");
  if (probe) config = read_file(dir + "/tokenizer_config.json");
  try {
    return from_strings(model, config);
  } catch (const Error& e) {
    fail("tokenizer in {}: {}", dir, e.what());
  }
}

Tokenizer Tokenizer::from_strings(std::string_view model, std::string_view config_json) {
  std::vector<std::string> ranks;
  std::vector<bool> seen;
  size_t line_no = 0, pos = 0;
  std::string bytes;
  while (pos < model.size()) {
    size_t eol = model.find('\n', pos);
    if (eol == std::string_view::npos) eol = model.size();
    std::string_view line = model.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos) fail("tiktoken.model line {}: expected 'base64 rank'", line_no);
    if (!b64_decode(line.substr(0, sp), bytes) || bytes.empty())
      fail("tiktoken.model line {}: bad base64", line_no);
    std::string_view rs = line.substr(sp + 1);
    uint64_t rank = 0;
    if (rs.empty() || rs.size() > 9) fail("tiktoken.model line {}: bad rank", line_no);
    for (char c : rs) {
      if (c < '0' || c > '9') fail("tiktoken.model line {}: bad rank", line_no);
      rank = rank * 10 + static_cast<uint64_t>(c - '0');
    }
    if (rank >= ranks.size()) {
      ranks.resize(rank + 1);
      seen.resize(rank + 1);
    }
    if (seen[rank]) fail("tiktoken.model line {}: duplicate rank {}", line_no, rank);
    seen[rank] = true;
    ranks[rank] = bytes;
  }
  if (ranks.empty()) fail("tiktoken.model is empty");
  for (size_t r = 0; r < ranks.size(); ++r)
    if (!seen[r]) fail("tiktoken.model: ranks must be 0..{} without gaps; {} is missing", ranks.size() - 1, r);

  // Special names: added_tokens_decoder {"<id>": {"content": "<name>", ...}}. Ids outside the
  // reserved slots cannot be placed and are rejected rather than silently dropped.
  std::vector<std::pair<std::string, TokenId>> specials;
  const size_t nb = ranks.size();
  std::vector<std::string> names(kNumReservedSpecial);
  if (!config_json.empty()) {
    nlohmann::json cfg;
    try {
      cfg = nlohmann::json::parse(config_json);
    } catch (const std::exception& e) {
      fail("tokenizer_config.json: {}", e.what());
    }
    if (cfg.contains("added_tokens_decoder")) {
      const auto& atd = cfg["added_tokens_decoder"];
      if (!atd.is_object()) fail("tokenizer_config.json: added_tokens_decoder must be an object");
      for (auto it = atd.begin(); it != atd.end(); ++it) {
        uint64_t id = 0;
        const std::string& k = it.key();
        if (k.empty() || k.size() > 9 || !std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; }))
          fail("tokenizer_config.json: added token id '{}' is not a number", k);
        id = std::stoull(k);
        if (id < nb || id >= nb + kNumReservedSpecial)
          fail("tokenizer_config.json: added token id {} is outside the special slots {}..{}", id, nb,
               nb + kNumReservedSpecial - 1);
        const auto& v = it.value();
        if (!v.is_object() || !v.contains("content") || !v["content"].is_string() ||
            v["content"].get<std::string>().empty())
          fail("tokenizer_config.json: added token {} has no content string", id);
        names[id - nb] = v["content"].get<std::string>();
      }
    }
  }
  for (size_t i = 0; i < kNumReservedSpecial; ++i) {
    const TokenId id = static_cast<TokenId>(nb + i);
    specials.emplace_back(names[i].empty() ? "<|reserved_token_" + std::to_string(id) + "|>" : names[i], id);
  }
  return from_ranks(std::move(ranks), specials);
}

Tokenizer Tokenizer::from_ranks(std::vector<std::string> ranks,
                                const std::vector<std::pair<std::string, TokenId>>& specials) {
  Tokenizer t;
  t.num_base_ = ranks.size();
  t.id_bytes_ = std::move(ranks);
  for (const auto& [name, id] : specials) {
    if (id < t.num_base_) fail("special token {} has id {} inside the base vocabulary", name, id);
    if (name.empty()) fail("special token {} has an empty name", id);
    if (id >= t.id_bytes_.size()) t.id_bytes_.resize(id + 1);
    if (!t.id_bytes_[id].empty()) fail("special id {} is named twice", id);
    if (!t.specials_.emplace(name, id).second) fail("special token name {} is used twice", name);
    t.id_bytes_[id] = name;
  }
  for (size_t id = t.num_base_; id < t.id_bytes_.size(); ++id)
    if (t.id_bytes_[id].empty()) fail("special id {} has no name", id);
  t.build_index();
  return t;
}

void Tokenizer::build_index() {
  size_t cap = 16;
  while (cap < num_base_ * 2) cap <<= 1;
  slots_.assign(cap, kNone);
  mask_ = cap - 1;
  for (size_t id = 0; id < num_base_; ++id) {
    const std::string& b = id_bytes_[id];
    if (b.empty()) fail("token {} has no bytes", id);
    uint64_t h = hash_bytes(b.data(), b.size()) & mask_;
    while (slots_[h] != kNone) {
      if (id_bytes_[slots_[h]] == b) fail("tiktoken.model: bytes of rank {} repeat rank {}", id, slots_[h]);
      h = (h + 1) & mask_;
    }
    slots_[h] = static_cast<uint32_t>(id);
  }
  for (auto& v : specials_by_first_) v.clear();
  for (const auto& [name, id] : specials_) specials_by_first_[static_cast<unsigned char>(name[0])].push_back(id);
  for (auto& v : specials_by_first_)
    std::sort(v.begin(), v.end(), [&](TokenId a, TokenId b) {
      const auto &x = id_bytes_[a], &y = id_bytes_[b];
      return x.size() != y.size() ? x.size() > y.size() : x < y;
    });
}

uint32_t Tokenizer::rank_of(const char* p, size_t n) const {
  uint64_t h = hash_bytes(p, n) & mask_;
  for (;;) {
    const uint32_t id = slots_[h];
    if (id == kNone) return kNone;
    const std::string& b = id_bytes_[id];
    if (b.size() == n && std::memcmp(b.data(), p, n) == 0) return id;
    h = (h + 1) & mask_;
  }
}

std::optional<TokenId> Tokenizer::base_id(std::string_view bytes) const {
  if (bytes.empty()) return std::nullopt;
  const uint32_t r = rank_of(bytes.data(), bytes.size());
  if (r == kNone) return std::nullopt;
  return r;
}

std::optional<TokenId> Tokenizer::special_id(std::string_view name) const {
  auto it = specials_.find(std::string(name));
  if (it == specials_.end()) return std::nullopt;
  return it->second;
}

TokenId Tokenizer::require_special(std::string_view name) const {
  auto id = special_id(name);
  if (!id) fail("the tokenizer has no special token {}", name);
  return *id;
}

const std::string& Tokenizer::token_bytes(TokenId id) const {
  if (id >= id_bytes_.size()) fail("token id {} is outside the vocabulary (size {})", id, id_bytes_.size());
  return id_bytes_[id];
}

void Tokenizer::bpe(std::string_view piece, std::vector<TokenId>& out) const {
  const char* p = piece.data();
  const size_t n = piece.size();
  if (const uint32_t whole = rank_of(p, n); whole != kNone) {
    out.push_back(whole);
    return;
  }
  auto emit = [&](size_t a, size_t b) {
    const uint32_t r = rank_of(p + a, b - a);
    // Every single byte is a base token in a byte-level vocabulary; a vocabulary without one
    // cannot encode this text at all.
    if (r == kNone) fail("the vocabulary has no token for byte 0x{:02x}", static_cast<unsigned char>(p[a]));
    out.push_back(r);
  };
  if (n < 128) {
    // tiktoken's scan: parts[i] = (start, rank of the pair starting here).
    struct Part { uint32_t start, rank; };
    Part parts[130];
    size_t m = n + 1;
    for (size_t i = 0; i < m; ++i) parts[i] = {static_cast<uint32_t>(i), kNone};
    auto pair_rank = [&](size_t i) -> uint32_t {
      if (i + 2 >= m) return kNone;
      return rank_of(p + parts[i].start, parts[i + 2].start - parts[i].start);
    };
    for (size_t i = 0; i + 2 < m; ++i) parts[i].rank = pair_rank(i);
    while (m > 2) {
      uint32_t best = kNone;
      size_t bi = 0;
      for (size_t i = 0; i + 1 < m; ++i)
        if (parts[i].rank < best) {
          best = parts[i].rank;
          bi = i;
        }
      if (best == kNone) break;
      // Merge bi with bi+1: drop boundary bi+1, then refresh the two pairs that changed.
      std::memmove(&parts[bi + 1], &parts[bi + 2], (m - bi - 2) * sizeof(Part));
      --m;
      parts[bi].rank = pair_rank(bi);
      if (bi > 0) parts[bi - 1].rank = pair_rank(bi - 1);
    }
    for (size_t i = 0; i + 1 < m; ++i) emit(parts[i].start, parts[i + 1].start);
    return;
  }
  // Long piece: linked list of symbols + min-heap of candidate pairs with lazy invalidation.
  std::vector<uint32_t> next(n), prev(n), end(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    next[i] = static_cast<uint32_t>(i + 1);
    prev[i] = i == 0 ? kNone : static_cast<uint32_t>(i - 1);
    end[i] = static_cast<uint32_t>(i + 1);
  }
  struct Cand { uint32_t rank, left, right_end; };  // the pair (left, next[left]) ending at right_end
  auto cmp = [](const Cand& a, const Cand& b) { return a.rank != b.rank ? a.rank > b.rank : a.left > b.left; };
  std::priority_queue<Cand, std::vector<Cand>, decltype(cmp)> heap(cmp);
  auto push_pair = [&](uint32_t left) {
    if (left == kNone || next[left] >= n) return;
    const uint32_t re = end[next[left]];
    const uint32_t r = rank_of(p + left, re - left);
    if (r != kNone) heap.push({r, left, re});
  };
  for (uint32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    // Stale if either symbol changed since the candidate was made.
    if (!alive[c.left] || next[c.left] >= n || end[next[c.left]] != c.right_end) continue;
    const uint32_t right = next[c.left];
    alive[right] = false;
    end[c.left] = end[right];
    next[c.left] = next[right];
    if (next[right] < n) prev[next[right]] = c.left;
    push_pair(c.left);
    push_pair(prev[c.left]);
  }
  for (uint32_t i = 0; i < n; i = next[i]) emit(i, end[i]);
}

void Tokenizer::encode_ordinary_part(std::string_view text, std::vector<TokenId>& out) const {
  pretokenize(text, [&](std::string_view piece) { bpe(piece, out); });
}

void Tokenizer::encode_part(std::string_view text, bool allow_special, std::vector<TokenId>& out) const {
  if (!allow_special || specials_.empty()) {
    encode_ordinary_part(text, out);
    return;
  }
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const auto& cands = specials_by_first_[static_cast<unsigned char>(text[i])];
    TokenId hit = kNone;
    for (TokenId id : cands) {
      const std::string& name = id_bytes_[id];
      if (text.size() - i >= name.size() && std::memcmp(text.data() + i, name.data(), name.size()) == 0) {
        hit = id;
        break;
      }
    }
    if (hit == kNone) {
      ++i;
      continue;
    }
    if (i > start) encode_ordinary_part(text.substr(start, i - start), out);
    out.push_back(hit);
    i += id_bytes_[hit].size();
    start = i;
  }
  if (start < text.size()) encode_ordinary_part(text.substr(start), out);
}

void Tokenizer::encode_append(std::string_view text_in, bool allow_special, std::vector<TokenId>& out) const {
  std::string sanitized;
  std::string_view text = text_in;
  if (!utf8_is_valid(text)) {
    sanitized = utf8_sanitize(text);
    text = sanitized;
  }
  // Chunking (code points): 400,000-character chunks, then runs of > 25,000 characters of one
  // class (Python isspace) split before the 25,001st. Boundaries end BPE merges and regex matches,
  // so they are part of the exact output.
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    size_t chars = 0, slice_start = i, run_len = 0;
    bool run_space = false;
    size_t j = i;
    while (j < n && chars < kMaxEncodeChars) {
      const Utf8Step st = p[j] < 0x80 ? Utf8Step{p[j], 1, true, false} : utf8_step(p + j, n - j);
      const bool sp = char_class(st.cp) & kPySpace;
      if (chars == 0) run_space = sp;
      if (sp != run_space) {
        run_space = sp;
        run_len = 1;
      } else if (++run_len > kMaxSameClassRun) {
        encode_part(text.substr(slice_start, j - slice_start), allow_special, out);
        slice_start = j;
        run_len = 1;
      }
      j += st.len;
      ++chars;
    }
    encode_part(text.substr(slice_start, j - slice_start), allow_special, out);
    i = j;
  }
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  encode_append(text, allow_special, out);
  return out;
}

std::string Tokenizer::decode_bytes(const std::vector<TokenId>& ids) const {
  std::string out;
  for (TokenId id : ids) out += token_bytes(id);
  return out;
}

std::string Tokenizer::decode(const std::vector<TokenId>& ids) const { return utf8_sanitize(decode_bytes(ids)); }

std::string StreamDecoder::push(TokenId id) { return utf8_.push(tok_->token_bytes(id)); }

std::string StreamDecoder::finish() { return utf8_.finish(); }

}  // namespace kestrel::tok
