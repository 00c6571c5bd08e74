// Structured outputs (src/structured): the vocabulary trie, the grammar builder, the matcher's table
// masks against exhaustive walks, and the JSON Schema compiler over the official JSON-Schema-Test-Suite.
//
// The suite is used twice, over the draft-7 files our validator runs (test_json_schema.cpp, same
// exclusions): (1) every schema the compiler accepts is a generation target — seeded random walks
// through the masks over the real k3-tiny vocabulary, every finished document must parse and
// validate with our validator (src/evalclient/json_schema), and along the way the table masks must
// equal the exhaustive ones; (2) every document of the suite's "valid" lists is fed token by token
// (tokenised with the real tokenizer) and must be accepted, except where the grammar is documented
// to be narrower (kNarrower, each with its reason, checked to still exist). Schemas the compiler
// refuses must be refused with an error naming the keyword.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/check.h"
#include "evalclient/json_schema.h"
#include "structured/cache.h"
#include "structured/json_schema_grammar.h"

#include <thread>
#include "test_structured_util.h"

namespace kestrel::structured {
namespace {

using testing::k3_tokenizer;
using testing::k3_vocab;
using testing::random_walk;
using json = nlohmann::json;

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

TokenId end_of_msg() { return k3_tokenizer().require_special("<|end_of_msg|>"); }

std::shared_ptr<const CompiledGrammar> compile(const std::string& schema, SchemaOptions opt = {},
                                               SchemaLimits lim = testing::test_limits()) {
  return compile_json_schema(k3_vocab(), ojson::parse(schema), opt, lim);
}

// Whether the matcher accepts `text` (tokenised by the real tokenizer) and may end after it.
bool accepts(const std::shared_ptr<const CompiledGrammar>& g, const std::string& text) {
  Matcher m(g, {end_of_msg()});
  for (TokenId id : k3_tokenizer().encode(text))
    if (!m.accept(id)) return false;
  return m.can_end();
}

TEST(StructuredVocab, TrieHoldsEveryOrdinaryTokenOnceInPreorder) {
  const TokenVocab& v = *k3_vocab();
  const auto& trie = v.trie();
  std::vector<int> seen(k3_tokenizer().num_base_tokens(), 0);
  std::vector<std::string> path(1);  // path[d]: bytes of the current node at depth d
  for (uint32_t i = 1; i < trie.size(); ++i) {
    const auto& n = trie[i];
    ASSERT_GE(n.depth, 1);
    ASSERT_LE(size_t(n.depth), path.size());
    path.resize(n.depth + 1);
    path[n.depth] = path[n.depth - 1] + char(n.byte);
    const std::string& bytes = path[n.depth];
    ASSERT_GT(n.end, i);
    ASSERT_LE(n.end, trie.size());
    for (uint32_t j = i + 1; j < n.end; ++j) ASSERT_GT(trie[j].depth, n.depth);  // the range is the subtree
    if (n.token != kNoToken) {
      ASSERT_LT(n.token, seen.size());
      EXPECT_EQ(v.bytes(n.token), bytes);
      ++seen[n.token];
    }
  }
  for (size_t id = 0; id < seen.size(); ++id) EXPECT_EQ(seen[id], 1) << "token " << id;
  EXPECT_EQ(v.mask_words(), (k3_tokenizer().vocab_size() + 31) / 32);
  EXPECT_THROW(TokenVocab(k3_tokenizer(), 10), Error);
}

TEST(StructuredGrammar, BuilderDeterminisesTrimsAndRefusesLeftRecursion) {
  {
    GrammarBuilder b;
    const uint32_t r = b.add_rule("r");
    // ("ab" | "ac")* "d", plus an alternative that can never finish.
    b.set_body(r, b.alt({b.seq(b.star(b.alt({b.literal("ab"), b.literal("ac")})), b.literal("d")),
                         b.seq(b.literal("x"), b.nothing())}));
    const Grammar g = b.build(r);
    EXPECT_TRUE(g.recognizes("d"));
    EXPECT_TRUE(g.recognizes("abacd"));
    EXPECT_FALSE(g.recognizes("abc"));
    EXPECT_FALSE(g.recognizes("x"));
    EXPECT_EQ(g.step(g.rules[r].start, 'x'), kDead);  // trimmed: 'x' leads nowhere
  }
  {
    GrammarBuilder b;
    const uint32_t a = b.add_rule("a"), c = b.add_rule("c");
    b.set_body(a, b.alt({b.seq(b.call(c), b.literal("!")), b.literal("z")}));
    b.set_body(c, b.seq(b.opt(b.literal("q")), b.call(a)));  // a -> c -> a reading nothing
    try {
      b.build(a);
      ADD_FAILURE() << "left recursion accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("recursion that reads no input"), std::string::npos) << e.what();
    }
  }
  {
    GrammarBuilder b;
    const uint32_t r = b.add_rule("r");
    b.set_body(r, b.seq(b.literal("a"), b.nothing()));
    EXPECT_THROW(b.build(r), Error);
  }
}

TEST(StructuredMatcher, MasksAcceptRollbackAndStop) {
  const auto g = compile(R"({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                             "additionalProperties": false})");
  Matcher m(g, {end_of_msg()});
  std::vector<uint32_t> mask(m.mask_words());
  EXPECT_FALSE(m.can_end());
  ASSERT_TRUE(m.accept_bytes("{\"ok\":"));
  m.fill_mask(mask.data());
  const auto t = k3_tokenizer().base_id("t"), f = k3_tokenizer().base_id("f"), q = k3_tokenizer().base_id("\"");
  ASSERT_TRUE(t && f && q);
  EXPECT_TRUE(mask_test(mask.data(), *t));
  EXPECT_TRUE(mask_test(mask.data(), *f));
  EXPECT_FALSE(mask_test(mask.data(), *q));
  EXPECT_FALSE(mask_test(mask.data(), end_of_msg()));
  EXPECT_FALSE(m.accept(*q));  // refused, state unchanged
  ASSERT_TRUE(m.accept_bytes("true}"));
  EXPECT_TRUE(m.can_end());
  m.fill_mask(mask.data());
  EXPECT_TRUE(mask_test(mask.data(), end_of_msg()));
  const size_t n = m.num_accepted();
  ASSERT_TRUE(m.accept(end_of_msg()));
  EXPECT_TRUE(m.is_terminated());
  EXPECT_FALSE(m.fill_mask(mask.data()));
  m.rollback(m.num_accepted() - n + 1);  // undo the stop and "true}"
  EXPECT_FALSE(m.can_end());
  ASSERT_TRUE(m.accept_bytes("false }"));
  EXPECT_TRUE(m.can_end());
  EXPECT_THROW(m.rollback(100), Error);
}

// Number bounds are exact as the validator compares them (doubles, 15 significant digits).
TEST(StructuredSchema, NumberBoundsAndFormats) {
  auto doc = [](const char* schema, const char* text) { return json_schema_grammar(ojson::parse(schema)).recognizes(text); };
  EXPECT_TRUE(doc(R"({"type": "integer", "minimum": 1, "maximum": 14})", "14"));
  EXPECT_FALSE(doc(R"({"type": "integer", "minimum": 1, "maximum": 14})", "15"));
  EXPECT_FALSE(doc(R"({"type": "integer", "minimum": 1, "maximum": 14})", "0"));
  EXPECT_FALSE(doc(R"({"type": "integer", "minimum": 1, "maximum": 14})", "1.0"));
  EXPECT_FALSE(doc(R"({"type": "number", "exclusiveMaximum": 0.1})", "0.1"));
  EXPECT_FALSE(doc(R"({"type": "number", "exclusiveMaximum": 0.1})", "0.10"));
  EXPECT_TRUE(doc(R"({"type": "number", "exclusiveMaximum": 0.1})", "0.0999"));
  EXPECT_TRUE(doc(R"({"type": "number", "minimum": -5})", "-5.000"));
  EXPECT_FALSE(doc(R"({"type": "number", "minimum": -5})", "-5.0001"));
  EXPECT_TRUE(doc(R"({"type": "number", "minimum": -5})", "-0"));
  EXPECT_FALSE(doc(R"({"type": "number", "exclusiveMinimum": 0})", "-0.0"));
  EXPECT_TRUE(doc(R"({"type": "number", "exclusiveMinimum": 0})", "0.001"));
  EXPECT_TRUE(doc(R"({"type": "number", "minimum": 1.5, "maximum": 1.5})", "1.50"));
  EXPECT_FALSE(doc(R"({"type": "integer", "minimum": 1.5, "maximum": 2.5})", "1"));
  EXPECT_TRUE(doc(R"({"type": "integer", "minimum": 1.5, "maximum": 2.5})", "2"));
  EXPECT_TRUE(doc(R"({"type": "number"})", "-12.5e+07"));
  EXPECT_FALSE(doc(R"({"type": "number"})", "1e999"));  // exponents have at most 2 digits (no overflow)
  EXPECT_FALSE(doc(R"({"type": "number"})", "01"));
  EXPECT_TRUE(doc(R"({"type": "string", "format": "date"})", R"("2024-02-29")"));
  EXPECT_FALSE(doc(R"({"type": "string", "format": "date"})", R"("2024-13-01")"));
  EXPECT_TRUE(doc(R"({"type": "string", "format": "date-time"})", R"("2024-02-29T23:59:60.5+01:00")"));
  EXPECT_TRUE(doc(R"({"type": "string", "format": "uuid"})", R"("123e4567-e89b-12d3-a456-426614174000")"));
  EXPECT_FALSE(doc(R"({"type": "string", "format": "ipv4"})", R"("256.1.1.1")"));
  EXPECT_TRUE(doc(R"({"type": "string", "format": "email"})", R"("a.b@example.org")"));
  EXPECT_TRUE(doc(R"({"type": "string", "minLength": 2, "maxLength": 3})", "\"\xC3\xA9\\u00e9\""));  // 2 characters
  EXPECT_FALSE(doc(R"({"type": "string", "maxLength": 1})", R"("ab")"));
  EXPECT_FALSE(doc(R"({"type": "string"})", R"("\ud800")"));  // lone surrogate: nlohmann refuses it
  EXPECT_TRUE(doc(R"({"type": "string"})", R"("\ud83d\ude00")"));
}

TEST(StructuredSchema, ObjectsFollowDeclarationOrderRequiredAndAdditional) {
  const char* s = R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                      "c": {"type": "boolean"}}, "required": ["b"]})";
  auto doc = [&](const char* text, SchemaOptions o = {}) { return json_schema_grammar(ojson::parse(s), o).recognizes(text); };
  EXPECT_TRUE(doc(R"({"b":"x"})"));
  EXPECT_TRUE(doc(R"({"a": 1, "b": "x", "c": true})"));
  EXPECT_TRUE(doc(R"({ "b" : "x" , "c" : false })"));
  EXPECT_FALSE(doc(R"({"a":1})"));            // required b missing
  EXPECT_FALSE(doc(R"({"b":"x","a":1})"));    // declaration order
  EXPECT_FALSE(doc(R"({"b":"x","d":1})"));    // closed by default (strict)
  SchemaOptions open;
  open.strict_objects = false;
  EXPECT_TRUE(doc(R"({"b":"x","d":1})", open));
  EXPECT_FALSE(doc(R"({"b":"x","a":1})", open));  // "a" is declared: not an additional key
  EXPECT_FALSE(doc(R"({"b":"x","d":1,"e":[]} )" "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n"));  // whitespace is bounded
  EXPECT_TRUE(json_schema_grammar(ojson::parse(R"({"type": "object"})")).recognizes(R"({"any": {"x": [1, null]}})"));
}

TEST(StructuredSchema, RefusalsNameTheKeywordAndPointer) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"({"properties": {"a": {"not": {"type": "string"}}}})", "'not'"},
      {R"({"properties": {"a": {"pattern": "^a"}}})", "'pattern'"},
      {R"({"type": "array", "uniqueItems": true})", "'uniqueItems'"},
      {R"({"patternProperties": {"^x": {}}})", "'patternProperties'"},
      {R"({"maxItmes": 3})", "'maxItmes'"},
      {R"({"type": "string", "format": "ipv6"})", "format 'ipv6'"},
      {R"({"oneOf": [{"type": "integer"}, {"type": "number"}]})", "oneOf"},
      {R"({"$ref": "#/$defs/missing"})", "does not resolve"},
      {R"({"$ref": "http://example.com/s.json"})", "only references inside the document"},
      {R"({"type": "integer", "minimum": 5, "maximum": 1})", "admits no value"},
  };
  for (const auto& [schema, needle] : cases) {
    SCOPED_TRACE(schema);
    try {
      json_schema_grammar(ojson::parse(schema));
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  try {
    json_schema_grammar(ojson::parse(R"({"properties": {"a": {"items": {"not": {}}}}})"));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/properties/a/items/not"), std::string::npos) << e.what();
  }
}

TEST(StructuredSchema, AdversarialSchemasAreRefusedOrBounded) {
  // Deep nesting: refused at the depth limit, quickly.
  std::string deep = "true";
  for (int i = 0; i < 5000; ++i) deep = R"({"type": "array", "items": )" + deep + "}";
  EXPECT_THROW(json_schema_grammar(ojson::parse(deep)), Error);
  // 100,000-value enum: refused with the limit named.
  ojson big = ojson::array();
  for (int i = 0; i < 100000; ++i) big.push_back("v" + std::to_string(i));
  try {
    json_schema_grammar(ojson{{"enum", big}});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("100000 values"), std::string::npos) << e.what();
  }
  // Under a raised limit the same enum compiles within the state limit or is refused by it.
  SchemaLimits raised = testing::test_limits();
  raised.max_enum_values = 200000;
  raised.max_states = 50000;
  EXPECT_THROW(json_schema_grammar(ojson{{"enum", big}}, {}, raised), Error);
  // Recursion that reads nothing is refused; recursion through a container compiles and generates.
  EXPECT_THROW(json_schema_grammar(ojson::parse(R"({"$ref": "#"})")), Error);
  EXPECT_THROW(json_schema_grammar(ojson::parse(R"({"anyOf": [{"type": "null"}, {"$ref": "#"}]})")), Error);
  const auto tree = compile(R"({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array",
      "items": {"$ref": "#/$defs/n"}}}, "additionalProperties": false}}, "$ref": "#/$defs/n"})");
  EXPECT_TRUE(accepts(tree, R"({"kids":[{"kids":[]},{}]})"));
  // The time limit ends a compilation that would take long.
  SchemaLimits quick;
  quick.max_compile_seconds = 1e-6;
  EXPECT_THROW(compile(R"({"type": "object", "properties": {"a": {"type": "string"}}})", {}, quick), Error);
  // Nesting beyond the matcher's stack limit is cut, the masks stay consistent near it, and none is
  // empty: near the limit a token is allowed only if the document can still be finished within it.
  SchemaLimits shallow = testing::test_limits();
  shallow.max_stack_depth = 6;
  const auto g = compile("true", {}, shallow);
  std::mt19937 rng(3);
  for (int i = 0; i < 20; ++i) {
    const auto w = random_walk(g, rng, 80, {end_of_msg()}, "[{", 0.8, 1);
    EXPECT_EQ(w.failure, "");
  }
}

TEST(StructuredCache, CompilesOncePerCanonicalSchemaAndCachesRefusals) {
  GrammarCache cache(k3_vocab(), 2, {}, testing::test_limits());
  const ojson a = ojson::parse(R"({"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}})");
  const ojson b = ojson::parse(R"({"type": "object", "properties": {"y": {"type": "string"}, "x": {"type": "integer"}}})");
  std::vector<std::shared_ptr<const CompiledGrammar>> got(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { got[i] = cache.json_schema(a); });
  for (auto& t : threads) t.join();
  for (int i = 1; i < 4; ++i) EXPECT_EQ(got[i], got[0]);  // one compilation, shared
  EXPECT_EQ(cache.stats().misses, 1u);
  EXPECT_EQ(cache.stats().hits, 3u);
  EXPECT_NE(cache.json_schema(b), got[0]);  // key order is part of the key: properties come in that order
  const ojson bad = ojson::parse(R"({"type": "string", "pattern": "^a"})");
  EXPECT_THROW(cache.json_schema(bad), Error);
  EXPECT_THROW(cache.json_schema(bad), Error);
  EXPECT_EQ(cache.stats().misses, 3u);  // the refusal was cached (and evicted a, with 2 entries)
  EXPECT_EQ(cache.stats().entries, 2u);
  EXPECT_NE(cache.json_schema(a), nullptr);
  EXPECT_EQ(cache.stats().misses, 4u);
}

// The suite's draft-7 groups, each with its schema compiled (nullptr when refused).
struct SuiteGroup {
  std::string file, description;
  ojson schema;
  json validator_schema;
  std::vector<std::pair<json, bool>> tests;  // (data, valid)
  std::vector<ojson> valid_docs;             // the valid data, in file key order
};

const std::vector<SuiteGroup>& suite() {
  static const std::vector<SuiteGroup> groups = [] {
    std::vector<SuiteGroup> out;
    for (const auto& name : kSuiteFiles) {
      std::ifstream f(std::string(kSuiteDir) + "/" + name + ".json");
      if (!f) continue;
      const ojson doc = ojson::parse(f);
      for (const auto& g : doc) {
        const std::string desc = g["description"].get<std::string>();
        if (kExcludedGroups.count({name, desc})) continue;
        SuiteGroup s{name, desc, g["schema"], json::parse(g["schema"].dump()), {}, {}};
        for (const auto& t : g["tests"]) {
          s.tests.push_back({json::parse(t["data"].dump()), t["valid"].get<bool>()});
          if (t["valid"].get<bool>()) s.valid_docs.push_back(t["data"]);
        }
        out.push_back(std::move(s));
      }
    }
    return out;
  }();
  return groups;
}

// Valid documents the grammar does not produce, by (file, group): why. Each must still reject
// something (so the list cannot hide a regression silently once the cause is gone).
const std::map<std::pair<std::string, std::string>, const char*> kNarrower = {
    {{"allOf", "allOf"}, "properties are written in declaration order (allOf merges bar before foo)"},
    {{"allOf", "allOf with base schema"}, "properties are written in declaration order"},
    {{"const", "const with object"}, "a const object is written as declared (key order)"},
};

TEST(StructuredSuite, EveryAcceptedSchemaGeneratesValidDocumentsAndAcceptsTheValidOnes) {
  ASSERT_TRUE(std::filesystem::is_directory(kSuiteDir)) << kSuiteDir << " missing (json-schema-test-suite)";
  ASSERT_GT(suite().size(), 100u);
  int accepted = 0, refused = 0, walks = 0, finished = 0, valid_docs = 0, valid_accepted = 0;
  std::map<std::string, int> refused_by;
  std::set<std::pair<std::string, std::string>> narrower_seen;
  std::mt19937 rng(20240601);
  for (const SuiteGroup& g : suite()) {
    SCOPED_TRACE(g.file + " / " + g.description);
    std::shared_ptr<const CompiledGrammar> strict, open;
    SchemaOptions o;
    o.strict_objects = false;
    try {
      strict = compile_json_schema(k3_vocab(), g.schema, {}, testing::test_limits());
      open = compile_json_schema(k3_vocab(), g.schema, o, testing::test_limits());
    } catch (const Error& e) {
      ++refused;
      // The error names a keyword of the schema (quoted) or says why no value exists.
      const std::string what = e.what();
      const size_t q = what.find("keyword '");
      std::string kw = q == std::string::npos ? "" : what.substr(q + 9, what.find('\'', q + 9) - q - 9);
      if (kw.empty() && what.find("oneOf") != std::string::npos) kw = "oneOf";
      if (kw.empty() && what.find("admits no value") != std::string::npos) kw = "(unsatisfiable)";
      if (kw.empty() && what.find("cannot combine") != std::string::npos) kw = "(allOf merge)";
      EXPECT_FALSE(kw.empty()) << "refusal without a keyword: " << what;
      if (!kw.empty() && kw[0] != '(') {
        EXPECT_NE(g.schema.dump().find("\"" + kw + "\""), std::string::npos) << what;
      }
      ++refused_by[kw];
      continue;
    }
    ++accepted;
    const eval::JsonSchema validator(g.validator_schema);
    for (const auto* cg : {&strict, &open}) {
      for (int i = 0; i < 6; ++i) {
        const auto w = random_walk(*cg, rng, 160, {end_of_msg()});
        ++walks;
        ASSERT_TRUE(w.failure.empty()) << w.failure;
        if (!w.finished) continue;
        ++finished;
        const json doc = json::parse(w.text, nullptr, false);
        ASSERT_FALSE(doc.is_discarded()) << "not JSON: " << w.text;
        EXPECT_EQ(validator.validate(doc), "") << "generated: " << w.text;
      }
    }
    for (const ojson& d : g.valid_docs) {
      ++valid_docs;
      const bool ok = accepts(open, d.dump()) || accepts(open, d.dump(2));
      valid_accepted += ok;
      if (!ok) {
        if (kNarrower.count({g.file, g.description})) {
          narrower_seen.insert({g.file, g.description});
        } else {
          ADD_FAILURE() << "valid document refused: " << d.dump();
        }
      }
    }
  }
  for (const auto& [k, why] : kNarrower) EXPECT_TRUE(narrower_seen.count(k)) << k.first << " / " << k.second << ": gone";
  std::string by;
  for (const auto& [k, n] : refused_by) by += " " + k + "=" + std::to_string(n);
  std::printf("JSON-Schema-Test-Suite draft7 as generation targets: %zu groups, %d compiled, %d refused (%s); "
              "%d walks, %d finished and valid; valid documents accepted %d of %d\n",
              suite().size(), accepted, refused, by.c_str() + 1, walks, finished, valid_accepted, valid_docs);
  EXPECT_GT(accepted, 50);
  EXPECT_GT(finished, walks / 2);
}

}  // namespace
}  // namespace kestrel::structured
