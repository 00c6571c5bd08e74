// Budget-aware completion through the engine (docs/structured-outputs.md, "Finishing within max_tokens";
// OutputConstraint::complete_within_max_tokens):
//  - a model that never closes a string (a scripted fake executor behind the real engine): complete and
//    valid within every max_tokens from the shortest answer up (finish stop), the old cut (finish length)
//    with the option off, the refusal naming max_tokens below the shortest answer; the chat grammar with
//    a think section the model never closes either;
//  - the nano checkpoint's real forward with random sampling and no closing bias (its random weights
//    rarely close anything) over every JSON-Schema-Test-Suite draft-7 schema the compiler accepts, with
//    max_tokens from the shortest answer to a few dozen above: every document ends within max_tokens,
//    parses and validates.
#include <gtest/gtest.h>

#include "evalclient/json_schema.h"
#include "runtime/constraints.h"
#include "runtime/fake_executor.h"
#include "structured/cache.h"
#include "structured/chat_grammar.h"
#include "test_engine_structured_util.h"

namespace kestrel {
namespace {

using namespace engine_structured_testing;
using runtime::Engine;  // not kestrel::Engine, the interface

// A model that never closes a string (it always wants "a", as k3-tiny in json_object mode): with
// complete_within_max_tokens the document is complete and valid within max_tokens for every max_tokens
// from the shortest answer up (finish stop); without it the string runs to max_tokens (finish length);
// below the shortest answer the request is refused naming max_tokens. Then the same through the chat
// grammar with a think section the model would never close either.
TEST(EngineStructured, CompleteWithinMaxTokensClosesWhatTheModelWouldNot) {
  const int32_t a = int32_t(*nano().tok->base_id("a"));
  EngineConfig cfg;
  cfg.memory_budget = 64 << 20;
  cfg.make_executor = runtime::fake_executor_factory(nano().cfg.text.vocab_size, {{a}, {}});
  Engine e(nano().cfg, cfg);
  Sink sink;
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {"name": {"type": "string"},
      "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}}, "required": ["name", "tags"],
      "additionalProperties": false})");
  OutputConstraint c = document(schema);
  c.complete_within_max_tokens = true;
  const uint32_t shortest = runtime::SeqConstraint(c.grammar, {end_of_msg()}).min_completion();
  EXPECT_LE(shortest, 22u);  // {"name":"","tags":[""]} is 22 bytes, then the end token; every byte is a token
  Request r;
  r.prompt = prompt_of("x");
  r.constraint = c;
  const std::vector<int32_t> budgets = {int32_t(shortest), int32_t(shortest) + 2, 40, 90};
  for (size_t i = 0; i < budgets.size(); ++i) {
    r.max_tokens = budgets[i];
    ASSERT_TRUE(e.submit(r, sink(int(i))).accepted());
  }
  r.constraint->complete_within_max_tokens = false;
  r.max_tokens = 40;
  ASSERT_TRUE(e.submit(r, sink(100)).accepted());
  r.constraint->complete_within_max_tokens = true;
  r.max_tokens = int32_t(shortest) - 1;
  try {
    e.submit(r, sink(101));
    ADD_FAILURE() << "max_tokens below the shortest answer was accepted";
  } catch (const RequestError& err) {
    EXPECT_EQ(err.field, "max_tokens");
    EXPECT_NE(std::string(err.what()).find(std::to_string(shortest) + " tokens"), std::string::npos) << err.what();
  }
  // The refusal names the budget as the client spelled it (Request::max_tokens_field).
  r.max_tokens_field = "max_completion_tokens";
  try {
    e.submit(r, sink(102));
    ADD_FAILURE() << "max_tokens below the shortest answer was accepted";
  } catch (const RequestError& err) {
    EXPECT_EQ(err.field, "max_completion_tokens");
    EXPECT_EQ(std::string(err.what()).rfind("max_completion_tokens is ", 0), 0u) << err.what();
    EXPECT_NE(std::string(err.what()).find("raise max_completion_tokens"), std::string::npos) << err.what();
  }
  r.max_tokens_field = "max_tokens";
  e.wait_idle();
  for (size_t i = 0; i < budgets.size(); ++i) {
    SCOPED_TRACE(budgets[i]);
    const Result out = sink.get(int(i));
    ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
    EXPECT_LE(int32_t(out.tokens.size()), budgets[i]);
    EXPECT_EQ(out.tokens.back(), end_of_msg());
    const std::string text = text_of(out.tokens);
    const json doc = json::parse(text, nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << text;
    EXPECT_EQ(eval::JsonSchema(json::parse(schema.dump())).validate(doc), "") << text;
    if (budgets[i] == 90) {
      EXPECT_GT(text.size(), 40u) << "far from the end the model writes what it wants";
    }
  }
  const Result cut = sink.get(100);
  EXPECT_EQ(cut.finish, FinishReason::length);
  EXPECT_TRUE(json::parse(text_of(cut.tokens), nullptr, false).is_discarded()) << text_of(cut.tokens);

  // The chat grammar: think section, then the JSON answer, then the message's end.
  structured::GrammarCache cache(nano_vocab(), 16, {}, limits());
  structured::ChatGrammarSpec spec;
  spec.response_schema = schema;
  OutputConstraint chat = structured::constraint_of(spec, OutputConstraint::Format::json_schema);
  chat.grammar = structured::compile(cache, chat);
  chat.complete_within_max_tokens = true;
  const uint32_t chat_shortest = runtime::SeqConstraint(chat.grammar, {}).min_completion();
  r.constraint = chat;
  r.max_tokens = int32_t(chat_shortest) + 3;
  ASSERT_TRUE(e.submit(r, sink(200)).accepted());
  e.wait_idle();
  const Result out = sink.get(200);
  ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
  EXPECT_LE(out.tokens.size(), size_t(r.max_tokens));
  EXPECT_EQ(out.tokens.back(), end_of_msg());
  std::string full;  // special tokens by name
  for (int32_t t : out.tokens) full += nano().tok->token_bytes(tok::TokenId(t));
  const std::string open = "<|open|>response<|sep|>", close = "<|close|>response<|sep|>";
  const size_t from = full.rfind(open), to = full.rfind(close);
  ASSERT_TRUE(from != std::string::npos && to != std::string::npos && from < to) << full;
  const json doc = json::parse(full.substr(from + open.size(), to - from - open.size()), nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << full;
  EXPECT_EQ(eval::JsonSchema(json::parse(schema.dump())).validate(doc), "") << full;
}

// The suite on nano, budgets from the shortest answer up: no document is cut, every one validates.
TEST(EngineStructured, SuiteSchemasFinishWithinMaxTokensOnNano) {
  int refused = 0;
  const std::vector<SuiteTarget> targets = suite_targets(refused);
  ASSERT_GT(targets.size(), 50u);
  Engine e(nano().w, nano().cfg, nano_engine_config(32));
  Sink sink;
  const auto prompt = prompt_of("Write a JSON value:");
  const int extra[] = {0, 1, 4, 30};  // max_tokens = the shortest answer + this
  std::vector<int32_t> max_tokens(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    Request r;
    r.prompt = prompt;
    r.constraint = targets[i].c;
    r.constraint->complete_within_max_tokens = true;
    const uint32_t shortest = runtime::SeqConstraint(r.constraint->grammar, {end_of_msg()}).min_completion();
    r.max_tokens = max_tokens[i] = int32_t(shortest) + extra[i % 4];
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 7000 + i;
    ASSERT_TRUE(e.submit(std::move(r), sink(int(i))).accepted()) << targets[i].name;
  }
  e.wait_idle();
  size_t tokens = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    SCOPED_TRACE(targets[i].name + ", max_tokens " + std::to_string(max_tokens[i]));
    const Result r = sink.get(int(i));
    ASSERT_EQ(r.finish, FinishReason::stop) << r.error;
    ASSERT_LE(int32_t(r.tokens.size()), max_tokens[i]);
    ASSERT_EQ(r.tokens.back(), end_of_msg());
    const std::string text = text_of(r.tokens);
    const json doc = json::parse(text, nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << "not JSON: " << text;
    EXPECT_EQ(eval::JsonSchema(targets[i].validator_schema).validate(doc), "") << text;
    tokens += r.tokens.size();
  }
  std::printf("suite on nano within max_tokens: %zu schemas, %zu tokens, all complete and valid\n", targets.size(),
              tokens);
}

}  // namespace
}  // namespace kestrel
