// Per-code-point character classes needed by the K3 pre-tokenizer (MODEL.md §7 pat_str).
//
// The data comes from ICU (general category, Script=Han, White_Space) — never from hand-made
// tables — and is cached once in a two-level lookup so the hot loop does one load per character.
// Rust's regex crate (used by tiktoken) resolves `\p{Han}` to the Script property (not
// Script_Extensions), `\s` to White_Space and `\p{L}`/`\p{N}`/`\p{M}` to general categories; the
// bits below mirror exactly those definitions.
#pragma once

#include <cstdint>

namespace kestrel::tok {

enum CharClass : uint16_t {
  kHan = 1 << 0,     // Script=Han
  kLetter = 1 << 1,  // \p{L}
  kNumber = 1 << 2,  // \p{N}
  kSpace = 1 << 3,   // \s = White_Space
  kCrLf = 1 << 4,    // \r or \n
  kUpper = 1 << 5,   // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
  kLower = 1 << 6,   // [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
  kPySpace = 1 << 7, // Python str.isspace(): the splitter of over-long runs uses it, not \s
};

// Class bits of cp (cp <= 0x10FFFF; larger values get 0).
uint16_t char_class(char32_t cp);

// The Unicode version of the property data in use (ICU's), e.g. "15.0".
const char* unicode_version();

}  // namespace kestrel::tok
