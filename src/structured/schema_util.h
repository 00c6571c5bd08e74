// JSON helpers that both JSON Schema users share: structured outputs' schema compiler
// (schema_normalize.cpp) and `kestrel eval`'s validator (evalclient/json_schema.cpp). Header-only
// templates over the nlohmann json type (json or ordered_json), so the validator uses them without
// linking the structured-outputs library.
#pragma once

#include <cstdint>
#include <string>

namespace kestrel::structured {

// A key as one JSON Pointer reference token (RFC 6901): '~' → "~0", '/' → "~1".
inline std::string escape_ptr(const std::string& key) {
  std::string out;
  for (char c : key) out += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
  return out;
}

// A JSON number as long double (64-bit mantissa: every int64, uint64 and double is exact).
template <class Json>
long double as_ld(const Json& v) {
  if (v.is_number_unsigned()) return static_cast<long double>(v.template get<uint64_t>());
  if (v.is_number_integer()) return static_cast<long double>(v.template get<int64_t>());
  return static_cast<long double>(v.template get<double>());
}

// Exact comparison of two JSON numbers (−1, 0, 1): integers as integers, otherwise as long double.
template <class Json>
int compare_numbers(const Json& a, const Json& b) {
  if (a.is_number_integer() && b.is_number_integer()) {
    const __int128 x = a.is_number_unsigned() ? __int128(a.template get<uint64_t>()) : __int128(a.template get<int64_t>());
    const __int128 y = b.is_number_unsigned() ? __int128(b.template get<uint64_t>()) : __int128(b.template get<int64_t>());
    return x < y ? -1 : x > y ? 1 : 0;
  }
  const long double x = as_ld(a), y = as_ld(b);
  return x < y ? -1 : x > y ? 1 : 0;
}

// JSON equality as JSON Schema defines it: numbers by value (1 == 1.0), recursively.
template <class Json>
bool json_equal(const Json& a, const Json& b) {
  if (a.is_number() && b.is_number()) return compare_numbers(a, b) == 0;
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!json_equal(a[i], b[i])) return false;
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (auto it = a.begin(); it != a.end(); ++it) {
      const auto jt = b.find(it.key());
      if (jt == b.end() || !json_equal(*it, *jt)) return false;
    }
    return true;
  }
  return a == b;
}

}  // namespace kestrel::structured
