// JSON Schema validation over nlohmann::json: see json_schema.h for the supported subset.
//
// The schema stays a json tree; construction walks it once (check) so that validation never meets a
// malformed keyword, and compiles every pattern into a cache keyed by its source. Validation
// (validate_node) walks schema and instance together; `why` is null inside anyOf/oneOf/not/contains/
// if, whose branch failures are expected and need no message. Both walks are limited in depth and in the
// stack bytes they use (StackGuard), so a deeply nested schema or instance, or a $ref cycle that consumes no
// instance ({"$ref": "#"}), ends with an error instead of exhausting the stack. The byte limit is what holds
// under AddressSanitizer, whose redzones make a frame of val() ~33 KB: 512 nested applications overflowed an
// 8 MiB stack there (fuzz_json_schema, session 21); a normal build meets the count limit first.
#include "evalclient/json_schema.h"

#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <regex>
#include <set>

#include "core/check.h"
#include "structured/schema_util.h"
#include "tokenizer/utf8.h"

namespace kestrel::eval {

using json = nlohmann::json;
using structured::compare_numbers;
using structured::escape_ptr;
using structured::json_equal;

namespace {

constexpr int kMaxSchemaDepth = 256;    // nesting of subschemas when checking
constexpr int kMaxValidateDepth = 512;  // schema applications on one path when validating
constexpr size_t kMaxStackBytes = size_t(2) << 20;  // stack one check or validation may use

// The frame where this thread's outermost check or validation began (0 outside one): StackGuard sets it
// in the outermost entry point and clears it when that returns.
thread_local uintptr_t t_stack_base = 0;
struct StackGuard {
  const bool outer = t_stack_base == 0;
  StackGuard() { if (outer) t_stack_base = reinterpret_cast<uintptr_t>(__builtin_frame_address(0)); }
  ~StackGuard() { if (outer) t_stack_base = 0; }
};
// Bytes of stack between the outermost entry point and the caller (either direction of growth).
[[gnu::noinline]] size_t stack_used() {
  const auto here = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  return t_stack_base == 0 ? 0 : here < t_stack_base ? t_stack_base - here : here - t_stack_base;
}

const std::set<std::string> kAnnotations = {
    "$schema", "$comment", "title", "description", "default", "examples", "deprecated", "readOnly",
    "writeOnly", "format", "contentMediaType", "contentEncoding", "contentSchema"};

const std::set<std::string> kTypeNames = {"null", "boolean", "object", "array", "number", "integer", "string"};

std::u32string to_u32(const std::string& s) {
  std::u32string out;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    const tok::Utf8Step st = tok::utf8_step(p + i, s.size() - i);
    out.push_back(st.cp);
    i += st.len;
  }
  return out;
}

std::wstring to_wide(const std::string& s) {
  static_assert(sizeof(wchar_t) == 4, "UTF-32 wide strings are assumed (Linux)");
  const std::u32string u = to_u32(s);
  return std::wstring(u.begin(), u.end());
}

size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool is_integer_value(const json& x) {
  if (x.is_number_integer()) return true;
  if (!x.is_number_float()) return false;
  const double d = x.get<double>();
  return std::isfinite(d) && std::floor(d) == d;
}

bool has_type(const json& x, const std::string& t) {
  if (t == "null") return x.is_null();
  if (t == "boolean") return x.is_boolean();
  if (t == "object") return x.is_object();
  if (t == "array") return x.is_array();
  if (t == "number") return x.is_number();
  if (t == "integer") return is_integer_value(x);
  return x.is_string();
}

bool is_multiple_of(const json& x, const json& m) {
  if (x.is_number_integer() && m.is_number_integer()) {
    const __int128 a = x.is_number_unsigned() ? __int128(x.get<uint64_t>()) : __int128(x.get<int64_t>());
    const __int128 b = m.is_number_unsigned() ? __int128(m.get<uint64_t>()) : __int128(m.get<int64_t>());
    return a % b == 0;
  }
  const double q = x.get<double>() / m.get<double>();
  if (!std::isfinite(q)) return false;
  return std::fabs(q - std::round(q)) <= 1e-9 * std::max(1.0, std::fabs(q));
}

std::string percent_decode(const std::string& s, const std::string& ref) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    auto hex = [&](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    if (i + 2 >= s.size() || hex(s[i + 1]) < 0 || hex(s[i + 2]) < 0)
      fail("$ref '{}': bad %-escape", ref);
    out += char(hex(s[i + 1]) * 16 + hex(s[i + 2]));
    i += 2;
  }
  return out;
}

std::string show(const json& x) {
  std::string s = x.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

}  // namespace

struct JsonSchema::Impl {
  json root;
  SchemaOptions opt;
  std::map<std::string, std::wregex> regexes;  // pattern source -> compiled
  std::map<std::string, const json*> refs;     // $ref string -> target inside root
  std::map<std::string, std::string> ref_at;   // $ref string -> where it first appears
  std::vector<std::pair<std::string, std::string>> unknown;  // (location, keyword) not understood

  const json* resolve(const std::string& ref) const {
    if (ref.empty() || ref[0] != '#')
      fail("$ref '{}': only references inside the same document ('#...') are supported", ref);
    const std::string frag = percent_decode(ref.substr(1), ref);
    if (frag.empty()) return &root;
    if (frag[0] != '/') fail("$ref '{}': anchors are not supported, only JSON pointers", ref);
    const json* cur = &root;
    size_t pos = 1;
    for (;;) {
      const size_t slash = frag.find('/', pos);
      std::string tok = frag.substr(pos, slash == std::string::npos ? std::string::npos : slash - pos);
      std::string key;
      for (size_t i = 0; i < tok.size(); ++i) {
        if (tok[i] == '~' && i + 1 < tok.size() && (tok[i + 1] == '0' || tok[i + 1] == '1')) {
          key += tok[i + 1] == '0' ? '~' : '/';
          ++i;
        } else if (tok[i] == '~') {
          fail("$ref '{}': bad '~' escape", ref);
        } else {
          key += tok[i];
        }
      }
      if (cur->is_object()) {
        const auto it = cur->find(key);
        if (it == cur->end()) fail("$ref '{}' does not resolve (no '{}')", ref, key);
        cur = &*it;
      } else if (cur->is_array()) {
        if (key.empty() || key.size() > 9 || key.find_first_not_of("0123456789") != std::string::npos ||
            std::stoul(key) >= cur->size())
          fail("$ref '{}' does not resolve (no index '{}')", ref, key);
        cur = &(*cur)[std::stoul(key)];
      } else {
        fail("$ref '{}' does not resolve", ref);
      }
      if (slash == std::string::npos) break;
      pos = slash + 1;
    }
    if (!cur->is_object() && !cur->is_boolean()) fail("$ref '{}' points at something that is not a schema", ref);
    return cur;
  }

  void check_schema_map(const json& v, const std::string& path, int depth) {
    if (!v.is_object()) fail("schema {}: must be an object of schemas", path);
    for (auto it = v.begin(); it != v.end(); ++it) check(*it, path + "/" + escape_ptr(it.key()), depth + 1);
  }
  void check_schema_array(const json& v, const std::string& path, int depth, bool allow_empty = false) {
    if (!v.is_array() || (!allow_empty && v.empty())) fail("schema {}: must be a non-empty array of schemas", path);
    for (size_t i = 0; i < v.size(); ++i) check(v[i], fmt::format("{}/{}", path, i), depth + 1);
  }
  static void check_count(const json& v, const std::string& path) {
    if (!is_integer_value(v) || compare_numbers(v, json(0)) < 0)
      fail("schema {}: must be a non-negative integer (got {})", path, show(v));
  }
  static void check_string_array(const json& v, const std::string& path) {
    if (!v.is_array()) fail("schema {}: must be an array of strings", path);
    for (const auto& s : v)
      if (!s.is_string()) fail("schema {}: must be an array of strings (got {})", path, show(s));
  }
  void add_regex(const std::string& src, const std::string& path) {
    if (!opt.allow_patterns) fail("schema {}: patterns are disabled", path);
    if (regexes.count(src)) return;
    try {
      regexes.emplace(src, std::wregex(to_wide(src), std::regex::ECMAScript));
    } catch (const std::regex_error& e) {
      fail("schema {}: pattern '{}' does not compile: {}", path, src, e.what());
    }
  }

  void check(const json& s, const std::string& path, int depth, bool is_root = false) {
    const std::string at = path.empty() ? "(root)" : path;
    if (depth > kMaxSchemaDepth) fail("schema {}: nested deeper than {} levels", at, kMaxSchemaDepth);
    if (stack_used() > kMaxStackBytes) fail("schema {}: nested too deeply (more than {} KiB of stack)", at, kMaxStackBytes >> 10);
    if (s.is_boolean()) return;
    if (!s.is_object()) fail("schema {}: a schema must be an object or a boolean (got {})", at, show(s));
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string& k = it.key();
      const json& v = *it;
      const std::string p = path + "/" + escape_ptr(k);
      if (kAnnotations.count(k)) continue;
      if (k == "$id") {
        if (!is_root) fail("schema {}: '$id' below the root is not supported (it would change how $ref resolves)", p);
        if (!v.is_string()) fail("schema {}: must be a string", p);
      } else if (k == "type") {
        auto one = [&](const json& t) {
          if (!t.is_string() || !kTypeNames.count(t.get<std::string>()))
            fail("schema {}: unknown type {}", p, show(t));
        };
        if (v.is_array()) {
          if (v.empty()) fail("schema {}: an empty array of types", p);
          for (const auto& t : v) one(t);
        } else {
          one(v);
        }
      } else if (k == "enum") {
        if (!v.is_array()) fail("schema {}: must be an array", p);
      } else if (k == "const") {
      } else if (k == "properties" || k == "patternProperties" || k == "$defs" || k == "definitions" ||
                 k == "dependentSchemas") {
        check_schema_map(v, p, depth);
        if (k == "patternProperties")
          for (auto jt = v.begin(); jt != v.end(); ++jt) add_regex(jt.key(), p);
      } else if (k == "additionalProperties" || k == "propertyNames" || k == "additionalItems" || k == "contains" ||
                 k == "not" || k == "if" || k == "then" || k == "else") {
        check(v, p, depth + 1);
      } else if (k == "items") {
        if (v.is_array()) {
          if (s.contains("prefixItems")) fail("schema {}: an array 'items' together with 'prefixItems'", p);
          check_schema_array(v, p, depth, true);
        } else {
          check(v, p, depth + 1);
        }
      } else if (k == "prefixItems") {
        check_schema_array(v, p, depth);
      } else if (k == "allOf" || k == "anyOf" || k == "oneOf") {
        check_schema_array(v, p, depth);
      } else if (k == "required") {
        check_string_array(v, p);
      } else if (k == "dependentRequired") {
        if (!v.is_object()) fail("schema {}: must be an object", p);
        for (auto jt = v.begin(); jt != v.end(); ++jt) check_string_array(*jt, p + "/" + escape_ptr(jt.key()));
      } else if (k == "dependencies") {
        if (!v.is_object()) fail("schema {}: must be an object", p);
        for (auto jt = v.begin(); jt != v.end(); ++jt) {
          const std::string q = p + "/" + escape_ptr(jt.key());
          if (jt->is_array())
            check_string_array(*jt, q);
          else
            check(*jt, q, depth + 1);
        }
      } else if (k == "minProperties" || k == "maxProperties" || k == "minItems" || k == "maxItems" ||
                 k == "minLength" || k == "maxLength" || k == "minContains" || k == "maxContains") {
        check_count(v, p);
      } else if (k == "uniqueItems") {
        if (!v.is_boolean()) fail("schema {}: must be a boolean", p);
      } else if (k == "minimum" || k == "maximum") {
        if (!v.is_number()) fail("schema {}: must be a number", p);
      } else if (k == "exclusiveMinimum" || k == "exclusiveMaximum") {
        if (v.is_boolean()) fail("schema {}: the draft-04 boolean form is not supported (use a number)", p);
        if (!v.is_number()) fail("schema {}: must be a number", p);
      } else if (k == "multipleOf") {
        if (!v.is_number() || compare_numbers(v, json(0)) <= 0) fail("schema {}: must be a positive number", p);
      } else if (k == "pattern") {
        if (!v.is_string()) fail("schema {}: must be a string", p);
        add_regex(v.get<std::string>(), p);
      } else if (k == "$ref") {
        if (!v.is_string()) fail("schema {}: must be a string", p);
        refs.emplace(v.get<std::string>(), nullptr);
        ref_at.emplace(v.get<std::string>(), p);
      } else {
        // Refused unless a $ref points into it (a container of subschemas under a name of its own,
        // as the test suite's "escaped pointer ref" has): decided once every $ref is known.
        unknown.emplace_back(p, k);
      }
    }
  }

  bool no(std::string* why, const std::string& ip, const std::string& sp, const std::string& msg) const {
    if (why) *why = fmt::format("{}: {} (schema {})", ip.empty() ? "(root)" : ip, msg, sp.empty() ? "(root)" : sp);
    return false;
  }

  bool match(const std::string& pattern, const std::string& s, std::string* reason) const {
    const std::wstring w = to_wide(s);
    if (w.size() > opt.max_pattern_input) {
      *reason = fmt::format("a string of {} characters is too long to match against a pattern (limit {})", w.size(),
                            opt.max_pattern_input);
      return false;
    }
    try {
      if (std::regex_search(w, regexes.at(pattern))) return true;
      *reason = fmt::format("{} does not match pattern '{}'", show(json(s)), pattern);
    } catch (const std::regex_error& e) {
      *reason = fmt::format("pattern '{}' failed to run: {}", pattern, e.what());
    }
    return false;
  }

  // Whether x is valid against s. ip/sp: instance and schema locations for the message.
  bool val(const json& s, const json& x, const std::string& ip, const std::string& sp, int depth,
           std::string* why) const {
    if (depth > kMaxValidateDepth)
      return no(why, ip, sp, fmt::format("schema applications nested deeper than {} ($ref cycle?)", kMaxValidateDepth));
    if (stack_used() > kMaxStackBytes)
      return no(why, ip, sp, fmt::format("schema applications nested too deeply (more than {} KiB of stack; $ref cycle?)",
                                         kMaxStackBytes >> 10));
    if (s.is_boolean()) return s.get<bool>() || no(why, ip, sp, "the schema 'false' admits nothing");
    auto kw = [&](const char* k) -> const json* {
      const auto it = s.find(k);
      return it == s.end() ? nullptr : &*it;
    };
    auto sub = [&](const char* k) { return sp + "/" + k; };

    if (const json* r = kw("$ref")) {
      if (!val(*refs.at(r->get<std::string>()), x, ip, sub("$ref"), depth + 1, why)) return false;
    }
    if (const json* t = kw("type")) {
      bool ok = false;
      if (t->is_string()) {
        ok = has_type(x, t->get<std::string>());
      } else {
        for (const auto& n : *t) ok = ok || has_type(x, n.get<std::string>());
      }
      if (!ok) return no(why, ip, sub("type"), fmt::format("{} is not of type {}", show(x), show(*t)));
    }
    if (const json* e = kw("enum")) {
      bool ok = false;
      for (const auto& v : *e) ok = ok || json_equal(v, x);
      if (!ok) return no(why, ip, sub("enum"), fmt::format("{} is not one of {}", show(x), show(*e)));
    }
    if (const json* c = kw("const")) {
      if (!json_equal(*c, x)) return no(why, ip, sub("const"), fmt::format("{} is not {}", show(x), show(*c)));
    }

    if (x.is_number()) {
      if (const json* v = kw("minimum"); v && compare_numbers(x, *v) < 0)
        return no(why, ip, sub("minimum"), fmt::format("{} is less than {}", show(x), show(*v)));
      if (const json* v = kw("maximum"); v && compare_numbers(x, *v) > 0)
        return no(why, ip, sub("maximum"), fmt::format("{} is greater than {}", show(x), show(*v)));
      if (const json* v = kw("exclusiveMinimum"); v && compare_numbers(x, *v) <= 0)
        return no(why, ip, sub("exclusiveMinimum"), fmt::format("{} is not greater than {}", show(x), show(*v)));
      if (const json* v = kw("exclusiveMaximum"); v && compare_numbers(x, *v) >= 0)
        return no(why, ip, sub("exclusiveMaximum"), fmt::format("{} is not less than {}", show(x), show(*v)));
      if (const json* v = kw("multipleOf"); v && !is_multiple_of(x, *v))
        return no(why, ip, sub("multipleOf"), fmt::format("{} is not a multiple of {}", show(x), show(*v)));
    }

    if (x.is_string()) {
      const std::string& str = x.get_ref<const std::string&>();
      if (const json* v = kw("minLength"); v && compare_numbers(json(code_points(str)), *v) < 0)
        return no(why, ip, sub("minLength"), fmt::format("{} is shorter than {} characters", show(x), show(*v)));
      if (const json* v = kw("maxLength"); v && compare_numbers(json(code_points(str)), *v) > 0)
        return no(why, ip, sub("maxLength"), fmt::format("{} is longer than {} characters", show(x), show(*v)));
      if (const json* v = kw("pattern")) {
        std::string reason;
        if (!match(v->get<std::string>(), str, &reason)) return no(why, ip, sub("pattern"), reason);
      }
    }

    if (x.is_array() && !validate_array(s, x, ip, sp, depth, why)) return false;
    if (x.is_object() && !validate_object(s, x, ip, sp, depth, why)) return false;

    if (const json* v = kw("allOf")) {
      for (size_t i = 0; i < v->size(); ++i)
        if (!val((*v)[i], x, ip, fmt::format("{}/{}", sub("allOf"), i), depth + 1, why)) return false;
    }
    if (const json* v = kw("anyOf")) {
      bool ok = false;
      for (size_t i = 0; i < v->size() && !ok; ++i) ok = val((*v)[i], x, ip, sp, depth + 1, nullptr);
      if (!ok) return no(why, ip, sub("anyOf"), fmt::format("{} matches none of the alternatives", show(x)));
    }
    if (const json* v = kw("oneOf")) {
      int n = 0;
      for (size_t i = 0; i < v->size() && n < 2; ++i) n += val((*v)[i], x, ip, sp, depth + 1, nullptr);
      if (n != 1)
        return no(why, ip, sub("oneOf"),
                  fmt::format("{} matches {} of the alternatives, not exactly one", show(x), n == 0 ? "none" : "several"));
    }
    if (const json* v = kw("not")) {
      if (val(*v, x, ip, sp, depth + 1, nullptr))
        return no(why, ip, sub("not"), fmt::format("{} matches the schema it must not match", show(x)));
    }
    if (const json* v = kw("if")) {
      const bool cond = val(*v, x, ip, sp, depth + 1, nullptr);
      const char* branch = cond ? "then" : "else";
      if (const json* b = kw(branch); b && !val(*b, x, ip, sub(branch), depth + 1, why)) return false;
    }
    return true;
  }

  bool validate_array(const json& s, const json& x, const std::string& ip, const std::string& sp, int depth,
                      std::string* why) const {
    auto kw = [&](const char* k) -> const json* {
      const auto it = s.find(k);
      return it == s.end() ? nullptr : &*it;
    };
    const size_t n = x.size();
    if (const json* v = kw("minItems"); v && compare_numbers(json(n), *v) < 0)
      return no(why, ip, sp + "/minItems", fmt::format("{} items, fewer than {}", n, show(*v)));
    if (const json* v = kw("maxItems"); v && compare_numbers(json(n), *v) > 0)
      return no(why, ip, sp + "/maxItems", fmt::format("{} items, more than {}", n, show(*v)));
    if (const json* v = kw("uniqueItems"); v && v->get<bool>()) {
      for (size_t i = 0; i < n; ++i)
        for (size_t j = i + 1; j < n; ++j)
          if (json_equal(x[i], x[j]))
            return no(why, ip, sp + "/uniqueItems", fmt::format("items {} and {} are equal", i, j));
    }
    // Positional schemas first (prefixItems, or draft-07's array form of items), then one schema for
    // the rest (items, or draft-07's additionalItems after an array form).
    const json* positional = kw("prefixItems");
    const char* pos_name = "prefixItems";
    const json* rest = kw("items");
    const char* rest_name = "items";
    if (rest && rest->is_array()) {
      positional = rest, pos_name = "items";
      rest = kw("additionalItems"), rest_name = "additionalItems";
    }
    size_t first_rest = 0;
    if (positional) {
      first_rest = std::min(n, positional->size());
      for (size_t i = 0; i < first_rest; ++i)
        if (!val((*positional)[i], x[i], fmt::format("{}/{}", ip, i), fmt::format("{}/{}/{}", sp, pos_name, i),
                 depth + 1, why))
          return false;
    }
    if (rest) {
      for (size_t i = first_rest; i < n; ++i)
        if (!val(*rest, x[i], fmt::format("{}/{}", ip, i), sp + "/" + rest_name, depth + 1, why)) return false;
    }
    if (const json* c = kw("contains")) {
      size_t hits = 0;
      for (size_t i = 0; i < n; ++i) hits += val(*c, x[i], ip, sp, depth + 1, nullptr);
      const json* mn = kw("minContains");
      const json* mx = kw("maxContains");
      if (mn ? compare_numbers(json(hits), *mn) < 0 : hits == 0)
        return no(why, ip, sp + "/contains",
                  fmt::format("{} items match 'contains', fewer than {}", hits, mn ? show(*mn) : "1"));
      if (mx && compare_numbers(json(hits), *mx) > 0)
        return no(why, ip, sp + "/maxContains", fmt::format("{} items match 'contains', more than {}", hits, show(*mx)));
    }
    return true;
  }

  bool validate_object(const json& s, const json& x, const std::string& ip, const std::string& sp, int depth,
                       std::string* why) const {
    auto kw = [&](const char* k) -> const json* {
      const auto it = s.find(k);
      return it == s.end() ? nullptr : &*it;
    };
    if (const json* v = kw("minProperties"); v && compare_numbers(json(x.size()), *v) < 0)
      return no(why, ip, sp + "/minProperties", fmt::format("{} properties, fewer than {}", x.size(), show(*v)));
    if (const json* v = kw("maxProperties"); v && compare_numbers(json(x.size()), *v) > 0)
      return no(why, ip, sp + "/maxProperties", fmt::format("{} properties, more than {}", x.size(), show(*v)));
    if (const json* v = kw("required")) {
      for (const auto& r : *v)
        if (!x.contains(r.get<std::string>()))
          return no(why, ip, sp + "/required", fmt::format("required property '{}' is missing", r.get<std::string>()));
    }
    auto require_all = [&](const json& names, const std::string& key, const std::string& where) {
      for (const auto& r : names)
        if (!x.contains(r.get<std::string>()))
          return no(why, ip, where,
                    fmt::format("property '{}' requires property '{}', which is missing", key, r.get<std::string>()));
      return true;
    };
    if (const json* v = kw("dependentRequired")) {
      for (auto it = v->begin(); it != v->end(); ++it)
        if (x.contains(it.key()) && !require_all(*it, it.key(), sp + "/dependentRequired")) return false;
    }
    if (const json* v = kw("dependentSchemas")) {
      for (auto it = v->begin(); it != v->end(); ++it)
        if (x.contains(it.key()) &&
            !val(*it, x, ip, sp + "/dependentSchemas/" + escape_ptr(it.key()), depth + 1, why))
          return false;
    }
    if (const json* v = kw("dependencies")) {
      for (auto it = v->begin(); it != v->end(); ++it) {
        if (!x.contains(it.key())) continue;
        const std::string where = sp + "/dependencies/" + escape_ptr(it.key());
        if (it->is_array() ? !require_all(*it, it.key(), where) : !val(*it, x, ip, where, depth + 1, why)) return false;
      }
    }
    const json* props = kw("properties");
    const json* pprops = kw("patternProperties");
    const json* addl = kw("additionalProperties");
    const json* names = kw("propertyNames");
    for (auto it = x.begin(); it != x.end(); ++it) {
      const std::string& key = it.key();
      const std::string kp = ip + "/" + escape_ptr(key);
      if (names && !val(*names, json(key), kp, sp + "/propertyNames", depth + 1, why)) return false;
      bool matched = false;
      if (props) {
        if (const auto jt = props->find(key); jt != props->end()) {
          matched = true;
          if (!val(*jt, *it, kp, sp + "/properties/" + escape_ptr(key), depth + 1, why)) return false;
        }
      }
      if (pprops) {
        for (auto jt = pprops->begin(); jt != pprops->end(); ++jt) {
          const std::wstring wkey = to_wide(key);
          if (wkey.size() > opt.max_pattern_input)
            return no(why, kp, sp + "/patternProperties", "a property name too long to match against a pattern");
          bool hit = false;
          try {
            hit = std::regex_search(wkey, regexes.at(jt.key()));
          } catch (const std::regex_error& e) {
            return no(why, kp, sp + "/patternProperties", fmt::format("pattern '{}' failed to run: {}", jt.key(), e.what()));
          }
          if (!hit) continue;
          matched = true;
          if (!val(*jt, *it, kp, sp + "/patternProperties/" + escape_ptr(jt.key()), depth + 1, why)) return false;
        }
      }
      if (!matched && addl) {
        if (addl->is_boolean() && !addl->get<bool>())
          return no(why, kp, sp + "/additionalProperties", fmt::format("property '{}' is not allowed", key));
        if (!val(*addl, *it, kp, sp + "/additionalProperties", depth + 1, why)) return false;
      }
    }
    return true;
  }
};

JsonSchema::JsonSchema(const json& schema, SchemaOptions opt) : impl_(std::make_unique<Impl>()) {
  impl_->root = schema;
  impl_->opt = opt;
  Impl& I = *impl_;
  const StackGuard guard;
  I.check(I.root, "", 0, true);
  // Resolve every $ref, checking each target as a schema (a target inside an unknown keyword was not
  // checked yet, and may hold more $refs: repeat until none is new).
  for (bool more = true; more;) {
    more = false;
    for (auto& [ref, target] : I.refs) {
      if (target) continue;
      try {
        target = I.resolve(ref);
      } catch (const Error& e) {
        fail("schema {}: {}", I.ref_at.at(ref), e.what());
      }
      const size_t before = I.refs.size();
      I.check(*target, ref.substr(1), 1, target == &I.root);
      if (I.refs.size() != before) {
        more = true;
        break;  // the map changed under the loop: start over
      }
    }
  }
  for (const auto& [where, keyword] : I.unknown) {
    bool referenced = false;
    for (const auto& [ref, target] : I.refs) {
      const std::string frag = percent_decode(ref.substr(1), ref);
      referenced = referenced || frag == where || frag.rfind(where + "/", 0) == 0;
    }
    if (!referenced) fail("schema {}: unsupported keyword '{}'", where, keyword);
  }
}

JsonSchema::~JsonSchema() = default;
JsonSchema::JsonSchema(JsonSchema&&) noexcept = default;
JsonSchema& JsonSchema::operator=(JsonSchema&&) noexcept = default;

std::string JsonSchema::validate(const json& instance) const {
  const StackGuard guard;
  std::string why;
  if (impl_->val(impl_->root, instance, "", "", 0, &why)) return "";
  return why.empty() ? "invalid" : why;
}

}  // namespace kestrel::eval
