// UTF-8 decoding with the replacement rules every text path of the tokenizer shares.
//
// Invalid input is never an error: each maximal ill-formed subpart (Unicode §3.9, "U+FFFD
// substitution of maximal subparts", the rule Python's bytes.decode(errors="replace") uses) becomes
// one U+FFFD. Encoding raw bytes therefore equals tiktoken encoding of the Python-decoded string,
// and decoding ids equals tiktoken's decode(), which also replaces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kestrel::tok {

// Result of reading one sequence at the front of a buffer.
struct Utf8Step {
  char32_t cp;      // decoded code point, or U+FFFD when !valid
  uint32_t len;     // bytes consumed (>= 1 whenever the buffer is non-empty)
  bool valid;       // a well-formed sequence was read
  bool truncated;   // ill-formed only because the buffer ended inside a valid prefix
};

// Reads one sequence from [p, p+n); n must be > 0.
Utf8Step utf8_step(const unsigned char* p, size_t n);

// True when s is well-formed UTF-8 (fast path: ASCII runs are skipped 8 bytes at a time).
bool utf8_is_valid(std::string_view s);

// s with every maximal ill-formed subpart replaced by U+FFFD (EF BF BD).
std::string utf8_sanitize(std::string_view s);

// Appends the UTF-8 encoding of cp (cp must be a scalar value).
void utf8_append(std::string& out, char32_t cp);

// Incremental validator for streamed bytes: emits the longest prefix that can no longer change,
// holding back a trailing incomplete sequence until more bytes or finish() arrive. The concatenation
// of all outputs equals utf8_sanitize of the concatenated input.
class Utf8Stream {
 public:
  // Appends bytes and returns the newly completed text (possibly empty).
  std::string push(std::string_view bytes);
  // Ends the stream: a held-back incomplete sequence becomes U+FFFD.
  std::string finish();
  // Bytes currently held back (0..3).
  size_t pending() const { return pending_.size(); }

 private:
  std::string pending_;
};

}  // namespace kestrel::tok
