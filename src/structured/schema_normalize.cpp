// SchemaCompiler, first half: keyword checking, $ref resolution and normalisation.
//
// normalize() turns a subschema into one the emitter handles directly: allOf, a $ref with
// constraining siblings and anyOf/oneOf with constraining siblings are merged (merge() combines two
// schemas only when the result means exactly "both": type lists intersect, required lists unite,
// bounds take the stricter, property maps merge per key, and keywords whose meaning depends on a
// sibling — additionalProperties next to properties, items next to prefixItems — are combined only if
// both sides agree; anything else is refused). A pure $ref stays a reference (compiled as a call, so
// recursion works); a oneOf is accepted as anyOf only when its alternatives are provably disjoint.
#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "structured/json_schema_grammar.h"
#include "structured/schema_util.h"

namespace kestrel::structured {

namespace {

const std::set<std::string> kAnnotations = {
    "$schema", "$comment", "title", "description", "default", "examples", "deprecated", "readOnly",
    "writeOnly", "contentMediaType", "contentEncoding", "contentSchema", "$id"};
const std::set<std::string> kContainers = {"$defs", "definitions"};
const std::set<std::string> kSupported = {
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required", "additionalProperties",
    "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
const std::set<std::string> kTypeNames = {"null", "boolean", "object", "array", "number", "integer", "string"};

bool is_count(const ojson& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0); }

bool constraining(const std::string& k) { return !kAnnotations.count(k) && !kContainers.count(k); }

// Type names of a `type` keyword value as a set, integer kept apart from number.
std::set<std::string> type_set(const ojson& t) {
  std::set<std::string> out;
  if (t.is_string()) out.insert(t.get<std::string>());
  else
    for (const auto& x : t) out.insert(x.get<std::string>());
  return out;
}

}  // namespace

void SchemaCompiler::error(const std::string& ptr, const std::string& msg) const {
  fail("{} {}: {}", where_, ptr.empty() ? "(root)" : ptr, msg);
}

void SchemaCompiler::check_deadline() const {
  if (std::chrono::steady_clock::now() > deadline_)
    fail("{}: compiling the schema took longer than the limit ({} s)", where_, limits_.max_compile_seconds);
}

SchemaCompiler::SchemaCompiler(JsonRules& rules, const ojson& document, const SchemaLimits& limits, std::string where)
    : rules_(rules), b_(rules.builder()), doc_(document), limits_(limits), where_(std::move(where)) {
  deadline_ = std::chrono::steady_clock::now() +
              std::chrono::microseconds(int64_t(limits_.max_compile_seconds * 1e6));
  // Every $ref in the document (its decoded pointer), so a container under an unknown name that a
  // $ref points into is accepted (as the validator does). Iterative: the document may be deep.
  // Also bounds the JSON nesting before anything recursive (copies, dumps) touches the document: a
  // schema level is at most two JSON levels (a keyword, then a map of subschemas).
  const size_t max_json_depth = 2 * limits_.max_schema_depth + 8;
  std::vector<std::pair<const ojson*, size_t>> todo = {{&doc_, 0}};
  size_t visited = 0;
  while (!todo.empty()) {
    const auto [x, depth] = todo.back();
    todo.pop_back();
    if (++visited > 10'000'000) fail("{}: schema document too large", where_);
    if (depth > max_json_depth)
      fail("{}: schema nested deeper than {} levels (limit)", where_, limits_.max_schema_depth);
    if (x->is_object()) {
      for (auto it = x->begin(); it != x->end(); ++it) {
        if (it.key() == "$ref" && it->is_string()) {
          const std::string r = it->get<std::string>();
          if (!r.empty() && r[0] == '#') {
            std::string frag;  // %-decoded, as resolve() reads it
            for (size_t i = 1; i < r.size(); ++i) {
              if (r[i] == '%' && i + 2 < r.size() && std::isxdigit(uint8_t(r[i + 1])) && std::isxdigit(uint8_t(r[i + 2]))) {
                frag += char(std::stoi(r.substr(i + 1, 2), nullptr, 16));
                i += 2;
              } else {
                frag += r[i];
              }
            }
            ref_targets_.insert(frag);
          }
        }
        if (it->is_structured()) todo.push_back({&*it, depth + 1});
      }
    } else if (x->is_array()) {
      for (const auto& y : *x)
        if (y.is_structured()) todo.push_back({&y, depth + 1});
    }
  }
}

const ojson& SchemaCompiler::resolve(const std::string& ref, const std::string& ptr) {
  if (ref.empty() || ref[0] != '#') error(ptr, fmt::format("$ref '{}': only references inside the document are supported", ref));
  std::string frag;
  for (size_t i = 1; i < ref.size(); ++i) {
    if (ref[i] == '%' && i + 2 < ref.size() && std::isxdigit(uint8_t(ref[i + 1])) && std::isxdigit(uint8_t(ref[i + 2]))) {
      frag += char(std::stoi(ref.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      frag += ref[i];
    }
  }
  const ojson* cur = &doc_;
  if (frag.empty()) return *cur;
  if (frag[0] != '/') error(ptr, fmt::format("$ref '{}': anchors are not supported, only JSON pointers", ref));
  size_t pos = 1;
  for (;;) {
    const size_t slash = frag.find('/', pos);
    const std::string tok = frag.substr(pos, slash == std::string::npos ? std::string::npos : slash - pos);
    std::string key;
    for (size_t i = 0; i < tok.size(); ++i) {
      if (tok[i] == '~' && i + 1 < tok.size() && (tok[i + 1] == '0' || tok[i + 1] == '1')) {
        key += tok[++i] == '0' ? '~' : '/';
      } else if (tok[i] == '~') {
        error(ptr, fmt::format("$ref '{}': bad '~' escape", ref));
      } else {
        key += tok[i];
      }
    }
    if (cur->is_object() && cur->contains(key)) {
      cur = &(*cur)[key];
    } else if (cur->is_array() && !key.empty() && key.size() < 10 &&
               key.find_first_not_of("0123456789") == std::string::npos && std::stoul(key) < cur->size()) {
      cur = &(*cur)[std::stoul(key)];
    } else {
      error(ptr, fmt::format("$ref '{}' does not resolve", ref));
    }
    if (slash == std::string::npos) break;
    pos = slash + 1;
  }
  if (!cur->is_object() && !cur->is_boolean()) error(ptr, fmt::format("$ref '{}' points at something that is not a schema", ref));
  return *cur;
}

void SchemaCompiler::check_keywords(const ojson& s, const std::string& ptr) {
  for (auto it = s.begin(); it != s.end(); ++it) {
    const std::string& k = it.key();
    const ojson& v = *it;
    const std::string p = ptr + "/" + escape_ptr(k);
    if (kAnnotations.count(k)) {
      if (k == "$id" && !ptr.empty() && &s != &doc_) error(p, "'$id' below the root is not supported");
      continue;
    }
    if (kContainers.count(k)) {
      if (!v.is_object()) error(p, "must be an object of schemas");
      continue;
    }
    if (!kSupported.count(k)) {
      bool referenced = false;
      for (const std::string& t : ref_targets_) referenced = referenced || t == p || t.rfind(p + "/", 0) == 0;
      if (referenced) continue;  // a container of subschemas under a name of its own
      error(p, fmt::format("unsupported JSON Schema keyword '{}'", k));
    }
    if (k == "type") {
      auto one = [&](const ojson& t) {
        if (!t.is_string() || !kTypeNames.count(t.get<std::string>())) error(p, "unknown type " + t.dump());
      };
      if (v.is_array()) {
        if (v.empty()) error(p, "an empty list of types");
        for (const auto& t : v) one(t);
      } else {
        one(v);
      }
    } else if (k == "enum") {
      if (!v.is_array()) error(p, "must be an array");
      if (v.size() > limits_.max_enum_values)
        error(p, fmt::format("{} values, more than the limit of {}", v.size(), limits_.max_enum_values));
    } else if (k == "anyOf" || k == "oneOf" || k == "allOf" || k == "prefixItems") {
      if (!v.is_array() || v.empty()) error(p, "must be a non-empty array of schemas");
    } else if (k == "properties") {
      if (!v.is_object()) error(p, "must be an object of schemas");
      if (v.size() > limits_.max_properties)
        error(p, fmt::format("{} properties, more than the limit of {}", v.size(), limits_.max_properties));
    } else if (k == "required") {
      if (!v.is_array()) error(p, "must be an array of strings");
      for (const auto& r : v)
        if (!r.is_string()) error(p, "must be an array of strings");
    } else if (k == "additionalProperties" || k == "additionalItems") {
      if (!v.is_object() && !v.is_boolean()) error(p, "must be a schema");
    } else if (k == "items") {
      if (!v.is_object() && !v.is_boolean() && !v.is_array()) error(p, "must be a schema or an array of schemas");
      if (v.is_array() && s.contains("prefixItems")) error(p, "an array 'items' together with 'prefixItems'");
    } else if (k == "minItems" || k == "maxItems" || k == "minLength" || k == "maxLength") {
      if (!is_count(v) && !(v.is_number_float() && v.get<double>() >= 0 && std::floor(v.get<double>()) == v.get<double>()))
        error(p, "must be a non-negative integer");
    } else if (k == "uniqueItems") {
      if (!v.is_boolean()) error(p, "must be a boolean");
      if (v.get<bool>()) error(p, "unsupported JSON Schema keyword 'uniqueItems' (true)");
    } else if (k == "format") {
      if (!v.is_string()) error(p, "must be a string");
    } else if (k == "minimum" || k == "maximum" || k == "exclusiveMinimum" || k == "exclusiveMaximum") {
      if (v.is_boolean()) error(p, "the draft-04 boolean form is not supported (use a number)");
      if (!v.is_number()) error(p, "must be a number");
    } else if (k == "$ref") {
      if (!v.is_string()) error(p, "must be a string");
      resolve(v.get<std::string>(), p);
    }
  }
}

ojson SchemaCompiler::normalize(const ojson& s, const std::string& ptr, int depth) {
  check_deadline();
  if (depth > int(limits_.max_schema_depth))
    error(ptr, fmt::format("schema nested deeper than {} levels (limit)", limits_.max_schema_depth));
  if (s.is_boolean()) return s;
  if (!s.is_object()) error(ptr, "a schema must be an object or a boolean, got " + s.dump());
  check_keywords(s, ptr);
  ojson n = ojson::object();
  for (auto it = s.begin(); it != s.end(); ++it)
    if (constraining(it.key()) && it.key() != "allOf") n[it.key()] = *it;
  if (s.contains("allOf")) {
    const ojson& all = s["allOf"];
    ojson rest = n;
    n = rest.empty() ? ojson(true) : rest;
    for (size_t i = 0; i < all.size(); ++i)
      n = merge(n, normalize(all[i], fmt::format("{}/allOf/{}", ptr, i), depth + 1), ptr, depth);
    return n.is_object() && n.empty() ? ojson(true) : n;
  }
  if (n.contains("$ref") && n.size() > 1) {
    const std::string ref = n["$ref"].get<std::string>();
    ojson rest = n;
    rest.erase("$ref");
    return merge(normalize(rest, ptr, depth + 1), normalize(resolve(ref, ptr), ref.substr(1), depth + 1), ptr, depth);
  }
  for (const char* k : {"anyOf", "oneOf"}) {
    if (!n.contains(k)) continue;
    if (n.contains(k == std::string("anyOf") ? "oneOf" : "anyOf")) error(ptr, "anyOf together with oneOf is not supported");
    ojson alts = ojson::array();
    for (size_t i = 0; i < n[k].size(); ++i) alts.push_back(normalize(n[k][i], fmt::format("{}/{}/{}", ptr, k, i), depth + 1));
    if (std::string(k) == "oneOf") {
      // Exactly-one is guaranteed only if no value can match two alternatives.
      // References are looked through (a few levels) to see the alternatives' shapes.
      std::vector<ojson> seen;
      for (const auto& a : alts) {
        ojson x = a;
        for (int k = 0; k < 8 && x.is_object() && x.contains("$ref"); ++k)
          x = normalize(resolve(x["$ref"].get<std::string>(), ptr), ptr, depth + 1);
        seen.push_back(std::move(x));
      }
      auto enum_of = [](const ojson& a) -> const ojson* {
        return a.is_object() && a.contains("enum") ? &a["enum"] : nullptr;
      };
      auto values_disjoint = [&](const ojson& x, const ojson& y) {
        for (const auto& u : x)
          for (const auto& v : y)
            if (json_equal(u, v)) return false;
        return true;
      };
      for (size_t i = 0; i < alts.size(); ++i)
        for (size_t j = i + 1; j < alts.size(); ++j) {
          const ojson &A = seen[i], &B = seen[j];
          const auto ti = admitted(A, ptr), tj = admitted(B, ptr);
          bool disjoint = std::none_of(ti.begin(), ti.end(), [&](JsonType t) { return tj.count(t); });
          if (!disjoint && enum_of(A) && enum_of(B)) disjoint = values_disjoint(*enum_of(A), *enum_of(B));
          // A discriminator: a property both require, with disjoint enum/const values.
          if (!disjoint && A.is_object() && B.is_object() && A.contains("properties") && B.contains("properties") &&
              A.contains("required") && B.contains("required")) {
            for (auto it = A["properties"].begin(); it != A["properties"].end() && !disjoint; ++it) {
              const std::string& key = it.key();
              auto req = [&](const ojson& X) {
                return std::find(X["required"].begin(), X["required"].end(), ojson(key)) != X["required"].end();
              };
              if (!B["properties"].contains(key) || !req(A) || !req(B)) continue;
              const ojson pa = normalize(*it, ptr, depth + 1), pb = normalize(B["properties"][key], ptr, depth + 1);
              if (enum_of(pa) && enum_of(pb)) disjoint = values_disjoint(*enum_of(pa), *enum_of(pb));
            }
          }
          if (!disjoint)
            error(ptr + "/oneOf", fmt::format("alternatives {} and {} may both match a value; only oneOf with "
                                               "disjoint alternatives (different types or enum/const values) is supported",
                                               i, j));
        }
    }
    ojson rest = n;
    rest.erase(k);
    if (rest.empty()) return ojson{{"anyOf", alts}};
    ojson merged = ojson::array();
    for (size_t i = 0; i < alts.size(); ++i) merged.push_back(merge(alts[i], rest, fmt::format("{}/{}/{}", ptr, k, i), depth));
    return ojson{{"anyOf", merged}};
  }
  if (n.contains("const")) {  // const is a one-value enum (intersected with an enum next to it)
    ojson vals = ojson::array({n["const"]});
    if (n.contains("enum")) {
      bool in = false;
      for (const auto& x : n["enum"]) in = in || json_equal(x, n["const"]);
      if (!in) vals = ojson::array();
    }
    n.erase("const");
    n["enum"] = vals;
  }
  return n.empty() ? ojson(true) : n;
}

ojson SchemaCompiler::merge(const ojson& a0, const ojson& b0, const std::string& ptr, int depth) {
  if (depth > int(limits_.max_schema_depth))
    error(ptr, fmt::format("schema nested deeper than {} levels (limit)", limits_.max_schema_depth));
  if (a0.is_boolean()) return a0.get<bool>() ? b0 : a0;
  if (b0.is_boolean()) return b0.get<bool>() ? a0 : b0;
  // Inline a pure reference once (its own references stay references).
  auto deref = [&](const ojson& x) {
    if (x.contains("$ref")) return normalize(resolve(x["$ref"].get<std::string>(), ptr), ptr, depth + 1);
    return x;
  };
  const ojson a = deref(a0), b = deref(b0);
  if (a.is_boolean() || b.is_boolean()) return merge(a, b, ptr, depth + 1);
  if (a.contains("anyOf") && b.contains("anyOf")) error(ptr, "combining two anyOf lists (allOf of unions) is not supported");
  for (const auto* pair : {&a, &b}) {
    const ojson& u = *pair;
    const ojson& other = pair == &a ? b : a;
    if (u.contains("anyOf")) {
      ojson alts = ojson::array();
      for (const auto& x : u["anyOf"]) alts.push_back(merge(x, other, ptr, depth + 1));
      return ojson{{"anyOf", alts}};
    }
  }
  ojson out = a;
  auto refuse = [&](const std::string& k) {
    error(ptr, fmt::format("cannot combine '{}' from allOf / sibling keywords (different values)", k));
  };
  // Keywords whose meaning depends on a sibling: combining sides is exact only when they agree.
  const std::vector<std::vector<std::string>> groups = {{"properties", "additionalProperties"},
                                                        {"items", "prefixItems", "additionalItems"}};
  for (const auto& g : groups) {
    bool in_a = false, in_b = false;
    for (const auto& k : g) in_a = in_a || a.contains(k), in_b = in_b || b.contains(k);
    if (!in_a || !in_b) continue;
    const bool a_closed = a.contains("additionalProperties") || a.contains("additionalItems") ||
                          (a.contains("items") && a.contains("prefixItems"));
    const bool b_closed = b.contains("additionalProperties") || b.contains("additionalItems") ||
                          (b.contains("items") && b.contains("prefixItems"));
    if (g[0] == "properties" && !a_closed && !b_closed) continue;  // plain property maps merge per key
    for (const auto& k : g)
      if (a.contains(k) != b.contains(k) || (a.contains(k) && !json_equal(a[k], b[k]))) refuse(k);
  }
  for (auto it = b.begin(); it != b.end(); ++it) {
    const std::string& k = it.key();
    const ojson& v = *it;
    if (!out.contains(k)) {
      out[k] = v;
      continue;
    }
    ojson& w = out[k];
    if (json_equal(w, v)) continue;
    if (k == "type") {
      std::set<std::string> x = type_set(w), y = type_set(v), r;
      for (const auto& t : x)
        if (y.count(t) || (t == "integer" && y.count("number"))) r.insert(t);
      for (const auto& t : y)
        if (t == "integer" && x.count("number")) r.insert(t);
      if (r.empty()) return ojson(false);
      w = ojson(std::vector<std::string>(r.begin(), r.end()));
    } else if (k == "required") {
      for (const auto& r : v)
        if (std::find(w.begin(), w.end(), r) == w.end()) w.push_back(r);
    } else if (k == "enum") {
      ojson keep = ojson::array();
      for (const auto& x : w)
        for (const auto& y : v)
          if (json_equal(x, y)) {
            keep.push_back(x);
            break;
          }
      w = keep;
    } else if (k == "minimum" || k == "exclusiveMinimum" || k == "minItems" || k == "minLength") {
      if (as_ld(v) > as_ld(w)) w = v;
    } else if (k == "maximum" || k == "exclusiveMaximum" || k == "maxItems" || k == "maxLength") {
      if (as_ld(v) < as_ld(w)) w = v;
    } else if (k == "properties") {
      for (auto jt = v.begin(); jt != v.end(); ++jt)
        w[jt.key()] = w.contains(jt.key()) ? merge(w[jt.key()], *jt, ptr + "/properties/" + escape_ptr(jt.key()), depth + 1)
                                           : *jt;
    } else if (k == "items" && w.is_object() && v.is_object()) {
      w = merge(w, v, ptr + "/items", depth + 1);
    } else {
      refuse(k);
    }
  }
  return out;
}

std::set<JsonType> SchemaCompiler::admitted(const ojson& n, const std::string& ptr) {
  const std::set<JsonType> all = {JsonType::kNull,   JsonType::kBoolean, JsonType::kNumber,
                                  JsonType::kString, JsonType::kArray,   JsonType::kObject};
  if (n.is_boolean()) return n.get<bool>() ? all : std::set<JsonType>{};
  if (n.contains("anyOf")) {
    std::set<JsonType> u;
    for (const auto& x : n["anyOf"])
      for (JsonType t : admitted(x, ptr)) u.insert(t);
    return u;
  }
  if (n.contains("$ref")) return all;  // not expanded here (recursion); callers trim empty results
  std::set<JsonType> out = all;
  if (n.contains("type")) {
    out.clear();
    for (const auto& t : type_set(n["type"])) {
      if (t == "null") out.insert(JsonType::kNull);
      if (t == "boolean") out.insert(JsonType::kBoolean);
      if (t == "number" || t == "integer") out.insert(JsonType::kNumber);
      if (t == "string") out.insert(JsonType::kString);
      if (t == "array") out.insert(JsonType::kArray);
      if (t == "object") out.insert(JsonType::kObject);
    }
  }
  if (n.contains("enum")) {
    std::set<JsonType> lit;
    for (const auto& v : n["enum"]) {
      if (v.is_null()) lit.insert(JsonType::kNull);
      else if (v.is_boolean()) lit.insert(JsonType::kBoolean);
      else if (v.is_number()) lit.insert(JsonType::kNumber);
      else if (v.is_string()) lit.insert(JsonType::kString);
      else if (v.is_array()) lit.insert(JsonType::kArray);
      else lit.insert(JsonType::kObject);
    }
    std::set<JsonType> r;
    for (JsonType t : out)
      if (lit.count(t)) r.insert(t);
    out = r;
  }
  return out;
}

}  // namespace kestrel::structured
