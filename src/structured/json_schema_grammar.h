// JSON Schema -> grammar. What OpenAI's strict mode and vLLM accept, compiled so that every document
// the grammar admits is valid against the schema (the grammar may be narrower: see below); anything
// the compiler does not implement is a kestrel::Error naming the keyword and its JSON pointer, never
// a silently unconstrained value.
//
// Supported: boolean schemas; type (one or a list; integer); enum, const (values of the admitted
// types, written compactly); properties, required, additionalProperties (false, true or a schema);
// items, prefixItems, draft-07 tuple items + additionalItems, minItems, maxItems; minLength,
// maxLength; minimum, maximum, exclusiveMinimum, exclusiveMaximum; format (date, time, date-time,
// uuid, ipv4, email, hostname, uri); anyOf; oneOf when its alternatives are provably disjoint; allOf
// and keywords next to $ref / anyOf, merged when they do not interact; $ref to local JSON pointers
// ($defs, definitions, "#"), recursion included; annotations (title, description, default, ...).
//
// Narrowing (valid JSON the grammar does not produce): properties appear in declaration order
// (required ones always, optional ones may be skipped), then any additional properties (keys without
// escapes); `properties` without `additionalProperties` closes the object (SchemaOptions::strict_objects,
// as OpenAI strict mode and vLLM); enum/const values and keys are written compactly; numbers have at
// most 20 integer and 20 fraction digits and a 2-digit exponent (15 significant digits and no exponent
// when bounded); integers are written without fraction or exponent; whitespace is at most
// SchemaOptions::max_whitespace characters (space, tab, newline, CR) at each place JSON allows it;
// maxLength / maxItems above SchemaLimits::max_repeat are clamped to it; nesting deeper than the
// matcher's stack limit cannot be produced.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "structured/grammar.h"
#include "structured/json_lexical.h"
#include "structured/matcher.h"

namespace kestrel::structured {

using ojson = nlohmann::ordered_json;

struct SchemaLimits {
  size_t max_schema_depth = 64;       // nesting of subschemas (refusal beyond)
  size_t max_enum_values = 10'000;    // values of one enum (refusal beyond)
  size_t max_repeat = 1'000;          // minItems / minLength refused beyond, maxItems / maxLength clamped
  size_t max_properties = 1'000;      // properties of one object (refusal beyond)
  size_t max_states = 200'000;        // automaton states of the whole grammar
  size_t max_nfa_nodes = 4'000'000;   // builder nodes
  double max_compile_seconds = 10.0;  // whole compilation including the token tables
  uint32_t max_stack_depth = 128;     // matcher stack frames (bounds the nesting of generated values)
};

struct SchemaOptions {
  size_t max_whitespace = 16;    // characters of whitespace allowed at each place JSON allows it
  bool strict_objects = true;    // `properties` without `additionalProperties` admits no other key
};

enum class JsonType { kNull, kBoolean, kNumber, kString, kArray, kObject };
const char* json_type_name(JsonType t);  // "null", "boolean", "number" (integers too), ...

// Rules shared by every schema compiled into one builder: whitespace, a string, any JSON value.
class JsonRules {
 public:
  JsonRules(GrammarBuilder& b, const SchemaOptions& opt) : b_(b), opt_(opt) {}
  // [ \t\n\r]{0,max_whitespace}, inline (a rule of its own would make every token that starts with
  // whitespace "uncertain" at the end of it; inline, a space followed by a word dies inside the rule).
  GrammarBuilder::Frag ws();
  uint32_t string();     // any JSON string
  uint32_t any_value();  // any JSON value
  GrammarBuilder& builder() { return b_; }
  const SchemaOptions& options() const { return opt_; }

 private:
  GrammarBuilder& b_;
  SchemaOptions opt_;
  uint32_t string_ = kDead, value_ = kDead, object_ = kDead, array_ = kDead;
};

// Compiles the subschemas of one schema document into a builder. `where` prefixes error messages
// (e.g. "tools[0].function.parameters").
class SchemaCompiler {
 public:
  SchemaCompiler(JsonRules& rules, const ojson& document, const SchemaLimits& limits, std::string where = "schema");

  // A JSON value valid against `schema` (a subschema of the document; ptr = its JSON pointer).
  GrammarBuilder::Frag value(const ojson& schema, const std::string& ptr);
  // A value of one JSON type only (nothing() when the schema admits none); strings in `mode`.
  GrammarBuilder::Frag typed_value(const ojson& schema, const std::string& ptr, JsonType t, detail::StrMode mode);
  // The JSON types the schema admits (after normalisation; a superset is fine for callers that then
  // ask typed_value, whose empty results the builder trims).
  std::set<JsonType> types(const ojson& schema, const std::string& ptr);
  // For object schemas (K3 tool parameters): properties in order, required names, and whether other
  // keys are allowed (their schema is then additional_schema()).
  struct ObjectShape {
    std::vector<std::pair<std::string, ojson>> properties;  // name -> subschema, declaration order
    std::vector<std::string> property_ptrs;
    std::set<std::string> required;
    std::optional<ojson> additional;  // schema for other keys, or nullopt = none allowed
  };
  // `schema` is normalised and references are followed; kestrel::Error if it admits no objects.
  ObjectShape object_shape(const ojson& schema, const std::string& ptr);

 private:
  struct Norm;
  ojson normalize(const ojson& s, const std::string& ptr, int depth);
  ojson merge(const ojson& a, const ojson& b, const std::string& ptr, int depth);
  const ojson& resolve(const std::string& ref, const std::string& ptr);
  void check_keywords(const ojson& s, const std::string& ptr);
  std::set<JsonType> admitted(const ojson& n, const std::string& ptr);
  GrammarBuilder::Frag typed(const ojson& n, const std::string& ptr, JsonType t, detail::StrMode mode, int depth);
  GrammarBuilder::Frag literals(const ojson& n, const std::string& ptr, JsonType t, detail::StrMode mode, int depth);
  GrammarBuilder::Frag string_value(const ojson& n, const std::string& ptr, detail::StrMode mode);
  GrammarBuilder::Frag number_value(const ojson& n, const std::string& ptr, bool integer);
  ObjectShape shape_of(const ojson& n, const std::string& ptr);
  uint32_t object_rule(const ojson& n, const std::string& ptr, int depth);
  uint32_t array_rule(const ojson& n, const std::string& ptr, int depth);
  GrammarBuilder::Frag value_at(const ojson& s, const std::string& ptr, int depth);
  GrammarBuilder::Frag typed_at(const ojson& s, const std::string& ptr, JsonType t, detail::StrMode mode, int depth);
  [[noreturn]] void error(const std::string& ptr, const std::string& msg) const;
  void check_deadline() const;

  JsonRules& rules_;
  GrammarBuilder& b_;
  const ojson& doc_;
  SchemaLimits limits_;
  std::string where_;
  std::set<std::string> ref_targets_;          // decoded JSON pointers that some $ref names
  std::map<std::string, uint32_t> memo_;       // (canonical schema, type, mode) -> rule
  std::chrono::steady_clock::time_point deadline_;
};

// One JSON document (with optional surrounding whitespace) valid against `schema`.
Grammar json_schema_grammar(const ojson& schema, const SchemaOptions& opt = {}, const SchemaLimits& limits = {});

// The grammar with its token tables over `vocab` (see matcher.h); errors as above.
std::shared_ptr<const CompiledGrammar> compile_json_schema(std::shared_ptr<const TokenVocab> vocab, const ojson& schema,
                                                           const SchemaOptions& opt = {},
                                                           const SchemaLimits& limits = {});

}  // namespace kestrel::structured
