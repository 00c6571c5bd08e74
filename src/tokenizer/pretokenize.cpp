// Hand-written matcher for the K3 pat_str. Text is first decoded into per-code-point class bits
// and byte offsets; every alternative is then a few scans over those arrays. Comments on each
// alternative explain how the regex's backtracking order reduces to these scans, which is where
// exactness against tiktoken lives.
#include "tokenizer/pretokenize.h"

#include <cstdint>

#include "tokenizer/unicode_class.h"
#include "tokenizer/utf8.h"

namespace kestrel::tok {

const char* const kK3PatStr =
    "[\\p{Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

namespace {

struct Decoded {
  std::vector<uint16_t> cls;  // class bits per code point
  std::vector<uint32_t> off;  // byte offset per code point, plus the end offset
};

void decode(std::string_view text, Decoded& d) {
  d.cls.clear();
  d.off.clear();
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    d.off.push_back(static_cast<uint32_t>(i));
    if (p[i] < 0x80) {
      d.cls.push_back(char_class(p[i]));
      ++i;
      continue;
    }
    Utf8Step st = utf8_step(p + i, n - i);
    d.cls.push_back(char_class(st.cp));  // invalid input cannot reach here (sanitized), but stays safe
    i += st.len;
  }
  d.off.push_back(static_cast<uint32_t>(n));
}

inline bool is_p1(uint16_t c) { return !(c & (kCrLf | kLetter | kNumber)); }  // [^\r\n\p{L}\p{N}]
inline bool is_p2(uint16_t c) { return !(c & (kSpace | kLetter | kNumber)); }  // [^\s\p{L}\p{N}]

class Matcher {
 public:
  Matcher(std::string_view text, const Decoded& d) : t_(text), cls_(d.cls), off_(d.off), n_(d.cls.size()) {}

  // End (code-point index) of the match starting at i.
  size_t match(size_t i) const {
    const uint16_t c = cls_[i];

    // [\p{Han}]+ : nothing follows the greedy run, so the run is maximal.
    if (c & kHan) return run(i, kHan);

    // P1? U* W+ C?  (U = upper-ish class, W = lower-ish class; they overlap on Lm/Lo/M).
    // Backtracking order: P1 taken (if possible) before not; U* longest first. Whatever follows
    // W+ cannot fail, so the first U* length whose next character is in W wins, and W+ is then the
    // maximal W-run from there. Scanning j downward from the end of the U-run finds that length.
    for (int take = is_p1(c) ? 1 : 0; take >= 0; --take) {
      const size_t s = i + take;
      const size_t e = run(s, kUpper);
      for (size_t j = e;; --j) {
        if (j < n_ && (cls_[j] & kLower)) return contraction(run(j, kLower));
        if (j == s) break;
      }
    }

    // P1? U+ W* C? : once U+ has one character the rest cannot fail, so only P1 backtracks.
    for (int take = is_p1(c) ? 1 : 0; take >= 0; --take) {
      const size_t s = i + take;
      const size_t e = run(s, kUpper);
      if (e > s) return contraction(run(e, kLower));
    }

    // \p{N}{1,3}
    if (c & kNumber) {
      size_t j = i + 1;
      while (j < n_ && j < i + 3 && (cls_[j] & kNumber)) ++j;
      return j;
    }

    //  ?[^\s\p{L}\p{N}]+[\r\n]* : the optional space is a literal U+0020 (itself \s, so never P2).
    {
      size_t s = SIZE_MAX;
      if (t_[off_[i]] == ' ' && i + 1 < n_ && is_p2(cls_[i + 1]))
        s = i + 1;
      else if (is_p2(c))
        s = i;
      if (s != SIZE_MAX) {
        size_t j = s;
        while (j < n_ && is_p2(cls_[j])) ++j;
        return run(j, kCrLf);
      }
    }

    if (c & kSpace) {
      const size_t e = run(i, kSpace);
      // \s*[\r\n]+ : \s* gives back characters until one is CR/LF; that CR/LF is the last one in
      // the run (a later one would have been found first), so the match ends right after it.
      for (size_t j = e; j > i; --j)
        if (cls_[j - 1] & kCrLf) return j;
      // \s+(?!\S) : at the end of text the whole run matches; otherwise the run minus its last
      // character (which is followed by whitespace), if that leaves at least one.
      if (e == n_) return e;
      if (e - 1 > i) return e - 1;
      // \s+
      return e;
    }
    // Every character is Han, a letter, a number, whitespace or [^\s\p{L}\p{N}], so one of the
    // alternatives above matched. Kept total anyway: a lone character becomes its own piece.
    return i + 1;
  }

 private:
  size_t run(size_t j, uint16_t bits) const {
    while (j < n_ && (cls_[j] & bits)) ++j;
    return j;
  }

  unsigned char byte_at(size_t cp_index) const { return static_cast<unsigned char>(t_[off_[cp_index]]); }

  // (?i:'s|'t|'re|'ve|'m|'ll|'d)? at code point f. Case-insensitive matching uses simple case
  // folding, under which 's' also matches U+017F LATIN SMALL LETTER LONG S; the other letters of
  // these contractions have no non-ASCII fold partners.
  size_t contraction(size_t f) const {
    if (f + 1 >= n_ || byte_at(f) != '\'') return f;
    const size_t a = f + 1;
    const unsigned char c1 = byte_at(a);
    const unsigned char l1 = (c1 >= 'A' && c1 <= 'Z') ? c1 + 32 : c1;
    if (l1 == 's' || l1 == 't' || l1 == 'm' || l1 == 'd') return f + 2;
    if (c1 == 0xC5 && off_[a + 1] - off_[a] == 2 && static_cast<unsigned char>(t_[off_[a] + 1]) == 0xBF)
      return f + 2;  // U+017F
    if (a + 1 < n_) {
      const unsigned char c2 = byte_at(a + 1);
      const unsigned char l2 = (c2 >= 'A' && c2 <= 'Z') ? c2 + 32 : c2;
      if ((l1 == 'r' && l2 == 'e') || (l1 == 'v' && l2 == 'e') || (l1 == 'l' && l2 == 'l')) return f + 3;
    }
    return f;
  }

  std::string_view t_;
  const std::vector<uint16_t>& cls_;
  const std::vector<uint32_t>& off_;
  size_t n_;
};

}  // namespace

void pretokenize(std::string_view text, const std::function<void(std::string_view)>& on_piece) {
  thread_local Decoded d;
  decode(text, d);
  Matcher m(text, d);
  const size_t n = d.cls.size();
  size_t i = 0;
  while (i < n) {
    const size_t j = m.match(i);
    on_piece(text.substr(d.off[i], d.off[j] - d.off[i]));
    i = j;
  }
}

std::vector<std::string> pretokenize(std::string_view text) {
  std::vector<std::string> out;
  pretokenize(text, [&](std::string_view p) { out.emplace_back(p); });
  return out;
}

}  // namespace kestrel::tok
