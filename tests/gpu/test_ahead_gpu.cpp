// Run-ahead on the GPU (async scheduling: model/cuda/ahead.h, CudaModel::sample_ahead / take_ids, CudaSeq::prev_id):
//  1. GpuServingOps.ResolvePendingIdsMatchesTwin: kernels/cuda/rows.h resolve_pending_ids against its CPU twin
//     (marked rows replaced, a handed-back −1 as 0, every other entry untouched, the empty call).
//  2. GpuAhead.DeviceFedTokensMatchSyncSteps, per checkpoint (KESTREL_GPU_CKPTS), eager and through graph buckets,
//     at 1 and 3 sequences: greedy decoding with each step enqueued before the previous step's ids are on the host
//     (the tokens fed from the device, the sequences' order reversed every other step so prev_id is not the
//     identity) gives exactly the tokens of forward + greedy step by step — the same kernels on the same rows.
//  3. GpuAhead.SampleAheadMatchesSample: seeded temperature / top-k / top-p rows and all-greedy rows give the same
//     ids through sample_ahead + take_ids as through sample(); tickets taken out of order.
//  4. GpuAhead.Misuse: a prev_id with no ids to take it from, a third ticket outstanding and a ticket taken twice
//     are refused with kestrel::Error.
//  5. GpuAhead.EngineAsyncSchedulingMatchesSync, per checkpoint: the GPU engine (CudaExecutor, graphs on) with
//     --async-scheduling gives the synchronous engine's greedy tokens exactly for requests submitted together (the
//     same step compositions: prefills synchronous, then decode chains run ahead, requests ending at max_tokens),
//     and its steps did run ahead; with two seeded requests in the batch (top-p; a top-k above the sampler's 1,024
//     candidates with a min-p, its slow path) the same tokens again and the same run-ahead (the device sampler hands
//     no row back, so sampled rows run ahead too).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "core/check.h"
#include "harness.h"
#include "kernels/cuda/rows.h"
#include "kernels/cuda/sampling.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"
#include "runtime/engine.h"
#include "runtime/executor_cuda.h"

namespace kestrel::gputest {
namespace {

TEST(GpuServingOps, ResolvePendingIdsMatchesTwin) {
  Rng r(35);
  for (int64_t n : {1, 7, 256, 300}) {
    const int64_t n_prev = 1 + n / 2;
    std::vector<int32_t> prev(static_cast<size_t>(n_prev)), ids(static_cast<size_t>(n));
    for (auto& v : prev) v = int32_t(r.next() % 100000);
    prev[0] = -1;  // a row the sampler handed back: resolved to 0
    for (int64_t i = 0; i < n; ++i)  // a third marked, the rest plain ids (0 and −1 included: not marks)
      ids[size_t(i)] = i % 3 == 0 ? cuda::pending_id(int32_t(r.next() % uint64_t(n_prev)))
                                  : i % 7 == 1 ? int32_t(i % 2) - 1 : int32_t(r.next() % 100000);
    auto dprev = upload(prev);
    auto dids = upload(ids);
    cuda::resolve_pending_ids(dids.p(), n, dprev.p(), nullptr);
    sync();
    std::vector<int32_t> ref = ids;
    cuda::cpu_resolve_pending_ids(ref.data(), n, prev.data());
    check_exact("resolve_pending_ids", fmt::format("n={}", n), dids.get().data(), ref.data(), ref.size() * 4);
    for (int64_t i = 0; i < n; ++i) ASSERT_GE(ref[size_t(i)], -1) << "twin left a mark at " << i;
  }
  cuda::resolve_pending_ids(nullptr, 0, nullptr, nullptr);  // nothing to do
  sync();
}

// A model, a cache and B prefilled sequences of one checkpoint, with their slots backed up.
struct Prefilled {
  ModelConfig cfg;
  Checkpoint ckpt;
  ModelWeights w;
  model::CudaModel m;
  model::CudaCachePtr cache;
  int64_t B, V;
  std::vector<std::vector<int32_t>> tables, prompts;
  Prefilled(const std::string& dir, int64_t B_, int64_t ctx)
      : cfg(load_config(dir)), ckpt(dir), w(bind_weights(cfg, ckpt)), m(cfg, w), cache(nullptr, nullptr), B(B_),
        V(cfg.text.vocab_size) {
    const int P = 16;
    const int64_t per = (ctx + 16 + P - 1) / P;
    cache = m.new_cache(int32_t(B * per), int32_t(2 * B),
                        CacheFormats{P, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
    tables.resize(size_t(B)), prompts.resize(size_t(B));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < per; ++i) tables[size_t(b)].push_back(int32_t(b * per + i));
      for (int64_t i = 0; i < ctx - 3 * b; ++i)
        prompts[size_t(b)].push_back(int32_t((i * 37 + b * 11 + 3) % std::min<int64_t>(V, 1000)));
      model::CudaSeq q{prompts[size_t(b)], 0, int32_t(b), tables[size_t(b)], model::CudaSeq::Logits::none};
      m.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
      m.copy_slot(*cache, int32_t(b), int32_t(B + b));
    }
  }
  void restore() {
    for (int64_t b = 0; b < B; ++b) m.copy_slot(*cache, int32_t(B + b), int32_t(b));
  }
  // Step k's sequences: every other step in reverse order. tok: per sequence its token (prev_id < 0) or none.
  std::vector<int64_t> order(int step) const {
    std::vector<int64_t> o(static_cast<size_t>(B));
    for (int64_t i = 0; i < B; ++i) o[size_t(i)] = step % 2 ? B - 1 - i : i;
    return o;
  }
};

TEST(GpuAhead, DeviceFedTokensMatchSyncSteps) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  const int steps = 6;
  for (const std::string& dir : dirs)
    for (int64_t B : {int64_t(1), int64_t(3)}) {
      Prefilled p(dir, B, 40);
      const std::string name = fmt::format("{} B={}", p.cfg.text.hidden_size == 256 ? "nano" : "mini", B);
      for (bool graphs : {false, true}) {
        p.m.enable_cuda_graphs(graphs);
        // Reference: step by step, the ids on the host before the next step. out[b][k]: sequence b's token k.
        std::vector<std::vector<int32_t>> ref(static_cast<size_t>(B)), got(static_cast<size_t>(B));
        std::vector<int32_t> cur(static_cast<size_t>(B));
        for (int64_t b = 0; b < B; ++b) cur[size_t(b)] = int32_t((b * 101 + 7) % std::min<int64_t>(p.V, 1000));
        const std::vector<int32_t> first = cur;
        for (int k = 0; k < steps; ++k) {
          const auto o = p.order(k);
          std::vector<model::CudaSeq> seqs;
          for (int64_t b : o)
            seqs.push_back({std::span<const int32_t>(&cur[size_t(b)], 1), int64_t(p.prompts[size_t(b)].size()) + k,
                            int32_t(b), p.tables[size_t(b)], model::CudaSeq::Logits::last});
          p.m.forward_batch(*p.cache, seqs);
          std::vector<int32_t> ids(static_cast<size_t>(B));
          p.m.greedy(ids.data());
          for (int64_t i = 0; i < B; ++i) cur[size_t(o[size_t(i)])] = ids[size_t(i)], ref[size_t(o[size_t(i)])].push_back(ids[size_t(i)]);
        }
        p.restore();
        // Run-ahead: step k+1 enqueued before step k's ids are taken; its tokens from the device.
        const int32_t placeholder = -1;
        std::vector<int64_t> tickets;
        std::vector<std::vector<int64_t>> orders;
        std::vector<int64_t> row_of(static_cast<size_t>(B), -1);  // sequence → its row in the latest ticket
        for (int k = 0; k < steps; ++k) {
          const auto o = p.order(k);
          std::vector<model::CudaSeq> seqs;
          for (int64_t b : o) {
            model::CudaSeq q{std::span<const int32_t>(k == 0 ? &first[size_t(b)] : &placeholder, 1),
                             int64_t(p.prompts[size_t(b)].size()) + k, int32_t(b), p.tables[size_t(b)],
                             model::CudaSeq::Logits::last};
            if (k > 0) q.prev_id = int32_t(row_of[size_t(b)]);
            seqs.push_back(q);
          }
          p.m.forward_batch(*p.cache, seqs);
          std::vector<cuda::SampleParams> params;
          for (int64_t i = 0; i < B; ++i) params.push_back({int32_t(i), 0, 0.0f, 1.0f, 0.0f, 0, 0});
          tickets.push_back(p.m.sample_ahead(params));
          orders.push_back(o);
          for (int64_t i = 0; i < B; ++i) row_of[size_t(o[size_t(i)])] = i;
          if (k > 0) {  // the previous step's ids now (two tickets outstanding at most)
            std::vector<int32_t> ids(static_cast<size_t>(B));
            p.m.take_ids(tickets[size_t(k - 1)], ids.data());
            for (int64_t i = 0; i < B; ++i) got[size_t(orders[size_t(k - 1)][size_t(i)])].push_back(ids[size_t(i)]);
          }
        }
        std::vector<int32_t> ids(static_cast<size_t>(B));
        p.m.take_ids(tickets.back(), ids.data());
        for (int64_t i = 0; i < B; ++i) got[size_t(orders.back()[size_t(i)])].push_back(ids[size_t(i)]);
        p.restore();
        for (int64_t b = 0; b < B; ++b) {
          check_exact("run-ahead tokens == step by step", fmt::format("{} seq {} {}", name, b, graphs ? "graphs" : "eager"),
                      got[size_t(b)].data(), ref[size_t(b)].data(), ref[size_t(b)].size() * 4);
          ASSERT_EQ(got[size_t(b)].size(), size_t(steps));
        }
        note(fmt::format("{:<28} {:<34} {} steps ahead, tokens identical", "run-ahead decode",
                         fmt::format("{} {}", name, graphs ? "graphs" : "eager"), steps));
      }
    }
}

TEST(GpuAhead, SampleAheadMatchesSample) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  const int64_t B = 4;
  Prefilled p(dirs.front(), B, 24);
  std::vector<int32_t> tok = {5, 6, 7, 8};
  auto forward = [&] {
    std::vector<model::CudaSeq> seqs;
    for (int64_t b = 0; b < B; ++b)
      seqs.push_back({std::span<const int32_t>(&tok[size_t(b)], 1), int64_t(p.prompts[size_t(b)].size()), int32_t(b),
                      p.tables[size_t(b)], model::CudaSeq::Logits::last});
    p.m.forward_batch(*p.cache, seqs);
    p.restore();
  };
  const std::vector<std::vector<cuda::SampleParams>> cases = {
      {{0, 0, 0.0f, 1.0f, 0.0f, 0, 0}, {1, 0, 0.0f, 1.0f, 0.0f, 0, 0}, {2, 0, 0.0f, 1.0f, 0.0f, 0, 0},
       {3, 0, 0.0f, 1.0f, 0.0f, 0, 0}},                                                    // all greedy: argmax alone
      {{0, 0, 0.8f, 1.0f, 0.0f, 11, 3}, {1, 40, 1.0f, 0.9f, 0.0f, 12, 0}, {2, 0, 0.0f, 1.0f, 0.0f, 0, 0},
       {3, 5, 1.3f, 0.95f, 0.0f, 13, 7}},                                                  // mixed knobs
      {{3, 0, 0.7f, 1.0f, 0.0f, 21, 1}, {1, 0, 0.7f, 1.0f, 0.0f, 21, 2}}};                // rows out of order
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto& params = cases[c];
    forward();
    std::vector<int32_t> want(params.size());
    p.m.sample(params, {}, want.data());
    forward();
    const int64_t t1 = p.m.sample_ahead(params);
    forward();  // a second ticket outstanding, over the same logits
    const int64_t t2 = p.m.sample_ahead(params);
    std::vector<int32_t> got2(params.size()), got1(params.size());
    p.m.take_ids(t2, got2.data());  // out of order
    p.m.take_ids(t1, got1.data());
    check_exact("sample_ahead == sample", fmt::format("case {} (first ticket)", c), got1.data(), want.data(), want.size() * 4);
    check_exact("sample_ahead == sample", fmt::format("case {} (second ticket)", c), got2.data(), want.data(), want.size() * 4);
  }
}

// Greedy (or, with seed ≥ 0, two of them seeded and sampled) requests of different lengths submitted at once to a
// GPU engine; their tokens, and the engine's counters.
std::pair<std::vector<std::vector<int32_t>>, EngineStats> gpu_engine(const ModelConfig& cfg, const ModelWeights& w,
                                                                     model::CudaModel& m, bool async, int64_t seed) {
  runtime::EngineConfig ec;
  ec.memory_budget = int64_t(256) << 20;
  ec.max_running = 8;
  ec.formats.block_size = 16;
  ec.async_scheduling = async;
  ec.make_executor = [&m, &cfg](const CacheFormats& f, const cache::CacheConfig& cc) {
    return std::unique_ptr<runtime::StepExecutor>(std::make_unique<runtime::CudaExecutor>(m, cfg, f, cc));
  };
  runtime::Engine e(w, cfg, ec);
  const int64_t V = cfg.text.vocab_size;
  const std::vector<int> lens = {5, 23, 40}, outs = {14, 9, 20};
  std::vector<std::vector<int32_t>> tokens(lens.size());
  std::mutex mu;
  std::string error;
  for (size_t k = 0; k < lens.size(); ++k) {
    Request r;
    for (int i = 0; i < lens[k]; ++i) r.prompt.push_back(int32_t((i * 7919 + 13 + int64_t(k) * 101) % std::min<int64_t>(V, 1000)));
    r.max_tokens = outs[k];
    r.ignore_eos = true;
    if (seed >= 0 && k == 1) r.sampling.temperature = 0.8f, r.sampling.top_p = 0.9f, r.sampling.seed = uint64_t(seed);
    if (seed >= 0 && k == 2) {  // the sampler's slow path: a top-k past its 1,024 candidates, with a min-p
      r.sampling.temperature = 1.1f, r.sampling.top_k = 2000, r.sampling.min_p = 1e-4f;
      r.sampling.seed = uint64_t(seed) + 1;
    }
    e.submit(std::move(r), [&, k](const TokenEvent& ev) {
      std::lock_guard<std::mutex> lk(mu);
      if (ev.token >= 0) tokens[k].push_back(ev.token);
      if (ev.finish == FinishReason::error) error = ev.error;
    });
  }
  e.wait_idle();
  EXPECT_EQ(error, "");
  return {tokens, e.stats()};
}

TEST(GpuAhead, EngineAsyncSchedulingMatchesSync) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    model::CudaModel m(cfg, w);
    const std::string name = cfg.text.hidden_size == 256 ? "nano" : "mini";
    for (int64_t seed : {int64_t(-1), int64_t(7)}) {
      const auto sync = gpu_engine(cfg, w, m, false, seed);
      const auto async = gpu_engine(cfg, w, m, true, seed);
      for (size_t k = 0; k < sync.first.size(); ++k)
        EXPECT_EQ(async.first[k], sync.first[k]) << name << " request " << k << (seed >= 0 ? " (two seeded)" : "");
      EXPECT_EQ(sync.second.ahead_steps, 0);
      // ~20 steps: the prefills, then decode chains that run ahead (sampled rows too: all but ~2 steps).
      EXPECT_GT(async.second.ahead_steps, 10) << name << (seed >= 0 ? " (seeded)" : "") << ": decode chains should run ahead";
      note(fmt::format("{:<28} {:<34} {} steps, {} ahead; tokens identical to the synchronous engine", "engine run-ahead",
                       fmt::format("{}{}", name, seed >= 0 ? " (two seeded)" : ""), async.second.steps,
                       async.second.ahead_steps));
    }
  }
}

TEST(GpuAhead, Misuse) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  Prefilled p(dirs.front(), 2, 20);
  const int32_t placeholder = -1, t0 = 3;
  model::CudaSeq q{std::span<const int32_t>(&placeholder, 1), int64_t(p.prompts[0].size()), 0, p.tables[0],
                   model::CudaSeq::Logits::last};
  q.prev_id = 0;
  EXPECT_THROW(p.m.forward_batch(*p.cache, std::span<const model::CudaSeq>(&q, 1)), Error);  // no sample_ahead yet
  model::CudaSeq k{std::span<const int32_t>(&t0, 1), int64_t(p.prompts[0].size()), 0, p.tables[0],
                   model::CudaSeq::Logits::last};
  p.m.forward_batch(*p.cache, std::span<const model::CudaSeq>(&k, 1));
  const std::vector<cuda::SampleParams> one = {{0, 0, 0.0f, 1.0f, 0.0f, 0, 0}};
  const int64_t a = p.m.sample_ahead(one), b = p.m.sample_ahead(one);
  EXPECT_THROW(p.m.sample_ahead(one), Error);  // a third outstanding
  q.prev_id = 1;                               // the latest ticket holds one id
  EXPECT_THROW(p.m.forward_batch(*p.cache, std::span<const model::CudaSeq>(&q, 1)), Error);
  int32_t id = -1;
  p.m.take_ids(a, &id);
  EXPECT_GE(id, 0);
  EXPECT_THROW(p.m.take_ids(a, &id), Error);  // taken twice
  p.m.take_ids(b, &id);
  EXPECT_THROW(p.m.take_ids(b + 5, &id), Error);  // never issued
  p.restore();
}

}  // namespace
}  // namespace kestrel::gputest
