// A JSON Schema validator for the subset of draft 2020-12 / draft-07 that tool declarations use.
//
// Debian ships no C++ JSON Schema library, and the tool-call score of `kestrel eval` (the K2 Vendor
// Verifier's "arguments are jsonschema-valid") needs one. The schema is checked completely when the
// JsonSchema is built: every keyword must be one we implement or a pure annotation, every keyword
// value must have the right JSON type, every regex must compile and every $ref must resolve. A
// schema using anything else (remote $ref, nested $id, $dynamicRef, unevaluated*, the draft-04
// boolean exclusiveMinimum, ...) is a kestrel::Error naming the keyword and its location — never a
// silent "valid".
//
// Implemented: boolean schemas; type (one or an array; "integer" is any number with no fractional
// part, so 1.0 is an integer as in drafts 6+); enum, const (numeric equality across int and float:
// 1 == 1.0); properties, patternProperties, additionalProperties (bool or schema), required,
// propertyNames, minProperties, maxProperties, dependentRequired, dependentSchemas, dependencies
// (draft-07); items (a schema; or an array = draft-07 tuple form, with additionalItems), prefixItems,
// contains / minContains / maxContains, minItems, maxItems, uniqueItems; minimum, maximum,
// exclusiveMinimum, exclusiveMaximum (numbers), multipleOf (exact on integers, relative tolerance
// 1e-9 on the quotient otherwise, so 0.0075 is a multiple of 0.0001); minLength, maxLength (Unicode
// code points); pattern (std::wregex ECMAScript over UTF-32, so '.' is one code point; classes such
// as \w and \d are ASCII as in ECMAScript; unanchored search as the spec requires); allOf, anyOf,
// oneOf, not, if/then/else; $ref to the document itself ("#", "#/$defs/x", "#/definitions/x", any
// local JSON pointer with ~0 ~1 and %-escapes). Keywords next to $ref apply too (2020-12 semantics;
// draft-07 ignored them).
// Annotations, accepted and ignored: $schema, $id (root only), $comment, title, description,
// default, examples, deprecated, readOnly, writeOnly, format (an annotation by default in 2020-12),
// contentMediaType, contentEncoding, contentSchema; $defs and definitions hold subschemas (checked,
// applied only through $ref). Any other keyword is refused, unless a $ref points into it (a
// container of subschemas under a name of its own); then what the $ref reaches is checked as a schema.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace kestrel::eval {

struct SchemaOptions {
  // false: a "pattern" or "patternProperties" keyword is an unsupported-keyword error. The fuzz
  // target uses it: std::regex backtracks exponentially on some patterns, which is a hang, not a bug.
  bool allow_patterns = true;
  // Strings longer than this (code points) are not run through a pattern: the instance fails with
  // a reason instead. libstdc++'s matcher recurses once per character: "^(a|b)*$" overflows an 8 MiB
  // stack at about 12,000 characters (4,000 under ASan), and a crash is worse than a refusal.
  size_t max_pattern_input = 1000;
};

class JsonSchema {
 public:
  // Throws kestrel::Error when the schema is malformed or uses something unsupported.
  explicit JsonSchema(const nlohmann::json& schema, SchemaOptions opt = {});
  ~JsonSchema();
  JsonSchema(JsonSchema&&) noexcept;
  JsonSchema& operator=(JsonSchema&&) noexcept;

  // "" when `instance` is valid; otherwise why not, for the first failure found:
  // "/a/0: 'x' is not of type integer (schema /properties/a/items)". Never throws.
  std::string validate(const nlohmann::json& instance) const;
  bool is_valid(const nlohmann::json& instance) const { return validate(instance).empty(); }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::eval
