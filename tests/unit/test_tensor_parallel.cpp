// The tensor-parallel CPU twin (issue #16 points 1 and 3; docs/parallel.md §8): N ranks as threads of
// one process behind the in-process communicator, each on its own shard of the nano checkpoints.
//  - forward: TP2 / TP4 / EP2 / EP4 give TP1's greedy tokens, and logits within BF16 noise, on nano
//    (TP2, EP2) and on nano_tp (whose indexer heads and expert width divide by 4); every rank ends
//    with the same bytes;
//  - serving: under TP2 the engine's mixed batch (chunked prefill, preemption, staggered arrivals)
//    gives every request its TP2-solo tokens and the greedy ones TP1's; a prefix hit gives the cold
//    run's logits bit for bit and skips exactly the restored prefix;
//  - errors: a layout the model cannot split fails the engine's load with every reason; CUDA DCP (not
//    built on the GPU) and the CUDA debug switch without CUDA are refused at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>

#include <fmt/format.h>

#include "loader/safetensors.h"
#include "loader/shard.h"
#include "model/model.h"
#include "model/tp.h"
#include "nano_checkpoint.h"
#include "tp_run.h"
#include "parallel/inproc_comm.h"
#include "runtime/engine.h"
#include "runtime/engine_host.h"
#include "runtime/executor_tp.h"

namespace kestrel {
namespace {

using testing::Ckpt;
using testing::RankRun;
using testing::argmax;
using testing::checkpoint;
using testing::random_prompt;
using testing::run_layout;

// max |a − b| over max |a|: BF16 carries 8 bits, and the split sums differ from TP1 only in f32 order
// before each BF16 rounding, so a few BF16 ulps of the logits' scale after 8 layers, no more.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::fabs(a[i] - b[i]))), m = std::max(m, double(std::fabs(a[i])));
  return m > 0 ? d / m : d;
}
constexpr double kLogitTol = 2e-2;  // = 5 BF16 ulps (2^-8) of the largest logit

struct LayoutCase {
  const char* ckpt;
  int tp;
  bool ep;
  int dcp = 1;
};

class TensorParallel : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(TensorParallel, GivesTp1GreedyTokensAndLogits) {
  const LayoutCase lc = GetParam();
  const Ckpt& ck = checkpoint(lc.ckpt);
  const int64_t V = ck.cfg.text.vocab_size;
  // 80 prompt tokens: past nano's index_topk (64), so the indexer's top-k really selects.
  const std::vector<int32_t> prompt = random_prompt(80, 11);
  const int steps = 8;
  const std::vector<RankRun> one = run_layout(ck, ParallelLayout{}, prompt, steps);
  ParallelLayout p;
  p.tp = lc.tp;
  p.expert_parallel = lc.ep;
  p.dcp = lc.dcp;
  // The split run decodes TP1's greedy tokens, so every step compares logits of the same inputs.
  const std::vector<RankRun> many = run_layout(ck, p, prompt, steps, one[0].tokens);
  for (int r = 1; r < lc.tp; ++r) {  // identical bytes on every rank (rank-order reductions)
    EXPECT_EQ(many[size_t(r)].prefill, many[0].prefill) << "rank " << r;
    EXPECT_EQ(many[size_t(r)].decode, many[0].decode) << "rank " << r;
  }
  const double dp = rel_diff(one[0].prefill, many[0].prefill);
  double dd = 0;
  for (int s = 0; s < steps; ++s) dd = std::max(dd, rel_diff(one[0].decode[size_t(s)], many[0].decode[size_t(s)]));
  EXPECT_LT(dp, kLogitTol);
  EXPECT_LT(dd, kLogitTol);
  EXPECT_GT(dp + dd, 0.0) << "a split sum that never differs from TP1 suggests the ranks did not split anything";
  // Greedy tokens: the same choice at every prompt position and decode step, except where TP1's own
  // top two are closer than the noise (a near-tie, < kTie of the largest logit, either way is right);
  // nano's random weights give flat logits (top two within 0.5 % at about 1 choice in 40), so a few
  // such choices flip; at most 1 in 10 may, so the check cannot pass vacuously.
  constexpr double kTie = 5e-3;
  int ties = 0, choices = 0;
  auto check = [&](const float* a, const float* b, int64_t where) {
    const int32_t ta = argmax(a, V), tb = argmax(b, V);
    ++choices;
    if (ta == tb) return;
    double scale = 0;
    for (int64_t v = 0; v < V; ++v) scale = std::max(scale, double(std::fabs(a[v])));
    const double margin = double(a[ta]) - double(a[tb]);
    EXPECT_LT(margin, kTie * scale) << "TP1 picks " << ta << ", " << p.name() << " " << tb << " at " << where
                                    << " though TP1's margin is " << margin;
    ++ties;
  };
  const int64_t T = int64_t(prompt.size());
  for (int64_t t = 0; t < T; ++t) check(one[0].prefill.data() + t * V, many[0].prefill.data() + t * V, t);
  for (int s = 0; s < steps; ++s) check(one[0].decode[size_t(s)].data(), many[0].decode[size_t(s)].data(), T + s);
  fmt::print("{} {}: logits rel diff prefill {:.2e}, decode {:.2e}; {} of {} greedy choices equal (others near-ties)\n",
             lc.ckpt, p.name(), dp, dd, choices - ties, choices);
  EXPECT_LE(ties, choices / 10);
}

INSTANTIATE_TEST_SUITE_P(Layouts, TensorParallel,
                         ::testing::Values(LayoutCase{"nano", 2, false}, LayoutCase{"nano", 2, true},
                                           LayoutCase{"nano_tp", 2, false}, LayoutCase{"nano_tp", 4, false},
                                           LayoutCase{"nano_tp", 4, true}, LayoutCase{"nano", 2, false, 2},
                                           LayoutCase{"nano_tp", 4, false, 4}),
                         [](const auto& info) {
                           return fmt::format("{}_{}{}{}", info.param.ckpt, info.param.ep ? "EP" : "TP", info.param.tp,
                                              info.param.dcp > 1 ? fmt::format("_DCP{}", info.param.dcp) : "");
                         });

// DCP2 against DCP1 at the same TP2 (the "DCP2 equals DCP1"): the same keys selected at every
// MLA layer and position (captured index_topk: whole-context top-k from spread candidates), greedy
// tokens equal, logits within BF16 noise.
TEST(TensorParallel, Dcp2SelectsTheSameKeysAsDcp1) {
  const Ckpt& ck = checkpoint("nano");
  const std::vector<int32_t> prompt = random_prompt(90, 5);
  std::map<std::string, std::vector<int32_t>> sel[2];  // per dcp: capture name → selected positions
  std::vector<float> logits[2];
  for (int d = 0; d < 2; ++d) {
    ParallelLayout p;
    p.tp = 2;
    p.dcp = d + 1;
    const int64_t V = ck.cfg.text.vocab_size, T = int64_t(prompt.size());
    parallel::run_ranks(2, [&](parallel::Comm& comm) {
      ParallelLayout mine = p;
      mine.rank = comm.rank();
      ModelWeights w = bind_shard(ck.cfg, *ck.ckpt, mine);
      const std::vector<HostBuffer> packed = model::pack_strided(ck.cfg, w);
      const ModelConfig rc = model::rank_config(ck.cfg, mine);
      model::State st(rc);
      model::ForwardOptions opt;
      opt.comm = &comm;
      opt.dcp = p.dcp;
      opt.mla_form_prefill = model::MlaForm::absorbed;  // the form DCP runs
      if (comm.rank() == 0)
        opt.observer = [&](std::string_view name, const TensorView& t) {
          if (name.find("index_topk") != name.npos)
            sel[d][std::string(name)].assign(t.as<const int32_t>(), t.as<const int32_t>() + t.numel());
        };
      std::vector<float> lg(size_t(T * V));
      model::prefill(w, rc, st, prompt, lg.data(), opt);
      std::vector<float> one(static_cast<size_t>(V));
      for (int32_t tok : {3, 500, 77}) model::decode(w, rc, st, tok, one.data(), opt);
      if (comm.rank() == 0) logits[d] = std::move(one);
    });
  }
  ASSERT_FALSE(sel[0].empty());
  EXPECT_EQ(sel[1].size(), sel[0].size());
  int64_t differ = 0, total = 0;
  for (const auto& [name, v] : sel[0]) {
    ASSERT_TRUE(sel[1].count(name)) << name;
    const auto& u = sel[1].at(name);
    ASSERT_EQ(u.size(), v.size()) << name;
    for (size_t i = 0; i < v.size(); ++i) differ += u[i] != v[i], ++total;
  }
  // The hidden states differ by BF16 noise between the two runs (attention sums in another order), so
  // a near-tie may rarely swap one key; anything more means the spread top-k is wrong.
  EXPECT_LE(differ, total / 1000) << differ << " of " << total << " selected positions differ";
  EXPECT_LT(rel_diff(logits[0], logits[1]), kLogitTol);
  EXPECT_EQ(argmax(logits[0].data(), int64_t(logits[0].size())), argmax(logits[1].data(), int64_t(logits[1].size())));
}

// ---- serving under TP2 --------------------------------------------------------------------------

class Collector {
 public:
  TokenSink callback(int key) {
    return [this, key](TokenEvent&& ev) {
      std::lock_guard lk(mu_);
      if (ev.token >= 0) out_[key].push_back(ev.token);
      cv_.notify_all();
    };
  }
  std::function<void(int64_t, std::span<const float>)> logits_sink(int key) {
    return [this, key](int64_t pos, std::span<const float> row) {
      std::lock_guard lk(mu_);
      logits_[key][pos].assign(row.begin(), row.end());
    };
  }
  void wait_tokens(int key, size_t n) {
    std::unique_lock lk(mu_);
    ASSERT_TRUE(cv_.wait_for(lk, std::chrono::seconds(120), [&] { return out_[key].size() >= n; }));
  }
  std::vector<int32_t> tokens(int key) {
    std::lock_guard lk(mu_);
    return out_[key];
  }
  std::map<int64_t, std::vector<float>> logits(int key) {
    std::lock_guard lk(mu_);
    return logits_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, std::vector<int32_t>> out_;
  std::map<int, std::map<int64_t, std::vector<float>>> logits_;
};

runtime::EngineConfig with_tp(runtime::EngineConfig cfg, int tp, int dcp = 1) {
  if (tp > 1) {
    ParallelLayout p;
    p.tp = tp;
    p.dcp = dcp;
    const testing::NanoCheckpoint& n = testing::nano_checkpoint();
    cfg.make_executor = runtime::tp_executor_factory(n.cfg, *n.ckpt, p);
    cfg.tp_size = tp;  // the memory plan counts one rank's caches
    cfg.dcp_size = dcp;
  }
  return cfg;
}

Request make_request(const std::vector<int32_t>& prompt, int max_tokens, bool sampled, int i) {
  Request r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  if (sampled) r.sampling.temperature = 0.8f, r.sampling.top_k = 50, r.sampling.seed = uint64_t(100 + i);
  return r;
}

class TensorParallelServing : public ::testing::TestWithParam<int> {};  // parameter: DCP size (TP2)

TEST_P(TensorParallelServing, MixedBatchWithPreemptionGivesSoloTokens) {
  const int dcp = GetParam();
  const testing::NanoCheckpoint& n = testing::nano_checkpoint();
  const size_t lens[] = {5, 40, 150, 77};
  const int max_tokens[] = {8, 6, 8, 7};
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_prompt(lens[i], 7 + uint32_t(i)));
  auto solo = [&](int tp) {
    runtime::EngineConfig cfg;
    cfg.memory_budget = 64 << 20;
    cfg.max_running = 1;
    cfg.enable_prefix_cache = false;
    runtime::Engine e(n.w, n.cfg, with_tp(cfg, tp, dcp));
    Collector col;
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < 4; ++i) {
      e.submit(make_request(prompts[size_t(i)], max_tokens[i], i % 2 == 1, i), col.callback(i));
      e.wait_idle();
      out.push_back(col.tokens(i));
    }
    return out;
  };
  const auto solo1 = solo(1), solo2 = solo(2);
  // Mixed under TP2: 16-token pages, 14 of them (the 150-token prompt alone needs 10), 3 running,
  // 24 tokens per step, staggered arrivals.
  runtime::EngineConfig cfg;
  cfg.formats.block_size = 16;
  cfg.max_running = 3;
  cfg.checkpoint_slots = 2;
  cfg.max_num_batched_tokens = 24;
  // One rank's bytes (KDA heads / 2; pages of 16/DCP rows): the plan must come out at exactly 14 pages.
  const cache::CacheLayout l = cache::CacheLayout::for_rank(n.cfg.text, cfg.formats, 2, dcp);
  cfg.memory_budget = l.total_state_bytes(5) + l.total_page_bytes(14);
  runtime::Engine e(n.w, n.cfg, with_tp(cfg, 2, dcp));
  ASSERT_EQ(e.memory_plan().num_pages, 14);
  ASSERT_EQ(e.memory_plan().num_state_slots, 5);
  Collector col;
  for (int i : {0, 1, 2}) e.submit(make_request(prompts[size_t(i)], max_tokens[i], i % 2 == 1, i), col.callback(i));
  col.wait_tokens(0, 2);
  e.submit(make_request(prompts[3], max_tokens[3], true, 3), col.callback(3));
  e.wait_idle();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(col.tokens(i), solo2[size_t(i)]) << "request " << i << " mixed TP2 vs solo TP2";
    if (i % 2 == 0) {
      EXPECT_EQ(solo2[size_t(i)], solo1[size_t(i)]) << "request " << i << " greedy TP2 vs TP1";
    }
  }
  const EngineStats st = e.stats();
  fmt::print("TP2 DCP{} mixed batch: {} steps, {} preemptions\n", dcp, st.steps, st.preemptions);
  EXPECT_GT(st.preemptions, 0) << "the small page pool was meant to force preemption";
}

INSTANTIATE_TEST_SUITE_P(Dcp, TensorParallelServing, ::testing::Values(1, 2),
                         [](const auto& info) { return fmt::format("TP2_DCP{}", info.param); });

TEST_P(TensorParallelServing, PrefixHitGivesColdLogits) {
  const int dcp = GetParam();
  const testing::NanoCheckpoint& n = testing::nano_checkpoint();
  const std::vector<int32_t> shared = random_prompt(100, 99);
  std::vector<int32_t> first = shared, second = shared;
  first.push_back(5);
  second.insert(second.end(), {6, 7});
  auto run = [&](bool prefix_cache, int64_t* forwarded, int64_t* hit) {
    runtime::EngineConfig cfg;
    cfg.formats.block_size = 16;
    cfg.max_running = 2;
    cfg.checkpoint_slots = 4;
    cfg.enable_prefix_cache = prefix_cache;
    cfg.memory_budget = 16 << 20;
    runtime::Engine e(n.w, n.cfg, with_tp(cfg, 2, dcp));
    Collector col;
    e.submit(make_request(first, 3, false, 0), col.callback(0));
    e.wait_idle();
    const int64_t before = e.stats().tokens_forwarded;
    Request b = make_request(second, 4, false, 1);
    b.on_logits = col.logits_sink(1);
    e.submit(b, col.callback(1));
    e.wait_idle();
    *forwarded = e.stats().tokens_forwarded - before;
    *hit = e.stats().prefix_hit_tokens;
    return std::make_pair(col.tokens(1), col.logits(1));
  };
  int64_t fwd_hot = 0, fwd_cold = 0, hit = 0, hit_cold = 0;
  const auto hot = run(true, &fwd_hot, &hit);
  const auto cold = run(false, &fwd_cold, &hit_cold);
  EXPECT_EQ(hit, 96);
  EXPECT_EQ(fwd_cold - fwd_hot, hit);
  EXPECT_EQ(hot.first, cold.first);
  EXPECT_EQ(int64_t(hot.second.size()), int64_t(second.size()) + 3 - hit);
  for (const auto& [pos, row] : hot.second) {
    ASSERT_TRUE(cold.second.count(pos)) << pos;
    EXPECT_EQ(row, cold.second.at(pos)) << "position " << pos;
  }
}

// ---- errors -------------------------------------------------------------------------------------

TEST(TensorParallelErrors, LayoutThatDoesNotDivideFailsTheLoadWithEveryReason) {
  runtime::EngineOptions o;
  o.model_dir = std::getenv("KESTREL_NANO_DIR");
  o.memory_budget = int64_t(16) << 20;
  o.tensor_parallel_size = 4;  // nano: 2 indexer heads, 64-wide experts (16 columns per rank)
  runtime::EngineHost e(o);
  ASSERT_FALSE(e.wait_loaded());
  const std::string err = e.load_error();
  EXPECT_NE(err.find("cannot run this model as TP4 (2 problems)"), std::string::npos) << err;
  EXPECT_NE(err.find("index_n_heads = 2"), std::string::npos) << err;
  EXPECT_NE(err.find("moe_intermediate_size = 64"), std::string::npos) << err;
  o.tensor_parallel_size = 3;
  runtime::EngineHost e3(o);
  ASSERT_FALSE(e3.wait_loaded());
  EXPECT_NE(e3.load_error().find("does not divide by tensor-parallel size 3"), std::string::npos) << e3.load_error();
}

TEST(TensorParallelErrors, OptionsRefusedAtOnce) {
  runtime::EngineOptions o;
  o.model_dir = std::getenv("KESTREL_NANO_DIR");
  o.tensor_parallel_size = 2;
  o.device = runtime::Device::cuda;
  o.decode_context_parallel_size = 2;  // GPU TP and EP are built, GPU DCP is not
  EXPECT_THROW({ runtime::EngineHost e(o); }, Error);
  o.decode_context_parallel_size = 1;
  o.device = runtime::Device::cpu;
  o.debug_tp_on_one_gpu = true;  // a CUDA debug switch
  EXPECT_THROW({ runtime::EngineHost e(o); }, Error);
  o.debug_tp_on_one_gpu = false;
  o.tensor_parallel_size = 1;
  o.expert_parallel = true;
  EXPECT_THROW({ runtime::EngineHost e(o); }, Error);
  o.tensor_parallel_size = 0;
  o.expert_parallel = false;
  EXPECT_THROW({ runtime::EngineHost e(o); }, Error);
}

// --enable-custom-all-reduce replaces the GPU ranks' all-reduces: refused at once, with the reason, on the CPU
// (TP2 twin) and with one GPU rank; accepted by the option check under CUDA TP2 (what the load then does
// needs GPUs: tests/gpu/test_tp_gpu.cpp GpuTp.CustomAllReduce*).
TEST(TensorParallelErrors, CustomAllReduceNeedsCudaTensorParallel) {
  runtime::EngineOptions o;
  o.model_dir = std::getenv("KESTREL_NANO_DIR");
  o.memory_budget = int64_t(16) << 20;
  o.custom_all_reduce = true;
  for (const auto& [device, tp] : {std::pair{runtime::Device::cpu, 2}, std::pair{runtime::Device::cpu, 1},
                                   std::pair{runtime::Device::cuda, 1}}) {
    o.device = device;
    o.tensor_parallel_size = tp;
    try {
      runtime::EngineHost e(o);
      ADD_FAILURE() << "accepted with tp " << tp;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("--enable-custom-all-reduce needs --device cuda and "
                                             "--tensor-parallel-size > 1"),
                std::string::npos)
          << err.what();
    }
  }
  // The same options without the flag pass the check (CPU TP2 loads and serves).
  o.custom_all_reduce = false;
  o.device = runtime::Device::cpu;
  o.tensor_parallel_size = 2;
  runtime::EngineHost ok(o);
  EXPECT_TRUE(ok.wait_loaded()) << ok.load_error();
}

}  // namespace
}  // namespace kestrel
