// Scheduler policy, one rule per test: decode before prefill, the token budget, chunked prefill,
// admission gated by pages and by state slots, rejection of requests that can never fit (request
// validity itself is validate()'s, test_request.cpp),
// cancellation (immediate, and deferred while a step is in flight), preemption by recompute,
// prefix hits that skip prefill, complete() refusing a result that does not match its plan, and
// speculative decodes (draft positions planned, rejected positions' pages released).
#include <gtest/gtest.h>

#include <numeric>

#include "core/check.h"
#include "sched/scheduler.h"
#include "sched_fake_executor.h"

namespace kestrel::sched {
namespace {

using testing::cache_config;
using testing::Harness;
using testing::request;

SchedulerConfig sched_config(int32_t budget, int32_t seqs = 8) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = seqs;
  return c;
}

TEST(SchedPolicy, DecodeBeforePrefill) {
  Harness h(sched_config(64), cache_config(32, 4));
  h.s.submit(1, request(10, 5));
  h.step();  // request 1 prefilled, now decoding
  h.s.submit(2, request(40, 5));
  StepPlan p = h.step();
  ASSERT_EQ(p.decodes.size(), 1u);
  EXPECT_EQ(p.decodes[0].id, 1u);
  EXPECT_EQ(p.decodes[0].end - p.decodes[0].start, 1);
  ASSERT_EQ(p.prefills.size(), 1u);
  EXPECT_EQ(p.prefills[0].id, 2u);
  // With a budget of one token, the decode takes it and the prefill waits.
  Harness tight(sched_config(1), cache_config(32, 4));
  tight.s.submit(1, request(1, 5));
  tight.step();
  tight.s.submit(2, request(8, 5));
  p = tight.step();
  EXPECT_EQ(p.decodes.size(), 1u);
  EXPECT_TRUE(p.prefills.empty());
}

TEST(SchedPolicy, TokenBudgetAndSeqLimitRespected) {
  Harness h(sched_config(20, 3), cache_config(64, 8));
  for (RequestId id = 1; id <= 6; ++id) h.s.submit(id, request(9, 4, int32_t(100 * id)));
  for (int i = 0; i < 30 && !h.s.idle(); ++i) {
    const StepPlan p = h.step();
    EXPECT_LE(p.num_tokens, 20);
    EXPECT_LE(p.decodes.size() + p.prefills.size(), 3u);
    EXPECT_LE(h.s.num_running(), 3u);
  }
  EXPECT_TRUE(h.s.idle());
}

TEST(SchedPolicy, ChunkedPrefillSplitsALongPrompt) {
  Harness h(sched_config(32), cache_config(32, 4));
  h.s.submit(1, request(100, 2));
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::vector<bool> sampled;
  for (int i = 0; i < 4; ++i) {
    const StepPlan p = h.step();
    ASSERT_EQ(p.prefills.size(), 1u);
    chunks.emplace_back(p.prefills[0].start, p.prefills[0].end);
    sampled.push_back(p.prefills[0].sample);
    EXPECT_EQ(p.prefills[0].block_table.size(), size_t((p.prefills[0].end + 15) / 16));
  }
  // 96 = the prompt's last full block: a KDA checkpoint boundary, so a chunk ends there.
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 32}, {32, 64}, {64, 96}, {96, 100}}));
  EXPECT_EQ(sampled, (std::vector<bool>{false, false, false, true}));
  const StepPlan d = h.step();
  ASSERT_EQ(d.decodes.size(), 1u);
  EXPECT_EQ(d.decodes[0].start, 100);
}

TEST(SchedPolicy, AdmissionWaitsForPages) {
  Harness h(sched_config(256), cache_config(8, 4));  // 128 tokens
  h.s.submit(1, request(100, 10));     // first chunk [0, 96): 6 pages, 2 left
  h.s.submit(2, request(50, 1, 500));  // first chunk [0, 48): 3 pages, must wait
  StepPlan p = h.step();
  EXPECT_EQ(p.prefills.size(), 1u);
  EXPECT_EQ(h.s.num_waiting(), 1u);
  int waited = 0;
  while (h.s.num_waiting() == 1 && waited < 50) h.step(), ++waited;
  EXPECT_GT(waited, 3);
  EXPECT_TRUE(h.s.stats().preemptions == 0);
}

TEST(SchedPolicy, AdmissionWaitsForStateSlots) {
  cache::CacheConfig cc = cache_config(64, 1);
  cc.enable_prefix_cache = false;
  Harness h(sched_config(256), cc);
  h.s.submit(1, request(10, 3));
  h.s.submit(2, request(10, 3, 50));
  StepPlan p = h.step();
  ASSERT_EQ(p.prefills.size(), 1u);
  EXPECT_EQ(h.s.num_waiting(), 1u);
  h.step(), h.step();  // request 1 finishes at its third token
  EXPECT_EQ(h.s.num_waiting(), 1u);
  p = h.step();
  ASSERT_EQ(p.prefills.size(), 1u);
  EXPECT_EQ(p.prefills[0].id, 2u);
  EXPECT_EQ(p.finished, (std::vector<RequestId>{1}));
}

TEST(SchedPolicy, RejectsWhatCanNeverFit) {
  Scheduler s(sched_config(64), cache_config(4, 2));  // 64 tokens
  try {
    s.submit(1, request(60, 10));
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("can never run"), std::string::npos) << e.what();
  }
  s.submit(2, request(60, 5));  // 64 positions exactly
  EXPECT_THROW(s.submit(2, request(4, 1)), Error);  // duplicate id
  EXPECT_THROW(s.submit(3, request(0, 1)), Error);
  EXPECT_THROW(s.submit(4, request(4, 0)), Error);
  s.check_integrity();
}

TEST(SchedPolicy, CancelFreesEverythingAtOnce) {
  cache::CacheConfig cc = cache_config(16, 4);
  cc.enable_prefix_cache = false;
  Harness h(sched_config(64), cc);
  h.s.submit(1, request(50, 20));
  h.s.submit(2, request(5, 20, 70));
  h.step();
  EXPECT_LT(h.s.cache().pages().num_free(), 16);
  EXPECT_TRUE(h.s.cancel(1));
  EXPECT_TRUE(h.s.cancel(2));
  EXPECT_FALSE(h.s.cancel(1));
  EXPECT_EQ(h.s.cache().pages().num_free(), 16);
  EXPECT_EQ(h.s.cache().slots().num_free(), 4);
  h.s.check_integrity();
  const auto done = h.s.drain_finished();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].reason, FinishReason::cancelled);
  EXPECT_EQ(done[0].output.size(), 1u);  // no prefix cache: no checkpoint split, one chunk
  EXPECT_EQ(done[1].output.size(), 1u);
  EXPECT_EQ(h.s.schedule().cancelled, (std::vector<RequestId>{1, 2}));
}

TEST(SchedPolicy, CancelDuringAStepIsDeferred) {
  Harness h(sched_config(64), cache_config(16, 4));
  h.s.submit(1, request(20, 20));
  const StepPlan p = h.s.schedule();
  EXPECT_TRUE(h.s.cancel(1));
  EXPECT_LT(h.s.cache().pages().num_free(), 16);  // the step still reads them
  h.s.complete(p, h.exec.run(p, h.s.cache()));
  h.s.check_integrity();
  EXPECT_TRUE(h.s.idle());
  const auto done = h.s.drain_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].output.empty());
}

TEST(SchedPolicy, PreemptionByRecomputeKeepsOutput) {
  cache::CacheConfig cc = cache_config(6, 4, 8);  // 48 tokens for two requests of up to 40
  Harness h(sched_config(64), cc);
  const Request a = request(10, 30), b = request(10, 30, 300);
  h.s.submit(1, a), h.s.submit(2, b);
  std::vector<FinishedRequest> done;
  bool saw_preempt = false;
  for (int i = 0; i < 200 && !h.s.idle(); ++i) {
    const StepPlan p = h.step();
    if (!p.preempted.empty()) {
      saw_preempt = true;
      EXPECT_EQ(p.preempted[0], 2u);  // the newer one yields
    }
    for (auto& f : h.s.drain_finished()) done.push_back(f);
  }
  EXPECT_TRUE(saw_preempt);
  ASSERT_EQ(done.size(), 2u);
  for (const auto& f : done) {
    const Request& r = f.id == 1 ? a : b;
    EXPECT_EQ(f.output, h.model.solo_output(r.prompt, r.max_tokens)) << "request " << f.id;
  }
}

TEST(SchedPrefix, HitSkipsPrefillAndRestoresState) {
  Harness h(sched_config(256), cache_config(32, 6));
  const Request a = request(70, 3);
  h.s.submit(1, a);
  while (!h.s.idle()) h.step();
  const auto first = h.s.drain_finished();
  h.s.submit(2, a);
  const StepPlan p = h.s.schedule();
  ASSERT_EQ(p.prefills.size(), 1u);
  EXPECT_EQ(p.prefills[0].start, 64);  // 4 cached blocks with a checkpoint at 64
  EXPECT_FALSE(p.prefills[0].reset_state);
  ASSERT_EQ(p.copies_before.size(), 1u);
  EXPECT_EQ(p.copies_before[0].dst, p.prefills[0].state_slot);
  h.s.complete(p, h.exec.run(p, h.s.cache()));
  while (!h.s.idle()) h.step();
  const auto second = h.s.drain_finished();
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].output, first[0].output);
  EXPECT_EQ(h.s.stats().prefix_hit_tokens, 64);
}

TEST(SchedPolicy, CompleteRejectsMismatchedResults) {
  Harness h(sched_config(64), cache_config(16, 4));
  h.s.submit(1, request(5, 4));
  EXPECT_THROW(h.s.complete(StepPlan{}, {}), Error);  // nothing in flight
  const StepPlan p = h.s.schedule();
  EXPECT_THROW(h.s.schedule(), Error);                 // one step at a time
  EXPECT_THROW(h.s.complete(p, {}), Error);            // token missing
  EXPECT_THROW(h.s.complete(p, {{{1, -3, false, {}}}}), Error);
  EXPECT_THROW(h.s.complete(p, {{{1, 3, false, {}}, {9, 3, false, {}}}}), Error);
  h.s.check_integrity();
  h.s.complete(p, {{{1, 3, false, {}}}});
  h.s.check_integrity();
}

}  // namespace
}  // namespace kestrel::sched

namespace kestrel::sched {
namespace {

// vLLM's disable_by_batch_size: a step with more decodes than it drafts for nobody; one with as many or fewer
// drafts as usual.
TEST(SchedPolicy, SpeculationPausesWhileTheBatchIsLargerThanDisableByBatchSize) {
  SchedulerConfig sc = sched_config(64);
  sc.num_speculative_tokens = 3;
  sc.spec_disable_by_batch_size = 2;
  Harness h(sc, cache_config(64, 4));
  h.s.submit(1, request(5, 30), true);
  h.s.submit(2, request(5, 30), true);
  h.s.submit(3, request(5, 2), true);  // finishes at its first decode
  h.step();                            // all three prefilled
  StepPlan p = h.s.schedule();
  ASSERT_EQ(p.decodes.size(), 3u);
  for (const ScheduledSeq& x : p.decodes) EXPECT_EQ(x.num_draft, 0) << "request " << x.id << ": 3 decodes > 2";
  EXPECT_EQ(p.num_tokens, 3);
  h.s.complete(p, {{{1, 3, false, {}}, {2, 3, false, {}}, {3, 3, false, {}}}});
  h.s.check_integrity();
  p = h.s.schedule();
  ASSERT_EQ(p.decodes.size(), 2u);  // request 3 reached max_tokens
  for (const ScheduledSeq& x : p.decodes) EXPECT_EQ(x.num_draft, 3) << "request " << x.id << ": 2 decodes";
  // Off (0): three decodes draft.
  sc.spec_disable_by_batch_size = 0;
  Harness all(sc, cache_config(64, 4));
  for (RequestId id : {1, 2, 3}) all.s.submit(id, request(5, 30), true);
  all.step();
  p = all.s.schedule();
  ASSERT_EQ(p.decodes.size(), 3u);
  for (const ScheduledSeq& x : p.decodes) EXPECT_EQ(x.num_draft, 3) << "request " << x.id;
}

// Speculation (docs/speculative.md): a speculating decode takes the anchor + γ' draft positions, γ' cut by
// max_tokens and the step budget; complete() keeps anchor + accepted and releases the pages wholly past them.
TEST(SchedPolicy, SpeculativeDecodesPlanDraftsAndReleaseRejectedPages) {
  SchedulerConfig sc = sched_config(64);
  sc.num_speculative_tokens = 4;
  Harness h(sc, cache_config(32, 4));
  h.s.submit(1, request(14, 8), true);
  h.s.submit(2, request(5, 3), false);  // not speculating
  h.step();                             // both prefilled: 1 token each
  StepPlan p = h.s.schedule();
  ASSERT_EQ(p.decodes.size(), 2u);
  const ScheduledSeq& x = p.decodes[0];
  EXPECT_EQ(x.id, 1u);
  EXPECT_EQ(x.num_draft, 4);
  EXPECT_EQ(x.start, 14);
  EXPECT_EQ(x.end, 19);  // anchor + 4 drafts
  EXPECT_EQ(x.tokens.size(), 1u);
  EXPECT_EQ(x.block_table.size(), 2u);  // positions 16..18 need a second page
  EXPECT_EQ(p.decodes[1].num_draft, 0);
  EXPECT_EQ(p.decodes[1].end - p.decodes[1].start, 1);
  EXPECT_EQ(p.num_tokens, 6);
  const int32_t free_before = h.s.cache().pages().num_free();
  EXPECT_THROW(h.s.complete(p, {{{1, 3, false, {5, 6, 7, 8, 9}}, {2, 3, false, {}}}}), Error);  // 5 > 4 drafts
  // Every draft rejected: position 14 (the anchor) kept, the page of 16..18 released.
  h.s.complete(p, {{{1, 3, false, {}}, {2, 3, false, {}}}});
  h.s.check_integrity();
  EXPECT_EQ(h.s.cache().pages().num_free(), free_before + 1);
  EXPECT_EQ(h.s.cache().block_table(1).num_tokens, 15);
  // All accepted: 1 + 1 + (4 + 1) = 7 of 8 tokens; the last step has γ' = min(4, 8 − 7 − 1) = 0: a plain decode.
  p = h.s.schedule();
  ASSERT_EQ(p.decodes.size(), 2u);
  EXPECT_EQ(p.decodes[0].num_draft, 4);
  h.s.complete(p, {{{1, 30, false, {10, 11, 12, 13}}, {2, 3, false, {}}}});
  h.s.check_integrity();
  EXPECT_EQ(h.s.cache().block_table(1).num_tokens, 20);
  p = h.s.schedule();
  ASSERT_EQ(p.decodes.size(), 1u);  // request 2 finished at max_tokens 3
  EXPECT_EQ(p.decodes[0].num_draft, 0);
  h.s.complete(p, {{{1, 31, false, {}}}});
  const auto done = h.s.drain_finished();
  ASSERT_EQ(done.size(), 2u);
  const std::vector<int32_t> expect_1 = {done[1].id == 1 ? done[1].output[0] : done[0].output[0], 3, 10, 11, 12, 13,
                                         30, 31};
  EXPECT_EQ((done[1].id == 1 ? done[1] : done[0]).output, expect_1);
  // A short budget cuts γ': 3 tokens = anchor + 2 drafts.
  SchedulerConfig tight = sc;
  tight.max_num_batched_tokens = 3;
  Harness t(tight, cache_config(32, 4));
  t.s.submit(1, request(3, 8), true);
  t.step();
  p = t.s.schedule();
  ASSERT_EQ(p.decodes.size(), 1u);
  EXPECT_EQ(p.decodes[0].num_draft, 2);
  t.s.complete(p, {{{1, 3, false, {4}}}});
  t.s.check_integrity();
}

}  // namespace
}  // namespace kestrel::sched
