// Async scheduling (run-ahead) on the nano checkpoint through the real CPU executor's twin (launch/collect):
// the same requests with EngineConfig::async_scheduling on and off give identical token streams and finish
// reasons — greedy and seeded sampling, stop ids hit mid-run, max_tokens, concurrent requests of different
// lengths, a request arriving mid-run (admitted at once, not after the chain), a cancel mid-run (no token
// after it), memory pressure with preemption — while the counter shows steps ran ahead; a request that is
// not plain (logprobs, penalties, bias, min_tokens not yet reached) keeps its batch synchronous with the same
// tokens. The executor refuses launch/collect misuse, and an executor that cannot run ahead ignores the flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cache/layout.h"
#include "core/check.h"
#include "engine_events.h"
#include "nano_checkpoint.h"
#include "runtime/engine.h"
#include "runtime/executor.h"
#include "runtime/fake_executor.h"

// A namespace of its own: CI batches test files into unity translation units (KESTREL_UNITY).
namespace kestrel::engine_ahead_testing {
namespace {

using runtime::Engine;
using runtime::EngineConfig;

const testing::NanoCheckpoint& nano() { return testing::nano_checkpoint(); }

using Events = testing::EngineEvents;

struct RunResult {
  std::map<int, Events::Out> out;
  EngineStats stats;
};

// Runs `submit` (which submits the requests, keys of its choice) on a fresh engine, async scheduling on or off,
// until idle; the engine's bookkeeping must be intact and empty then.
RunResult run(EngineConfig cfg, bool async, const std::function<void(Engine&, Events&)>& submit) {
  cfg.async_scheduling = async;
  Engine e(nano().w, nano().cfg, cfg);
  Events ev;
  submit(e, ev);
  e.wait_idle();
  const IntegrityReport ir = e.check_integrity();
  EXPECT_EQ(ir.requests + ir.running + ir.waiting, 0);
  RunResult r;
  r.stats = e.stats();
  r.out = ev.all();
  e.shutdown();
  return r;
}

EngineConfig roomy() {
  EngineConfig cfg;
  cfg.memory_budget = 64 << 20;
  cfg.max_running = 8;
  return cfg;
}

std::vector<int32_t> random_prompt(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = int32_t(rng() % 768);  // ordinary ids, never EOS (770)
  return p;
}

Request greedy(size_t prompt, int32_t max_tokens, uint32_t seed) {
  Request r;
  r.prompt = random_prompt(prompt, seed);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

Request seeded(size_t prompt, int32_t max_tokens, uint32_t seed) {
  Request r = greedy(prompt, max_tokens, seed);
  r.sampling.temperature = 0.9f, r.sampling.top_k = 50, r.sampling.top_p = 0.9f, r.sampling.seed = 1000 + seed;
  return r;
}

// Both runs: the same tokens, reasons and one final event per request; the counters agree. `dropped`: tokens
// the async run sampled for a request whose cancel landed while their step was in flight (counted, not sent).
void expect_same(const RunResult& sync, const RunResult& async, int64_t dropped = 0) {
  ASSERT_EQ(sync.out.size(), async.out.size());
  int64_t tokens = 0;
  for (const auto& [key, s] : sync.out) {
    const Events::Out& a = async.out.at(key);
    EXPECT_EQ(a.tokens, s.tokens) << "request " << key;
    EXPECT_EQ(a.logprobs, s.logprobs) << "request " << key;
    EXPECT_EQ(a.reason, s.reason) << "request " << key;
    EXPECT_EQ(s.finals, 1) << "request " << key;
    EXPECT_EQ(a.finals, 1) << "request " << key;
    tokens += int64_t(a.tokens.size());
  }
  // A row computed for a request that ended the step before is no generated token.
  EXPECT_EQ(async.stats.generation_tokens, tokens + dropped);
  EXPECT_EQ(sync.stats.generation_tokens, tokens);
  EXPECT_EQ(sync.stats.ahead_steps, 0);
}

TEST(AsyncScheduling, SameTokensAsSynchronous) {
  // Six requests of different lengths, greedy and seeded; three end at a stop id mid-run, one of them after
  // min_tokens held its stop id back (it keeps the batch synchronous until then).
  std::vector<Request> reqs = {greedy(20, 24, 1), seeded(33, 30, 2), seeded(7, 17, 3),
                               greedy(12, 30, 4), seeded(50, 40, 5), greedy(9, 36, 6)};
  const RunResult full = run(roomy(), false, [&](Engine& e, Events& ev) {
    for (size_t i = 0; i < reqs.size(); ++i) e.submit(reqs[i], ev.sink(int(i)));
  });
  // The stop id: the first token from index `from` on that neither it nor the end-of-sequence id precedes, so the
  // request ends exactly there (masking a stop id before min_tokens changes no draw: none was drawn).
  const int32_t eos = nano().cfg.text.eos_token_id;
  std::map<int, size_t> stop_at;
  for (auto [key, from] : {std::pair{3, 9}, {4, 12}, {5, 9}}) {
    const std::vector<int32_t>& t = full.out.at(key).tokens;
    size_t i = size_t(from);
    while (i < t.size() && (std::find(t.begin(), t.begin() + std::ptrdiff_t(i) + 1, eos) != t.begin() + std::ptrdiff_t(i) + 1 ||
                            std::find(t.begin(), t.begin() + std::ptrdiff_t(i), t[i]) != t.begin() + std::ptrdiff_t(i)))
      ++i;
    ASSERT_LT(i + 3, t.size()) << "request " << key << ": no fresh token to stop at";
    Request& r = reqs[size_t(key)];
    r.ignore_eos = false;
    r.stop_token_ids = {t[i]};
    stop_at[key] = i;
  }
  reqs[5].sampling.min_tokens = 8;  // greedy: its draws before 8 never were the stop id
  auto submit = [&](Engine& e, Events& ev) {
    for (size_t i = 0; i < reqs.size(); ++i) e.submit(reqs[i], ev.sink(int(i)));
  };
  const RunResult sync = run(roomy(), false, submit), async = run(roomy(), true, submit);
  expect_same(sync, async);
  for (const auto& [key, o] : async.out) {
    const std::vector<int32_t>& t = full.out.at(key).tokens;
    if (!stop_at.count(key)) {
      EXPECT_EQ(o.reason, FinishReason::length) << "request " << key;
      EXPECT_EQ(o.tokens, t) << "request " << key;
      continue;
    }
    // Its stream without a stop id, up to and including the stop: well before max_tokens.
    EXPECT_EQ(o.reason, FinishReason::stop) << "request " << key;
    EXPECT_EQ(o.tokens, std::vector<int32_t>(t.begin(), t.begin() + std::ptrdiff_t(stop_at[key]) + 1))
        << "request " << key;
  }
  fmt::print("async scheduling: {} of {} steps ran ahead\n", async.stats.ahead_steps, async.stats.steps);
  EXPECT_GT(async.stats.ahead_steps, 10);
  EXPECT_EQ(async.stats.running + async.stats.waiting, 0);
}

// A request submitted mid-run (from a sink, so at a fixed token) ends the chain: it is admitted by the next
// normal step, not after the others finish, and its tokens are those of the synchronous engine.
TEST(AsyncScheduling, ArrivalMidRunIsAdmittedAtOnce) {
  auto submit = [](Engine& e, Events& ev) {
    e.submit(greedy(10, 40, 11), ev.sink(0, [&e, &ev](size_t n) {
      if (n == 3) e.submit(seeded(12, 5, 13), ev.sink(2));
    }));
    e.submit(seeded(14, 40, 12), ev.sink(1));
  };
  const RunResult sync = run(roomy(), false, submit), async = run(roomy(), true, submit);
  expect_same(sync, async);
  for (const RunResult* r : {&sync, &async}) {
    const auto& late = r->out.at(2);
    ASSERT_EQ(late.tokens.size(), 5u);
    // Admitted within a step or two of its arrival: done long before request 0's 40 tokens.
    EXPECT_LT(late.final_order, r->out.at(0).order.at(14)) << (r == &async ? "async" : "sync");
  }
  EXPECT_GT(async.stats.ahead_steps, 0);
}

// A cancel from a sink (at request 1's 5th token, while the next step is already in flight when async): the
// request ends with exactly those 5 tokens and nothing after its final event; the others are unaffected.
TEST(AsyncScheduling, CancelMidRunEndsAtTheCancelledToken) {
  // Requests 1 and 2 come from request 0's first event (on the engine thread), so all three decode together
  // from a fixed step on, whatever the test thread's timing.
  auto with_cancel = [](Engine& e, Events& ev) {
    e.submit(greedy(16, 30, 21), ev.sink(0, [&e, &ev](size_t n) {
      if (n != 1) return;
      auto id = std::make_shared<RequestId>(0);  // its own sink cancels it: the id, known after submit()
      *id = e.submit(seeded(25, 30, 22), ev.sink(1, [&e, id](size_t k) {
              if (k == 5) {
                EXPECT_TRUE(e.cancel(*id));
              }
            })).id;
      e.submit(greedy(8, 30, 23), ev.sink(2));
    }));
  };
  const RunResult sync = run(roomy(), false, with_cancel), async = run(roomy(), true, with_cancel);
  // Async: the cancel lands while the step with request 1's 6th token is in flight; that token is dropped.
  expect_same(sync, async, 1);
  const auto& cut = async.out.at(1);
  EXPECT_EQ(cut.reason, FinishReason::cancelled);
  EXPECT_EQ(cut.tokens.size(), 5u);
  for (int key : {0, 2}) {
    EXPECT_EQ(async.out.at(key).reason, FinishReason::length);
    EXPECT_EQ(async.out.at(key).tokens.size(), 30u);
  }
  EXPECT_EQ(async.stats.cancelled, 1);
  EXPECT_GT(async.stats.ahead_steps, 0);
}

// A request that is not plain is in every decode step of its batch (first and longest; the other comes from its
// first event): nothing runs ahead, and the tokens (logprobs too) are the synchronous engine's. The same batch
// all plain runs ahead.
TEST(AsyncScheduling, ANonPlainRequestKeepsItsBatchSynchronous) {
  const std::vector<std::pair<const char*, std::function<void(SamplingParams&)>>> kinds = {
      {"plain", [](SamplingParams&) {}},
      {"logprobs", [](SamplingParams& p) { p.logprobs = 2; }},
      {"repetition penalty", [](SamplingParams& p) { p.repetition_penalty = 1.3f; }},
      {"presence penalty", [](SamplingParams& p) { p.presence_penalty = 0.5f; }},
      {"logit bias", [](SamplingParams& p) { p.logit_bias = {{17, 2.0f}}; }},
  };
  for (const auto& [name, edit] : kinds) {
    auto submit = [&](Engine& e, Events& ev) {
      Request first = seeded(18, 20, 31);
      edit(first.sampling);
      e.submit(first, ev.sink(0, [&e, &ev](size_t n) {
        if (n == 1) e.submit(greedy(11, 12, 32), ev.sink(1));
      }));
    };
    const RunResult sync = run(roomy(), false, submit), async = run(roomy(), true, submit);
    SCOPED_TRACE(name);
    expect_same(sync, async);
    if (std::string(name) == "plain") {
      EXPECT_GT(async.stats.ahead_steps, 0);
    } else {
      EXPECT_EQ(async.stats.ahead_steps, 0);
    }
  }
  // min_tokens holds the stop ids back until 6 tokens: from then on the request is plain. Its 7th token comes
  // from a normal step, which starts the chain; tokens 8 to 16 are planned ahead.
  auto submit = [](Engine& e, Events& ev) {
    Request r = seeded(10, 16, 33);
    r.sampling.min_tokens = 6;
    e.submit(r, ev.sink(0));
  };
  const RunResult sync = run(roomy(), false, submit), async = run(roomy(), true, submit);
  expect_same(sync, async);
  EXPECT_EQ(async.stats.ahead_steps, 9);
}

// An executor that draws only some rows by itself (StepExecutor::samples_ahead; a device sampler that could hand
// rows back to the host would be one): a batch with a seeded request stays synchronous until that request ends, then the greedy one runs ahead; the
// tokens are the synchronous engine's either way. The CPU executor underneath, its samples_ahead narrowed.
class GreedyAhead : public runtime::StepExecutor {
 public:
  explicit GreedyAhead(std::unique_ptr<runtime::StepExecutor> inner) : inner_(std::move(inner)) {}
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    return inner_->run(plan, hooks);
  }
  const runtime::ExecutorStats& stats() const override { return inner_->stats(); }
  bool runs_ahead() const override { return true; }
  bool samples_ahead(const SamplingParams& p) const override { return p.temperature == 0.0f; }
  void launch(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    for (const sched::ScheduledSeq& x : plan.decodes)
      EXPECT_EQ(hooks.sampling_inputs(x).params->temperature, 0.0f) << "a sampled row launched ahead";
    inner_->launch(plan, hooks);
  }
  sched::StepResult collect(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    return inner_->collect(plan, hooks);
  }

 private:
  std::unique_ptr<runtime::StepExecutor> inner_;
};

TEST(AsyncScheduling, RowsTheExecutorCannotDrawKeepTheBatchSynchronous) {
  EngineConfig cfg = roomy();
  cfg.make_executor = [](const CacheFormats& f, const cache::CacheConfig& cc) {
    return std::unique_ptr<runtime::StepExecutor>(
        std::make_unique<GreedyAhead>(std::make_unique<runtime::Executor>(nano().w, nano().cfg, f, cc)));
  };
  // The seeded request (8 tokens) ends long before the greedy one (30): from then on the greedy one runs ahead.
  auto submit = [](Engine& e, Events& ev) {
    e.submit(seeded(12, 8, 41), ev.sink(0, [&e, &ev](size_t n) {
      if (n == 1) e.submit(greedy(9, 30, 42), ev.sink(1));
    }));
  };
  const RunResult sync = run(cfg, false, submit), async = run(cfg, true, submit);
  expect_same(sync, async);
  EXPECT_GT(async.stats.ahead_steps, 10);
  EXPECT_LT(async.stats.ahead_steps, 29) << "steps with the seeded request ran ahead";
  // Seeded alone: never ahead.
  auto seeded_only = [](Engine& e, Events& ev) { e.submit(seeded(12, 12, 43), ev.sink(0)); };
  const RunResult s2 = run(cfg, false, seeded_only), a2 = run(cfg, true, seeded_only);
  expect_same(s2, a2);
  EXPECT_EQ(a2.stats.ahead_steps, 0);
}

// A request that arrives from another thread (a client: the HTTP side) while a run-ahead step computes enters the
// step after it, as without run-ahead: the continuation is launched only shortly before the step in flight ends
// (Engine::run_ahead, "late launch"), not right after the step before was collected — which made every such
// arrival wait one whole decode step more, and, in `kestrel bench`'s closed loop at 64 requests, grew the queue of
// prompts that each wave of new requests waits behind (bench/RESULTS.md, docs/serving.md). The modelled device
// (fake executor) takes 100 ms a step; the request comes 10 ms after request 0's 4th token is out (90 ms of slack
// for a loaded machine's late wake-up before the arrival would land in the step after, in both modes).
TEST(AsyncScheduling, AnArrivalDuringAStepInFlightEntersTheNextStep) {
  EngineConfig cfg = roomy();
  runtime::FakeExecutorOptions fo;
  fo.device_step = std::chrono::milliseconds(100);
  cfg.make_executor = runtime::fake_executor_factory(nano().cfg.text.vocab_size, fo);
  std::map<bool, size_t> before;  // async: request 0's tokens out before the late request's first token
  for (const bool async : {false, true}) {
    std::thread client;
    auto submit = [&client](Engine& e, Events& ev) {
      e.submit(greedy(8, 10, 71), ev.sink(0, [&e, &ev, &client](size_t n) {
        if (n == 4)
          client = std::thread([&e, &ev] {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
            e.submit(greedy(6, 2, 72), ev.sink(1));
          });
        if (n == 10) client.join();  // its last token: the client is long done (the engine outlives it)
      }));
    };
    const RunResult r = run(cfg, async, submit);
    ASSERT_EQ(r.out.count(1), 1u) << (async ? "async" : "sync");
    const auto& a = r.out.at(0).order;
    const int64_t b_first = r.out.at(1).order.at(0);
    before[async] = size_t(std::count_if(a.begin(), a.end(), [&](int64_t o) { return o < b_first; }));
    if (async) {
      EXPECT_GT(r.stats.ahead_steps, 3);
    }
  }
  // Request 0's 5th token comes from the step in flight at the arrival, its 6th from the step the late request
  // enters (decodes are listed first, so it is out just before that request's first token).
  EXPECT_EQ(before[false], 6u);
  EXPECT_EQ(before[true], before[false]) << "with run-ahead the late request entered a step later";
}

// More requests than slots (max_running 2, 6 submitted at once): the waiting ones cannot come in until a running one
// ends, so the decode chains run ahead beside the backlog (Scheduler::could_admit) instead of stopping for it — and
// each request is admitted as soon as a slot frees, with the synchronous engine's tokens.
TEST(AsyncScheduling, ABacklogThatCannotBeAdmittedDoesNotStopTheChain) {
  EngineConfig cfg = roomy();
  cfg.max_running = 2;
  auto submit = [](Engine& e, Events& ev) {
    for (int k = 0; k < 6; ++k)
      e.submit(k % 2 ? seeded(6 + 3 * size_t(k), 10 + 2 * k, 60 + uint32_t(k)) : greedy(5 + size_t(k), 12 + k, 60 + uint32_t(k)),
               ev.sink(k));
  };
  const RunResult sync = run(cfg, false, submit), async = run(cfg, true, submit);
  expect_same(sync, async);
  // Every decode step but a chain's first (and the steps next to an admission) runs ahead: most of them.
  EXPECT_GT(async.stats.ahead_steps, async.stats.steps / 2) << async.stats.steps << " steps";
}

// The fake executor with a modelled device (FakeExecutorOptions::device_step, `kestrel serve --fake-engine
// --fake-step-us`) runs ahead too: its streams (random logits seeded by the prompt and the output index, the pending
// row's index one further) are the synchronous engine's, greedy and seeded.
TEST(AsyncScheduling, FakeExecutorWithAModelledDeviceRunsAhead) {
  EngineConfig cfg = roomy();
  runtime::FakeExecutorOptions fo;
  fo.device_step = std::chrono::microseconds(50);
  cfg.make_executor = runtime::fake_executor_factory(nano().cfg.text.vocab_size, fo);
  auto submit = [](Engine& e, Events& ev) {
    e.submit(greedy(7, 20, 51), ev.sink(0));
    e.submit(seeded(9, 14, 52), ev.sink(1));
    e.submit(greedy(5, 9, 53), ev.sink(2));
  };
  const RunResult sync = run(cfg, false, submit), async = run(cfg, true, submit);
  expect_same(sync, async);
  EXPECT_GT(async.stats.ahead_steps, 10);
}

// A page pool far smaller than the requests need: preemption by recompute in the normal steps, continuations
// left out when their pages cannot grow — and still every token the synchronous engine gives.
TEST(AsyncScheduling, MemoryPressureWithPreemption) {
  EngineConfig cfg;
  cfg.formats.block_size = 16;
  cfg.max_running = 4;
  cfg.checkpoint_slots = 2;
  cfg.max_num_batched_tokens = 64;
  const cache::CacheLayout l = cache::CacheLayout::from_config(nano().cfg.text, cfg.formats);
  cfg.memory_budget = l.total_state_bytes(6) + l.total_page_bytes(16);  // 256 tokens for ~450 wanted
  // The others from the first one's first event, so they all overlap whatever the test thread's timing.
  auto submit = [](Engine& e, Events& ev) {
    auto make = [](int i) {
      const size_t lens[] = {60, 45, 70, 52, 30};
      const int32_t max_tokens[] = {40, 35, 30, 38, 33};
      return i % 2 ? seeded(lens[i], max_tokens[i], 40 + uint32_t(i)) : greedy(lens[i], max_tokens[i], 40 + uint32_t(i));
    };
    e.submit(make(0), ev.sink(0, [&e, &ev, make](size_t n) {
      if (n != 1) return;
      for (int i = 1; i < 5; ++i) e.submit(make(i), ev.sink(i));
    }));
  };
  const RunResult sync = run(cfg, false, submit), async = run(cfg, true, submit);
  expect_same(sync, async);
  fmt::print("memory pressure: {} preemptions synchronous, {} async; {} of {} steps ran ahead\n",
             sync.stats.preemptions, async.stats.preemptions, async.stats.ahead_steps, async.stats.steps);
  EXPECT_GT(sync.stats.preemptions, 0);
  EXPECT_GT(async.stats.preemptions, 0);
  EXPECT_GT(async.stats.ahead_steps, 0);
  for (const auto& [key, o] : async.out) EXPECT_EQ(o.reason, FinishReason::length) << "request " << key;
}

// An executor that cannot run ahead (the fake one): the flag is accepted and changes nothing.
TEST(AsyncScheduling, IgnoredByAnExecutorThatCannotRunAhead) {
  auto fake = [](bool async) {
    EngineConfig cfg = roomy();
    cfg.async_scheduling = async;
    cfg.make_executor = runtime::fake_executor_factory(nano().cfg.text.vocab_size, {});
    Engine e(nano().cfg, cfg);
    Events ev;
    for (int i = 0; i < 3; ++i) e.submit(greedy(10 + size_t(i), 12, 50 + uint32_t(i)), ev.sink(i));
    e.wait_idle();
    return RunResult{ev.all(), e.stats()};
  };
  const RunResult off = fake(false), on = fake(true);
  expect_same(off, on);
  EXPECT_EQ(on.stats.ahead_steps, 0);
  runtime::FakeExecutor ex(16, {});
  EXPECT_FALSE(ex.runs_ahead());
  EXPECT_THROW(ex.launch(sched::StepPlan{}, {}), Error);
  EXPECT_THROW(ex.collect(sched::StepPlan{}, {}), Error);
}

// The real CPU executor behind a launch that fails at the n-th call (a device error, say), counting what it
// launched and collected; the counts outlive the engine, which destroys its executor.
class FailingLaunch : public runtime::StepExecutor {
 public:
  struct Counts {
    int launched = 0, collected = 0;
  };
  FailingLaunch(std::unique_ptr<runtime::StepExecutor> inner, int fail_at, std::shared_ptr<Counts> counts)
      : inner_(std::move(inner)), fail_at_(fail_at), counts_(std::move(counts)) {}
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    return inner_->run(plan, hooks);
  }
  const runtime::ExecutorStats& stats() const override { return inner_->stats(); }
  bool runs_ahead() const override { return true; }
  void launch(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    if (++calls_ == fail_at_) fail("injected launch failure");
    inner_->launch(plan, hooks);
    ++counts_->launched;
  }
  sched::StepResult collect(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    sched::StepResult r = inner_->collect(plan, hooks);
    ++counts_->collected;
    return r;
  }

 private:
  std::unique_ptr<runtime::StepExecutor> inner_;
  int fail_at_, calls_ = 0;
  std::shared_ptr<Counts> counts_;
};

// A launch that throws with a step in flight (the chain's third launch: its step before is launched and not
// collected): every request ends with the error, the engine refuses more, and the step in flight is collected
// before the engine gives up, so the executor is left with nothing launched.
TEST(AsyncScheduling, AFailedLaunchEndsEveryRequestAndLeavesNothingLaunched) {
  auto counts = std::make_shared<FailingLaunch::Counts>();
  EngineConfig cfg = roomy();
  cfg.async_scheduling = true;
  cfg.make_executor = [counts](const CacheFormats& f, const cache::CacheConfig& cc) {
    return std::unique_ptr<runtime::StepExecutor>(std::make_unique<FailingLaunch>(
        std::make_unique<runtime::Executor>(nano().w, nano().cfg, f, cc), 3, counts));
  };
  Events ev;
  {
    Engine e(nano().w, nano().cfg, cfg);
    // Request 1 from request 0's first event (the engine thread): both are running when the launch fails,
    // however late the test thread would have come.
    e.submit(greedy(10, 30, 70), ev.sink(0, [&e, &ev](size_t n) {
      if (n == 1) {
        EXPECT_TRUE(e.submit(seeded(12, 30, 71), ev.sink(1)).accepted());
      }
    }));
    e.wait_idle();
    EXPECT_FALSE(e.ready());
    EXPECT_NE(e.failure().find("injected launch failure"), std::string::npos) << e.failure();
    Request late = greedy(5, 3, 72);
    EXPECT_EQ(e.submit(late, ev.sink(2)).status, SubmitStatus::not_ready);
  }
  EXPECT_EQ(counts->launched, 2);
  EXPECT_EQ(counts->collected, counts->launched) << "a launched step was left uncollected";
  for (int key : {0, 1}) {
    const Events::Out o = ev.all().at(key);
    EXPECT_EQ(o.finals, 1);
    EXPECT_EQ(o.reason, FinishReason::error);
    EXPECT_NE(o.error.find("injected launch failure"), std::string::npos) << o.error;
  }
}

// The CPU executor's launch/collect contract: collects in launch order, at most two launched, no run() in
// between, a pending token only from the launch before; the tokens are those run() and the sampler give.
TEST(AsyncScheduling, ExecutorLaunchAndCollectInOrder) {
  cache::CacheConfig cc;
  cc.num_pages = 16, cc.num_state_slots = 4, cc.block_size = 16;
  CacheFormats f;
  f.block_size = 16;
  sched::SchedulerConfig sc;
  sc.vocab_size = int32_t(nano().cfg.text.vocab_size);
  const Request r = seeded(9, 10, 60);
  std::vector<int32_t> output;
  runtime::StepHooks hooks;
  hooks.sample = [&](const sched::ScheduledSeq&, std::span<const float> logits) {
    sched::SeqResult s;
    s.token = runtime::sample_token(r.sampling, logits, r.prompt, output, output.size()).token;
    return s;
  };
  hooks.sampling_inputs = [&](const sched::ScheduledSeq&) {
    return runtime::StepHooks::SamplingInputs{&r.sampling, r.prompt, output, {}};
  };
  hooks.take_token = [&](const sched::ScheduledSeq&, int32_t t) {
    output.push_back(t);
    sched::SeqResult s;
    s.token = t;
    return s;
  };
  // Synchronous reference: prefill + 3 decodes through run().
  std::vector<int32_t> reference;
  {
    runtime::Executor ex(nano().w, nano().cfg, f, cc);
    sched::Scheduler s(sc, cc);
    s.submit(1, r);
    for (int i = 0; i < 4; ++i) {
      const sched::StepPlan p = s.schedule();
      const sched::StepResult res = ex.run(p, hooks);
      output.push_back(res.seqs.at(0).token);
      s.complete(p, res);
    }
    reference = output;
    output.clear();
  }
  runtime::Executor ex(nano().w, nano().cfg, f, cc);
  sched::Scheduler s(sc, cc);
  s.submit(1, r);
  sched::StepPlan p = s.schedule();  // the prefill, synchronously
  sched::StepResult res = ex.run(p, hooks);
  output.push_back(res.seqs.at(0).token);
  s.complete(p, res);
  const sched::StepPlan n = s.schedule();
  ex.launch(n, hooks);
  const sched::StepPlan a = s.schedule_ahead();
  ASSERT_EQ(a.decodes.size(), 1u);
  {
    runtime::Executor fresh(nano().w, nano().cfg, f, cc);  // never launched: no token to take
    EXPECT_THROW(fresh.launch(a, hooks), Error);
  }
  ex.launch(a, hooks);
  EXPECT_THROW(ex.launch(a, hooks), Error);     // a third step launched
  EXPECT_THROW(ex.run(p, hooks), Error);        // run() while steps are launched
  EXPECT_THROW(ex.collect(a, hooks), Error);    // not the oldest
  res = ex.collect(n, hooks);
  ASSERT_EQ(res.seqs.size(), 1u);
  EXPECT_EQ(res.seqs[0].id, 1u);
  s.complete(n, res);
  const sched::StepPlan a2 = s.schedule_ahead();
  ex.launch(a2, hooks);
  s.complete(a, ex.collect(a, hooks));
  s.complete(a2, ex.collect(a2, hooks));
  EXPECT_EQ(output, reference);
  EXPECT_EQ(ex.stats().steps, 4);
  EXPECT_EQ(ex.stats().samples, 4);
  EXPECT_THROW(ex.collect(a2, hooks), Error);  // nothing launched
}

}  // namespace
}  // namespace kestrel::engine_ahead_testing
