// DSpark speculation in the serving engine (runtime/spec_executor.h, docs/speculative.md) on nano with its
// random draft: batched greedy speculation gives every request exactly its tokens without speculation —
// several requests at once, preemption forced by a small page pool, prefix-cache hits — with the caches'
// bookkeeping intact after every run; a draft that always agrees (the test hook) is accepted whole; a seeded
// sampled request gives the same tokens alone and batched with others; requests speculation cannot serve
// exactly (logprobs) are served without it and match the plain engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "cache/layout.h"
#include "engine_events.h"
#include "nano_checkpoint.h"
#include "nano_draft_dir.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/spec_executor.h"

namespace kestrel {
namespace {

using runtime::Engine;
using runtime::EngineConfig;

const testing::NanoCheckpoint& nano() { return testing::nano_checkpoint(); }

using Events = testing::EngineEvents;

std::vector<int32_t> random_prompt(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = int32_t(rng() % 768);  // ordinary ids, never EOS
  return p;
}

struct Case {
  std::vector<int32_t> prompt;
  int32_t max_tokens;
  bool sampled = false;   // temperature 0.8, top-p 0.95, seeded
  bool logprobs = false;  // served without speculation
};

Request make_request(const Case& c, int i) {
  Request r;
  r.prompt = c.prompt;
  r.max_tokens = c.max_tokens;
  r.ignore_eos = true;
  if (c.sampled) r.sampling.temperature = 0.8f, r.sampling.top_p = 0.95f, r.sampling.seed = uint64_t(40 + i);
  if (c.logprobs) r.sampling.logprobs = 2;
  return r;
}

// Two requests share a 48-token prefix (three 16-token blocks: a prefix-cache hit for the later one).
std::vector<Case> cases() {
  const std::vector<int32_t> shared = random_prompt(48, 5);
  std::vector<int32_t> a = shared, b = shared;
  a.insert(a.end(), {11, 12, 13});
  b.insert(b.end(), {21, 22});
  return {{a, 14}, {random_prompt(37, 6), 12}, {b, 13}, {random_prompt(20, 7), 15, false, true},
          {random_prompt(9, 8), 11}};
}

EngineConfig small_engine(bool speculate, int gamma, int pages) {
  EngineConfig cfg;
  cfg.formats.block_size = 16;
  cfg.max_running = 4;
  cfg.checkpoint_slots = 4;
  cfg.max_num_batched_tokens = 64;
  const cache::CacheLayout l = cache::CacheLayout::from_config(nano().cfg.text, cfg.formats);
  cfg.memory_budget = l.total_state_bytes(cfg.max_running + cfg.checkpoint_slots) + l.total_page_bytes(pages);
  if (speculate) {
    runtime::SpecServing s;
    s.draft = testing::nano_draft().draft.get();
    s.num_speculative_tokens = gamma;
    cfg.speculative = s;
  }
  return cfg;
}

// Runs the cases: the first alone (it fills the prefix cache), then the rest submitted together.
std::vector<std::vector<int32_t>> run(Engine& e, const std::vector<Case>& cs) {
  Events ev;
  e.submit(make_request(cs[0], 0), ev.sink(0));
  e.wait_idle();
  for (size_t i = 1; i < cs.size(); ++i) e.submit(make_request(cs[i], int(i)), ev.sink(int(i)));
  e.wait_idle();
  e.check_integrity();
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < cs.size(); ++i) {
    const auto o = ev.get(int(i));
    EXPECT_EQ(o.finals, 1) << "request " << i;
    EXPECT_EQ(o.reason, FinishReason::length) << "request " << i;
    EXPECT_EQ(o.tokens.size(), size_t(cs[i].max_tokens)) << "request " << i;
    out.push_back(o.tokens);
  }
  return out;
}

TEST(SpecEngine, BatchedGreedyEqualsNoSpeculationWithPreemptionAndPrefixHits) {
  const auto cs = cases();
  std::vector<std::vector<int32_t>> plain;
  {
    Engine e(nano().w, nano().cfg, small_engine(false, 0, 64));
    plain = run(e, cs);
  }
  for (int gamma : {2, 4}) {  // nano's draft has 4-token blocks
    // 8 pages of 16 tokens: the four later requests need up to 4 pages each, so some are preempted.
    Engine e(nano().w, nano().cfg, small_engine(true, gamma, 8));
    const auto spec = run(e, cs);
    for (size_t i = 0; i < cs.size(); ++i) EXPECT_EQ(spec[i], plain[i]) << "request " << i << " gamma " << gamma;
    const EngineStats st = e.stats();
    fmt::print("gamma {}: {} drafts, {} draft tokens, {} accepted, {} preemptions, {} prefix-hit tokens, {} steps\n",
               gamma, st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens, st.preemptions,
               st.prefix_hit_tokens, st.steps);
    EXPECT_GT(st.spec_drafts, 0);
    EXPECT_LE(st.spec_draft_tokens, st.spec_drafts * gamma);
    EXPECT_LT(st.spec_accepted_tokens, st.spec_draft_tokens) << "a random draft should be rejected sometimes";
    EXPECT_GT(st.preemptions, 0) << "the small page pool was meant to force preemption";
    EXPECT_GT(st.prefix_hit_tokens, 0);
    EXPECT_EQ(st.generation_tokens, 14 + 12 + 13 + 15 + 11);
    const IntegrityReport r = e.check_integrity();
    EXPECT_EQ(r.pages_held, 0);
    EXPECT_EQ(r.slots_free + r.checkpoints, r.slots_total);
  }
}

TEST(SpecEngine, AnAgreeingDraftIsAcceptedWhole) {
  auto cs = cases();
  cs.resize(3);
  for (Case& c : cs) c.logprobs = false;
  std::vector<std::vector<int32_t>> plain;
  {
    Engine e(nano().w, nano().cfg, small_engine(false, 0, 64));
    plain = run(e, cs);
  }
  EngineConfig cfg = small_engine(true, 4, 64);
  // Engine ids are 1, 2, ... in submission order: request id k is case k − 1.
  cfg.speculative->oracle = [&plain](RequestId id, int64_t j) -> int32_t {
    const auto& p = plain.at(size_t(id - 1));
    return j < int64_t(p.size()) ? p[size_t(j)] : -1;
  };
  Engine e(nano().w, nano().cfg, cfg);
  const auto spec = run(e, cs);
  for (size_t i = 0; i < cs.size(); ++i) EXPECT_EQ(spec[i], plain[i]) << "request " << i;
  const EngineStats st = e.stats();
  EXPECT_GT(st.spec_drafts, 0);
  EXPECT_EQ(st.spec_accepted_tokens, st.spec_draft_tokens);
  // Each request: 1 token from its prefill, then steps of γ'+1 = min(4, left − 1) + 1 tokens; a step with
  // one token left has γ' = 0 and is a plain decode.
  int64_t drafts = 0;
  for (const Case& c : cs)
    for (int64_t left = c.max_tokens - 1; left > 0; left -= std::min<int64_t>(4, left - 1) + 1) drafts += left >= 2;
  EXPECT_EQ(st.spec_drafts, drafts);
}

TEST(SpecEngine, SampledSpeculationIsBatchInvariant) {
  Case c{random_prompt(23, 9), 16, true};
  std::vector<int32_t> alone;
  {
    Engine e(nano().w, nano().cfg, small_engine(true, 4, 64));
    alone = run(e, {c})[0];
  }
  auto cs = cases();
  cs[0] = c;
  Engine e(nano().w, nano().cfg, small_engine(true, 4, 64));
  // Case 0 alone first in run(): submit it again batched with the rest and compare both.
  Events ev;
  for (size_t i = 0; i < cs.size(); ++i) e.submit(make_request(cs[i], 0), ev.sink(int(i)));
  e.wait_idle();
  e.check_integrity();
  EXPECT_EQ(ev.get(0).tokens, alone);
  EXPECT_GT(e.stats().spec_drafts, 0);
}

// The GPU executor's draft path on the CPU (executor_cuda_spec.cpp with the draft on the GPU): a SpecDrafter
// without host caches, given the block's base logits, picks exactly the tokens and keeps exactly the q_i the
// host drafter does — greedy and sampled — and refuses to draft or inject on its own.
TEST(SpecEngine, DraftingFromBaseLogitsEqualsTheHostDraft) {
  const model::Draft& d = *testing::nano_draft().draft;
  const int64_t ctx = 21, Nb = d.cfg->block_size, V = d.cfg->vocab_size, W = d.cfg->tap_width();
  const std::vector<int32_t> prompt = random_prompt(size_t(ctx + 1), 11);
  // The target's taps of the context.
  model::State st(nano().cfg);
  model::Bf16Vec taps(size_t(ctx * W));
  model::ForwardOptions opt;
  opt.tap_layers = d.cfg->target_layer_ids;
  opt.taps_out = taps.data();
  std::vector<float> lg(size_t(ctx * nano().cfg.text.vocab_size));
  model::prefill(nano().w, nano().cfg, st, std::span<const int32_t>(prompt.data(), size_t(ctx)), lg.data(), opt);
  runtime::SpecServing s;
  s.draft = &d;
  s.num_speculative_tokens = int(Nb);
  const std::vector<cache::PageId> table{3, 1};  // 32 positions of 16
  runtime::SpecDrafter host(s, 4, 16), dev(s, 4, 16, false);
  host.inject(table, 0, taps.data(), ctx);
  // The block's base logits as the GPU draft returns them (here: the CPU draft's).
  std::vector<int32_t> blk(size_t(Nb), d.cfg->mask_token_id);
  blk[0] = prompt[size_t(ctx)];
  model::Bf16Vec hn(size_t(Nb * d.cfg->hidden_size));
  d.block(host.views(table), ctx, blk, hn.data());
  std::vector<float> base(size_t(Nb * V));
  d.base_logits(hn.data(), Nb, base.data());
  for (bool sampled : {false, true}) {
    SamplingParams p;
    if (sampled) p.temperature = 0.9f, p.seed = 77;
    const auto a = host.draft_block(1, table, ctx, blk[0], int(Nb) - 1, p, 5);
    const auto b = dev.draft_block(1, table, ctx, blk[0], int(Nb) - 1, p, 5, base.data());
    EXPECT_EQ(a.tokens, b.tokens) << (sampled ? "sampled" : "greedy");
    EXPECT_EQ(a.q, b.q) << (sampled ? "sampled" : "greedy");
  }
  EXPECT_THROW(dev.inject(table, 0, taps.data(), ctx), Error);
  EXPECT_THROW(dev.draft_block(1, table, ctx, blk[0], 2, SamplingParams{}, 5), Error);
}

}  // namespace
}  // namespace kestrel
