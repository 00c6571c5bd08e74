// Randomised serving simulation: the Scheduler driven by the fake executor for 10,000 steps per
// seed, with arrivals sharing prefixes (so the prefix cache hits), exact repeats, random lengths,
// random cancellations, requests too big to ever fit, and a cache small enough to force preemption.
// After every step the whole cache and scheduler must pass check_integrity(). Every request that
// completes must have produced exactly its solo output (preemption by recompute and prefix hits
// must not change a token); a cancelled one a prefix of it. At the end nothing leaks: with no
// request left, only cache entries hold pages and checkpoints, and evicting them returns all.
// With run-ahead on, a decodes-only step is usually followed by a chain of continuations (schedule_ahead),
// each run before the step before it completes, with cancels landing while two steps are in flight: the
// same checks hold after every call.
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <random>

#include "core/check.h"
#include "sched/scheduler.h"
#include "sched_fake_executor.h"

namespace kestrel::sched {
namespace {

struct SimTotals {
  int64_t steps = 0, completed = 0, cancelled = 0, rejected = 0;
  int64_t ahead_steps = 0, retired_stops = 0, retired_cancels = 0;  // run-ahead
  EngineStats stats;
};

SimTotals simulate(uint64_t seed, int64_t steps, int hash_bits = 64, bool run_ahead = false) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };

  cache::CacheConfig cc;
  cc.block_size = 8;
  cc.num_pages = 72;  // 576 tokens: a few requests at a time, so memory runs out
  cc.num_state_slots = 12;
  cc.hash_bits = hash_bits;
  SchedulerConfig sc;
  sc.max_num_seqs = 8;
  sc.max_num_batched_tokens = 48;
  sc.checkpoint_interval_blocks = 2;
  sc.vocab_size = 1000;
  testing::FakeModel model{seed, 1000, 53};
  testing::FakeExecutor exec(model, cc);
  Scheduler s(sc, cc);

  std::vector<std::vector<int32_t>> system_prompts;
  for (int i = 0; i < 5; ++i) {
    std::vector<int32_t> p(size_t(uniform(8, 56)));
    for (auto& t : p) t = int32_t(uniform(0, 999));
    system_prompts.push_back(p);
  }
  std::vector<std::vector<int32_t>> past_prompts;
  std::map<RequestId, Request> live;
  SimTotals tot;
  RequestId next_id = 1;

  auto check_output = [&](const FinishedRequest& f) {
    const Request& r = live.at(f.id);
    const auto solo = model.solo_output(r.prompt, r.max_tokens);
    if (f.reason == FinishReason::cancelled) {
      KCHECK(f.output.size() <= solo.size() && std::equal(f.output.begin(), f.output.end(), solo.begin()),
             "cancelled request {} diverged from its solo output", f.id);
      ++tot.cancelled;
    } else {
      KCHECK(f.output == solo, "request {} produced {} tokens, solo {}; outputs differ", f.id, f.output.size(),
             solo.size());
      KCHECK((f.reason == FinishReason::stop) == model.stops(f.output.back()), "request {} finish reason", f.id);
      ++tot.completed;
    }
    live.erase(f.id);
  };

  for (int64_t step = 0; step < steps || !s.idle(); ++step) {
    KCHECK(step < steps + 20000, "seed {}: the simulation did not drain", seed);
    const bool arrivals = step < steps;
    if (arrivals && chance(0.12)) {
      Request r;
      const RequestId id = next_id++;
      if (!past_prompts.empty() && chance(0.15)) {
        r.prompt = past_prompts[size_t(uniform(0, int64_t(past_prompts.size()) - 1))];
      } else {
        if (chance(0.7)) r.prompt = system_prompts[size_t(uniform(0, 4))];
        const int64_t extra = uniform(1, 90);
        for (int64_t i = 0; i < extra; ++i) r.prompt.push_back(int32_t(uniform(0, 999)));
      }
      r.max_tokens = int32_t(uniform(1, 80));
      if (chance(0.01)) r.max_tokens = 600;  // can never fit
      try {
        s.submit(id, r);
        past_prompts.push_back(r.prompt);
        live.emplace(id, r);
      } catch (const Error&) {
        KCHECK(r.prompt.size() + size_t(r.max_tokens) - 1 > size_t(cc.num_pages * cc.block_size),
               "request {} rejected although it fits", id);
        ++tot.rejected;
      }
    }
    if (arrivals && !live.empty() && chance(0.01)) {
      auto it = live.begin();
      std::advance(it, uniform(0, int64_t(live.size()) - 1));
      KCHECK(s.cancel(it->first), "cancel of live request {}", it->first);
    }
    for (const auto& f : s.drain_finished()) check_output(f);
    s.check_integrity();
    const StepPlan plan = s.schedule();
    KCHECK(plan.num_tokens <= sc.max_num_batched_tokens, "step {} over budget", step);
    s.check_integrity();
    // Cancelling a request whose step is in flight must wait for complete().
    if (!plan.prefills.empty() && chance(0.005)) s.cancel(plan.prefills.front().id);
    std::deque<std::pair<StepPlan, StepResult>> flight;
    flight.emplace_back(plan, exec.run(plan, s.cache()));
    while (!flight.empty()) {
      // Run-ahead: a continuation of the decodes-only step in flight, run before that step completes — most
      // of the time while nobody waits (the engine's rule), now and then even when someone does.
      const StepPlan& cur = flight.front().first;
      if (run_ahead && flight.size() == 1 && cur.has_work() && cur.prefills.empty() &&
          chance(s.num_waiting() == 0 ? 0.9 : 0.2)) {
        StepPlan next = s.schedule_ahead();
        s.check_integrity();
        KCHECK(next.num_tokens <= int64_t(cur.decodes.size()), "a continuation longer than its step");
        if (next.has_work()) {
          StepResult r = exec.run(next, s.cache());
          flight.emplace_back(std::move(next), std::move(r));
          ++tot.ahead_steps;
        }
      }
      if (run_ahead && flight.size() == 2 && chance(0.02)) {  // lands while both are in flight
        const auto& rows = flight.back().first.decodes;
        s.cancel(rows[size_t(uniform(0, int64_t(rows.size()) - 1))].id);
        s.check_integrity();
      }
      s.complete(flight.front().first, flight.front().second);
      flight.pop_front();
      s.check_integrity();
      for (const auto& f : s.drain_finished()) {
        // Finished while the step still in flight computes it: retired (released at that step's complete).
        if (!flight.empty())
          for (const ScheduledSeq& x : flight.front().first.decodes)
            if (x.id == f.id) ++(f.reason == FinishReason::cancelled ? tot.retired_cancels : tot.retired_stops);
        check_output(f);
      }
      ++tot.steps;
    }
  }
  KCHECK(live.empty(), "{} requests never finished", live.size());
  const auto& cm = s.cache();
  KCHECK(cm.pages().num_free() + int32_t(cm.prefix_cache().size()) == cc.num_pages,
         "pages leak: {} free + {} cached of {}", cm.pages().num_free(), cm.prefix_cache().size(), cc.num_pages);
  KCHECK(cm.slots().num_free() + cm.prefix_cache().num_checkpoints() == cc.num_state_slots, "slots leak");
  s.evict_prefix_cache();
  KCHECK(cm.pages().num_free() == cc.num_pages && cm.slots().num_free() == cc.num_state_slots &&
             cm.prefix_cache().size() == 0,
         "evicting the cache did not return everything");
  s.check_integrity();
  tot.stats = s.stats();
  return tot;
}

TEST(SchedSimulation, TenThousandStepsThreeSeeds) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    SimTotals t;
    ASSERT_NO_THROW(t = simulate(seed, 10000)) << "seed " << seed;
    const auto& st = t.stats;
    std::printf(
        "seed %llu: %lld steps, %lld completed, %lld cancelled, %lld rejected, %lld admissions, %lld preemptions, "
        "%lld prefix hits skipping %lld of %lld prefill tokens, %lld decode tokens\n",
        (unsigned long long)seed, (long long)t.steps, (long long)t.completed, (long long)t.cancelled,
        (long long)t.rejected, (long long)st.admitted, (long long)st.preemptions, (long long)st.prefix_hits,
        (long long)st.prefix_hit_tokens, (long long)(st.prefill_tokens + st.prefix_hit_tokens),
        (long long)st.decode_tokens);
    EXPECT_GE(t.steps, 10000);
    EXPECT_GT(t.completed, 500);
    EXPECT_GT(t.cancelled, 0);
    EXPECT_GT(t.rejected, 0);
    EXPECT_GT(st.preemptions, 0);
    EXPECT_GT(st.prefix_hits, 0);
    EXPECT_GT(st.prefix_hit_tokens, 0);
  }
}

// Run-ahead chains between the normal steps: every output still matches its solo run, and requests stop
// (the fake model's stop ids), finish at max_tokens and are cancelled while two steps are in flight.
TEST(SchedSimulation, RunAheadChains) {
  for (uint64_t seed : {4u, 5u}) {
    SimTotals t;
    ASSERT_NO_THROW(t = simulate(seed, 3000, 64, true)) << "seed " << seed;
    std::printf("seed %llu with run-ahead: %lld steps (%lld ahead), %lld completed, %lld cancelled, %lld preemptions; "
                "%lld stops and %lld cancels while the next step was in flight\n",
                (unsigned long long)seed, (long long)t.steps, (long long)t.ahead_steps, (long long)t.completed,
                (long long)t.cancelled, (long long)t.stats.preemptions, (long long)t.retired_stops,
                (long long)t.retired_cancels);
    EXPECT_EQ(t.stats.ahead_steps, t.ahead_steps);
    EXPECT_GT(t.retired_stops, 0);
    EXPECT_GT(t.retired_cancels, 0);
    EXPECT_GT(t.ahead_steps, t.steps / 4);
    EXPECT_GT(t.completed, 100);
    EXPECT_GT(t.cancelled, 0);
    EXPECT_GT(t.stats.preemptions, 0);
  }
}

// Three-bit chain hashes: nearly every lookup meets colliding entries, which only a token-by-token
// comparison tells apart; outputs must still match their solo runs.
TEST(SchedSimulation, SurvivesHashCollisions) {
  SimTotals t;
  ASSERT_NO_THROW(t = simulate(11, 3000, 3));
  EXPECT_GT(t.stats.prefix_hit_tokens, 0);
}

}  // namespace
}  // namespace kestrel::sched
