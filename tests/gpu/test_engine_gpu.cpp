// The serving runtime on the GPU (runtime/executor_cuda.h): the paged-cache row copies and the
// device argmax against their CPU twins, then the whole engine on real checkpoints
// (KESTREL_GPU_CKPTS, as test_model_gpu.cpp; required).
//
// Engine test, per checkpoint: requests of different prompt lengths (nano's cross index_topk = 64,
// so the indexer's sparse path runs in the batched decode), greedy, ignore_eos.
//  1. solo: each request alone on the GPU engine (prefix cache off): the reference tokens, with every
//     position's logits (on_logits) to judge near ties;
//  2. batched: all of them on one GPU engine, staggered (two first; the rest once the first has
//     produced tokens), one request repeating another's prompt head so the prefix cache restores a
//     KDA checkpoint and shared pages; each request must get its solo tokens. The GPU path is not
//     batch invariant (cuBLASLt may pick another algorithm for another batch size), so a divergence
//     is allowed only where the solo logits' top two are within 1% of max |logit| (reported);
//  3. the CPU engine on the same requests: the same tokens, except at near ties (top two within 4% of
//     max |logit| of the CPU logits, the bound of test_model_gpu.cpp), reported.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "harness.h"
#include "kernels/cuda/rows.h"
#include "kernels/cuda/sampling.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"
#include "runtime/engine.h"
#include "runtime/executor_cuda.h"
#include "runtime/sampler.h"

namespace kestrel::gputest {
namespace {

TEST(GpuServingOps, CopyRowsGatherAndScatter) {
  Rng r(71);
  for (int64_t row_bytes : {16, 1152, 256}) {
    const int64_t pool_rows = 300, n = 137;
    const auto pool = rand_u8(size_t(pool_rows * row_bytes), r, 0, 255);
    std::vector<int32_t> idx(static_cast<size_t>(pool_rows));
    for (int32_t i = 0; i < pool_rows; ++i) idx[size_t(i)] = i;
    for (int64_t i = pool_rows - 1; i > 0; --i) std::swap(idx[size_t(i)], idx[size_t(r.next() % uint64_t(i + 1))]);
    idx.resize(size_t(n));  // distinct rows: a valid scatter map too
    const std::string shape = fmt::format("n={} row={}B", n, row_bytes);
    // Gather: every output row written.
    auto dpool = upload(pool);
    auto didx = upload(idx);
    auto got = poisoned<uint8_t>(size_t(n * row_bytes));
    cuda::copy_rows(dpool.p(), didx.p(), got.p(), nullptr, n, row_bytes, nullptr);
    sync();
    std::vector<uint8_t> ref(size_t(n * row_bytes));
    cuda::cpu_copy_rows(pool.data(), idx.data(), ref.data(), nullptr, n, row_bytes);
    check_exact("copy_rows gather", shape, got.get().data(), ref.data(), ref.size());
    // Scatter into a poisoned pool: the mapped rows written, every other row untouched.
    const auto src = rand_u8(size_t(n * row_bytes), r, 0, 255);
    auto dsrc = upload(src);
    auto dst = poisoned<uint8_t>(size_t(pool_rows * row_bytes));
    cuda::copy_rows(dsrc.p(), nullptr, dst.p(), didx.p(), n, row_bytes, nullptr);
    sync();
    std::vector<uint8_t> ref2(size_t(pool_rows * row_bytes), 0xFF);
    cuda::cpu_copy_rows(src.data(), nullptr, ref2.data(), idx.data(), n, row_bytes);
    check_exact("copy_rows scatter", shape, dst.get().data(), ref2.data(), ref2.size());
  }
  EXPECT_THROW(cuda::copy_rows(nullptr, nullptr, nullptr, nullptr, 1, 12, nullptr), Error);
}

TEST(GpuServingOps, ArgmaxRowsMatchesGreedySampler) {
  Rng r(72);
  // The split kernel's workspace (zeroed once; every call must leave it zeroed), and the row kernel without it.
  auto ws = upload(std::vector<uint8_t>(cuda::argmax_workspace_bytes(), 0));
  for (int64_t V : {1, 7, 1000, 4097, 163840})
  for (int64_t n : {int64_t(1), int64_t(9)})
  for (void* w : {static_cast<void*>(nullptr), static_cast<void*>(ws.p())}) {
    auto x = rand_f32(size_t(n * V), r, -4.0f, 4.0f);
    // Row 1: an exact tie of the maximum at two ids (the lower wins); row 2: the maximum at the end;
    // row 3: a NaN before the maximum (never chosen).
    if (V > 2 && n > 3) {
      x[size_t(V + V / 3)] = 9.0f, x[size_t(V + V / 2)] = 9.0f;
      x[size_t(3 * V - 1)] = 9.0f;
      x[size_t(3 * V)] = NAN, x[size_t(3 * V + V - 1)] = 9.0f;
    }
    auto dx = upload(x);
    auto got = poisoned<int32_t>(size_t(n));
    cuda::argmax_rows(dx.p(), V, n, V, got.p(), nullptr, w);
    sync();
    std::vector<int32_t> ref(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      std::span<const float> row(x.data() + i * V, size_t(V));
      if (V > 2 && n > 3 && i == 3) {
        ref[size_t(i)] = int32_t(V - 1);  // the twin's max_element is undefined with NaN; the rule is "skip NaN"
        continue;
      }
      ref[size_t(i)] = runtime::sample_token(runtime::SamplingParams{}, row, {}, {}, 0).token;
    }
    check_exact("argmax_rows", fmt::format("n={} V={} {}", n, V, w ? "split" : "row"), got.get().data(), ref.data(),
                ref.size() * 4);
  }
  const auto after = ws.get();
  // The counters lead the workspace (argmax.cu SplitWs): all zero again.
  for (size_t i = 0; i < 128 * sizeof(unsigned); ++i) ASSERT_EQ(after[i], 0) << "argmax counter byte " << i;
}

// The device sampler against its twin: the RNG is the same SplitMix64, so for the same (seed, index)
// both draw the same token (a difference needs the FP64 prefix sums of the two to straddle the draw,
// about 1e-13 likely per draw). Rows: random logits (some peaked, some flat), every knob and mixes,
// penalties from random prompt/output histories. Every row is compared (the device hands none back;
// GpuSampling.WideCutsAndTiesMatchCpuTwin covers its slow paths). Plain temperature, top-p and wide
// min-p rows over the 160K vocabulary exercise the tail walk past the 1024 candidates.
TEST(GpuSampling, SameTokensAsCpuTwin) {
  Rng r(73);
  for (int64_t V : {50, 1000, 163840}) {
    const int64_t n = V > 100000 ? 48 : 160;
    std::vector<float> x(size_t(n * V));
    for (int64_t i = 0; i < n; ++i) {
      const float spread = (i % 3 == 0) ? 12.0f : (i % 3 == 1) ? 3.0f : 0.5f;
      for (int64_t v = 0; v < V; ++v) x[size_t(i * V + v)] = r.uniform(-spread, spread);
    }
    std::vector<cuda::SampleParams> params;
    std::vector<cuda::PenaltyEntry> pen;
    std::vector<runtime::SamplingParams> sp(static_cast<size_t>(n));
    std::vector<std::vector<int32_t>> prompt(static_cast<size_t>(n)), output(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      runtime::SamplingParams& p = sp[size_t(i)];
      const int kind = int(i % 8);
      p.temperature = kind == 0 ? 0.0f : r.uniform(0.3f, 1.5f);
      if (kind == 2 || kind == 6) p.top_k = int32_t(1 + r.next() % 64);
      if (kind == 3 || kind == 6) p.top_p = r.uniform(0.2f, 0.95f);
      if (kind == 4) p.min_p = r.uniform(0.01f, 0.3f);
      if (kind == 5 || kind == 7 || kind == 0) {
        p.repetition_penalty = r.uniform(0.7f, 1.6f);
        p.frequency_penalty = r.uniform(-0.5f, 0.5f);
        p.presence_penalty = r.uniform(-0.5f, 0.5f);
        for (int k = 0; k < 20; ++k) prompt[size_t(i)].push_back(int32_t(r.next() % uint64_t(V)));
        for (int k = 0; k < 12; ++k) output[size_t(i)].push_back(int32_t(r.next() % uint64_t(std::min<int64_t>(V, 40))));
        if (kind == 7) p.top_k = 40, p.top_p = 0.9f;
      }
      p.seed = r.next();
      const uint64_t index = output[size_t(i)].size();
      params.push_back({int32_t(i), p.top_k, p.temperature, p.top_p, p.min_p, p.seed, index});
      runtime::append_logit_adjustments(int32_t(i), {&p, prompt[size_t(i)], output[size_t(i)], {}}, V, pen);
    }
    auto dx = upload(x);
    auto dp = upload(params);
    auto de = upload(pen);
    auto got = poisoned<int32_t>(size_t(n));
    cuda::apply_penalties(dx.p(), V, V, de.p(), int64_t(pen.size()), nullptr);
    cuda::sample_rows(dx.p(), V, V, dp.p(), n, got.p(), nullptr);
    sync();
    const auto ids = got.get();
    int64_t equal = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto ref = runtime::sample_token(sp[size_t(i)], std::span<const float>(x.data() + i * V, size_t(V)),
                                             prompt[size_t(i)], output[size_t(i)], output[size_t(i)].size());
      EXPECT_EQ(ids[size_t(i)], ref.token) << "V=" << V << " row " << i << " kind " << i % 8;
      equal += ids[size_t(i)] == ref.token;
    }
    note(fmt::format("{:<28} {:<34} {}/{} equal to the twin", "sample_rows (same seed)", fmt::format("n={} V={}", n, V),
                     equal, n));
  }
}

// Sampled frequencies against the twin's probabilities: one row, 20000 draws (indices 0..19999),
// chi-square over the kept tokens at p = 0.001.
TEST(GpuSampling, DistributionMatchesTwinProbabilities) {
  Rng r(74);
  const int64_t V = 4096, draws = 20000;
  std::vector<float> x(static_cast<size_t>(V));
  for (auto& v : x) v = r.uniform(-6.0f, 6.0f);
  struct Case {
    const char* name;
    float temperature, top_p, min_p;
    int32_t top_k;
  };
  for (const Case& c : {Case{"top_k=12 T=0.8", 0.8f, 1.0f, 0.0f, 12}, Case{"top_p=0.5 T=0.7", 0.7f, 0.5f, 0.0f, 0},
                        Case{"min_p=0.2 T=1.2", 1.2f, 1.0f, 0.2f, 0}}) {
    // The twin's probabilities (runtime/sampler.h's rules): order, softmax over the full vocabulary,
    // min-p, top-k, top-p, renormalised over what is kept.
    std::vector<int32_t> order(static_cast<size_t>(V));
    for (int32_t i = 0; i < V; ++i) order[size_t(i)] = i;
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[size_t(a)] > x[size_t(b)] || (x[size_t(a)] == x[size_t(b)] && a < b); });
    double Z = 0;
    for (float v : x) Z += std::exp((double(v) - x[size_t(order[0])]) / c.temperature);
    std::vector<double> prob;
    for (int32_t id : order) prob.push_back(std::exp((double(x[size_t(id)]) - x[size_t(order[0])]) / c.temperature) / Z);
    size_t keep = c.top_k > 0 ? size_t(c.top_k) : size_t(V);
    if (c.min_p > 0) {
      size_t k = 1;
      while (k < keep && prob[k] >= c.min_p * prob[0]) ++k;
      keep = k;
    }
    if (c.top_p < 1) {
      double m = 0;
      for (size_t i = 0; i < keep; ++i)
        if ((m += prob[i]) >= c.top_p) {
          keep = i + 1;
          break;
        }
    }
    double kept = 0;
    for (size_t i = 0; i < keep; ++i) kept += prob[i];
    std::vector<cuda::SampleParams> params;
    for (int64_t i = 0; i < draws; ++i) params.push_back({0, c.top_k, c.temperature, c.top_p, c.min_p, 99, uint64_t(i) + 1000000});
    auto dx = upload(x);
    auto dp = upload(params);
    auto got = poisoned<int32_t>(size_t(draws));
    cuda::sample_rows(dx.p(), V, V, dp.p(), draws, got.p(), nullptr);
    sync();
    std::map<int32_t, int64_t> freq;
    for (int32_t id : got.get()) ++freq[id];
    double chi2 = 0;
    int64_t outside = draws;
    for (size_t i = 0; i < keep; ++i) {
      const double e = double(draws) * prob[i] / kept;
      const double o = double(freq[order[i]]);
      outside -= int64_t(o);
      chi2 += (o - e) * (o - e) / e;
    }
    // Chi-square critical value at p = 0.001 (Wilson–Hilferty) for keep − 1 degrees of freedom.
    const double k = double(keep) - 1, zq = 3.09;
    const double crit = k * std::pow(1 - 2 / (9 * k) + zq * std::sqrt(2 / (9 * k)), 3);
    note(fmt::format("{:<28} {:<34} kept {} tokens, chi2 {:.1f} (crit {:.1f} at p=0.001), {} draws outside", "sample_rows (distribution)",
                     c.name, keep, chi2, crit, outside));
    EXPECT_EQ(outside, 0) << c.name;
    EXPECT_LT(chi2, crit) << c.name;
    EXPECT_GT(keep, size_t(2)) << c.name << ": the case should keep several tokens";
  }
}

struct EngineRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;  // per request f32 [positions, V] (when asked)
  EngineStats stats;
};

// Runs `prompts` through an engine; `stagger` submits the first two, then the rest once request 0
// has 3 tokens; `solo` runs them one at a time.
EngineRun run_engine(const ModelConfig& cfg, const ModelWeights& w, model::CudaModel* gpu,
               const std::vector<std::vector<int32_t>>& prompts, int max_tokens, bool prefix_cache, bool solo,
               bool want_logits, IndexKeyFormat keys = IndexKeyFormat::bf16,
               LatentFormat latent = LatentFormat::bf16,
               KdaStateDtype state = KdaStateDtype::f32) {
  runtime::EngineConfig ec;
  ec.memory_budget = int64_t(256) << 20;
  ec.max_running = 8;
  ec.enable_prefix_cache = prefix_cache;
  ec.formats.block_size = 16;  // several pages per request: block tables matter
  ec.formats.index_keys = keys;
  ec.formats.latent = latent;
  ec.formats.kda_state = state;
  ec.max_num_batched_tokens = 64;  // long prompts prefill in chunks, beside running decodes
  if (gpu)
    ec.make_executor = [gpu, &cfg](const CacheFormats& f, const cache::CacheConfig& cc) {
      return std::unique_ptr<runtime::StepExecutor>(std::make_unique<runtime::CudaExecutor>(*gpu, cfg, f, cc));
    };
  runtime::Engine e(w, cfg, ec);
  EngineRun out;
  out.tokens.resize(prompts.size());
  out.logits.resize(prompts.size());
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0;
  std::string error;
  auto submit = [&](size_t i) {
    Request r;
    r.prompt = prompts[i];
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    if (want_logits)
      r.on_logits = [&out, i](int64_t, std::span<const float> row) {
        out.logits[i].insert(out.logits[i].end(), row.begin(), row.end());
      };
    e.submit(std::move(r), [&, i](const TokenEvent& ev) {
      std::lock_guard<std::mutex> lk(mu);
      if (ev.token >= 0) out.tokens[i].push_back(ev.token);
      if (ev.finish == FinishReason::error) error = ev.error;
      if (ev.finished()) ++done;
      cv.notify_all();
    });
  };
  if (solo) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      submit(i);
      e.wait_idle();
    }
  } else {
    submit(0), submit(1);
    {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return out.tokens[0].size() >= 3 || done > 0; });
    }
    for (size_t i = 2; i < prompts.size(); ++i) submit(i);
  }
  e.wait_idle();
  EXPECT_EQ(error, "");
  out.stats = e.stats();
  return out;
}

// The first output index where a and b differ (a.size() if none).
size_t first_diff(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}


TEST(GpuEngine, BatchedStaggeredMatchesSoloAndCpu) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;
    const bool nano = cfg.text.hidden_size == 256;
    const std::vector<int64_t> lens = nano ? std::vector<int64_t>{3, 17, 70, 90, 9, 40} : std::vector<int64_t>{5, 12, 20};
    const int max_tokens = nano ? 12 : 6;
    std::vector<std::vector<int32_t>> prompts;
    for (size_t k = 0; k < lens.size(); ++k) {
      std::vector<int32_t> p;
      for (int64_t i = 0; i < lens[k]; ++i) p.push_back(int32_t((i * 7919 + 13 + int64_t(k) * 101) % std::min<int64_t>(V, 1000)));
      prompts.push_back(p);
    }
    // The first page of prompt 1 (17 tokens, so its last full block, 16, has a KDA checkpoint) again
    // with a new tail: a prefix-cache hit once request 1 has prefilled (it is submitted first).
    if (nano) {
      std::vector<int32_t> p(prompts[1].begin(), prompts[1].begin() + 16);
      for (int i = 0; i < 7; ++i) p.push_back(500 + i);
      prompts.push_back(p);
    }
    const std::string name = fmt::format("{} ({} requests)", nano ? "nano" : "mini(reduced)", prompts.size());
    model::CudaModel gm(cfg, w);
    const EngineRun solo = run_engine(cfg, w, &gm, prompts, max_tokens, false, true, true);
    const EngineRun batched = run_engine(cfg, w, &gm, prompts, max_tokens, true, false, false);
    const EngineRun cpu = run_engine(cfg, w, nullptr, prompts, max_tokens, false, false, true);
    note(fmt::format("  engine {}: batched run {} steps, {} prefix hits ({} tokens skipped), {} preemptions", name,
                     batched.stats.steps, batched.stats.prefix_hits, batched.stats.prefix_hit_tokens,
                     batched.stats.preemptions));
    if (nano) {
      EXPECT_GT(batched.stats.prefix_hits, 0) << "the repeated prompt head should hit the prefix cache";
    }
    int equal_solo = 0, equal_cpu = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(solo.tokens[i].size(), size_t(max_tokens));
      ASSERT_EQ(batched.tokens[i].size(), size_t(max_tokens));
      ASSERT_EQ(cpu.tokens[i].size(), size_t(max_tokens));
      const int64_t P = int64_t(prompts[i].size());
      // Logits row of the step that produced output token j: prompt position P−1+j.
      const size_t ds = first_diff(solo.tokens[i], batched.tokens[i]);
      if (ds == solo.tokens[i].size()) {
        ++equal_solo;
      } else {
        const double gap = rel_gap(solo.logits[i].data() + (P - 1 + int64_t(ds)) * V, V);
        note(fmt::format("  engine {} request {}: batched differs from solo at output {} (solo top-2 gap {:.2e} of "
                         "max|logit|)", name, i, ds, gap));
        EXPECT_LE(gap, 1e-2) << name << " request " << i << ": batched GPU tokens differ from solo at output " << ds
                             << " where the solo logits are no near tie";
      }
      const size_t dc = first_diff(cpu.tokens[i], solo.tokens[i]);
      if (dc == cpu.tokens[i].size()) {
        ++equal_cpu;
      } else {
        const double gap = rel_gap(cpu.logits[i].data() + (P - 1 + int64_t(dc)) * V, V);
        note(fmt::format("  engine {} request {}: GPU differs from CPU at output {} (CPU top-2 gap {:.2e} of "
                         "max|logit|)", name, i, dc, gap));
        EXPECT_LE(gap, 4e-2) << name << " request " << i << ": GPU tokens differ from the CPU engine's at output "
                             << dc << " where the CPU logits are no near tie";
      }
    }
    note(fmt::format("{:<28} {:<34} batched == solo for {}/{} requests, GPU == CPU for {}/{}", "engine (GPU)", name,
                     equal_solo, prompts.size(), equal_cpu, prompts.size()));
  }
}

// Quantised caches in the GPU engine: FP8 / MXFP4 index keys (MODEL.md §3.5) and the FP8 latent (§0.3)
// are written with the bytes the CPU writes, the paged indexer selects the ids the CPU selects, the decode
// and the prefill's gather dequantise exactly, an FP16 KDA state is widened and rounded back per launch as
// the CPU does per layer call, so the GPU engine's greedy tokens equal the CPU engine's
// with the same formats (up to near ties of the logits, as for BF16). Nano's prompts of 70 and 90 tokens
// pass its index_topk, so the quantised keys decide selections.
TEST(GpuEngine, QuantisedCachesMatchCpuEngine) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    if (!cfg.text.has_indexer()) continue;
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;
    const bool nano = cfg.text.hidden_size == 256;
    const std::vector<int64_t> lens = nano ? std::vector<int64_t>{70, 90, 17, 40} : std::vector<int64_t>{12, 20};
    const int max_tokens = nano ? 12 : 6;
    std::vector<std::vector<int32_t>> prompts;
    for (size_t k = 0; k < lens.size(); ++k) {
      std::vector<int32_t> p;
      for (int64_t i = 0; i < lens[k]; ++i) p.push_back(int32_t((i * 6007 + 29 + int64_t(k) * 131) % std::min<int64_t>(V, 1000)));
      prompts.push_back(p);
    }
    model::CudaModel gm(cfg, w);
    using F = std::tuple<LatentFormat, IndexKeyFormat, KdaStateDtype>;
    for (const auto& [latent, keys, state] :
         {F{LatentFormat::bf16, IndexKeyFormat::fp8, KdaStateDtype::f32},
          F{LatentFormat::bf16, IndexKeyFormat::mxfp4, KdaStateDtype::f32},
          F{LatentFormat::fp8, IndexKeyFormat::fp8, KdaStateDtype::f32},
          F{LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f16}}) {
      const std::string name = fmt::format("{} {} latent {} keys {} state", nano ? "nano" : "mini(reduced)",
                                           format_name(latent), format_name(keys),
                                           format_name(state));
      const EngineRun gpu = run_engine(cfg, w, &gm, prompts, max_tokens, true, false, false, keys, latent, state);
      const EngineRun cpu = run_engine(cfg, w, nullptr, prompts, max_tokens, true, false, true, keys, latent, state);
      int equal = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        ASSERT_EQ(gpu.tokens[i].size(), size_t(max_tokens)) << name;
        ASSERT_EQ(cpu.tokens[i].size(), size_t(max_tokens)) << name;
        const size_t d = first_diff(cpu.tokens[i], gpu.tokens[i]);
        if (d == cpu.tokens[i].size()) {
          ++equal;
          continue;
        }
        const int64_t P = int64_t(prompts[i].size());
        const double gap = rel_gap(cpu.logits[i].data() + (P - 1 + int64_t(d)) * V, V);
        note(fmt::format("  engine {} request {}: GPU differs from CPU at output {} (CPU top-2 gap {:.2e})", name, i,
                         d, gap));
        EXPECT_LE(gap, 4e-2) << name << " request " << i << ": GPU tokens differ from the CPU engine's at output " << d
                             << " where the CPU logits are no near tie";
      }
      note(fmt::format("{:<28} {:<34} GPU == CPU for {}/{} requests", "engine (GPU)", name, equal, prompts.size()));
    }
  }
}

// CUDA graphs (model/cuda/graphs.h): for every bucket B, a decode step of B requests (contexts of different
// lengths, nano's past index_topk so the sparse path runs) gives bit-identical logits eagerly, through
// the capture run and through a replay (KDA slots restored from backups between the runs). Then a
// padded batch (3 requests in bucket 4, 5 in 8) against the eager step of the same 3/5: the padded
// rows must not disturb the real ones (rel L2 ≤ 1e-3, identical argmax; bit equality reported).
// Bmax requests on one model, contexts 70 − b % 7 (nano's cross its index_topk), prefilled on slots 0..Bmax−1 with
// backups on Bmax..2·Bmax−1; step(B, graphs) runs one decode step of the first B through the graphs or eagerly and
// returns their logits (f32 [B, V]), restoring their slots afterwards.
struct DecodeBatch {
  model::CudaModel& m;
  int64_t V, Bmax;
  model::CudaCachePtr cache;
  std::vector<std::vector<int32_t>> tables, prompts;
  std::vector<int32_t> tok;
  DecodeBatch(model::CudaModel& mm, int64_t vocab, int64_t bmax) : m(mm), V(vocab), Bmax(bmax), cache(nullptr, nullptr) {
    const int64_t ctx = 70;
    const int P = 16;
    const int64_t per = (ctx + 1 + P - 1) / P;
    cache = m.new_cache(int32_t(Bmax * per), int32_t(2 * Bmax),
                        CacheFormats{P, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
    tables.resize(size_t(Bmax)), prompts.resize(size_t(Bmax)), tok.resize(size_t(Bmax));
    for (int64_t b = 0; b < Bmax; ++b) {
      for (int64_t i = 0; i < per; ++i) tables[size_t(b)].push_back(int32_t(b * per + i));
      for (int64_t i = 0; i < ctx - b % 7; ++i) prompts[size_t(b)].push_back(int32_t((i * 31 + b * 17 + 5) % std::min<int64_t>(V, 1000)));
      model::CudaSeq q{prompts[size_t(b)], 0, int32_t(b), tables[size_t(b)], model::CudaSeq::Logits::none};
      m.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
      m.copy_slot(*cache, int32_t(b), int32_t(Bmax + b));  // backup
      tok[size_t(b)] = int32_t((b * 101 + 7) % std::min<int64_t>(V, 1000));
    }
  }
  std::vector<float> step(int64_t B, bool graphs) {
    std::vector<model::CudaSeq> seqs;
    for (int64_t b = 0; b < B; ++b)
      seqs.push_back({std::span<const int32_t>(&tok[size_t(b)], 1), int64_t(prompts[size_t(b)].size()), int32_t(b),
                      tables[size_t(b)], model::CudaSeq::Logits::last});
    m.enable_cuda_graphs(graphs);
    const int64_t rows = m.forward_batch(*cache, seqs);
    EXPECT_EQ(rows, B);
    std::vector<float> out(size_t(B * V));
    m.copy_logits(out.data());
    for (int64_t b = 0; b < B; ++b) m.copy_slot(*cache, int32_t(Bmax + b), int32_t(b));  // restore
    return out;
  }
};

TEST(GpuGraphs, ReplayBitIdenticalToEagerPerBucket) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size, Bmax = 64;
    model::CudaModel m(cfg, w);
    DecodeBatch batch(m, V, Bmax);
    auto step = [&](int64_t B, bool graphs) { return batch.step(B, graphs); };
    const std::string name = cfg.text.hidden_size == 256 ? "nano" : "mini(reduced)";
    for (int64_t B = 1; B <= Bmax; B *= 2) {
      const int64_t before = m.graph_steps();
      const auto eager = step(B, false);
      const auto captured = step(B, true);
      const auto replayed = step(B, true);
      EXPECT_EQ(m.graph_steps(), before + 2) << "bucket " << B << " did not run through its graph";
      check_exact("graph capture == eager", fmt::format("{} B={}", name, B), captured.data(), eager.data(), eager.size() * 4);
      check_exact("graph replay == eager", fmt::format("{} B={}", name, B), replayed.data(), eager.data(), eager.size() * 4);
    }
    for (int64_t B : {int64_t(3), int64_t(5)}) {
      const auto eager = step(B, false);
      const auto padded = step(B, true);
      double num = 0, den = 0;
      bool same_argmax = true;
      for (int64_t b = 0; b < B; ++b) {
        const float* e = eager.data() + b * V;
        const float* g = padded.data() + b * V;
        for (int64_t i = 0; i < V; ++i) num += double(g[i] - e[i]) * (g[i] - e[i]), den += double(e[i]) * e[i];
        same_argmax = same_argmax && std::max_element(e, e + V) - e == std::max_element(g, g + V) - g;
      }
      const double rel = std::sqrt(num / den);
      const bool bits = std::memcmp(eager.data(), padded.data(), eager.size() * 4) == 0;
      note(fmt::format("{:<28} {:<34} rel L2 {:.2e}, argmax {}, bit-identical {}", "graph padded vs eager",
                       fmt::format("{} B={} in bucket {}", name, B, B == 3 ? 4 : 8), rel, same_argmax ? "equal" : "DIFFERS",
                       bits ? "yes" : "no"));
      EXPECT_LE(rel, 1e-3) << name << " B=" << B;
      EXPECT_TRUE(same_argmax) << name << " B=" << B;
    }
  }
}

// The MoE router's top-k in the in-projection's tail (KESTREL_ROUTE_IN_GEMM=1, DecodeOptions::route_in_gemm, read
// by the model's constructor): decode steps of B requests through the step graphs give the default model's
// logits bit for bit — in the tail at B ≤ 16 (the skinny kernel), after the wide GEMM at 32 (linear()'s fallback).
TEST(GpuGraphs, RouteInGemmBitIdentical) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;
    // Logits of decode steps at each B (capture, then replay), from a model built with `route` set.
    auto run = [&](bool route) {
      const char* old = std::getenv("KESTREL_ROUTE_IN_GEMM");
      const std::string keep = old ? old : "";
      setenv("KESTREL_ROUTE_IN_GEMM", route ? "1" : "0", 1);
      model::CudaModel m(cfg, w);
      if (old) setenv("KESTREL_ROUTE_IN_GEMM", keep.c_str(), 1);
      else unsetenv("KESTREL_ROUTE_IN_GEMM");
      DecodeBatch batch(m, V, 32);
      std::vector<std::vector<float>> out;
      for (int64_t B : {1, 4, 16, 32})
        for (int rep = 0; rep < 2; ++rep) out.push_back(batch.step(B, true));
      return out;
    };
    const auto plain = run(false), routed = run(true);
    ASSERT_EQ(plain.size(), routed.size());
    const std::string name = cfg.text.hidden_size == 256 ? "nano" : "mini(reduced)";
    for (size_t i = 0; i < plain.size(); ++i)
      check_exact("route in GEMM == moe_route launch", fmt::format("{} step {} (B={}, {})", name, i,
                                                                   plain[i].size() / size_t(V), i % 2 ? "replay" : "capture"),
                  routed[i].data(), plain[i].data(), plain[i].size() * 4);
  }
}

}  // namespace
}  // namespace kestrel::gputest
