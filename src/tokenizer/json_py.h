// JSON text exactly as Python's json.dumps(..., ensure_ascii=False) writes it.
//
// The K3 prompt embeds JSON (tool declarations, schemas, tool-call argument values) that Moonshot's
// reference encoder produces with Python's json module, so the bytes must match: separators,
// string escaping (only '"', '\\' and control characters; non-ASCII kept) and float formatting
// (repr: shortest round-trip digits, exponent form below 1e-4 and from 1e16 on).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace kestrel::tok {

// compact: separators (",", ":"); otherwise Python's default (", ", ": "). Object keys are written
// in the order the value holds them (sort first where the format asks for sorted keys).
std::string py_json_dumps(const nlohmann::ordered_json& v, bool compact);

// Appends s as the inside of a JSON string literal (no quotes), Python-style escaping.
void py_json_escape_append(std::string& out, std::string_view s);

// Python repr() of a double (also used by json.dumps): "1.0", "1e-05", "1e+16", "NaN", "Infinity".
std::string py_float_repr(double v);

// Recursively sorts object keys (code-point order = UTF-8 byte order), like the reference's
// deep_sort_dict; arrays keep their order.
nlohmann::ordered_json deep_sort(const nlohmann::ordered_json& v);

}  // namespace kestrel::tok
