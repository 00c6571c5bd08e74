// The JSON Schema validator (src/evalclient/json_schema.h): the official JSON-Schema-Test-Suite for
// every keyword we implement, plus hand-written cases for what the suite's draft-07 files do not
// cover (prefixItems and other 2020-12 keywords, code-point lengths, error messages, refusals).
//
// The suite comes from Debian's json-schema-test-suite package (scripts/install-deps.sh); a missing
// suite is a failure, not a skip. Version 2.0.0 in Debian 12 ships drafts 3, 4, 6 and 7, so draft 7
// is what runs. Excluded, with the reason (each exclusion is counted and checked to still exist, so
// a renamed case cannot silently drop out of the run):
//   files  definitions.json  - validates schemas against the remote draft-07 meta-schema (remote $ref)
//          refRemote.json    - remote references (http://localhost:1234/...)
//          optional/*        - format assertions, bignums, ECMA-262 regex details: optional in the spec
//   groups ref.json "ref overrides any sibling keywords" - draft-07 ignores keywords next to $ref; we
//          apply them as 2020-12 does (tool schemas are 2020-12 or draft-07 without that habit)
//          ref.json "remote ref, containing refs itself" - a remote $ref to the meta-schema
//          ref.json "Recursive references between schemas" - resolves through nested $id base URIs
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/check.h"
#include "evalclient/json_schema.h"

using kestrel::eval::JsonSchema;
using kestrel::eval::SchemaOptions;
using json = nlohmann::json;

namespace {

const char* kSuiteDir = "/usr/share/json-schema-test-suite/tests/draft7";

const std::vector<std::string> kSuiteFiles = {
    "additionalItems", "additionalProperties", "allOf", "anyOf", "boolean_schema", "const", "contains", "default",
    "dependencies", "enum", "exclusiveMaximum", "exclusiveMinimum", "if-then-else", "items", "maxItems", "maxLength",
    "maxProperties", "maximum", "minItems", "minLength", "minProperties", "minimum", "multipleOf", "not", "oneOf",
    "pattern", "patternProperties", "properties", "propertyNames", "ref", "required", "type", "uniqueItems"};

const std::set<std::pair<std::string, std::string>> kExcludedGroups = {
    {"ref", "ref overrides any sibling keywords"},
    {"ref", "remote ref, containing refs itself"},
    {"ref", "Recursive references between schemas"}};

bool valid(const json& schema, const json& instance) { return JsonSchema(schema).is_valid(instance); }

}  // namespace

TEST(JsonSchemaSuite, Draft7EveryCaseOfTheSupportedKeywords) {
  ASSERT_TRUE(std::filesystem::is_directory(kSuiteDir))
      << kSuiteDir << " missing: apt-get install json-schema-test-suite (scripts/install-deps.sh)";
  int files = 0, groups = 0, cases = 0, failures = 0;
  std::set<std::pair<std::string, std::string>> excluded_seen;
  for (const auto& name : kSuiteFiles) {
    const std::string path = std::string(kSuiteDir) + "/" + name + ".json";
    std::ifstream f(path);
    ASSERT_TRUE(f) << path;
    const json doc = json::parse(f);
    ++files;
    for (const auto& g : doc) {
      const std::string desc = g["description"].get<std::string>();
      if (kExcludedGroups.count({name, desc})) {
        excluded_seen.insert({name, desc});
        continue;
      }
      ++groups;
      std::unique_ptr<JsonSchema> schema;
      try {
        schema = std::make_unique<JsonSchema>(g["schema"]);
      } catch (const kestrel::Error& e) {
        ADD_FAILURE() << name << " / " << desc << ": schema refused: " << e.what();
        failures += int(g["tests"].size());
        continue;
      }
      for (const auto& t : g["tests"]) {
        ++cases;
        const bool expect = t["valid"].get<bool>();
        const std::string why = schema->validate(t["data"]);
        if (why.empty() != expect) {
          ++failures;
          ADD_FAILURE() << name << " / " << desc << " / " << t["description"].get<std::string>() << ": expected "
                        << (expect ? "valid" : "invalid") << ", got " << (why.empty() ? "valid" : "invalid: " + why);
        }
      }
    }
  }
  EXPECT_EQ(excluded_seen, kExcludedGroups) << "an excluded group is gone from the suite: update the list";
  EXPECT_EQ(failures, 0);
  // Draft 7 of suite 2.0.0 has 33 files of supported keywords; their groups and cases, less the
  // three excluded groups. A change here means the suite changed: look at what moved.
  EXPECT_EQ(files, 33);
  EXPECT_EQ(cases, 399);
  std::printf("JSON-Schema-Test-Suite draft7: %d files, %d groups, %d cases, %d failures, %zu groups excluded\n",
              files, groups, cases, failures, kExcludedGroups.size());
}

TEST(JsonSchema, IntegerVersusNumber) {
  const json s = {{"type", "integer"}};
  EXPECT_TRUE(valid(s, 3));
  EXPECT_TRUE(valid(s, -3));
  EXPECT_TRUE(valid(s, 18446744073709551615ull));
  EXPECT_TRUE(valid(s, 2.0));  // no fractional part: an integer (drafts 6+)
  EXPECT_FALSE(valid(s, 2.5));
  EXPECT_FALSE(valid(s, "3"));
  EXPECT_FALSE(valid(s, true));
  const json n = {{"type", "number"}};
  EXPECT_TRUE(valid(n, 3));
  EXPECT_TRUE(valid(n, 2.5));
  EXPECT_FALSE(valid(n, nullptr));
  EXPECT_TRUE(valid({{"type", {"string", "null"}}}, nullptr));
  EXPECT_FALSE(valid({{"type", {"string", "null"}}}, 0));
}

TEST(JsonSchema, PrefixItemsAndItems2020) {
  const json s = json::parse(R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                                 "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4})");
  EXPECT_TRUE(valid(s, json::parse(R"(["a"])")));
  EXPECT_TRUE(valid(s, json::parse(R"(["a", 1, true, false])")));
  EXPECT_FALSE(valid(s, json::parse(R"([1])")));
  EXPECT_FALSE(valid(s, json::parse(R"(["a", 1, 2])")));          // beyond the prefix: items applies
  EXPECT_FALSE(valid(s, json::parse(R"(["a", 1, true, true, true])")));  // maxItems
  EXPECT_FALSE(valid(s, json::array()));                            // minItems
  const json closed = json::parse(R"({"prefixItems": [{"const": 1}], "items": false})");
  EXPECT_TRUE(valid(closed, json::parse("[1]")));
  EXPECT_FALSE(valid(closed, json::parse("[1, 2]")));
  EXPECT_THROW(JsonSchema(json::parse(R"({"prefixItems": [{}], "items": [{}]})")), kestrel::Error);
}

TEST(JsonSchema, ContainsCountsAndDependents2020) {
  const json s = json::parse(R"({"contains": {"type": "integer"}, "minContains": 2, "maxContains": 3})");
  EXPECT_FALSE(valid(s, json::parse(R"([1, "a"])")));
  EXPECT_TRUE(valid(s, json::parse(R"([1, "a", 2])")));
  EXPECT_FALSE(valid(s, json::parse(R"([1, 2, 3, 4])")));
  const json d = json::parse(R"({"dependentRequired": {"card": ["cvv"]},
                                 "dependentSchemas": {"x": {"required": ["y"]}}})");
  EXPECT_TRUE(valid(d, json::parse(R"({"cvv": 1})")));
  EXPECT_FALSE(valid(d, json::parse(R"({"card": 1})")));
  EXPECT_FALSE(valid(d, json::parse(R"({"x": 1})")));
  EXPECT_TRUE(valid(d, json::parse(R"({"x": 1, "y": 2})")));
}

TEST(JsonSchema, DefsRefsAndDefinitions) {
  const json s = json::parse(R"({
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"unit": {"$ref": "#/$defs/unit"}, "loc": {"$ref": "#/definitions/loc"},
                   "tree": {"$ref": "#/$defs/node"}},
    "$defs": {"unit": {"enum": ["c", "f"]},
              "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                       "additionalProperties": false}},
    "definitions": {"loc": {"type": "string", "minLength": 2}}})");
  EXPECT_TRUE(valid(s, json::parse(R"({"unit": "c", "loc": "Paris", "tree": {"kids": [{"kids": []}, {}]}})")));
  EXPECT_FALSE(valid(s, json::parse(R"({"unit": "k"})")));
  EXPECT_FALSE(valid(s, json::parse(R"({"loc": "P"})")));
  EXPECT_FALSE(valid(s, json::parse(R"({"tree": {"kids": [{"kid": 1}]}})")));
  EXPECT_THROW(JsonSchema(json::parse(R"({"$ref": "#/$defs/none"})")), kestrel::Error);
  EXPECT_THROW(JsonSchema(json::parse(R"({"$ref": "other.json#/x"})")), kestrel::Error);
  // A cycle that consumes no instance ends with a reason, not a stack overflow: the count limit in a
  // normal build, the stack-bytes limit where frames are large (under ASan the count alone overflowed an
  // 8 MiB stack: fuzz_json_schema's crash input, next to $defs and with an object instance).
  const JsonSchema loop(json::parse(R"({"$ref": "#"})"));
  EXPECT_NE(loop.validate(1).find("$ref cycle?"), std::string::npos);
  const JsonSchema loop2(json::parse(R"({"$defs": {"n": {"type": "object", "properties": {"k": {"type": "array",
      "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#"})"));
  EXPECT_NE(loop2.validate(json::parse(R"({"k": [{"k": []}, {}]})")).find("$ref cycle?"), std::string::npos);
  // A recursive schema over a deep instance: fine at 100 levels, a reason (not a crash) at 5,000.
  const JsonSchema nest(json::parse(R"({"type": "array", "items": {"$ref": "#"}})"));
  auto nested = [](int n) {
    json x = json::array();
    for (int i = 0; i < n; ++i) x = json::array({x});
    return x;
  };
  EXPECT_EQ(nest.validate(nested(100)), "");
  EXPECT_NE(nest.validate(nested(5000)).find("nested"), std::string::npos);
}

TEST(JsonSchema, LengthsCountCodePointsAndPatternsSearchCodePoints) {
  const json s = {{"type", "string"}, {"minLength", 2}, {"maxLength", 3}};
  EXPECT_TRUE(valid(s, "\xC3\xA9\xC3\xA9"));             // "éé": 4 bytes, 2 code points
  EXPECT_FALSE(valid(s, "\xF0\x9F\x98\x80"));            // one emoji: 4 bytes, 1 code point
  EXPECT_FALSE(valid(s, "\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9"));
  EXPECT_TRUE(valid({{"pattern", "^.$"}}, "\xC3\xA9"));   // '.' is one code point, not a byte
  EXPECT_TRUE(valid({{"pattern", "b+"}}, "abbc"));       // unanchored search
  EXPECT_FALSE(valid({{"pattern", "^b+$"}}, "abbc"));
  EXPECT_TRUE(valid({{"pattern", "^b+$"}}, 12));         // applies to strings only
  EXPECT_THROW(JsonSchema(json{{"pattern", "(unclosed"}}), kestrel::Error);
  SchemaOptions no_patterns;
  no_patterns.allow_patterns = false;
  EXPECT_THROW(JsonSchema(json{{"pattern", "a"}}, no_patterns), kestrel::Error);
  SchemaOptions short_input;
  short_input.max_pattern_input = 4;
  EXPECT_TRUE(JsonSchema(json{{"pattern", "a"}}, short_input).is_valid("\xC3\xA9\xC3\xA9" "a"));  // 3 code points
  EXPECT_NE(JsonSchema(json{{"pattern", "a"}}, short_input).validate("aaaaa").find("too long"), std::string::npos);
  // The default limit keeps the per-character recursion of std::regex far from the stack's end: a
  // long string is refused with a reason, not a crash.
  EXPECT_NE(JsonSchema(json{{"pattern", "^(a|b)*$"}}).validate(std::string(100000, 'a')).find("too long"),
            std::string::npos);
  EXPECT_TRUE(JsonSchema(json{{"pattern", "^(a|b)*$"}}).is_valid(std::string(1000, 'a')));
}

TEST(JsonSchema, NumbersCompareExactlyAcrossIntAndFloat) {
  EXPECT_TRUE(valid({{"maximum", 9007199254740993ll}}, 9007199254740993ll));
  EXPECT_FALSE(valid({{"maximum", 9007199254740992ll}}, 9007199254740993ll));  // equal as doubles, not as integers
  EXPECT_TRUE(valid({{"exclusiveMinimum", 0}}, 1e-300));
  EXPECT_FALSE(valid({{"exclusiveMinimum", 0}}, 0.0));
  EXPECT_TRUE(valid({{"multipleOf", 0.01}}, 19.99));
  EXPECT_FALSE(valid({{"multipleOf", 0.01}}, 19.995));
  EXPECT_FALSE(valid({{"multipleOf", 3}}, -7));
  EXPECT_TRUE(valid({{"multipleOf", 3}}, -9));
  EXPECT_TRUE(valid({{"enum", {1, "a"}}}, 1.0));
  EXPECT_TRUE(valid({{"const", json::parse(R"({"a": [1, 2.0]})")}}, json::parse(R"({"a": [1.0, 2]})")));
  EXPECT_FALSE(valid({{"uniqueItems", true}}, json::parse("[1, 1.0]")));
  EXPECT_TRUE(valid({{"uniqueItems", true}}, json::parse("[1, true]")));
}

TEST(JsonSchema, RefusesWhatItDoesNotImplement) {
  for (const char* s : {R"({"unevaluatedProperties": false})", R"({"$dynamicRef": "#x"})",
                        R"({"properties": {"a": {"$id": "http://x/a"}}})", R"({"exclusiveMinimum": true})",
                        R"({"type": "float"})", R"({"type": []})", R"({"required": "a"})", R"({"minLength": -1})",
                        R"({"minLength": 1.5})", R"({"multipleOf": 0})", R"({"properties": []})", R"({"allOf": []})",
                        R"({"items": 3})", R"({"maxItmes": 3})", R"({"$ref": "#foo"})", R"({"$ref": "#/a~2b"})", "3",
                        R"("string")"}) {
    SCOPED_TRACE(s);
    try {
      JsonSchema x(json::parse(s));
      ADD_FAILURE() << "accepted";
    } catch (const kestrel::Error& e) {
      EXPECT_NE(std::string(e.what()).find("schema"), std::string::npos) << e.what();
    }
  }
  // Annotations are accepted and do not constrain (format is an annotation in 2020-12).
  EXPECT_TRUE(valid(json::parse(R"({"title": "t", "description": "d", "format": "email", "examples": [1],
                                    "default": 2, "$comment": "c", "deprecated": true})"),
                    "not an email"));
}

TEST(JsonSchema, MessagesNameInstanceAndSchemaLocations) {
  const JsonSchema s(json::parse(R"({"type": "object", "required": ["city"],
      "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}},
      "additionalProperties": false})"));
  EXPECT_EQ(s.validate(json::parse(R"({"city": "x", "days": [1, 2]})")), "");
  EXPECT_EQ(s.validate(json::parse(R"({"days": []})")), "(root): required property 'city' is missing (schema /required)");
  EXPECT_EQ(s.validate(json::parse(R"({"city": "x", "days": [1, "2"]})")),
            "/days/1: \"2\" is not of type \"integer\" (schema /properties/days/items/type)");
  EXPECT_EQ(s.validate(json::parse(R"({"city": "x", "unit": "c"})")),
            "/unit: property 'unit' is not allowed (schema /additionalProperties)");
  // Deep nesting is refused, not a stack overflow.
  json deep = json::object();
  for (int i = 0; i < 2000; ++i) deep = json{{"not", deep}};
  EXPECT_THROW(JsonSchema{deep}, kestrel::Error);
}

TEST(JsonSchema, UnknownKeywordsOnlyAsTargetsOfRef) {
  // A container of subschemas under a name of its own is fine when a $ref points into it, and what it
  // holds is checked like any schema; unreferenced, the name is an unsupported keyword.
  const json s = json::parse(R"({"my-defs": {"city": {"type": "string"}}, "properties": {"c": {"$ref": "#/my-defs/city"}}})");
  EXPECT_TRUE(valid(s, json::parse(R"({"c": "Oslo"})")));
  EXPECT_FALSE(valid(s, json::parse(R"({"c": 1})")));
  EXPECT_THROW(JsonSchema(json::parse(R"({"my-defs": {"city": {"type": "string"}}})")), kestrel::Error);
  EXPECT_THROW(JsonSchema(json::parse(R"({"my-defs": {"city": {"typo": 1}}, "$ref": "#/my-defs/city"})")),
               kestrel::Error);
  // A root $id stays a root $id when "$ref": "#" re-checks the root.
  EXPECT_TRUE(valid(json::parse(R"({"$id": "https://x/s", "properties": {"n": {"$ref": "#"}}})"),
                    json::parse(R"({"n": {"n": {}}})")));
}
