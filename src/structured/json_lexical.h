// Internal: the lexical pieces of JSON as grammar fragments — characters of strings (JSON-escaped or
// raw), numbers with optional bounds, object keys outside a set — and the helper that turns a small
// explicitly enumerated automaton (a step function over abstract states) into a fragment.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "structured/grammar.h"

namespace kestrel::structured::detail {

// A DFA given by its states and byte intervals; emit_dfa copies it into the builder.
struct ExplicitDfa {
  struct Edge {
    uint8_t lo, hi;
    uint32_t to;
  };
  struct State {
    std::vector<Edge> edges;
    bool accepting = false;
  };
  std::vector<State> states;  // state 0 is the start
};
GrammarBuilder::Frag emit_dfa(GrammarBuilder& b, const ExplicitDfa& d);

// How a string's characters are written: inside a JSON string literal (quotes, backslashes and
// control characters escaped; any valid escape accepted), or raw (a K3 string argument: the text
// itself, any valid UTF-8).
enum class StrMode { kJson, kRaw };

// One character (code point) of string content.
GrammarBuilder::Frag string_char(GrammarBuilder& b, StrMode mode);
// A JSON string value `"..."` whose content has min..max characters (max nullopt = unbounded).
GrammarBuilder::Frag quoted_string(GrammarBuilder& b, size_t min, std::optional<size_t> max);
// The exact text of a string in the given mode (a literal: JSON-escaped with quotes, or raw bytes).
std::string string_literal(const std::string& value, StrMode mode);

// A decimal bound, magnitude as digit strings: int_digits without leading zeros ("0" below 1),
// frac_digits without trailing zeros.
struct Decimal {
  bool neg = false;
  std::string int_digits = "0";
  std::string frac_digits;
  bool is_zero() const { return int_digits == "0" && frac_digits.empty(); }
};
// A JSON number as an exact decimal of its shortest round-trip form, rounded toward the inside of the
// interval (`up` for a lower bound) when it has more than 15 significant digits (see json_lexical.cpp).
// *rounded is set when digits were dropped (the bound is then inclusive of the rounded value).
Decimal decimal_of(const nlohmann::json& number, bool up, bool* rounded = nullptr);

struct NumberSpec {
  bool integer = false;
  std::optional<Decimal> lo, hi;
  bool lo_exclusive = false, hi_exclusive = false;
};
// Number text: -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)? with at most 20 integer and 20 fraction digits and
// a 2-digit exponent; integers have no fraction or exponent. With a bound: no exponent, at most 15
// significant digits, and the value within the bounds (exactly, as the validator compares doubles).
GrammarBuilder::Frag number(GrammarBuilder& b, const NumberSpec& spec);

// The content (no quotes) of a string in a `format`: date, time, date-time, uuid, ipv4, email,
// hostname, uri — ASCII without quotes or backslashes, so the same text in both modes. Other
// formats: kestrel::Error.
GrammarBuilder::Frag format_content(GrammarBuilder& b, const std::string& format);

// A quoted object key with no escapes whose content is none of `names` (raw UTF-8 property names).
// attribute: a K3 attribute value instead (`"` delimited, no '&' so no entity can spell a name).
GrammarBuilder::Frag key_not_in(GrammarBuilder& b, const std::vector<std::string>& names, bool attribute = false);

}  // namespace kestrel::structured::detail
