// Internal: small JSON helpers shared by the schema compiler's two halves.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace kestrel::structured::detail {

inline std::string escape_ptr(const std::string& key) {
  std::string out;
  for (char c : key) out += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
  return out;
}

inline long double as_ld(const nlohmann::ordered_json& v) {
  if (v.is_number_unsigned()) return static_cast<long double>(v.get<uint64_t>());
  if (v.is_number_integer()) return static_cast<long double>(v.get<int64_t>());
  return static_cast<long double>(v.get<double>());
}

// JSON equality as JSON Schema defines it: numbers by value (1 == 1.0), recursively.
inline bool json_equal(const nlohmann::ordered_json& a, const nlohmann::ordered_json& b) {
  if (a.is_number() && b.is_number()) return as_ld(a) == as_ld(b);
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

}  // namespace kestrel::structured::detail
