// Structured outputs through the engine (runtime/engine.h, runtime/constraints.h; issue #20 phase 2):
//  - every JSON-Schema-Test-Suite draft-7 schema the compiler accepts is a generation target on the
//    nano checkpoint with random sampling (temperature 1, one seed per schema): every document must
//    end with the end-of-sequence token the grammar allows only where the document may end, parse, and
//    validate with our validator. The nano model's random weights rarely close a string by chance, so
//    an executor wrapper adds +4 to the logits of tokens holding `"` `]` `}` `,` before the engine
//    samples (the engine, the masks and the sampler are the real ones);
//  - preemption (recompute) and the prefix cache leave a constrained request's tokens unchanged;
//  - the end token only where the document may end; the nesting limit is never a dead end (with the
//    budget, complete and valid within max_tokens); free text is sampled without a mask and a refused
//    token drawn again;
//  - the pieces: the mask twin, SeqConstraint::sync (rollback / replay) and take (deferred matcher
//    steps), the mask pool (several threads = the serial results), validate();
//  - a device executor's masks start once its forward is enqueued (forward_launched), never before its run,
//    and equal the serial masks bit for bit.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "evalclient/json_schema.h"
#include "nano_checkpoint.h"
#include "runtime/engine.h"
#include "runtime/fake_executor.h"
#include "structured/constraint.h"
#include "structured/json_schema_grammar.h"
#include "test_engine_structured_util.h"

namespace kestrel {
namespace {

using namespace engine_structured_testing;
using runtime::Engine;  // not kestrel::Engine, the interface


// ---- the suite as generation targets -------------------------------------------------------------

TEST(EngineStructured, SuiteSchemasGenerateValidDocumentsOnNano) {
  const size_t kSeeds = 2;    // requests per schema
  const float kBias = 2.5f;   // on closing tokens: most documents end well within max_tokens
  int refused = 0;
  const std::vector<SuiteTarget> targets = suite_targets(refused);
  ASSERT_GT(targets.size(), 50u);  // of ~150 groups; the rest use keywords the compiler refuses (test_structured.cpp)
  Engine e(nano().w, nano().cfg, nano_engine_config(32, kBias));
  Sink sink;
  const auto prompt = prompt_of("Write a JSON value:");
  for (size_t i = 0; i < targets.size() * kSeeds; ++i) {
    Request r;
    r.prompt = prompt;
    r.max_tokens = 400;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 1000 + i;
    r.constraint = targets[i % targets.size()].c;
    ASSERT_TRUE(e.submit(std::move(r), sink(int(i))).accepted());
  }
  e.wait_idle();
  int valid = 0, truncated = 0;
  size_t tokens = 0;
  for (size_t i = 0; i < targets.size() * kSeeds; ++i) {
    SCOPED_TRACE(targets[i % targets.size()].name);
    const Result r = sink.get(int(i));
    tokens += r.tokens.size();
    ASSERT_TRUE(r.finish == FinishReason::stop || r.finish == FinishReason::length) << r.error;
    if (r.finish == FinishReason::length) {  // cut by max_tokens: counted
      ++truncated;
      continue;
    }
    ASSERT_EQ(r.tokens.back(), end_of_msg()) << "a document ends with the end token";
    const std::string text = text_of(r.tokens);
    const json doc = json::parse(text, nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << "not JSON: " << text;
    EXPECT_EQ(eval::JsonSchema(targets[i % targets.size()].validator_schema).validate(doc), "") << text;
    ++valid;
  }
  const auto st = e.structured_stats();
  std::printf("suite on nano through the engine: %zu schemas (%d refused by the compiler) x %zu seeds: %d documents "
              "valid, %d cut by max_tokens, %zu tokens; %lld masked, %lld free samples\n",
              targets.size(), refused, kSeeds, valid, truncated, tokens, (long long)st.masked_samples,
              (long long)st.free_samples);
  EXPECT_LE(truncated, int(targets.size() * kSeeds) / 20) << "most documents must finish";
}


// ---- preemption and the prefix cache -------------------------------------------------------------

// Constrained requests sharing a prompt head, alone on a roomy engine, then all at once on an engine
// whose page pool forces preemption (recompute) and whose prefix cache serves the shared head: the
// same tokens (the CPU executor is batch invariant; sampling is seeded), every document valid.
TEST(EngineStructured, PreemptionAndPrefixCacheKeepTheTokens) {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
      "required": ["name", "n", "tags"], "additionalProperties": false})");
  const OutputConstraint c = document(schema);
  const json validator_schema = json::parse(schema.dump());
  std::vector<int32_t> head = prompt_of("The shared head of every prompt in this test, long enough to fill pages. ");
  while (head.size() < 70) head.insert(head.end(), head.begin(), head.end());
  const int n = 6;
  auto request = [&](int i) {
    Request r;
    r.prompt = head;
    for (int32_t t : prompt_of(" request " + std::to_string(i) + ":")) r.prompt.push_back(t);
    r.max_tokens = 120;
    r.sampling.temperature = i % 2 ? 0.9f : 0.0f;
    r.sampling.seed = 77 + uint64_t(i);
    r.constraint = c;
    return r;
  };
  std::vector<Result> solo;
  {
    EngineConfig cfg = nano_engine_config(1, 4.0f);
    cfg.enable_prefix_cache = false;
    Engine e(nano().w, nano().cfg, cfg);
    Sink sink;
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE(e.submit(request(i), sink(i)).accepted());
      e.wait_idle();
      solo.push_back(sink.get(i));
    }
  }
  EngineConfig cfg = nano_engine_config(n, 4.0f);
  cfg.formats.block_size = 16;
  const cache::CacheLayout l = cache::CacheLayout::from_config(nano().cfg.text, cfg.formats);
  cfg.memory_budget = l.total_state_bytes(n + cfg.checkpoint_slots) + l.total_page_bytes(22);
  Engine e(nano().w, nano().cfg, cfg);
  Sink sink;
  for (int i = 0; i < n; ++i) ASSERT_TRUE(e.submit(request(i), sink(i)).accepted());
  e.wait_idle();
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    const Result r = sink.get(i);
    EXPECT_EQ(r.tokens, solo[size_t(i)].tokens);
    ASSERT_EQ(r.finish, FinishReason::stop) << r.error;
    const json doc = json::parse(text_of(r.tokens), nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << text_of(r.tokens);
    EXPECT_EQ(eval::JsonSchema(validator_schema).validate(doc), "");
  }
  EXPECT_GT(e.stats().preemptions, 0) << "the page pool was meant to force preemption";
  EXPECT_GT(e.stats().prefix_hits, 0) << "the shared head was meant to hit the prefix cache";
}

// ---- ends, dead ends, free text -------------------------------------------------------------------

// A fake model that wants to stop at once: the end token is masked until the document may end, so
// the output is a whole document, then the end token.
TEST(EngineStructured, EndTokenOnlyWhereTheDocumentMayEnd) {
  EngineConfig cfg;
  cfg.memory_budget = 64 << 20;
  cfg.make_executor = runtime::fake_executor_factory(nano().cfg.text.vocab_size, {{end_of_msg()}, {}});
  Engine e(nano().cfg, cfg);
  Sink sink;
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {"a": {"type": "boolean"},
      "b": {"enum": [1, 2]}}, "required": ["a", "b"]})");
  Request r;
  r.prompt = prompt_of("x");
  r.max_tokens = 400;
  r.constraint = document(schema);
  ASSERT_TRUE(e.submit(r, sink(0)).accepted());
  r.ignore_eos = true;  // the grammar's end is the request's end all the same
  ASSERT_TRUE(e.submit(r, sink(1)).accepted());
  e.wait_idle();
  for (int k : {0, 1}) {
    const Result out = sink.get(k);
    ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
    ASSERT_GE(out.tokens.size(), 2u);
    EXPECT_EQ(out.tokens.back(), end_of_msg());
    for (size_t i = 0; i + 1 < out.tokens.size(); ++i) EXPECT_NE(out.tokens[i], end_of_msg());
    const json doc = json::parse(text_of(out.tokens), nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << text_of(out.tokens);
    EXPECT_EQ(eval::JsonSchema(json::parse(schema.dump())).validate(doc), "");
  }
}

// Nesting at the matcher's stack limit, where only a deeper value could continue: the masks allow a token
// only if the document can still be finished within the limit, so a model that always opens another
// object gets no further than that and no request meets an empty mask (before, such a request ended with
// an error event). With the budget the answer is complete and valid within max_tokens for every budget
// from the shortest up; without it, it runs to max_tokens (the model writes "{" into a string forever).
TEST(EngineStructured, TheNestingLimitNeverDeadEnds) {
  const int32_t brace = int32_t(*nano().tok->base_id("{"));
  EngineConfig cfg;
  cfg.memory_budget = 64 << 20;
  cfg.make_executor = runtime::fake_executor_factory(nano().cfg.text.vocab_size, {{brace}, {}});
  Engine e(nano().cfg, cfg);
  Sink sink;
  // Every object needs "a", whose value is a string or another such object; 6 frames of nesting.
  const ojson deep = ojson::parse(R"({"anyOf": [{"type": "string"}, {"type": "object", "properties":
      {"a": {"$ref": "#"}}, "required": ["a"], "additionalProperties": false}]})");
  OutputConstraint c = document(deep, 6);
  const uint32_t shortest = runtime::SeqConstraint(c.grammar, {end_of_msg()}).min_completion();
  Request r;
  r.prompt = prompt_of("x");
  r.constraint = c;
  r.max_tokens = 300;  // greedy over equal logits writes the lowest ids: whitespace runs included
  ASSERT_TRUE(e.submit(r, sink(0)).accepted());
  r.constraint->complete_within_max_tokens = true;
  const std::vector<int32_t> budgets = {int32_t(shortest), int32_t(shortest) + 1, int32_t(shortest) + 5, 40, 120};
  for (size_t i = 0; i < budgets.size(); ++i) {
    r.max_tokens = budgets[i];
    ASSERT_TRUE(e.submit(r, sink(int(1 + i))).accepted());
  }
  e.wait_idle();
  const Result open = sink.get(0);
  EXPECT_EQ(open.finish, FinishReason::length) << open.error;
  EXPECT_EQ(open.tokens.size(), 300u);
  const std::string text = text_of(open.tokens);
  EXPECT_GE(std::count(text.begin(), text.end(), '{'), 2) << text;  // each level takes frames of several rules
  for (size_t i = 0; i < budgets.size(); ++i) {
    SCOPED_TRACE(budgets[i]);
    const Result out = sink.get(int(1 + i));
    ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
    EXPECT_LE(int32_t(out.tokens.size()), budgets[i]);
    const json doc = json::parse(text_of(out.tokens), nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << text_of(out.tokens);
    EXPECT_EQ(eval::JsonSchema(json::parse(deep.dump())).validate(doc), "") << text_of(out.tokens);
  }
  // A schema whose every document nests deeper than the limit: with the budget, refused at submit naming
  // the format (no max_tokens would do).
  std::string chain = R"({"type": "boolean"})";
  for (int i = 0; i < 8; ++i)
    chain = R"({"type": "object", "properties": {"a": )" + chain + R"(}, "required": ["a"], "additionalProperties": false})";
  r.constraint = document(ojson::parse(chain), 6);
  r.constraint->complete_within_max_tokens = true;
  r.max_tokens = 300;
  try {
    e.submit(r, sink(50));
    ADD_FAILURE() << "a format with no answer within the nesting limit was accepted";
  } catch (const RequestError& err) {
    EXPECT_EQ(err.field, "response_format");
    EXPECT_NE(std::string(err.what()).find("nesting limit (6 frames"), std::string::npos) << err.what();
  }
  EXPECT_TRUE(e.ready());
}

// The chat grammar with thinking: the think section is free text (no mask). A fake model that wants
// <|open|> (not allowed in the think section) gets it drawn again under the mask; the tools section
// can never open without tools; the message still ends with <|end_of_msg|>.
TEST(EngineStructured, FreeTextIsUnmaskedAndRefusedTokensAreRedrawn) {
  const int32_t open = special("<|open|>"), close = special("<|close|>");
  const int32_t word = int32_t(*nano().tok->base_id("a"));
  EngineConfig cfg;
  cfg.memory_budget = 64 << 20;
  // open, a, a, close, then open forever: the grammar needs "think<|sep|><|open|>response<|sep|>..."
  cfg.make_executor =
      runtime::fake_executor_factory(nano().cfg.text.vocab_size, {{open, word, word, close, open, open, open}, {}});
  Engine e(nano().cfg, cfg);
  Sink sink;
  structured::GrammarCache cache(nano_vocab(), 16, {}, limits());
  structured::ChatGrammarSpec spec;  // no tools: the tools section cannot open
  OutputConstraint c = structured::constraint_of(spec, OutputConstraint::Format::text);
  c.grammar = structured::compile(cache, c);
  Request r;
  r.prompt = prompt_of("Hello");
  r.max_tokens = 64;
  r.constraint = c;
  ASSERT_TRUE(e.submit(r, sink(0)).accepted());
  e.wait_idle();
  const Result out = sink.get(0);
  ASSERT_EQ(out.finish, FinishReason::stop) << out.error;
  EXPECT_EQ(out.tokens.back(), end_of_msg());
  EXPECT_NE(out.tokens[0], open) << "<|open|> is refused in the think section";
  // Parsed as the chat parser would: think, response, no tools.
  size_t opens = 0;
  for (int32_t t : out.tokens) opens += t == open;
  EXPECT_EQ(opens, 1u) << "only <|open|>response";
  const auto st = e.structured_stats();
  EXPECT_GT(st.redraws, 0);
  EXPECT_GT(st.free_samples, 0);
  EXPECT_GT(st.masked_samples, 0);
}

// ---- the pieces -----------------------------------------------------------------------------------

TEST(EngineStructured, MaskTwinSyncAndWorker) {
  // apply_token_mask: −inf exactly where the bit is 0; mask_count counts the first V bits only.
  std::vector<float> x(70, 1.0f);
  std::vector<uint32_t> w = {0xFFFFFFFFu, 0x00000001u, 0xFFFFFFFFu};
  runtime::apply_token_mask(x, w.data());
  for (size_t v = 0; v < 70; ++v) EXPECT_EQ(std::isinf(x[v]), v >= 33 && v < 64) << v;
  EXPECT_EQ(runtime::mask_count(w.data(), 70), 32 + 1 + 6);
  // sync: a matcher follows the output whatever happened to it (replay, rollback, rewrite).
  const OutputConstraint c = document(ojson::parse(R"({"type": "array", "items": {"type": "integer"}})"));
  runtime::SeqConstraint sc(c.grammar, {end_of_msg()});
  const auto ids = prompt_of("[1,2,3]");
  ASSERT_TRUE(sc.sync(ids));
  EXPECT_EQ(sc.accepted(), ids.size());
  std::vector<int32_t> shorter(ids.begin(), ids.begin() + 2);
  ASSERT_TRUE(sc.sync(shorter));
  EXPECT_EQ(sc.accepted(), 2u);
  const auto other = prompt_of("[7]");
  ASSERT_TRUE(sc.sync(other));
  EXPECT_TRUE(sc.accept(end_of_msg()));
  EXPECT_TRUE(sc.terminated());
  EXPECT_FALSE(sc.sync(prompt_of("[x")));
  // The pool runs the jobs; wait(i) gives each job's allowed count (the same as filling directly).
  runtime::SeqConstraint a(c.grammar, {end_of_msg()}), b(c.grammar, {end_of_msg()});
  ASSERT_TRUE(b.sync(prompt_of("[1")));
  std::vector<uint32_t> ma(nano_vocab()->mask_words()), mb(ma.size()), ref(ma.size());
  runtime::MaskPool worker;
  worker.start({{&a, ma.data()}, {&b, mb.data()}});
  const int64_t nb = worker.wait(1), na = worker.wait(0);
  worker.wait_all();
  EXPECT_EQ(na, a.fill(ref.data()));
  EXPECT_EQ(ma, ref);
  EXPECT_EQ(nb, b.fill(ref.data()));
  EXPECT_EQ(mb, ref);
  EXPECT_GT(na, 0);
  worker.start({});
  worker.wait_all();
}

// SeqConstraint::take: an allowed ordinary token is taken by its mask bit and the matcher's step
// deferred to flush() (which the next mask job runs); a token outside the mask is refused and changes
// nothing; the end token is stepped at once and completes the document; sync() keeps a deferred token.
TEST(EngineStructured, TakeDefersTheMatcherStepOfOrdinaryTokens) {
  const OutputConstraint c = document(ojson::parse(R"({"type": "array", "items": {"type": "integer"}})"));
  runtime::SeqConstraint sc(c.grammar, {end_of_msg()});
  std::vector<uint32_t> mask(nano_vocab()->mask_words());
  const int32_t open = int32_t(*nano().tok->base_id("[")), one = int32_t(*nano().tok->base_id("1"));
  const int32_t close = int32_t(*nano().tok->base_id("]"));
  bool end = true;
  ASSERT_GT(sc.fill(mask.data()), 0);
  EXPECT_FALSE(sc.take(close, mask.data(), end)) << "']' cannot open the document";
  ASSERT_TRUE(sc.take(open, mask.data(), end));
  EXPECT_FALSE(end);
  EXPECT_EQ(sc.deferred(), open);
  EXPECT_EQ(sc.accepted(), 1u);
  std::vector<int32_t> out = {open};
  ASSERT_TRUE(sc.sync(out));  // the output is what was taken: nothing to do, still deferred
  EXPECT_EQ(sc.deferred(), open);
  ASSERT_TRUE(sc.flush());
  EXPECT_EQ(sc.deferred(), -1);
  ASSERT_GT(sc.fill(mask.data()), 0);
  ASSERT_TRUE(sc.take(one, mask.data(), end));
  ASSERT_TRUE(sc.flush());
  ASSERT_GT(sc.fill(mask.data()), 0);
  EXPECT_FALSE(sc.take(end_of_msg(), mask.data(), end)) << "not where the document may end";
  ASSERT_TRUE(sc.take(close, mask.data(), end));
  ASSERT_TRUE(sc.flush());
  ASSERT_GT(sc.fill(mask.data()), 0);
  ASSERT_TRUE(sc.take(end_of_msg(), mask.data(), end));
  EXPECT_TRUE(end);
  EXPECT_TRUE(sc.terminated());
  EXPECT_EQ(sc.deferred(), -1) << "the end token is stepped at once";
  // A token taken without a mask outside free text: the matcher decides at once (refused here).
  runtime::SeqConstraint fresh(c.grammar, {end_of_msg()});
  EXPECT_FALSE(fresh.take(close, nullptr, end));
  ASSERT_TRUE(fresh.take(open, nullptr, end));
  EXPECT_EQ(fresh.deferred(), -1);
  // sync() onto another output flushes and replays.
  ASSERT_TRUE(fresh.take(one, nullptr, end));
  out = {open, close};
  ASSERT_TRUE(fresh.sync(out));
  EXPECT_EQ(fresh.accepted(), 2u);
  EXPECT_EQ(fresh.deferred(), -1);
}

// The pool with several threads over many batches of many jobs, each job a matcher step (a deferred
// token) and a fill: every result and row equals the serial one, whichever thread (or waiter) ran it.
TEST(EngineStructured, MaskPoolThreadsGiveTheSerialResults) {
  const OutputConstraint c = document(ojson::parse(R"({"type": "array", "items": {"type": "string", "maxLength": 3}})"));
  const int n = 24;
  std::vector<std::unique_ptr<runtime::SeqConstraint>> par, ser;
  for (int i = 0; i < n; ++i) {
    par.push_back(std::make_unique<runtime::SeqConstraint>(c.grammar, std::vector<int32_t>{end_of_msg()}));
    ser.push_back(std::make_unique<runtime::SeqConstraint>(c.grammar, std::vector<int32_t>{end_of_msg()}));
  }
  const size_t W = nano_vocab()->mask_words();
  std::vector<uint32_t> rows(n * W), ref(W);
  runtime::MaskPool pool(3);
  EXPECT_EQ(pool.threads(), 3);
  std::mt19937 rng(5);
  for (int step = 0; step < 60; ++step) {
    std::vector<runtime::MaskPool::Job> jobs;
    for (int i = 0; i < n; ++i) jobs.push_back({par[size_t(i)].get(), rows.data() + size_t(i) * W});
    pool.start(std::move(jobs));
    for (int k = 0; k < n; ++k) {
      const int i = step % 2 ? n - 1 - k : k;  // waiters in either order
      const int64_t got = pool.wait(size_t(i));
      ASSERT_TRUE(ser[size_t(i)]->flush());
      const int64_t want = ser[size_t(i)]->free_text() ? runtime::MaskPool::kFreeText : ser[size_t(i)]->fill(ref.data());
      ASSERT_EQ(got, want) << "step " << step << " job " << i;
      if (want <= 0) continue;
      ASSERT_TRUE(std::equal(ref.begin(), ref.end(), rows.begin() + std::ptrdiff_t(size_t(i) * W)));
      // The same allowed token for both (drawn from the row), deferred or not alike.
      std::vector<int32_t> ids;
      for (size_t id = 0; id < size_t(nano().cfg.text.vocab_size); ++id)
        if (structured::mask_test(ref.data(), structured::TokenId(id)) && int32_t(id) != end_of_msg()) ids.push_back(int32_t(id));
      if (ids.empty()) continue;
      const int32_t t = ids[rng() % ids.size()];
      bool e1, e2;
      ASSERT_TRUE(par[size_t(i)]->take(t, rows.data() + size_t(i) * W, e1));
      ASSERT_TRUE(ser[size_t(i)]->take(t, ref.data(), e2));
    }
    pool.wait_all();
  }
  EXPECT_GT(pool.busy_seconds(), 0.0);
}

// mask_count (POPCNT where the CPU has it) and its portable twin against a bit-by-bit count: random
// densities, every tail length, the vocabulary sizes of nano, k3-tiny and K3.
TEST(EngineStructured, MaskCountMatchesABitByBitCount) {
  std::mt19937_64 rng(11);
  for (int64_t V : {int64_t(1), int64_t(31), int64_t(32), int64_t(33), int64_t(63), int64_t(64), int64_t(65),
                    int64_t(95), int64_t(nano().cfg.text.vocab_size), int64_t(12256), int64_t(12257), int64_t(163840),
                    int64_t(163841)})
    for (int density = 0; density <= 4; ++density) {
      std::vector<uint32_t> w(size_t((V + 31) / 32));
      for (uint32_t& x : w) {
        x = uint32_t(rng());
        for (int d = density; d < 2; ++d) x &= uint32_t(rng());  // sparser
        for (int d = 2; d < density; ++d) x |= uint32_t(rng());  // denser
        if (density == 4) x = 0xFFFFFFFFu;
      }
      int64_t want = 0;
      for (int64_t id = 0; id < V; ++id) want += (w[size_t(id / 32)] >> (id % 32)) & 1u;
      EXPECT_EQ(runtime::mask_count(w.data(), V), want) << "V " << V << " density " << density;
      EXPECT_EQ(runtime::mask_count_portable(w.data(), V), want) << "V " << V << " density " << density;
    }
}

// A device executor without a model, in the GPU executor's order (runtime/executor_cuda.cpp): sampling_inputs,
// the forward "enqueued" (forward_launched, when `call_hook`), token_mask per row, then a token drawn from each
// mask row, check_token, take_token. Before the launch it poisons the mask table (`poison`): a job that ran
// before the launch would leave a poisoned row. Every row it gets is compared, bit for bit, with the mask of
// a SeqConstraint brought serially to the request's output.
class DeviceLike : public runtime::StepExecutor {
 public:
  DeviceLike(bool announce, bool call_hook, bool poison, std::shared_ptr<const structured::CompiledGrammar> g,
             std::vector<int32_t> ends)
      : announce_(announce), call_hook_(call_hook), poison_(poison), g_(std::move(g)), ends_(std::move(ends)) {}
  bool announces_forward() const override { return announce_; }
  const runtime::ExecutorStats& stats() const override { return stats_; }
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    ++stats_.steps;
    std::vector<const sched::ScheduledSeq*> rows;
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const sched::ScheduledSeq& x : *list)
        if (x.sample) rows.push_back(&x);
    std::vector<std::vector<int32_t>> outputs;
    for (const sched::ScheduledSeq* x : rows) {
      const auto in = hooks.sampling_inputs(*x);
      outputs.emplace_back(in.output.begin(), in.output.end());
    }
    const runtime::StepHooks::MaskTable& t = hooks.mask_table;
    if (poison_) std::fill_n(const_cast<uint32_t*>(t.data), size_t(t.rows * t.words), 0xA5A5A5A5u);
    if (call_hook_ && hooks.forward_launched) hooks.forward_launched();
    std::vector<runtime::StepHooks::TokenMask> tm;
    for (const sched::ScheduledSeq* x : rows) tm.push_back(hooks.token_mask(*x));
    sched::StepResult result;
    std::vector<uint32_t> ref(size_t(t.words));
    for (size_t i = 0; i < rows.size(); ++i) {
      runtime::SeqConstraint serial(g_, ends_);
      EXPECT_TRUE(serial.sync(outputs[i]));
      EXPECT_TRUE(serial.flush());
      const uint32_t* row = tm[i].row >= 0 ? t.data + tm[i].row * t.words : nullptr;
      if (serial.free_text()) {
        EXPECT_LT(tm[i].row, 0);
      } else {
        EXPECT_EQ(tm[i].allowed, serial.fill(ref.data()));
        ++compared;
        if (!row || !std::equal(ref.begin(), ref.end(), row)) ++mismatched;
      }
      // A pseudo-random allowed id (the end token one time in four where allowed).
      std::vector<int32_t> ids;
      for (int64_t id = 0; row && id < t.words * 32 && id < int64_t(g_->vocab().vocab_size()); ++id)
        if (structured::mask_test(row, structured::TokenId(id))) ids.push_back(int32_t(id));
      int32_t token = ids.empty() ? 0 : ids[(draws_++ * 2654435761u) % ids.size()];
      for (int32_t e : ends_)
        if (row && structured::mask_test(row, structured::TokenId(e)) && draws_ % 4 == 0) token = e;
      EXPECT_TRUE(hooks.check_token(*rows[i], token));
      sched::SeqResult r = hooks.take_token(*rows[i], token);
      r.id = rows[i]->id;
      result.seqs.push_back(r);
    }
    return result;
  }
  std::atomic<int64_t> compared{0}, mismatched{0};

 private:
  bool announce_, call_hook_, poison_;
  std::shared_ptr<const structured::CompiledGrammar> g_;
  std::vector<int32_t> ends_;
  uint64_t draws_ = 1;
  runtime::ExecutorStats stats_;
};

// The step's mask jobs start when the device executor has enqueued its forward (StepHooks::forward_launched),
// not before its run — a row filled before the launch would keep the executor's poison; without the hook
// call they start at the first token_mask; an executor that does not announce its forward gets them started
// before its run. Every row equals the serial mask, and every document ends complete.
TEST(EngineStructured, DeviceMasksStartAtTheLaunchAndAreExact) {
  const OutputConstraint c = document(ojson::parse(
      R"({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}, "b": {"type": "array",
          "items": {"type": "boolean"}, "maxItems": 3}}, "required": ["a", "b"], "additionalProperties": false})"));
  const int32_t eos = int32_t(nano().cfg.text.eos_token_id);
  ASSERT_GE(eos, 0);
  struct Mode {
    bool announce, call_hook, poison;
  };
  for (const Mode m : {Mode{true, true, true}, Mode{true, false, true}, Mode{false, false, false}}) {
    SCOPED_TRACE(::testing::Message() << "announce " << m.announce << ", hook called " << m.call_hook);
    DeviceLike* dev = nullptr;
    EngineConfig cfg = nano_engine_config(16);
    cfg.eos_token_ids = {eos};
    cfg.mask_threads = 3;
    cfg.make_executor = [&](const CacheFormats&, const cache::CacheConfig&) {
      auto x = std::make_unique<DeviceLike>(m.announce, m.call_hook, m.poison, c.grammar, std::vector<int32_t>{eos});
      dev = x.get();
      return std::unique_ptr<runtime::StepExecutor>(std::move(x));
    };
    Engine e(nano().cfg, cfg);
    Sink sink;
    const int n = 16;
    for (int i = 0; i < n; ++i) {
      Request r;
      r.prompt = prompt_of("item " + std::to_string(i));
      r.max_tokens = 200;
      r.constraint = c;
      ASSERT_EQ(e.submit(std::move(r), sink(i)).status, SubmitStatus::accepted);
    }
    e.wait_idle();
    ASSERT_NE(dev, nullptr);
    EXPECT_GT(dev->compared.load(), 200);
    EXPECT_EQ(dev->mismatched.load(), 0) << "rows differing from the serial mask (poisoned: filled before the launch)";
    for (int i = 0; i < n; ++i) {
      const Result r = sink.get(i);
      EXPECT_TRUE(r.error.empty()) << r.error;
      EXPECT_EQ(r.finish, FinishReason::stop) << "request " << i;
      const json doc = json::parse(text_of(r.tokens), nullptr, false);
      EXPECT_FALSE(doc.is_discarded()) << text_of(r.tokens);
    }
  }
}

// validate(): the constraint's consistency, named by field; the engine checks the grammar's vocabulary.
TEST(EngineStructured, ValidateChecksTheConstraint) {
  const RequestLimits lim{nano().cfg.text.vocab_size, 100, {}};
  auto field = [&](const std::function<void(OutputConstraint&)>& edit) -> std::string {
    Request r;
    r.prompt = {1, 2};
    r.max_tokens = 4;
    OutputConstraint c = structured::constraint_of({}, OutputConstraint::Format::text);
    c.grammar = document(ojson::parse("true")).grammar;
    edit(c);
    r.constraint = c;
    try {
      validate(r, lim);
    } catch (const RequestError& e) {
      return e.field;
    }
    return "";
  };
  using TC = OutputConstraint::ToolChoice;
  EXPECT_EQ(field([](OutputConstraint&) {}), "");
  EXPECT_EQ(field([](OutputConstraint& c) { c.grammar = nullptr; }), "response_format");
  EXPECT_EQ(field([](OutputConstraint& c) { c.format = OutputConstraint::Format::json_schema; }), "response_format");
  EXPECT_EQ(field([](OutputConstraint& c) { c.tools = {{"f", ""}, {"f", ""}}; }), "tools");
  EXPECT_EQ(field([](OutputConstraint& c) { c.tools = {{"", ""}}; }), "tools");
  EXPECT_EQ(field([](OutputConstraint& c) { c.tool_choice = TC::required; }), "tool_choice");
  EXPECT_EQ(field([](OutputConstraint& c) { c.tools = {{"f", ""}}, c.tool_choice = TC::named, c.named_tool = "g"; }),
            "tool_choice");
  EXPECT_EQ(field([](OutputConstraint& c) { c.tools = {{"f", ""}}, c.tool_choice = TC::named, c.named_tool = "f"; }),
            "");
  EXPECT_EQ(field([](OutputConstraint& c) { c.chat = false; }), "response_format");
  // A grammar compiled over another vocabulary size: refused at submit.
  EngineConfig cfg;
  cfg.memory_budget = 64 << 20;
  cfg.make_executor = runtime::fake_executor_factory(nano().cfg.text.vocab_size, {});
  Engine e(nano().cfg, cfg);
  Request r;
  r.prompt = {1, 2};
  r.constraint = structured::document_constraint(OutputConstraint::Format::json_object, {});
  r.constraint->grammar = structured::compile_json_schema(
      std::make_shared<const structured::TokenVocab>(*nano().tok, size_t(nano().cfg.text.vocab_size) + 32),
      ojson{{"type", "object"}});
  try {
    e.submit(r, [](TokenEvent&&) {});
    ADD_FAILURE() << "accepted";
  } catch (const RequestError& err) {
    EXPECT_EQ(err.field, "response_format");
  }
}

}  // namespace
}  // namespace kestrel
