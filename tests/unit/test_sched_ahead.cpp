// Run-ahead in the scheduler (sched/scheduler.h schedule_ahead; the engine's async scheduling): the
// continuation of a decodes-only step in flight (one position further, tokens pending, block tables grown
// across a page boundary), requests left out at max_tokens or when their pages cannot grow (nobody is
// preempted), a request that stops or is cancelled at step N while N+1 is in flight (reported at N, its
// memory released only at N+1's complete, its row ignored with or without a result), and the calls that are
// refused (a second schedule, a continuation of prefills or drafts, out-of-order completes). Integrity is
// checked between every two calls, and outputs driven to the end match each request's solo output.
#include <gtest/gtest.h>

#include <deque>
#include <utility>

#include "core/check.h"
#include "sched/scheduler.h"
#include "sched_fake_executor.h"

// A namespace of its own: CI batches test files into unity translation units (KESTREL_UNITY).
namespace kestrel::sched::ahead_testing {
namespace {

using testing::cache_config;
using testing::Harness;
using testing::request;

SchedulerConfig config(int32_t budget = 64) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = 8;
  return c;
}

// Runs the scheduler to idle as the engine does with run-ahead: every decodes-only step in flight gets its
// continuation, run (by the fake executor, which takes pending tokens from the step before) before the step
// before it completes.
std::vector<FinishedRequest> drive(Harness& h) {
  std::vector<FinishedRequest> done;
  for (int i = 0; i < 1000 && !h.s.idle(); ++i) {
    std::deque<std::pair<StepPlan, StepResult>> flight;
    StepPlan p = h.s.schedule();
    h.s.check_integrity();
    StepResult r = h.exec.run(p, h.s.cache());
    flight.emplace_back(std::move(p), std::move(r));
    while (!flight.empty()) {
      const StepPlan& cur = flight.front().first;
      if (flight.size() == 1 && cur.has_work() && cur.prefills.empty()) {
        StepPlan a = h.s.schedule_ahead();
        h.s.check_integrity();
        if (a.has_work()) {
          StepResult ra = h.exec.run(a, h.s.cache());
          flight.emplace_back(std::move(a), std::move(ra));
        }
      }
      h.s.complete(flight.front().first, flight.front().second);
      h.s.check_integrity();
      flight.pop_front();
      for (auto& f : h.s.drain_finished()) done.push_back(std::move(f));
    }
  }
  EXPECT_TRUE(h.s.idle());
  return done;
}

const FinishedRequest& by_id(const std::vector<FinishedRequest>& done, RequestId id) {
  for (const FinishedRequest& f : done)
    if (f.id == id) return f;
  throw Error(fmt::format("request {} did not finish", id));
}

// Drives requests 1 (`a`) and 2 (`b`) to the end: each output is its solo one.
void expect_solo_outputs(Harness& h, const Request& a, const Request& b) {
  const auto done = drive(h);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(by_id(done, 1).output, h.model.solo_output(a.prompt, a.max_tokens));
  EXPECT_EQ(by_id(done, 2).output, h.model.solo_output(b.prompt, b.max_tokens));
}

TEST(SchedAhead, ContinuationIsOnePositionFurtherWithItsTokenPending) {
  Harness h(config(), cache_config(16, 4));
  const Request a = request(15, 10), b = request(5, 10, 100);
  h.s.submit(1, a);
  h.s.submit(2, b);
  h.step();  // both prefilled: request 1 has 16 tokens, request 2 has 6
  const StepPlan n = h.s.schedule();
  const StepResult rn = h.exec.run(n, h.s.cache());
  h.s.check_integrity();
  ASSERT_EQ(n.decodes.size(), 2u);
  const EngineStats before = h.s.stats();
  const StepPlan next = h.s.schedule_ahead();
  h.s.check_integrity();
  EXPECT_EQ(next.step, n.step + 1);
  ASSERT_EQ(next.decodes.size(), 2u);
  EXPECT_TRUE(next.prefills.empty() && next.copies_before.empty() && next.copies_after.empty());
  EXPECT_TRUE(next.finished.empty() && next.cancelled.empty() && next.preempted.empty());
  EXPECT_EQ(next.num_tokens, 2);
  for (size_t i = 0; i < 2; ++i) {
    const ScheduledSeq &x = next.decodes[i], &prev = n.decodes[i];
    EXPECT_EQ(x.id, prev.id);  // the order of the step it continues
    EXPECT_EQ(x.start, prev.end);
    EXPECT_EQ(x.end, prev.end + 1);
    EXPECT_EQ(x.tokens, std::vector<int32_t>{-1});
    EXPECT_TRUE(x.token_pending && x.sample && !x.reset_state);
    EXPECT_EQ(x.num_draft, 0);
    EXPECT_EQ(x.state_slot, prev.state_slot);
  }
  // Request 1's position 16 starts a second page; the first is the one its step in flight writes.
  ASSERT_EQ(next.decodes[0].block_table.size(), 2u);
  EXPECT_EQ(next.decodes[0].block_table[0], n.decodes[0].block_table.at(0));
  EXPECT_EQ(h.s.cache().block_table(1).num_tokens, 17);
  EXPECT_EQ(next.decodes[1].block_table, n.decodes[1].block_table);
  const EngineStats after = h.s.stats();
  EXPECT_EQ(after.steps, before.steps + 1);
  EXPECT_EQ(after.ahead_steps, before.ahead_steps + 1);
  EXPECT_EQ(after.decode_tokens, before.decode_tokens + 2);
  EXPECT_EQ(h.s.num_in_flight(), 2u);

  // Two in flight: no new plan of either kind, no eviction, and completes only in order (state intact).
  EXPECT_THROW(h.s.schedule(), Error);
  EXPECT_THROW(h.s.schedule_ahead(), Error);
  EXPECT_THROW(h.s.evict_prefix_cache(), Error);
  const StepResult rnext = h.exec.run(next, h.s.cache());
  EXPECT_THROW(h.s.complete(next, rnext), Error);
  h.s.check_integrity();
  h.s.complete(n, rn);
  h.s.check_integrity();
  EXPECT_EQ(h.s.num_in_flight(), 1u);
  h.s.complete(next, rnext);
  h.s.check_integrity();
  expect_solo_outputs(h, a, b);
}

TEST(SchedAhead, MaxTokensLeavesTheLastTokenOut) {
  Harness h(config(), cache_config(16, 4));
  h.s.submit(1, request(5, 2));       // its prefill token, then one decode: the last
  h.s.submit(2, request(5, 4, 100));  // prefill + three decodes
  h.step();
  const StepPlan n = h.s.schedule();
  const StepResult rn = h.exec.run(n, h.s.cache());
  const StepPlan a1 = h.s.schedule_ahead();
  h.s.check_integrity();
  ASSERT_EQ(a1.decodes.size(), 1u);
  EXPECT_EQ(a1.decodes[0].id, 2u);
  const StepResult ra1 = h.exec.run(a1, h.s.cache());
  h.s.complete(n, rn);
  h.s.check_integrity();
  EXPECT_FALSE(h.s.cache().has(1)) << "request 1 ended at max_tokens and is in no step in flight: released at once";
  const StepPlan a2 = h.s.schedule_ahead();  // request 2's 4th and last token
  h.s.check_integrity();
  ASSERT_EQ(a2.decodes.size(), 1u);
  EXPECT_EQ(a2.decodes[0].start, 7);  // prompt 5, then positions 5 (n) and 6 (a1)
  const StepResult ra2 = h.exec.run(a2, h.s.cache());
  h.s.complete(a1, ra1);
  h.s.check_integrity();
  const int64_t steps = h.s.stats().steps;
  const StepPlan a3 = h.s.schedule_ahead();  // nothing can follow a request's last token
  h.s.check_integrity();
  EXPECT_FALSE(a3.has_work());
  EXPECT_EQ(h.s.num_in_flight(), 1u) << "a plan without work is not in flight";
  EXPECT_EQ(h.s.stats().steps, steps);
  h.s.complete(a2, ra2);
  h.s.check_integrity();
  EXPECT_TRUE(h.s.idle());
  const auto done = h.s.drain_finished();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(by_id(done, 1).output, h.model.solo_output(request(5, 2).prompt, 2));
  EXPECT_EQ(by_id(done, 2).output, h.model.solo_output(request(5, 4, 100).prompt, 4));
  EXPECT_EQ(by_id(done, 2).reason, FinishReason::length);
}

TEST(SchedAhead, AFullPoolLeavesAContinuationOutAndPreemptsNobody) {
  cache::CacheConfig cc = cache_config(3, 4, 4);  // 12 tokens
  cc.enable_prefix_cache = false;
  Harness h(config(), cc);
  const Request a = request(3, 6), b = request(6, 6, 100);
  h.s.submit(1, a);
  h.s.submit(2, b);
  h.step();  // request 1 holds one page (4 tokens), request 2 two (7 tokens): the pool is full
  const StepPlan n = h.s.schedule();
  const StepResult rn = h.exec.run(n, h.s.cache());
  ASSERT_EQ(n.decodes.size(), 2u);
  ASSERT_TRUE(n.preempted.empty());
  const StepPlan next = h.s.schedule_ahead();
  h.s.check_integrity();
  // Request 1's position 4 needs a second page and none is free; request 2's position 7 fits its pages.
  ASSERT_EQ(next.decodes.size(), 1u);
  EXPECT_EQ(next.decodes[0].id, 2u);
  EXPECT_TRUE(next.preempted.empty());
  EXPECT_EQ(h.s.stats().preemptions, 0);
  EXPECT_EQ(h.s.num_running(), 2u);
  EXPECT_EQ(h.s.cache().block_table(1).pages.size(), 1u);
  const StepResult rnext = h.exec.run(next, h.s.cache());
  h.s.complete(n, rn);
  h.s.check_integrity();
  h.s.complete(next, rnext);
  h.s.check_integrity();
  // Request 1 goes on through schedule() (which may preempt there); both outputs are their solo ones.
  expect_solo_outputs(h, a, b);
}

// A stop at N while N+1 computes the request: reported at N; pages, slot and queue entry kept until N+1
// completes, which ignores its row whether the executor returned a result for it (request 1) or not (2).
TEST(SchedAhead, AStopAtNIsReportedAtNAndReleasedAtNPlus1) {
  Harness h(config(), cache_config(16, 4));
  for (RequestId id : {1, 2, 3}) h.s.submit(id, request(5, 20, int32_t(100 * id)));
  h.step();
  const StepPlan n = h.s.schedule();
  const StepPlan a1 = h.s.schedule_ahead();
  ASSERT_EQ(a1.decodes.size(), 3u);
  const int32_t free_pages = h.s.cache().pages().num_free();
  h.s.complete(n, {{{1, 7, true, {}}, {2, 8, false, {}}, {3, 9, false, {}}}});
  h.s.check_integrity();
  auto done = h.s.drain_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, 1u);
  EXPECT_EQ(done[0].reason, FinishReason::stop);
  ASSERT_EQ(done[0].output.size(), 2u);  // its prefill token, then the stop
  EXPECT_EQ(done[0].output[1], 7);
  EXPECT_EQ(h.s.stats().finished, 1);
  // Still holding what step a1 writes.
  EXPECT_TRUE(h.s.cache().has(1));
  EXPECT_EQ(h.s.cache().pages().num_free(), free_pages);
  EXPECT_EQ(h.s.num_running(), 3u);
  EXPECT_FALSE(h.s.cancel(1)) << "a finished request cannot be cancelled";
  const StepPlan a2 = h.s.schedule_ahead();
  h.s.check_integrity();
  ASSERT_EQ(a2.decodes.size(), 2u);  // request 1 does not continue
  EXPECT_EQ(a2.decodes[0].id, 2u);
  EXPECT_EQ(a2.decodes[1].id, 3u);
  // a1 with a (wasted) result for request 1, and a stop of request 2, which a2 still computes.
  h.s.complete(a1, {{{1, 11, false, {}}, {2, 12, true, {}}, {3, 13, false, {}}}});
  h.s.check_integrity();
  EXPECT_FALSE(h.s.cache().has(1));
  EXPECT_TRUE(h.s.cache().has(2));
  done = h.s.drain_finished();
  ASSERT_EQ(done.size(), 1u) << "request 1 is reported once";
  EXPECT_EQ(done[0].id, 2u);
  EXPECT_EQ(done[0].output.back(), 12);
  EXPECT_EQ(done[0].output.size(), 3u);
  // a2 without a result for request 2, and one too many for request 3's: refused, nothing changed.
  EXPECT_THROW(h.s.complete(a2, {{{3, 14, false, {}}, {1, 14, false, {}}}}), Error);
  EXPECT_THROW(h.s.complete(a2, {}), Error);  // request 3's token is missing
  h.s.check_integrity();
  h.s.complete(a2, {{{3, 14, false, {}}}});
  h.s.check_integrity();
  EXPECT_FALSE(h.s.cache().has(2));
  EXPECT_TRUE(h.s.drain_finished().empty());
  EXPECT_EQ(h.s.num_running(), 1u);
  EXPECT_EQ(h.s.stats().finished, 2);
  const StepPlan p = h.s.schedule();  // nothing in flight now: the executor hears of both
  EXPECT_EQ(p.finished, (std::vector<RequestId>{1, 2}));
  ASSERT_EQ(p.decodes.size(), 1u);
  EXPECT_EQ(p.decodes[0].start, 8);  // request 3: prompt 5 + 3 tokens, the last not yet computed
}

TEST(SchedAhead, CancelWithTwoStepsInFlight) {
  Harness h(config(), cache_config(16, 4));
  h.s.submit(1, request(5, 20));
  h.s.submit(2, request(5, 20, 100));
  h.s.submit(3, request(5, 2, 200));  // its decode in n is its last: not in the continuation
  h.step();
  const StepPlan n = h.s.schedule();
  const StepResult rn = h.exec.run(n, h.s.cache());
  const StepPlan next = h.s.schedule_ahead();
  ASSERT_EQ(next.decodes.size(), 2u);
  const StepResult rnext = h.exec.run(next, h.s.cache());
  EXPECT_TRUE(h.s.cancel(1));
  EXPECT_TRUE(h.s.cancel(3));
  EXPECT_TRUE(h.s.cancel(1)) << "already pending";
  h.s.check_integrity();
  EXPECT_TRUE(h.s.cache().has(1) && h.s.cache().has(3));  // both steps still use them
  EXPECT_TRUE(h.s.drain_finished().empty());
  h.s.complete(n, rn);
  h.s.check_integrity();
  auto done = h.s.drain_finished();
  ASSERT_EQ(done.size(), 2u);
  for (const FinishedRequest& f : done) {
    EXPECT_EQ(f.reason, FinishReason::cancelled) << "request " << f.id;
    EXPECT_EQ(f.output.size(), 1u) << "request " << f.id << ": n's token is dropped";
  }
  EXPECT_FALSE(h.s.cache().has(3)) << "in no step in flight: released at once";
  EXPECT_TRUE(h.s.cache().has(1)) << "next still computes it";
  EXPECT_FALSE(h.s.cancel(1));
  const StepPlan after = h.s.schedule_ahead();
  h.s.check_integrity();
  ASSERT_EQ(after.decodes.size(), 1u);
  EXPECT_EQ(after.decodes[0].id, 2u);
  const StepResult rafter = h.exec.run(after, h.s.cache());
  h.s.complete(next, rnext);
  h.s.check_integrity();
  EXPECT_FALSE(h.s.cache().has(1));
  EXPECT_TRUE(h.s.drain_finished().empty());
  h.s.complete(after, rafter);
  h.s.check_integrity();
  EXPECT_EQ(h.s.num_running(), 1u);
  EXPECT_EQ(h.s.stats().cancelled, 2);
  const auto rest = drive(h);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].output, h.model.solo_output(request(5, 20, 100).prompt, 20));
}

TEST(SchedAhead, OnlyAStepOfPlainDecodesCanBeContinued) {
  Harness h(config(), cache_config(16, 4));
  EXPECT_THROW(h.s.schedule_ahead(), Error);  // nothing in flight
  h.s.submit(1, request(5, 10));
  StepPlan p = h.s.schedule();  // a prefill
  EXPECT_THROW(h.s.schedule_ahead(), Error);
  h.s.check_integrity();
  h.s.complete(p, h.exec.run(p, h.s.cache()));
  h.s.check_integrity();
  // A step with a prefill beside its decodes.
  h.s.submit(2, request(5, 10, 100));
  p = h.s.schedule();
  ASSERT_EQ(p.decodes.size(), 1u);
  ASSERT_EQ(p.prefills.size(), 1u);
  EXPECT_THROW(h.s.schedule_ahead(), Error);
  h.s.complete(p, h.exec.run(p, h.s.cache()));
  h.s.check_integrity();
  // A speculative decode (draft positions).
  SchedulerConfig sc = config();
  sc.num_speculative_tokens = 2;
  Harness spec(sc, cache_config(16, 4));
  spec.s.submit(1, request(5, 10), true);
  spec.step();
  p = spec.s.schedule();
  ASSERT_EQ(p.decodes.size(), 1u);
  ASSERT_EQ(p.decodes[0].num_draft, 2);
  EXPECT_THROW(spec.s.schedule_ahead(), Error);
  spec.s.check_integrity();
}

}  // namespace
}  // namespace kestrel::sched::ahead_testing
