// Builds the character-class lookup from ICU once (about 1.1 M code points, tens of ms) and
// compresses it into 256-entry blocks shared between identical ranges (most planes are uniform).
#include "tokenizer/unicode_class.h"

#include <unicode/uchar.h>
#include <unicode/uscript.h>

#include <map>
#include <mutex>
#include <vector>

namespace kestrel::tok {
namespace {

uint16_t compute(UChar32 c) {
  uint16_t f = 0;
  UErrorCode err = U_ZERO_ERROR;
  const bool han = uscript_getScript(c, &err) == USCRIPT_HAN && U_SUCCESS(err);
  if (han) f |= kHan;
  const int8_t gc = u_charType(c);
  const bool lu_lt = gc == U_UPPERCASE_LETTER || gc == U_TITLECASE_LETTER;
  const bool ll = gc == U_LOWERCASE_LETTER;
  const bool lm_lo = gc == U_MODIFIER_LETTER || gc == U_OTHER_LETTER;
  const bool mark = gc == U_NON_SPACING_MARK || gc == U_ENCLOSING_MARK || gc == U_COMBINING_SPACING_MARK;
  if (lu_lt || ll || lm_lo) f |= kLetter;
  if (gc == U_DECIMAL_DIGIT_NUMBER || gc == U_LETTER_NUMBER || gc == U_OTHER_NUMBER) f |= kNumber;
  const bool ws = u_hasBinaryProperty(c, UCHAR_WHITE_SPACE);
  if (ws) f |= kSpace;
  if (c == '\r' || c == '\n') f |= kCrLf;
  if (!han && (lu_lt || lm_lo || mark)) f |= kUpper;
  if (!han && (ll || lm_lo || mark)) f |= kLower;
  // Python's isspace() = bidi class WS/B/S or category Zs. That is White_Space plus the four
  // ASCII information separators U+001C..U+001F (bidi B/S); ask ICU rather than list them.
  const int bidi = u_charDirection(c);
  if (ws || bidi == U_WHITE_SPACE_NEUTRAL || bidi == U_BLOCK_SEPARATOR || bidi == U_SEGMENT_SEPARATOR ||
      gc == U_SPACE_SEPARATOR)
    f |= kPySpace;
  return f;
}

struct Table {
  std::vector<uint16_t> index;   // block number for cp >> 8
  std::vector<uint16_t> blocks;  // 256 entries per block
};

const Table& table() {
  static Table t;
  static std::once_flag once;
  std::call_once(once, [] {
    std::map<std::vector<uint16_t>, uint16_t> seen;
    t.index.resize(0x110000 >> 8);
    std::vector<uint16_t> block(256);
    for (UChar32 hi = 0; hi < (0x110000 >> 8); ++hi) {
      for (int lo = 0; lo < 256; ++lo) block[lo] = compute((hi << 8) | lo);
      auto it = seen.find(block);
      if (it == seen.end()) {
        const auto id = static_cast<uint16_t>(seen.size());
        it = seen.emplace(block, id).first;
        t.blocks.insert(t.blocks.end(), block.begin(), block.end());
      }
      t.index[hi] = it->second;
    }
  });
  return t;
}

}  // namespace

uint16_t char_class(char32_t cp) {
  if (cp >= 0x110000) return 0;
  const Table& t = table();
  return t.blocks[(static_cast<size_t>(t.index[cp >> 8]) << 8) | (cp & 0xFF)];
}

const char* unicode_version() { return U_UNICODE_VERSION; }

}  // namespace kestrel::tok
