// min_tokens against a grammar's forced end (docs/structured-outputs.md, "min_tokens"): min_tokens holds
// the stop ids back only while the grammar allows something else; where it allows nothing but an end (a
// JSON answer that is complete before min_tokens, a budget's last token) the end is drawn, the request
// ends `stop` with fewer than min_tokens tokens, and no row reaches a sampler with every id at −inf.
// Before, that row was all −inf: the draw landed on a masked id and the request ended with an error.
//  - a scripted model that always wants to end (the real engine over a fake executor, the host sampler):
//    an enum with min_tokens within its longest document is held to min_tokens (the hold still works
//    where the grammar allows more); above it, the answer ends complete and valid before min_tokens
//    (document and chat grammar); an unbounded array with min_tokens = max_tokens under the budget ends
//    with the end as its last, max_tokens-th token;
//  - the same through an executor that samples as a device executor does (sampling_inputs' stop ids
//    held back on its own logits, token_mask rows, check_token): it never sees an all-masked row;
//  - the nano checkpoint's real forward with random sampling: the suite's bounded schemas with a
//    min_tokens above their longest documents end stop, valid.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "evalclient/json_schema.h"
#include "runtime/constraints.h"
#include "runtime/fake_executor.h"
#include "structured/cache.h"
#include "structured/chat_grammar.h"
#include "test_engine_structured_util.h"

namespace kestrel {
namespace {

using namespace engine_structured_testing;
using runtime::Engine;

// Samples the way a device executor does: the stop ids sampling_inputs hands over are set to −inf on the
// executor's own copy of the logits while the output is shorter than min_tokens, the mask row from
// token_mask is applied, greedy argmax; check_token before take_token, sample_penalised for a refused
// token. The logits are a script (logit 20 on `want`). Counts the rows that reach the draw all −inf.
class MinTokensDevice : public runtime::StepExecutor {
 public:
  MinTokensDevice(int64_t V, int32_t want, int* all_masked) : V_(V), want_(want), all_masked_(all_masked) {}
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    sched::StepResult result;
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const sched::ScheduledSeq& x : *list) {
        if (!x.sample) continue;
        const runtime::StepHooks::SamplingInputs in = hooks.sampling_inputs(x);
        std::vector<float> logits(size_t(V_), 0.0f);
        logits[size_t(want_)] = 20.0f;
        const float ninf = -std::numeric_limits<float>::infinity();
        if (in.output.size() < size_t(in.params->min_tokens))
          for (int32_t t : in.stop_ids) logits[size_t(t)] = ninf;
        const runtime::StepHooks::TokenMask m = hooks.token_mask(x);
        if (m.row >= 0)
          runtime::apply_token_mask(logits, hooks.mask_table.data + int64_t(m.row) * hooks.mask_table.words);
        const auto best = std::max_element(logits.begin(), logits.end());
        if (std::isinf(*best) && *best < 0) ++*all_masked_;
        const int32_t token = int32_t(best - logits.begin());
        sched::SeqResult r = hooks.check_token(x, token) ? hooks.take_token(x, token) : hooks.sample_penalised(x, logits);
        r.id = x.id;
        result.seqs.push_back(r);
        ++stats_.samples;
      }
    ++stats_.steps;
    return result;
  }
  const runtime::ExecutorStats& stats() const override { return stats_; }

 private:
  int64_t V_;
  int32_t want_;
  int* all_masked_;
  runtime::ExecutorStats stats_;
};

json parse_doc(const std::vector<int32_t>& tokens) { return json::parse(text_of(tokens), nullptr, false); }

std::string validate_doc(const ojson& schema, const json& doc) {
  return eval::JsonSchema(json::parse(schema.dump())).validate(doc);
}

// A model that always wants to end, through the host sampler and through the device-like one. Greedy
// among equal logits takes the lowest id, so the script's model otherwise writes the lowest ids allowed.
TEST(EngineStructured, MinTokensYieldsToTheGrammarsEnd) {
  // ≤ 16 whitespace bytes before and after "yes": at most 37 tokens and the end, below min_tokens = 60.
  const ojson bounded = ojson::parse(R"({"enum": ["yes", "no"]})");
  const ojson unbounded = ojson::parse(R"({"type": "array", "items": {"type": "integer"}})");
  for (const bool device : {false, true}) {
    SCOPED_TRACE(device ? "device-like sampler" : "host sampler");
    int all_masked = 0;
    EngineConfig cfg;
    cfg.memory_budget = 64 << 20;
    const int64_t V = nano().cfg.text.vocab_size;
    const int32_t end = end_of_msg();
    if (device)
      cfg.make_executor = [&](const CacheFormats&, const cache::CacheConfig&) {
        return std::unique_ptr<runtime::StepExecutor>(std::make_unique<MinTokensDevice>(V, end, &all_masked));
      };
    else
      cfg.make_executor = runtime::fake_executor_factory(V, {{end}, {}});
    Engine e(nano().cfg, cfg);
    Sink sink;
    int next_key = 0;
    auto run = [&](const OutputConstraint& c, int32_t max_tokens, int32_t min_tokens, bool budget) {
      Request r;
      r.prompt = prompt_of("x");
      r.constraint = c;
      r.constraint->complete_within_max_tokens = budget;
      r.max_tokens = max_tokens;
      r.sampling.min_tokens = min_tokens;
      const int k = next_key++;
      EXPECT_TRUE(e.submit(r, sink(k)).accepted());
      e.wait_idle();
      return sink.get(k);
    };
    auto check = [&](const Result& out, const ojson& schema) {
      ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
      EXPECT_EQ(out.tokens.back(), end);
      const json doc = parse_doc(out.tokens);
      ASSERT_FALSE(doc.is_discarded()) << text_of(out.tokens);
      EXPECT_EQ(validate_doc(schema, doc), "") << text_of(out.tokens);
    };
    // No min_tokens: the model ends as soon as the grammar lets it.
    const Result first = run(document(bounded), 80, 0, false);
    check(first, bounded);
    const size_t shortest = first.tokens.size();
    ASSERT_LT(shortest + 3, 37u);
    // min_tokens within the longest document: held until then (whitespace after the value), then the end.
    const Result held = run(document(bounded), 80, int32_t(shortest) + 3, false);
    check(held, bounded);
    EXPECT_GE(held.tokens.size(), shortest + 4) << "no stop id before min_tokens tokens";
    // min_tokens above the longest document: the grammar's end wins, before min_tokens.
    const Result over = run(document(bounded), 80, 60, false);
    check(over, bounded);
    EXPECT_LT(over.tokens.size(), 60u);
    // The same under the budget with min_tokens = max_tokens.
    const Result over_budget = run(document(bounded), 40, 40, true);
    check(over_budget, bounded);
    EXPECT_LE(over_budget.tokens.size(), 40u);
    // An unbounded array under the budget, min_tokens = max_tokens: held to the budget's last token, which
    // only the end may take.
    const Result last = run(document(unbounded), 20, 20, true);
    check(last, unbounded);
    EXPECT_EQ(last.tokens.size(), 20u);

    // The chat grammar (thinking off: the JSON answer, then <|end_of_msg|>, itself an end-of-sequence id).
    structured::GrammarCache cache(nano_vocab(), 16, {}, limits());
    structured::ChatGrammarSpec spec;
    spec.thinking = false;
    spec.response_schema = bounded;
    OutputConstraint chat = structured::constraint_of(spec, OutputConstraint::Format::json_schema);
    chat.grammar = structured::compile(cache, chat);
    const Result out = run(chat, 300, 200, false);
    ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
    EXPECT_EQ(out.tokens.back(), end);
    EXPECT_LT(out.tokens.size(), 200u);
    std::string full;  // special tokens by name
    for (int32_t t : out.tokens) full += nano().tok->token_bytes(tok::TokenId(t));
    // Thinking off: the prompt opened the response section, so the answer is what comes before its close.
    const size_t to = full.find("<|close|>response<|sep|>");
    ASSERT_NE(to, std::string::npos) << full;
    const json doc = json::parse(full.substr(0, to), nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << full;
    EXPECT_EQ(validate_doc(bounded, doc), "") << full;
    EXPECT_EQ(all_masked, 0) << "a row reached the sampler with every id at -inf";
  }
}

// The nano checkpoint's real forward, random sampling: bounded schemas (a boolean, null, a const, an enum;
// each document at most 16 + 42 + 16 bytes) with min_tokens far above their longest documents end stop,
// valid; with min_tokens 1 too.
TEST(EngineStructured, MinTokensAboveTheLongestDocumentOnNano) {
  const std::vector<ojson> schemas = {
      ojson::parse(R"({"type": "boolean"})"), ojson::parse(R"({"type": "null"})"),
      ojson::parse(R"({"const": "fixed"})"), ojson::parse(R"({"enum": [1, "two", [3], {"four": 4}]})")};
  Engine e(nano().w, nano().cfg, nano_engine_config(8));
  Sink sink;
  const auto prompt = prompt_of("Write a JSON value:");
  int key = 0;
  for (const ojson& schema : schemas)
    for (const int32_t min_tokens : {1, 150}) {
      Request r;
      r.prompt = prompt;
      r.constraint = document(schema);
      r.max_tokens = 200;
      r.sampling.min_tokens = min_tokens;
      r.sampling.temperature = 1.0f;
      r.sampling.seed = uint64_t(500 + key);
      ASSERT_TRUE(e.submit(std::move(r), sink(key++)).accepted());
    }
  e.wait_idle();
  key = 0;
  for (const ojson& schema : schemas)
    for (const int32_t min_tokens : {1, 150}) {
      SCOPED_TRACE(schema.dump() + ", min_tokens " + std::to_string(min_tokens));
      const Result out = sink.get(key++);
      ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
      EXPECT_EQ(out.tokens.back(), end_of_msg());
      EXPECT_LT(out.tokens.size(), 150u);
      const json doc = parse_doc(out.tokens);
      ASSERT_FALSE(doc.is_discarded()) << text_of(out.tokens);
      EXPECT_EQ(validate_doc(schema, doc), "") << text_of(out.tokens);
    }
}

}  // namespace
}  // namespace kestrel
