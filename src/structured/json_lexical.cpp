// JSON lexical fragments. Numbers with bounds and keys outside a set are small automata enumerated
// from a step function over packed abstract states (explore), which keeps each readable as the rule
// it implements and leaves minimisation to the builder.
//
// Number bounds, exactly: the validator compares doubles (and int64 exactly). A generated number
// has at most 15 significant digits when bounded, and a bound is its shortest round-trip decimal
// (rounded inward to 15 digits if longer). Two different decimals of at most 15 significant digits
// are different doubles, and rounding to double is monotone, so "decimal x < decimal b" implies
// "double x < double b": a strict bound checked on decimals holds on doubles too.
#include "structured/json_lexical.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <unordered_map>

#include "core/check.h"

namespace kestrel::structured::detail {

using Frag = GrammarBuilder::Frag;

GrammarBuilder::Frag emit_dfa(GrammarBuilder& b, const ExplicitDfa& d) {
  // One builder node per state (reached by empty fragments joined with epsilon edges).
  std::vector<Frag> nodes;
  nodes.reserve(d.states.size());
  for (size_t i = 0; i < d.states.size(); ++i) nodes.push_back(b.empty());
  Frag out = b.empty();
  for (size_t i = 0; i < d.states.size(); ++i) {
    for (const auto& e : d.states[i].edges) {
      Frag r = b.byte_range(e.lo, e.hi);
      b.seq(nodes[i], r);
      b.seq(r, nodes[e.to]);
    }
    if (d.states[i].accepting) b.seq(nodes[i], out);
  }
  return {nodes[0].in, out.out};
}

namespace {

ExplicitDfa explore(uint64_t init, const std::function<std::optional<uint64_t>(uint64_t, uint8_t)>& step,
                    const std::function<bool(uint64_t)>& accept, size_t max_states = 100'000) {
  ExplicitDfa d;
  std::unordered_map<uint64_t, uint32_t> ids;
  std::vector<uint64_t> keys;
  auto intern = [&](uint64_t k) {
    auto [it, fresh] = ids.emplace(k, uint32_t(keys.size()));
    if (fresh) {
      if (keys.size() >= max_states) fail("internal: lexical automaton too large");
      keys.push_back(k);
      d.states.emplace_back();
    }
    return it->second;
  };
  intern(init);
  for (size_t i = 0; i < keys.size(); ++i) {
    const uint64_t k = keys[i];
    d.states[i].accepting = accept(k);
    int b = 0;
    while (b < 256) {
      const auto t = step(k, uint8_t(b));
      if (!t) {
        ++b;
        continue;
      }
      int e = b;
      while (e + 1 < 256) {
        const auto u = step(k, uint8_t(e + 1));
        if (!u || *u != *t) break;
        ++e;
      }
      const uint32_t to = intern(*t);
      d.states[i].edges.push_back({uint8_t(b), uint8_t(e), to});
      b = e + 1;
    }
  }
  return d;
}

// UTF-8 well-formedness: u = 0 at a character boundary, else which continuation is expected.
std::optional<int> utf8_next(int u, uint8_t c) {
  switch (u) {
    case 0:
      if (c < 0x80) return 0;
      if (c >= 0xC2 && c <= 0xDF) return 1;
      if (c == 0xE0) return 2;
      if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return 3;
      if (c == 0xED) return 4;
      if (c == 0xF0) return 5;
      if (c >= 0xF1 && c <= 0xF3) return 6;
      if (c == 0xF4) return 7;
      return std::nullopt;
    case 1: return c >= 0x80 && c <= 0xBF ? std::optional<int>(0) : std::nullopt;
    case 2: return c >= 0xA0 && c <= 0xBF ? std::optional<int>(1) : std::nullopt;
    case 3: return c >= 0x80 && c <= 0xBF ? std::optional<int>(1) : std::nullopt;
    case 4: return c >= 0x80 && c <= 0x9F ? std::optional<int>(1) : std::nullopt;
    case 5: return c >= 0x90 && c <= 0xBF ? std::optional<int>(3) : std::nullopt;
    case 6: return c >= 0x80 && c <= 0xBF ? std::optional<int>(3) : std::nullopt;
    case 7: return c >= 0x80 && c <= 0x8F ? std::optional<int>(3) : std::nullopt;
  }
  return std::nullopt;
}

Frag multibyte(GrammarBuilder& b) {
  auto cont = [&] { return b.byte_range(0x80, 0xBF); };
  return b.alt({
      b.seq(b.byte_range(0xC2, 0xDF), cont()),
      b.seq({b.literal("\xE0"), b.byte_range(0xA0, 0xBF), cont()}),
      b.seq({b.alt({b.byte_range(0xE1, 0xEC), b.byte_range(0xEE, 0xEF)}), cont(), cont()}),
      b.seq({b.literal("\xED"), b.byte_range(0x80, 0x9F), cont()}),
      b.seq({b.literal("\xF0"), b.byte_range(0x90, 0xBF), cont(), cont()}),
      b.seq({b.byte_range(0xF1, 0xF3), cont(), cont(), cont()}),
      b.seq({b.literal("\xF4"), b.byte_range(0x80, 0x8F), cont(), cont()}),
  });
}

Frag hex(GrammarBuilder& b) {
  std::bitset<256> s;
  for (int c = '0'; c <= '9'; ++c) s.set(c);
  for (int c = 'a'; c <= 'f'; ++c) s.set(c), s.set(c - 32);
  return b.byte_set(s);
}

}  // namespace

GrammarBuilder::Frag string_char(GrammarBuilder& b, StrMode mode) {
  if (mode == StrMode::kRaw) return b.alt({b.byte_range(0x00, 0x7F), multibyte(b)});
  std::bitset<256> plain;
  for (int c = 0x20; c < 0x80; ++c)
    if (c != '"' && c != '\\') plain.set(c);
  std::bitset<256> simple;
  for (char c : std::string("\"\\/bfnrt")) simple.set(uint8_t(c));
  // \uXXXX: a non-surrogate, or a high surrogate followed by \u and a low surrogate (nlohmann/json
  // refuses lone surrogates).
  std::bitset<256> first_non_d, hi2, lo2;
  for (int c : std::string("0123456789abcefABCEF")) first_non_d.set(c);
  for (int c : std::string("89abAB")) hi2.set(c);
  for (int c : std::string("cdefCDEF")) lo2.set(c);
  std::bitset<256> d;
  d.set('d'), d.set('D');
  Frag u = b.alt({
      b.seq({b.byte_set(first_non_d), hex(b), hex(b), hex(b)}),
      b.seq({b.byte_set(d), b.byte_range('0', '7'), hex(b), hex(b)}),
      b.seq({b.byte_set(d), b.byte_set(hi2), hex(b), hex(b), b.literal("\\u"), b.byte_set(d), b.byte_set(lo2), hex(b),
             hex(b)}),
  });
  Frag escape = b.seq(b.literal("\\"), b.alt({b.byte_set(simple), b.seq(b.literal("u"), u)}));
  return b.alt({b.byte_set(plain), multibyte(b), escape});
}

GrammarBuilder::Frag quoted_string(GrammarBuilder& b, size_t min, std::optional<size_t> max) {
  Frag body = b.repeat([&] { return string_char(b, StrMode::kJson); }, min, max);
  return b.seq({b.literal("\""), body, b.literal("\"")});
}

std::string string_literal(const std::string& value, StrMode mode) {
  if (mode == StrMode::kRaw) return value;
  return nlohmann::json(value).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Decimal decimal_of(const nlohmann::json& v, bool up, bool* rounded) {
  if (rounded) *rounded = false;
  KCHECK(v.is_number(), "decimal_of: not a number");
  Decimal d;
  std::string digits;  // all significant digits
  long exp10 = 0;       // value = 0.digits * 10^exp10 ... computed below as int/frac split
  if (v.is_number_unsigned()) {
    digits = std::to_string(v.get<uint64_t>());
    exp10 = long(digits.size());
  } else if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    d.neg = x < 0;
    digits = std::to_string(x);
    if (d.neg) digits.erase(0, 1);
    exp10 = long(digits.size());
  } else {
    const double x = v.get<double>();
    d.neg = std::signbit(x) && x != 0;
    std::string s = fmt::format("{}", std::fabs(x));  // shortest round-trip
    long e = 0;
    if (const size_t p = s.find_first_of("eE"); p != std::string::npos) {
      e = std::stol(s.substr(p + 1));
      s = s.substr(0, p);
    }
    const size_t dot = s.find('.');
    const std::string ip = dot == std::string::npos ? s : s.substr(0, dot);
    const std::string fp = dot == std::string::npos ? "" : s.substr(dot + 1);
    digits = ip + fp;
    exp10 = long(ip.size()) + e;
  }
  // Normalise: strip leading zeros (adjusting the exponent) and trailing zeros.
  size_t lead = 0;
  while (lead < digits.size() && digits[lead] == '0') ++lead;
  digits = digits.substr(lead);
  exp10 -= long(lead);
  while (!digits.empty() && digits.back() == '0') digits.pop_back();
  if (digits.empty()) return Decimal{};  // zero
  if (digits.size() > 15) {
    const bool dropped = digits.find_first_not_of('0', 15) != std::string::npos;
    if (rounded) *rounded = dropped;
    digits.resize(15);
    // Lower bounds round up, upper bounds down: in magnitude that is away from zero exactly when the
    // direction and the sign disagree.
    if (dropped && (up != d.neg)) {
      int i = 14;
      while (i >= 0 && digits[i] == '9') digits[i--] = '0';
      if (i < 0) {
        digits.insert(digits.begin(), '1');
        digits.pop_back();
        ++exp10;
      } else {
        ++digits[i];
      }
    }
    while (!digits.empty() && digits.back() == '0') digits.pop_back();
  }
  if (exp10 <= 0) {
    d.int_digits = "0";
    d.frac_digits = std::string(size_t(-exp10), '0') + digits;
  } else if (size_t(exp10) >= digits.size()) {
    d.int_digits = digits + std::string(size_t(exp10) - digits.size(), '0');
  } else {
    d.int_digits = digits.substr(0, size_t(exp10));
    d.frac_digits = digits.substr(size_t(exp10));
  }
  if (d.int_digits.size() > 400 || d.frac_digits.size() > 400) fail("number bound {} is out of range", v.dump());
  return d;
}

namespace {

// Packed number-lexer state.
struct NS {
  unsigned phase : 4;  // 0 start, 1 after '-', 2 int digits, 3 int "0", 4 after '.', 5 frac, 6 after e, 7 e sign, 8 exp
  unsigned neg : 1, nonzero : 1;
  unsigned ilen : 6, flen : 6, elen : 2;
  unsigned lex_lo : 2, lex_hi : 2;  // integer prefix vs the bound's integer digits: 0 eq, 1 less, 2 greater
  unsigned fc_lo : 2, fc_hi : 2;    // fraction vs the bound's fraction digits (zero-padded)
  uint64_t pack() const {
    return uint64_t(phase) | uint64_t(neg) << 4 | uint64_t(nonzero) << 5 | uint64_t(ilen) << 6 |
           uint64_t(flen) << 12 | uint64_t(elen) << 18 | uint64_t(lex_lo) << 20 | uint64_t(lex_hi) << 22 |
           uint64_t(fc_lo) << 24 | uint64_t(fc_hi) << 26;
  }
  static NS unpack(uint64_t k) {
    NS s;
    s.phase = k & 15, s.neg = (k >> 4) & 1, s.nonzero = (k >> 5) & 1, s.ilen = (k >> 6) & 63;
    s.flen = (k >> 12) & 63, s.elen = (k >> 18) & 3, s.lex_lo = (k >> 20) & 3, s.lex_hi = (k >> 22) & 3;
    s.fc_lo = (k >> 24) & 3, s.fc_hi = (k >> 26) & 3;
    return s;
  }
};

unsigned cmp_digit(char a, char b) { return a == b ? 0 : a < b ? 1 : 2; }

// Magnitude comparison of the number read so far (complete) with bound magnitude B: -1, 0, 1.
int magnitude_cmp(const NS& s, unsigned lex, unsigned fc, const Decimal& B) {
  const size_t bl = B.int_digits.size();
  int ic = s.ilen < bl ? -1 : s.ilen > bl ? 1 : (lex == 0 ? 0 : lex == 1 ? -1 : 1);
  if (ic != 0) return ic;
  if (fc != 0) return fc == 1 ? -1 : 1;
  return s.flen < B.frac_digits.size() ? -1 : 0;  // the bound's remaining digits hold a nonzero one
}

// Signed comparison of value x with bound b.
int value_cmp(const NS& s, unsigned lex, unsigned fc, const Decimal& b) {
  const int sx = s.nonzero ? (s.neg ? -1 : 1) : 0;
  const int sb = b.is_zero() ? 0 : (b.neg ? -1 : 1);
  if (sx != sb) return sx < sb ? -1 : 1;
  if (sx == 0) return 0;
  const int m = magnitude_cmp(s, lex, fc, b);
  return sx > 0 ? m : -m;
}

}  // namespace

GrammarBuilder::Frag number(GrammarBuilder& b, const NumberSpec& spec) {
  const bool bounded = spec.lo || spec.hi;
  const int max_int = bounded ? 15 : 20, max_frac = 20, max_sig = 15;
  const bool allow_exp = !bounded && !spec.integer;
  const Decimal zero;
  const Decimal& lo = spec.lo ? *spec.lo : zero;
  const Decimal& hi = spec.hi ? *spec.hi : zero;
  auto int_digit = [&](NS s, char c) -> std::optional<uint64_t> {
    if (s.ilen + 1 > max_int) return std::nullopt;
    if (bounded && s.ilen + s.flen + 1 > max_sig) return std::nullopt;
    if (spec.lo && s.lex_lo == 0 && s.ilen < lo.int_digits.size()) s.lex_lo = cmp_digit(c, lo.int_digits[s.ilen]);
    if (spec.hi && s.lex_hi == 0 && s.ilen < hi.int_digits.size()) s.lex_hi = cmp_digit(c, hi.int_digits[s.ilen]);
    s.ilen++;
    s.nonzero = s.nonzero || c != '0';
    s.phase = (c == '0' && s.phase <= 1) ? 3 : 2;
    return s.pack();
  };
  auto frac_digit = [&](NS s, char c) -> std::optional<uint64_t> {
    if (s.flen + 1 > max_frac || (bounded && s.ilen + s.flen + 1 > max_sig)) return std::nullopt;
    auto fdig = [&](const Decimal& B) { return s.flen < B.frac_digits.size() ? B.frac_digits[s.flen] : '0'; };
    if (spec.lo && s.fc_lo == 0) s.fc_lo = cmp_digit(c, fdig(lo));
    if (spec.hi && s.fc_hi == 0) s.fc_hi = cmp_digit(c, fdig(hi));
    s.flen++;
    s.nonzero = s.nonzero || c != '0';
    s.phase = 5;
    return s.pack();
  };
  auto step = [&](uint64_t k, uint8_t c) -> std::optional<uint64_t> {
    NS s = NS::unpack(k);
    const bool digit = c >= '0' && c <= '9';
    switch (s.phase) {
      case 0:
        if (c == '-') {
          s.neg = 1, s.phase = 1;
          return s.pack();
        }
        [[fallthrough]];
      case 1:
        return digit ? int_digit(s, char(c)) : std::nullopt;
      case 2:
        if (digit) return int_digit(s, char(c));
        [[fallthrough]];
      case 3:
        if (c == '.' && !spec.integer) {
          s.phase = 4;
          if (!bounded) s.ilen = 0;  // only caps and bounds look back at it
          return s.pack();
        }
        if ((c == 'e' || c == 'E') && allow_exp) {
          s.phase = 6, s.ilen = 0;
          return s.pack();
        }
        return std::nullopt;
      case 4:
        return digit ? frac_digit(s, char(c)) : std::nullopt;
      case 5:
        if (digit) return frac_digit(s, char(c));
        if ((c == 'e' || c == 'E') && allow_exp) {
          s.phase = 6, s.ilen = 0, s.flen = 0;
          return s.pack();
        }
        return std::nullopt;
      case 6:
        if (c == '+' || c == '-') {
          s.phase = 7;
          return s.pack();
        }
        [[fallthrough]];
      case 7:
      case 8:
        if (!digit || s.elen >= 2) return std::nullopt;
        s.elen++, s.phase = 8;
        return s.pack();
    }
    return std::nullopt;
  };
  auto accept = [&](uint64_t k) {
    const NS s = NS::unpack(k);
    if (s.phase != 2 && s.phase != 3 && s.phase != 5 && s.phase != 8) return false;
    if (spec.lo) {
      const int c = value_cmp(s, s.lex_lo, s.fc_lo, lo);
      if (c < 0 || (c == 0 && spec.lo_exclusive)) return false;
    }
    if (spec.hi) {
      const int c = value_cmp(s, s.lex_hi, s.fc_hi, hi);
      if (c > 0 || (c == 0 && spec.hi_exclusive)) return false;
    }
    return true;
  };
  return emit_dfa(b, explore(NS{}.pack(), step, accept));
}

GrammarBuilder::Frag key_not_in(GrammarBuilder& b, const std::vector<std::string>& names, bool attribute) {
  // Trie of the names (raw bytes); node 0 is the root, FREE = left the trie.
  struct TNode {
    std::map<uint8_t, uint32_t> kids;
    bool end = false;
  };
  std::vector<TNode> trie(1);
  for (const std::string& n : names) {
    uint32_t t = 0;
    for (char c : n) {
      auto it = trie[t].kids.find(uint8_t(c));
      if (it == trie[t].kids.end()) {
        trie[t].kids[uint8_t(c)] = uint32_t(trie.size());
        t = uint32_t(trie.size());
        trie.emplace_back();
      } else {
        t = it->second;
      }
    }
    trie[t].end = true;
  }
  constexpr uint32_t kFree = 0xFFFFFF;
  // key: phase (2 bits: 0 before the quote, 1 inside, 2 after), utf8 state (3 bits), trie node (24 bits).
  auto pack = [](uint64_t phase, uint64_t u, uint64_t t) { return phase | u << 2 | t << 5; };
  auto step = [&](uint64_t k, uint8_t c) -> std::optional<uint64_t> {
    const uint64_t phase = k & 3, u = (k >> 2) & 7, t = k >> 5;
    if (phase == 0) return c == '"' ? std::optional<uint64_t>(pack(1, 0, 0)) : std::nullopt;
    if (phase != 1) return std::nullopt;
    if (c == '"') {
      if (u != 0 || (t != kFree && trie[t].end)) return std::nullopt;
      return pack(2, 0, 0);
    }
    if (c == '\\' || c < 0x20 || (attribute && c == '&')) return std::nullopt;
    const auto nu = utf8_next(int(u), c);
    if (!nu) return std::nullopt;
    uint64_t nt = kFree;
    if (t != kFree) {
      auto it = trie[t].kids.find(c);
      if (it != trie[t].kids.end()) nt = it->second;
    }
    return pack(1, uint64_t(*nu), nt);
  };
  if (trie.size() >= kFree) fail("too many property names");
  return emit_dfa(b, explore(pack(0, 0, 0), step, [](uint64_t k) { return (k & 3) == 2; }));
}

}  // namespace kestrel::structured::detail
