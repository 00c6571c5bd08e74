// SchemaCompiler, second half: normalised schemas -> grammar fragments, and the entry points.
//
// Every value is emitted per JSON type (typed): literals from enum/const, numbers as bounded
// automata (json_lexical), strings, and arrays / objects as rules of their own, memoised by the
// canonical text of the normalised schema (plus type and string mode), so equal subschemas share one
// rule and recursive $refs become recursive calls.
//
// Objects: junction nodes S[i][first] = "properties 1..i decided, nothing written yet?"; from S[i]
// any later property j may follow as long as no required property lies strictly between (so required
// ones are never skipped), then additional properties if allowed, then '}' once no required property
// remains. Arrays: positions 1..U unrolled (prefixItems, minItems, maxItems), then a loop when
// unbounded.
#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "structured/json_schema_grammar.h"
#include "structured/schema_util.h"

namespace kestrel::structured {

using Frag = GrammarBuilder::Frag;
using detail::StrMode;

namespace {

size_t count_of(const ojson& v) {
  if (v.is_number_unsigned()) return size_t(std::min<uint64_t>(v.get<uint64_t>(), SIZE_MAX / 2));
  if (v.is_number_integer()) return size_t(std::max<int64_t>(0, v.get<int64_t>()));
  const double d = v.get<double>();
  return d >= 1e18 ? size_t(1e18) : size_t(d);
}

bool is_pure_ref(const ojson& n) { return n.is_object() && n.size() == 1 && n.contains("$ref"); }

}  // namespace

const char* json_type_name(JsonType t) {
  switch (t) {
    case JsonType::kNull: return "null";
    case JsonType::kBoolean: return "boolean";
    case JsonType::kNumber: return "number";
    case JsonType::kString: return "string";
    case JsonType::kArray: return "array";
    case JsonType::kObject: return "object";
  }
  return "?";
}

GrammarBuilder::Frag JsonRules::ws() {
  std::bitset<256> s;
  for (char c : {' ', '\t', '\n', '\r'}) s.set(uint8_t(c));
  return b_.repeat([&] { return b_.byte_set(s); }, 0, opt_.max_whitespace);
}

uint32_t JsonRules::string() {
  if (string_ == kDead) {
    string_ = b_.add_rule("string");
    b_.set_body(string_, detail::quoted_string(b_, 0, std::nullopt));
  }
  return string_;
}

uint32_t JsonRules::any_value() {
  if (value_ != kDead) return value_;
  value_ = b_.add_rule("value");
  object_ = b_.add_rule("object");
  array_ = b_.add_rule("array");
  const uint32_t s = string();
  auto W = [&] { return ws(); };
  auto member = [&] { return b_.seq({b_.call(s), W(), b_.literal(":"), W(), b_.call(value_), W()}); };
  b_.set_body(object_, b_.seq({b_.literal("{"), W(),
                               b_.opt(b_.seq(member(), b_.star(b_.seq({b_.literal(","), W(), member()})))),
                               b_.literal("}")}));
  auto item = [&] { return b_.seq(b_.call(value_), W()); };
  b_.set_body(array_, b_.seq({b_.literal("["), W(), b_.opt(b_.seq(item(), b_.star(b_.seq({b_.literal(","), W(), item()})))),
                              b_.literal("]")}));
  b_.set_body(value_, b_.alt({b_.call(object_), b_.call(array_), b_.call(s), detail::number(b_, {}), b_.literal("true"),
                              b_.literal("false"), b_.literal("null")}));
  return value_;
}

GrammarBuilder::Frag SchemaCompiler::value(const ojson& schema, const std::string& ptr) { return value_at(schema, ptr, 0); }

GrammarBuilder::Frag SchemaCompiler::typed_value(const ojson& schema, const std::string& ptr, JsonType t, StrMode mode) {
  return typed_at(schema, ptr, t, mode, 0);
}

std::set<JsonType> SchemaCompiler::types(const ojson& schema, const std::string& ptr) {
  return admitted(normalize(schema, ptr, 0), ptr);
}

GrammarBuilder::Frag SchemaCompiler::value_at(const ojson& s, const std::string& ptr, int depth) {
  const ojson n = normalize(s, ptr, depth);
  if (n.is_boolean()) return n.get<bool>() ? b_.call(rules_.any_value()) : b_.nothing();
  if (n.contains("anyOf")) {
    std::vector<Frag> alts;
    for (size_t i = 0; i < n["anyOf"].size(); ++i)
      alts.push_back(value_at(n["anyOf"][i], fmt::format("{}/anyOf/{}", ptr, i), depth + 1));
    return b_.alt(alts);
  }
  if (is_pure_ref(n)) {
    const std::string ref = n["$ref"].get<std::string>();
    const std::string key = "ref|" + ref;
    auto it = memo_.find(key);
    if (it != memo_.end()) return b_.call(it->second);
    const uint32_t r = b_.add_rule("ref " + ref);
    memo_[key] = r;
    b_.set_body(r, value_at(resolve(ref, ptr), ref.substr(1), depth + 1));
    return b_.call(r);
  }
  std::vector<Frag> alts;
  for (JsonType t : admitted(n, ptr)) alts.push_back(typed(n, ptr, t, StrMode::kJson, depth));
  return b_.alt(alts);
}

GrammarBuilder::Frag SchemaCompiler::typed_at(const ojson& s, const std::string& ptr, JsonType t, StrMode mode,
                                              int depth) {
  const ojson n = normalize(s, ptr, depth);
  if (n.is_boolean()) {
    if (!n.get<bool>()) return b_.nothing();
    return typed(ojson::object(), ptr, t, mode, depth);
  }
  if (n.contains("anyOf")) {
    std::vector<Frag> alts;
    for (size_t i = 0; i < n["anyOf"].size(); ++i)
      alts.push_back(typed_at(n["anyOf"][i], fmt::format("{}/anyOf/{}", ptr, i), t, mode, depth + 1));
    return b_.alt(alts);
  }
  if (is_pure_ref(n)) {
    const std::string ref = n["$ref"].get<std::string>();
    const std::string key = fmt::format("ref|{}|{}|{}", ref, int(t), int(mode));
    auto it = memo_.find(key);
    if (it != memo_.end()) return b_.call(it->second);
    const uint32_t r = b_.add_rule(fmt::format("ref {} ({})", ref, json_type_name(t)));
    memo_[key] = r;
    b_.set_body(r, typed_at(resolve(ref, ptr), ref.substr(1), t, mode, depth + 1));
    return b_.call(r);
  }
  return typed(n, ptr, t, mode, depth);
}

GrammarBuilder::Frag SchemaCompiler::typed(const ojson& n, const std::string& ptr, JsonType t, StrMode mode, int depth) {
  check_deadline();
  if (!admitted(n, ptr).count(t)) return b_.nothing();
  if (n.contains("enum") || n.contains("const")) return literals(n, ptr, t, mode, depth);
  bool integer = false;
  if (n.contains("type")) {
    const ojson& ty = n["type"];
    const bool has_int = ty.is_string() ? ty == "integer" : std::find(ty.begin(), ty.end(), "integer") != ty.end();
    const bool has_num = ty.is_string() ? ty == "number" : std::find(ty.begin(), ty.end(), "number") != ty.end();
    integer = has_int && !has_num;
  }
  switch (t) {
    case JsonType::kNull: return b_.literal("null");
    case JsonType::kBoolean: return b_.alt({b_.literal("true"), b_.literal("false")});
    case JsonType::kNumber: return number_value(n, ptr, integer);
    case JsonType::kString: return string_value(n, ptr, mode);
    case JsonType::kArray: return b_.call(array_rule(n, ptr, depth));
    case JsonType::kObject: return b_.call(object_rule(n, ptr, depth));
  }
  return b_.nothing();
}

GrammarBuilder::Frag SchemaCompiler::literals(const ojson& n, const std::string& ptr, JsonType t, StrMode mode, int depth) {
  ojson values = n.contains("enum") ? n["enum"] : ojson::array();
  if (n.contains("const")) {
    if (n.contains("enum")) {
      ojson keep = ojson::array();
      for (const auto& v : values)
        if (json_equal(v, n["const"]))
          keep.push_back(v);
      values = keep;
    } else {
      values = ojson::array({n["const"]});
    }
  }
  // Other constraints next to the enum: keep the values that a grammar of those constraints accepts
  // (that grammar is itself within the schema, so what it accepts is valid).
  ojson rest = ojson::object();
  bool constrained = false;
  for (auto it = n.begin(); it != n.end(); ++it)
    if (it.key() != "enum" && it.key() != "const") {
      rest[it.key()] = *it;
      constrained = constrained || it.key() != "type";
    }
  std::optional<Grammar> check;
  if (constrained) {
    GrammarBuilder sub(BuildLimits{limits_.max_nfa_nodes, limits_.max_states, deadline_});
    JsonRules sub_rules(sub, rules_.options());
    SchemaCompiler sc(sub_rules, doc_, limits_, where_);
    sc.deadline_ = deadline_;
    const uint32_t root = sub.add_rule("enum check");
    sub.set_body(root, sc.value_at(rest, ptr, depth + 1));
    try {
      check = sub.build(root);
    } catch (const Error&) {
      return b_.nothing();  // nothing satisfies the other constraints
    }
  }
  const bool integer = n.contains("type") && n["type"] == "integer";
  std::vector<Frag> alts;
  std::set<std::string> texts;
  for (const auto& v : values) {
    JsonType vt = v.is_null() ? JsonType::kNull : v.is_boolean() ? JsonType::kBoolean : v.is_number() ? JsonType::kNumber
                 : v.is_string() ? JsonType::kString : v.is_array() ? JsonType::kArray : JsonType::kObject;
    if (vt != t) continue;
    if (integer && v.is_number_float() && std::floor(v.get<double>()) != v.get<double>()) continue;
    const std::string json_text = v.dump(-1, ' ', false, ojson::error_handler_t::replace);
    if (check && !check->recognizes(json_text)) continue;
    const std::string text = v.is_string() ? detail::string_literal(v.get<std::string>(), mode) : json_text;
    if (text.empty() && mode == StrMode::kRaw) {
      alts.push_back(b_.empty());
      continue;
    }
    if (texts.insert(text).second) alts.push_back(b_.literal(text));
  }
  return b_.alt(alts);
}

GrammarBuilder::Frag SchemaCompiler::string_value(const ojson& n, const std::string& ptr, StrMode mode) {
  if (n.contains("pattern")) error(ptr + "/pattern", "unsupported JSON Schema keyword 'pattern'");
  const bool has_len = n.contains("minLength") || n.contains("maxLength");
  if (mode == StrMode::kJson && !has_len && !n.contains("format")) return b_.call(rules_.string());
  size_t min = n.contains("minLength") ? count_of(n["minLength"]) : 0;
  std::optional<size_t> max;
  if (n.contains("maxLength")) max = std::min(count_of(n["maxLength"]), limits_.max_repeat);
  if (min > limits_.max_repeat)
    error(ptr + "/minLength", fmt::format("minLength {} exceeds the limit of {}", min, limits_.max_repeat));
  if (max && *max < min) return b_.nothing();
  const std::string key = fmt::format("str|{}|{}|{}|{}", min, max ? int64_t(*max) : -1,
                                      n.contains("format") ? n["format"].get<std::string>() : "", int(mode));
  auto it = memo_.find(key);
  if (it != memo_.end()) return b_.call(it->second);
  Frag body;
  if (n.contains("format")) {
    if (has_len) error(ptr + "/format", "format together with minLength / maxLength is not supported");
    try {
      body = detail::format_content(b_, n["format"].get<std::string>());
    } catch (const Error& e) {
      error(ptr + "/format", e.what());
    }
  } else {
    body = b_.repeat([&] { return detail::string_char(b_, mode); }, min, max);
  }
  const uint32_t r = b_.add_rule(mode == StrMode::kJson ? "string " + ptr : "raw string " + ptr);
  memo_[key] = r;
  b_.set_body(r, mode == StrMode::kJson ? b_.seq({b_.literal("\""), body, b_.literal("\"")}) : body);
  return b_.call(r);
}

GrammarBuilder::Frag SchemaCompiler::number_value(const ojson& n, const std::string& ptr, bool integer) {
  detail::NumberSpec spec;
  spec.integer = integer;
  auto pick = [&](const char* incl, const char* excl, bool lower) {
    const ojson* i = n.contains(incl) ? &n[incl] : nullptr;
    const ojson* e = n.contains(excl) ? &n[excl] : nullptr;
    if (!i && !e) return;
    // The stricter of the two: a larger lower bound (exclusive wins a tie), a smaller upper bound.
    bool exclusive = false;
    const ojson* v = i;
    if (e && (!i || (lower ? as_ld(*e) >= as_ld(*i) : as_ld(*e) <= as_ld(*i)))) v = e, exclusive = true;
    bool rounded = false;
    const detail::Decimal d = detail::decimal_of(*v, lower, &rounded);
    if (rounded) exclusive = false;  // rounded inward: the rounded value itself is inside
    if (lower) spec.lo = d, spec.lo_exclusive = exclusive;
    else spec.hi = d, spec.hi_exclusive = exclusive;
  };
  try {
    pick("minimum", "exclusiveMinimum", true);
    pick("maximum", "exclusiveMaximum", false);
  } catch (const Error& e) {
    error(ptr, e.what());
  }
  return detail::number(b_, spec);
}

uint32_t SchemaCompiler::array_rule(const ojson& n, const std::string& ptr, int depth) {
  const std::string key = "arr|" + n.dump(-1, ' ', false, ojson::error_handler_t::replace);
  if (auto it = memo_.find(key); it != memo_.end()) return it->second;
  const uint32_t r = b_.add_rule("array " + ptr);
  memo_[key] = r;
  std::vector<std::pair<ojson, std::string>> prefix;  // (schema, pointer)
  ojson rest = true;
  std::string rest_ptr = ptr + "/items";
  if (n.contains("prefixItems")) {
    for (size_t i = 0; i < n["prefixItems"].size(); ++i)
      prefix.push_back({n["prefixItems"][i], fmt::format("{}/prefixItems/{}", ptr, i)});
    if (n.contains("items")) rest = n["items"];
  } else if (n.contains("items") && n["items"].is_array()) {
    for (size_t i = 0; i < n["items"].size(); ++i) prefix.push_back({n["items"][i], fmt::format("{}/items/{}", ptr, i)});
    if (n.contains("additionalItems")) rest = n["additionalItems"], rest_ptr = ptr + "/additionalItems";
  } else if (n.contains("items")) {
    rest = n["items"];
  }
  const size_t k = prefix.size();
  const size_t min = n.contains("minItems") ? count_of(n["minItems"]) : 0;
  if (min > limits_.max_repeat)
    error(ptr + "/minItems", fmt::format("minItems {} exceeds the limit of {}", min, limits_.max_repeat));
  std::optional<size_t> max;
  if (n.contains("maxItems")) max = std::min(count_of(n["maxItems"]), limits_.max_repeat);
  if (rest.is_boolean() && !rest.get<bool>()) max = std::min(max.value_or(k), k);
  if (!max && k > limits_.max_repeat) error(ptr, "too many prefixItems");
  auto W = [&] { return rules_.ws(); };
  // One rule per item schema (so each is built once however often it is unrolled).
  auto item_rule = [&](const ojson& s, const std::string& p) {
    const uint32_t ir = b_.add_rule("item " + p);
    b_.set_body(ir, value_at(s, p, depth + 1));
    return ir;
  };
  std::vector<uint32_t> prefix_rules;
  for (const auto& [s, p] : prefix) prefix_rules.push_back(item_rule(s, p));
  const uint32_t rest_rule = item_rule(rest, rest_ptr);
  auto value_i = [&](size_t i) { return b_.call(i <= k ? prefix_rules[i - 1] : rest_rule); };  // i is 1-based
  Frag body;
  if (max && *max < min) {
    body = b_.nothing();
  } else {
    const size_t U = max ? *max : std::max(k, min);
    // Continuation after item U: more items only when unbounded.
    Frag after = max ? b_.empty() : b_.star(b_.seq({b_.literal(","), W(), b_.call(rest_rule), W()}));
    Frag item;  // item i with everything after it
    for (size_t i = U; i >= 1; --i) {
      if (i % 64 == 0) check_deadline();
      item = b_.seq({value_i(i), W(), after});
      if (i > 1) {
        Frag next = b_.seq({b_.literal(","), W(), item});
        after = (i - 1 < min) ? next : b_.opt(next);
      }
    }
    if (U == 0) item = b_.seq({b_.call(rest_rule), W(), after});
    body = min == 0 ? b_.opt(item) : item;
  }
  b_.set_body(r, b_.seq({b_.literal("["), W(), body, b_.literal("]")}));
  return r;
}

SchemaCompiler::ObjectShape SchemaCompiler::object_shape(const ojson& schema, const std::string& ptr) {
  ojson n = normalize(schema, ptr, 0);
  std::string p = ptr;
  for (int i = 0; i < 16 && is_pure_ref(n); ++i) {
    p = n["$ref"].get<std::string>().substr(1);
    n = normalize(resolve(n["$ref"].get<std::string>(), ptr), p, 0);
  }
  if (n.is_object() && n.contains("anyOf")) error(ptr, "an object schema with anyOf is not supported here");
  if (!admitted(n, p).count(JsonType::kObject)) error(ptr, "must be an object schema");
  return shape_of(n, p);
}

SchemaCompiler::ObjectShape SchemaCompiler::shape_of(const ojson& n, const std::string& ptr) {
  ObjectShape sh;
  if (n.is_boolean()) {
    if (n.get<bool>()) sh.additional = ojson(true);
    return sh;
  }
  if (n.contains("properties"))
    for (auto it = n["properties"].begin(); it != n["properties"].end(); ++it) {
      sh.properties.push_back({it.key(), *it});
      sh.property_ptrs.push_back(ptr + "/properties/" + escape_ptr(it.key()));
    }
  if (n.contains("required"))
    for (const auto& rq : n["required"]) {
      const std::string name = rq.get<std::string>();
      sh.required.insert(name);
      if (std::none_of(sh.properties.begin(), sh.properties.end(), [&](const auto& p) { return p.first == name; })) {
        sh.properties.push_back({name, ojson(true)});
        sh.property_ptrs.push_back(ptr + "/required");
      }
    }
  if (n.contains("additionalProperties")) {
    const ojson& a = n["additionalProperties"];
    if (!(a.is_boolean() && !a.get<bool>())) sh.additional = a;
  } else if (!(n.contains("properties") && rules_.options().strict_objects)) {
    sh.additional = ojson(true);
  }
  return sh;
}

uint32_t SchemaCompiler::object_rule(const ojson& n, const std::string& ptr, int depth) {
  const std::string key = "obj|" + n.dump(-1, ' ', false, ojson::error_handler_t::replace);
  if (auto it = memo_.find(key); it != memo_.end()) return it->second;
  const uint32_t r = b_.add_rule("object " + ptr);
  memo_[key] = r;
  const ObjectShape sh = shape_of(n, ptr);
  const size_t P = sh.properties.size();
  auto W = [&] { return rules_.ws(); };
  std::vector<uint32_t> vals;
  for (size_t j = 0; j < P; ++j) {
    const uint32_t vr = b_.add_rule("property " + sh.property_ptrs[j]);
    b_.set_body(vr, value_at(sh.properties[j].second, sh.property_ptrs[j], depth + 1));
    vals.push_back(vr);
  }
  // required_after[i]: some property among i+1..P (1-based) is required.
  std::vector<bool> req(P + 1, false);
  for (size_t j = 0; j < P; ++j) req[j + 1] = sh.required.count(sh.properties[j].first) > 0;
  std::vector<bool> required_after(P + 1, false);
  for (size_t i = P; i-- > 0;) required_after[i] = required_after[i + 1] || req[i + 1];

  Frag end = b_.literal("}");
  std::vector<std::array<Frag, 2>> S(P + 1), K(P + 1);
  for (size_t i = 0; i <= P; ++i) S[i] = {b_.empty(), b_.empty()}, K[i] = {b_.empty(), b_.empty()};
  for (size_t j = 1; j <= P; ++j)
    for (int f = 0; f < 2; ++f) {
      Frag m = b_.seq({b_.literal(detail::string_literal(sh.properties[j - 1].first, StrMode::kJson)), W(),
                       b_.literal(":"), W(), b_.call(vals[j - 1]), W()});
      if (f == 1) m = b_.seq({b_.literal(","), W(), m});
      b_.link(K[j][f], m);
      b_.link(m, S[j][1]);
    }
  std::array<Frag, 2> X = {b_.empty(), b_.empty()};
  if (sh.additional) {
    std::vector<std::string> names;
    for (const auto& p : sh.properties) names.push_back(p.first);
    const uint32_t av = b_.add_rule("additional property " + ptr);
    b_.set_body(av, value_at(*sh.additional, ptr + "/additionalProperties", depth + 1));
    for (int f = 0; f < 2; ++f) {
      Frag m = b_.seq({detail::key_not_in(b_, names), W(), b_.literal(":"), W(), b_.call(av), W()});
      if (f == 1) m = b_.seq({b_.literal(","), W(), m});
      b_.link(X[f], m);
      b_.link(m, X[1]);
    }
    b_.link(X[1], end);
  }
  for (size_t i = 0; i <= P; ++i)
    for (int f = 0; f < 2; ++f) {
      for (size_t j = i + 1; j <= P; ++j) {
        b_.link(S[i][f], K[j][f]);
        if (req[j]) break;
      }
      if (!required_after[i]) {
        b_.link(S[i][f], end);
        if (sh.additional) b_.link(S[i][f], X[f]);
      }
    }
  Frag open = b_.seq(b_.literal("{"), W());
  b_.link(open, S[0][0]);
  b_.set_body(r, {open.in, end.out});
  return r;
}

Grammar json_schema_grammar(const ojson& schema, const SchemaOptions& opt, const SchemaLimits& limits) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::microseconds(int64_t(limits.max_compile_seconds * 1e6));
  GrammarBuilder b(BuildLimits{limits.max_nfa_nodes, limits.max_states, deadline});
  JsonRules rules(b, opt);
  SchemaCompiler sc(rules, schema, limits);
  const uint32_t root = b.add_rule("document");
  b.set_body(root, b.seq({rules.ws(), sc.value(schema, ""), rules.ws()}));
  try {
    return b.build(root);
  } catch (const Error& e) {
    fail("schema: {}", e.what());
  }
}

std::shared_ptr<const CompiledGrammar> compile_json_schema(std::shared_ptr<const TokenVocab> vocab, const ojson& schema,
                                                           const SchemaOptions& opt, const SchemaLimits& limits) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::microseconds(int64_t(limits.max_compile_seconds * 1e6));
  Grammar g = json_schema_grammar(schema, opt, limits);
  return std::make_shared<const CompiledGrammar>(std::move(vocab), std::move(g), limits.max_stack_depth, deadline);
}

}  // namespace kestrel::structured
