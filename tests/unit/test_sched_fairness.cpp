// Scheduler fairness between long and short prompts (sched/scheduler.h, vLLM's partial-prefill
// limits): a long prefill's chunks are capped at long_prefill_token_threshold, so a short request
// arriving meanwhile is admitted and sampled in the very next step; a second long prompt waits for
// the long-prefill slot while shorter ones behind it pass; at most max_num_partial_prefills requests
// prefill at once; requests whose every prompt position must be computed (prompt logprobs) never
// start from a prefix-cache hit. Also a randomised run with the limits on, checked like the main
// simulation (integrity after every step, solo outputs).
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

#include "core/check.h"
#include "sched/scheduler.h"
#include "sched_fake_executor.h"

namespace kestrel::sched {
namespace {

using testing::cache_config;
using testing::Harness;
using testing::request;

SchedulerConfig fair(int32_t budget, int32_t threshold, int32_t partial = 4, int32_t long_partial = 1) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = 8;
  c.long_prefill_token_threshold = threshold;
  c.max_num_partial_prefills = partial;
  c.max_long_partial_prefills = long_partial;
  return c;
}

const ScheduledSeq* find(const std::vector<ScheduledSeq>& v, RequestId id) {
  for (const auto& x : v)
    if (x.id == id) return &x;
  return nullptr;
}

TEST(SchedFairness, ShortRequestIsSampledInTheNextStepOfALongPrefill) {
  // Without the cap the long prompt takes the whole budget every step and the short one waits for
  // all of it: the behaviour the cap removes.
  for (int32_t threshold : {0, 64}) {
    Harness h(fair(256, threshold), cache_config(128, 4));
    h.s.submit(1, request(1500, 4));
    h.step();
    h.step();
    h.s.submit(2, request(12, 4, 3000));  // under a block: no checkpoint boundary splits it
    const StepPlan p = h.step();
    const ScheduledSeq* lng = find(p.prefills, 1);
    const ScheduledSeq* sht = find(p.prefills, 2);
    ASSERT_NE(lng, nullptr);
    if (threshold == 0) {
      EXPECT_EQ(lng->end - lng->start, 256);
      EXPECT_EQ(sht, nullptr) << "without the cap the short request waits";
    } else {
      EXPECT_LE(lng->end - lng->start, 64);
      ASSERT_NE(sht, nullptr);
      EXPECT_TRUE(sht->sample) << "the short prompt is prefilled whole and sampled in its first step";
      EXPECT_EQ(sht->end - sht->start, 12);
    }
  }
}

TEST(SchedFairness, LongChunksNeverExceedTheThreshold) {
  Harness h(fair(512, 100), cache_config(256, 4));
  h.s.submit(1, request(1000, 2));
  int steps = 0;
  while (!h.s.idle() && steps < 100) {
    const StepPlan p = h.step();
    for (const auto& x : p.prefills) EXPECT_LE(x.end - x.start, 100);
    ++steps;
  }
  EXPECT_TRUE(h.s.idle());
  EXPECT_GE(steps, 10);  // 1000 tokens in chunks of at most 100, then a decode
}

TEST(SchedFairness, ASecondLongPromptWaitsWhileShortOnesPass) {
  Harness h(fair(256, 64, 4, 1), cache_config(256, 6));
  h.s.submit(1, request(800, 2));        // long, admitted first
  h.s.submit(2, request(700, 2, 2000));  // long: waits for the long slot
  h.s.submit(3, request(14, 2, 4000));   // short, behind it: passes
  const StepPlan p = h.step();
  EXPECT_NE(find(p.prefills, 1), nullptr);
  EXPECT_EQ(find(p.prefills, 2), nullptr);
  ASSERT_NE(find(p.prefills, 3), nullptr);
  EXPECT_TRUE(find(p.prefills, 3)->sample);
  // The second long prompt starts only after the first one's last prefill chunk (the step that
  // samples it).
  int last_chunk_of_1 = -1, first_chunk_of_2 = -1;
  for (int i = 1; i < 100 && !h.s.idle(); ++i) {
    const StepPlan q = h.step();
    if (const ScheduledSeq* x = find(q.prefills, 1); x && x->sample) last_chunk_of_1 = i;
    if (find(q.prefills, 2) && first_chunk_of_2 < 0) first_chunk_of_2 = i;
  }
  EXPECT_TRUE(h.s.idle());
  ASSERT_GT(last_chunk_of_1, 0);
  EXPECT_GT(first_chunk_of_2, last_chunk_of_1);
}

TEST(SchedFairness, AtMostMaxNumPartialPrefillsAtOnce) {
  Harness h(fair(1024, 32, 2, 2), cache_config(256, 8));
  for (RequestId id = 1; id <= 5; ++id) h.s.submit(id, request(200, 2, int32_t(1000 * id)));
  for (int i = 0; i < 60 && !h.s.idle(); ++i) {
    const StepPlan p = h.step();
    EXPECT_LE(p.prefills.size(), 2u);
  }
  EXPECT_TRUE(h.s.idle());
}

TEST(SchedFairness, PromptLogprobsRequestsComputeEveryPosition) {
  Harness h(fair(512, 0), cache_config(64, 8));
  h.s.submit(1, request(100, 1));
  while (!h.s.idle()) h.step();
  // The same prompt again hits the prefix cache; with prompt logprobs it does not.
  Request hit = request(100, 1);
  h.s.submit(2, hit);
  StepPlan p = h.step();
  ASSERT_EQ(p.prefills.size(), 1u);
  EXPECT_GT(p.prefills[0].start, 0);
  while (!h.s.idle()) h.step();
  Request all = request(100, 1);
  all.sampling.prompt_logprobs = 0;
  h.s.submit(3, all);
  p = h.step();
  ASSERT_EQ(p.prefills.size(), 1u);
  EXPECT_EQ(p.prefills[0].start, 0);
}

// The randomised run of test_sched_simulation.cpp, shortened, with the fairness limits on and a mix
// of long and short prompts: every step passes check_integrity(), no step exceeds the budget or the
// chunk cap, every request finishes with its solo output, nothing leaks.
TEST(SchedFairness, RandomisedRunWithLimits) {
  for (uint64_t seed : {1u, 2u}) {
    std::mt19937_64 rng(seed);
    auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
    cache::CacheConfig cc = cache_config(96, 12, 8);
    SchedulerConfig sc = fair(48, 12, 3, 1);
    sc.checkpoint_interval_blocks = 2;
    sc.vocab_size = 1000;
    testing::FakeModel model{seed, 1000, 53};
    testing::FakeExecutor exec(model, cc);
    Scheduler s(sc, cc);
    std::map<RequestId, Request> live;
    RequestId next = 1;
    for (int64_t step = 0; step < 3000 || !s.idle(); ++step) {
      ASSERT_LT(step, 40000) << "did not drain";
      if (step < 3000 && uniform(0, 99) < 12) {
        Request r;
        const int64_t n = uniform(0, 4) == 0 ? uniform(100, 400) : uniform(1, 30);
        for (int64_t i = 0; i < n; ++i) r.prompt.push_back(int32_t(uniform(0, 999)));
        r.max_tokens = int32_t(uniform(1, 40));
        if (uniform(0, 9) == 0) r.sampling.prompt_logprobs = 1;
        s.submit(next, r);
        live.emplace(next++, r);
      }
      const StepPlan p = s.schedule();
      ASSERT_LE(p.num_tokens, sc.max_num_batched_tokens);
      for (const auto& x : p.prefills) ASSERT_LE(x.end - x.start, 12);
      s.complete(p, exec.run(p, s.cache()));
      s.check_integrity();
      for (const auto& f : s.drain_finished()) {
        const Request& r = live.at(f.id);
        ASSERT_EQ(f.output, model.solo_output(r.prompt, r.max_tokens)) << "request " << f.id;
        live.erase(f.id);
      }
    }
    EXPECT_TRUE(live.empty());
    s.evict_prefix_cache();
    EXPECT_EQ(s.cache().pages().num_free(), cc.num_pages);
  }
}

}  // namespace
}  // namespace kestrel::sched
