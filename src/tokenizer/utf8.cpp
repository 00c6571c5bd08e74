// UTF-8 stepping per Unicode Table 3-7 (well-formed byte sequences); see utf8.h for the rules.
#include "tokenizer/utf8.h"

#include <cstring>

namespace kestrel::tok {

Utf8Step utf8_step(const unsigned char* p, size_t n) {
  const unsigned b0 = p[0];
  if (b0 < 0x80) return {b0, 1, true, false};
  unsigned need;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  char32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return {0xFFFD, 1, false, false};
  }
  // The maximal subpart is the lead byte plus every continuation byte that still fits a valid
  // prefix; one U+FFFD replaces all of it.
  for (unsigned i = 1; i <= need; ++i) {
    if (i >= n) return {0xFFFD, static_cast<uint32_t>(i), false, true};
    const unsigned b = p[i];
    const unsigned l = (i == 1) ? lo : 0x80u, h = (i == 1) ? hi : 0xBFu;
    if (b < l || b > h) return {0xFFFD, static_cast<uint32_t>(i), false, false};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {cp, need + 1, true, false};
}

bool utf8_is_valid(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    if (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    Utf8Step st = utf8_step(p + i, n - i);
    if (!st.valid) return false;
    i += st.len;
  }
  return true;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_sanitize(std::string_view s) {
  if (utf8_is_valid(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 16);
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    Utf8Step st = utf8_step(p + i, n - i);
    if (st.valid)
      out.append(s.substr(i, st.len));
    else
      out.append("\xEF\xBF\xBD");
    i += st.len;
  }
  return out;
}

std::string Utf8Stream::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(pending_.data());
  size_t n = pending_.size(), i = 0;
  while (i < n) {
    Utf8Step st = utf8_step(p + i, n - i);
    if (st.truncated) break;  // may still complete: hold back
    if (st.valid)
      out.append(pending_, i, st.len);
    else
      out.append("\xEF\xBF\xBD");
    i += st.len;
  }
  pending_.erase(0, i);
  return out;
}

std::string Utf8Stream::finish() {
  std::string out = pending_.empty() ? std::string() : std::string("\xEF\xBF\xBD");
  pending_.clear();
  return out;
}

}  // namespace kestrel::tok
