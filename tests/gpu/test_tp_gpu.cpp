// Tensor parallelism on the GPU engine (runtime/executor_cuda_tp.h, docs/parallel.md §8), on the one GPU
// there is: N ranks as threads on one device through the same-device communicator
// (parallel/device_comm.h).
//
//  1. GpuTp.SameDeviceComm*: the communicator against the CPU twin's collectives — every all-reduce
//     byte-identical to parallel::sum_in_rank_order (f32 and bf16, odd sizes, messages cut into pieces),
//     gathers / broadcast / all-to-all exact, a mismatched call one Error on every rank (no hang).
//  2. GpuTp.GivesTp1GreedyTokensAndLogits: the whole GPU engine as TP2 and TP4 against TP1 on every
//     checkpoint of KESTREL_GPU_CKPTS the GPU can split (bench/gpu/run.sh tp makes `nano_tp_gpu`, nano with
//     4 indexer heads and I = 256, so TP4 leaves 64 expert columns per rank, the GPU expert kernels'
//     granule): an 80-token prompt (past nano's top-64 indexer) and a 9-token one, 8 greedy tokens each,
//     every position's logits. Logits within 2 % of the row's max |logit| (the CPU twin's bound: a split
//     sum adds the products in another order, and here each rank's partial is rounded to BF16 once more),
//     compared up to the first token where the runs part; tokens equal except where TP1's own top two lie
//     within 2 % (a near tie), reported.
//  3. GpuTp.ExpertParallelGivesTp1GreedyTokensAndLogits: the same with --enable-expert-parallel, EP2 (nano,
//     nano_tp_gpu) and EP4 (nano_tp_gpu: 4 of its 16 experts per rank) against TP1, same bounds.
//  4. GpuTp.RefusesWhatTheGpuCannotSplit: nano's I = 64 split 2 ways (32 columns) is refused at start with
//     the reason; EP2 of nano (whole experts) is not; DCP (not built on the GPU) is, with the reason.
//  5. GpuTp.CustomAllReduce*: --enable-custom-all-reduce (parallel/peer_allreduce.h) with N = 2, 3, 4 ranks
//     as threads on this one GPU, each launching the one-shot kernel on its own stream: every routed
//     all-reduce byte-identical to the CPU twin's sum (aligned, misaligned = staged, several in a row),
//     messages it must not take (not a multiple of 16 bytes, over max_bytes) through the wrapped comm, the
//     one-shot call count exactly the routed ones; then the whole engine at TP2 and TP4 with the flag against
//     without: the same tokens and bit-identical logits (both paths sum in rank order in f32 and round once;
//     checked only when two runs without the flag are themselves bit-identical, else the TP tolerance), and
//     the flag's path taken. A note line gives µs per 16 KB all-reduce, one-shot against the same-device
//     comm: informational only (one device is not the topology the kernel is for). Where two GPUs exist,
//     TP2 as rank r on GPU r: the flag's kernel over peer access against NCCL within the TP tolerance (or,
//     without peer access, the flag refused at start); skipped on one GPU.
// One file (~670 lines) because every part shares run_tp and the tolerance checks; splitting it would
// duplicate that harness.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/check.h"
#include "harness.h"
#include "kernels/cuda/allreduce.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/shard.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"
#include "parallel/comm.h"
#include "parallel/device_comm.h"
#include "parallel/peer_allreduce.h"
#include "runtime/engine.h"
#include "runtime/executor_cuda.h"
#include "runtime/executor_cuda_tp.h"

namespace kestrel::gputest {
namespace {

// Runs fn(rank) on n threads (device 0 current); rethrows the first error after all joined.
void on_ranks(int n, const std::function<void(int)>& fn) {
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        KCHECK(cudaSetDevice(0) == cudaSuccess, "cudaSetDevice");
        fn(r);
      } catch (const std::exception& e) {
        std::lock_guard lk(mu);
        errors.push_back(e.what());
      }
    });
  for (auto& t : ts) t.join();
  if (!errors.empty()) throw Error(errors.front());
}

// n streams on device 0 and the group's n comms on them.
struct Ranks {
  std::vector<cudaStream_t> streams;
  std::vector<std::unique_ptr<parallel::Comm>> comms;
  Ranks(parallel::SameDeviceGroup& g, int n) {
    for (int r = 0; r < n; ++r) {
      cudaStream_t s = nullptr;
      KCHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "cudaStreamCreate");
      streams.push_back(s);
      comms.push_back(g.comm(r, s));
    }
  }
  ~Ranks() {
    comms.clear();
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
};

TEST(GpuTp, SameDeviceCommMatchesCpuTwin) {
  Rng rng(1601);
  // Pieces of 4 KB force several pieces per message and a padded last one.
  for (int n : {2, 3, 4}) {
    parallel::SameDeviceGroup g(n, 0, 4096);
    Ranks rk(g, n);
    for (size_t count : {size_t(1), size_t(7), size_t(1000), size_t(5003)}) {
      for (DType dt : {DType::f32, DType::bf16}) {
        const size_t esz = dtype_size(dt), bytes = count * esz;
        // Host inputs per rank (bf16 values, or f32 values), and the twin's sum.
        std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n), std::vector<uint8_t>(bytes));
        for (auto& v : in) {
          if (dt == DType::f32) {
            const auto f = rand_f32(count, rng, -4.0f, 4.0f);
            std::memcpy(v.data(), f.data(), bytes);
          } else {
            const auto b = rand_bf16(count, rng, -4.0f, 4.0f);
            std::memcpy(v.data(), b.data(), bytes);
          }
        }
        std::vector<const void*> parts;
        for (auto& v : in) parts.push_back(v.data());
        std::vector<uint8_t> ref(bytes);
        parallel::sum_in_rank_order(parts.data(), n, ref.data(), count, dt);
        std::vector<std::vector<uint8_t>> got(static_cast<size_t>(n), std::vector<uint8_t>(bytes));
        on_ranks(n, [&](int r) {
          void* d = nullptr;
          KCHECK(cudaMalloc(&d, bytes) == cudaSuccess, "cudaMalloc");
          cudaMemcpy(d, in[size_t(r)].data(), bytes, cudaMemcpyHostToDevice);
          rk.comms[size_t(r)]->all_reduce_sum(d, count, dt);
          cudaMemcpy(got[size_t(r)].data(), d, bytes, cudaMemcpyDeviceToHost);
          cudaFree(d);
        });
        const std::string shape = fmt::format("N={} count={} {}", n, count, dt == DType::f32 ? "f32" : "bf16");
        for (int r = 0; r < n; ++r) check_exact("same-device all_reduce", shape, got[size_t(r)].data(), ref.data(), bytes);
      }
    }
    // all_gather, broadcast (root n−1), all_to_all of raw bytes: exact.
    const size_t count = 999;  // bf16 elements per block
    std::vector<std::vector<uint16_t>> send(static_cast<size_t>(n));
    for (auto& v : send) v = rand_bf16(count * size_t(n), rng, -1.0f, 1.0f);
    std::vector<std::vector<uint16_t>> gathered(static_cast<size_t>(n)), bcast(static_cast<size_t>(n)),
        a2a(static_cast<size_t>(n));
    on_ranks(n, [&](int r) {
      parallel::Comm* c = rk.comms[size_t(r)].get();
      const size_t b = count * 2;
      void *ds = nullptr, *dr = nullptr;
      cudaMalloc(&ds, b * size_t(n));
      cudaMalloc(&dr, b * size_t(n));
      cudaMemcpy(ds, send[size_t(r)].data(), b * size_t(n), cudaMemcpyHostToDevice);
      c->all_gather(ds, dr, count, DType::bf16);  // each rank sends its first block
      gathered[size_t(r)].resize(count * size_t(n));
      cudaMemcpy(gathered[size_t(r)].data(), dr, b * size_t(n), cudaMemcpyDeviceToHost);
      c->all_to_all(ds, dr, count, DType::bf16);
      a2a[size_t(r)].resize(count * size_t(n));
      cudaMemcpy(a2a[size_t(r)].data(), dr, b * size_t(n), cudaMemcpyDeviceToHost);
      c->broadcast(ds, count, DType::bf16, n - 1);
      bcast[size_t(r)].resize(count);
      cudaMemcpy(bcast[size_t(r)].data(), ds, b, cudaMemcpyDeviceToHost);
      c->barrier();
      cudaFree(ds), cudaFree(dr);
    });
    for (int r = 0; r < n; ++r)
      for (int p = 0; p < n; ++p) {
        const std::string shape = fmt::format("N={} rank {} block {}", n, r, p);
        check_exact("same-device all_gather", shape, gathered[size_t(r)].data() + size_t(p) * count,
                    send[size_t(p)].data(), count * 2);
        check_exact("same-device all_to_all", shape, a2a[size_t(r)].data() + size_t(p) * count,
                    send[size_t(p)].data() + size_t(r) * count, count * 2);
        if (p == 0)
          check_exact("same-device broadcast", shape, bcast[size_t(r)].data(), send[size_t(n - 1)].data(), count * 2);
      }
  }
}

TEST(GpuTp, SameDeviceCommMismatchIsOneErrorOnEveryRank) {
  parallel::SameDeviceGroup g(2, 0);
  Ranks rk(g, 2);
  std::mutex mu;
  int errors = 0;
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      cudaSetDevice(0);
      void* d = nullptr;
      cudaMalloc(&d, 64);
      try {
        rk.comms[size_t(r)]->all_reduce_sum(d, r == 0 ? 8 : 16, DType::f32);  // counts differ
      } catch (const Error&) {
        std::lock_guard lk(mu);
        ++errors;
      }
      cudaFree(d);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors, 2);
}

struct TpRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;  // per request f32 [positions, V]
};

// Each prompt alone through a GPU engine (greedy, every position's logits); tp > 1: a CudaTpGroup on GPU 0
// (one_device; else rank r on GPU r, NCCL), with --enable-custom-all-reduce when `custom_all_reduce` (then
// *one_shot_calls: the one-shot launches).
TpRun run_tp(const ModelConfig& cfg, const Checkpoint& ckpt, const ModelWeights& w, const ParallelLayout& p,
             const std::vector<std::vector<int32_t>>& prompts, int max_tokens, bool custom_all_reduce = false,
             int64_t* one_shot_calls = nullptr, bool one_device = true) {
  const int tp = p.tp;
  runtime::EngineConfig ec;
  ec.memory_budget = int64_t(128) << 20;
  ec.max_running = 2;
  ec.enable_prefix_cache = false;
  ec.formats.block_size = 16;
  std::unique_ptr<model::CudaModel> one;
  std::unique_ptr<runtime::CudaTpGroup> group;
  if (tp == 1) {
    one = std::make_unique<model::CudaModel>(cfg, w);
    model::CudaModel* m = one.get();
    ec.make_executor = [m, &cfg](const CacheFormats& f, const cache::CacheConfig& cc) {
      runtime::CudaExecutorOptions eo;
      eo.cuda_graphs = false;
      return std::unique_ptr<runtime::StepExecutor>(std::make_unique<runtime::CudaExecutor>(*m, cfg, f, cc, eo));
    };
  } else {
    runtime::CudaTpOptions o;
    o.one_device = one_device;
    o.custom_all_reduce = custom_all_reduce;
    group = std::make_unique<runtime::CudaTpGroup>(cfg, ckpt, p, o);
    ec.tp_size = tp;
    runtime::CudaTpGroup* g = group.get();
    ec.make_executor = [g](const CacheFormats& f, const cache::CacheConfig& cc) {
      return std::unique_ptr<runtime::StepExecutor>(std::make_unique<runtime::CudaTpExecutor>(*g, f, cc));
    };
  }
  TpRun out;
  out.tokens.resize(prompts.size());
  out.logits.resize(prompts.size());
  {
    runtime::Engine e(w, cfg, ec);
    for (size_t i = 0; i < prompts.size(); ++i) {
      Request r;
      r.prompt = prompts[i];
      r.max_tokens = max_tokens;
      r.ignore_eos = true;
      r.on_logits = [&out, i](int64_t, std::span<const float> row) {
        out.logits[i].insert(out.logits[i].end(), row.begin(), row.end());
      };
      std::string error;
      e.submit(std::move(r), [&out, &error, i](const TokenEvent& ev) {
        if (ev.token >= 0) out.tokens[i].push_back(ev.token);
        if (ev.finish == FinishReason::error) error = ev.error;
      });
      e.wait_idle();
      EXPECT_EQ(error, "") << p.name() << " request " << i;
    }
  }
  if (one_shot_calls) *one_shot_calls = group ? group->custom_all_reduces() : 0;
  return out;
}

// The test prompts: 80 tokens (past nano's top-64 indexer) and 9.
std::vector<std::vector<int32_t>> test_prompts(int64_t V) {
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t len : {80, 9}) {
    std::vector<int32_t> p;
    for (int64_t i = 0; i < len; ++i) p.push_back(int32_t((i * 7919 + 13 + len * 101) % std::min<int64_t>(V, 1000)));
    prompts.push_back(p);
  }
  return prompts;
}

// Every layout of `layouts` the GPU can split, on every checkpoint of KESTREL_GPU_CKPTS, against TP1 (see the
// header, 2.). Returns how many runs each TP size had.
std::map<int, int> check_against_tp1(const std::vector<ParallelLayout>& layouts) {
  std::map<int, int> ran;
  const auto dirs = gpu_ckpt_dirs();
  EXPECT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh tp";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;
    const std::vector<std::vector<int32_t>> prompts = test_prompts(V);
    const int max_tokens = 8;
    std::unique_ptr<TpRun> ref;
    for (const ParallelLayout& p : layouts) {
      const std::string name = p.name();
      const std::vector<std::string> why = runtime::cuda_tp_problems(cfg, p);
      if (!why.empty()) {
        note(fmt::format("  {} on {}: skipped ({})", name, dir, why.front()));
        continue;
      }
      if (!ref) ref = std::make_unique<TpRun>(run_tp(cfg, ckpt, w, ParallelLayout{}, prompts, max_tokens));
      const TpRun got = run_tp(cfg, ckpt, w, p, prompts, max_tokens);
      ++ran[p.tp];
      double worst = 0;
      int rows = 0, ties = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(ref->tokens[i].size(), size_t(max_tokens));
        EXPECT_EQ(got.tokens[i].size(), size_t(max_tokens)) << name << " request " << i;
        if (ref->tokens[i].size() != size_t(max_tokens) || got.tokens[i].size() != size_t(max_tokens)) continue;
        const int64_t P = int64_t(prompts[i].size());
        size_t same = 0;
        while (same < got.tokens[i].size() && got.tokens[i][same] == ref->tokens[i][same]) ++same;
        // Rows computed from the same context: the prompt's, then one per output token up to the first that
        // differs (its row included: it is the row that chose differently).
        const int64_t nrows = P + int64_t(std::min(same, size_t(max_tokens - 1)));
        EXPECT_GE(int64_t(ref->logits[i].size()), nrows * V);
        EXPECT_GE(int64_t(got.logits[i].size()), nrows * V) << name << " request " << i;
        if (int64_t(ref->logits[i].size()) < nrows * V || int64_t(got.logits[i].size()) < nrows * V) continue;
        for (int64_t row = 0; row < nrows; ++row) {
          const float* a = ref->logits[i].data() + row * V;
          const float* b = got.logits[i].data() + row * V;
          double scale = 0, err = 0;
          for (int64_t v = 0; v < V; ++v) {
            scale = std::max(scale, double(std::fabs(a[v])));
            err = std::max(err, double(std::fabs(a[v] - b[v])));
          }
          EXPECT_TRUE(std::isfinite(err)) << name << " request " << i << " row " << row;
          worst = std::max(worst, err / scale);
          EXPECT_LE(err, 2e-2 * scale) << name << " request " << i << " logits row " << row;
          ++rows;
        }
        if (same < got.tokens[i].size()) {
          const float* a = ref->logits[i].data() + (P - 1 + int64_t(same)) * V;
          std::vector<float> v(a, a + V);
          std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
          double scale = 0;
          for (int64_t k = 0; k < V; ++k) scale = std::max(scale, double(std::fabs(a[k])));
          const double gap = double(v[0] - v[1]) / scale;
          ++ties;
          note(fmt::format("  {} {} request {}: tokens part at output {} (TP1 top-2 gap {:.2e} of max|logit|)", name,
                           dir, i, same, gap));
          EXPECT_LE(gap, 2e-2) << name << " request " << i << ": greedy tokens differ at output " << same
                               << " where TP1's logits are no near tie";
        }
      }
      note(fmt::format("{:<28} {} on {}: {} logits rows, worst |Δ| {:.2e} of max|logit|, {} near-tie partings",
                       "engine TP (one GPU)", name, dir, rows, worst, ties));
    }
  }
  return ran;
}

ParallelLayout layout(int tp, bool ep) {
  ParallelLayout p;
  p.tp = tp;
  p.expert_parallel = ep;
  return p;
}

TEST(GpuTp, GivesTp1GreedyTokensAndLogits) {
  const std::map<int, int> ran = check_against_tp1({layout(2, false), layout(4, false)});
  EXPECT_GT(ran.count(4), 0u) << "no checkpoint the GPU splits 4 ways (bench/gpu/run.sh tp makes nano_tp_gpu)";
}

// --enable-expert-parallel: each rank holds X/N whole experts (nano: 16 experts, top-4; EP4 leaves exactly
// 4 per rank, so some tokens have all their experts on one rank and none on the others).
TEST(GpuTp, ExpertParallelGivesTp1GreedyTokensAndLogits) {
  const std::map<int, int> ran = check_against_tp1({layout(2, true), layout(4, true)});
  EXPECT_GT(ran.count(2), 0u) << "no checkpoint the GPU runs as TP2+EP2";
  EXPECT_GT(ran.count(4), 0u) << "no checkpoint the GPU runs as TP4+EP4 (bench/gpu/run.sh tp makes nano_tp_gpu)";
}

TEST(GpuTp, RefusesWhatTheGpuCannotSplit) {
  for (const std::string& dir : gpu_ckpt_dirs()) {
    const ModelConfig cfg = load_config(dir);
    if (cfg.text.hidden_size != 256 || cfg.text.moe_intermediate_size != 64) continue;  // nano itself
    ParallelLayout p;
    p.tp = 2;
    const std::vector<std::string> why = runtime::cuda_tp_problems(cfg, p);
    ASSERT_EQ(why.size(), 1u);
    EXPECT_NE(why[0].find("multiple of 64"), std::string::npos) << why[0];
    const Checkpoint ckpt(dir);
    try {
      runtime::CudaTpGroup g(cfg, ckpt, p, runtime::CudaTpOptions{true, {}});
      ADD_FAILURE() << "TP2 of nano was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot run this model as TP2 on the GPU"), std::string::npos) << e.what();
    }
    // Whole experts per rank need no 64-column slices: EP2 of nano is accepted (and run by the test above).
    p.expert_parallel = true;
    const std::vector<std::string> ep = runtime::cuda_tp_problems(cfg, p);
    EXPECT_TRUE(ep.empty()) << ep.front();
    // Decode context parallelism is not built on the GPU: refused with the reason (EP2+DCP2: the only one).
    p.dcp = 2;
    const std::vector<std::string> dcp = runtime::cuda_tp_problems(cfg, p);
    ASSERT_EQ(dcp.size(), 1u);
    EXPECT_NE(dcp[0].find("--decode-context-parallel-size"), std::string::npos) << dcp[0];
    return;
  }
  GTEST_SKIP() << "nano is not among KESTREL_GPU_CKPTS";
}

// ---- 5. --enable-custom-all-reduce: the one-shot kernel per rank, ranks as threads on this one GPU ----

// n ranks on device 0, each with its own stream and a same-device comm wrapped by one PeerAllReduceGroup.
struct PeerRanks {
  parallel::SameDeviceGroup same;
  parallel::PeerAllReduceGroup peer;
  std::vector<cudaStream_t> streams;
  std::vector<std::unique_ptr<parallel::Comm>> comms;
  PeerRanks(int n, size_t max_bytes) : same(n, 0), peer(std::vector<int>(size_t(n), 0), max_bytes) {
    for (int r = 0; r < n; ++r) {
      cudaStream_t s = nullptr;
      KCHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "cudaStreamCreate");
      streams.push_back(s);
      comms.push_back(peer.wrap(same.comm(r, s), r, s));
    }
  }
  ~PeerRanks() {
    comms.clear();
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
};

TEST(GpuTp, CustomAllReduceMatchesCpuTwin) {
  Rng rng(1606);
  const size_t max_bytes = size_t(64) << 10;
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct Case {
    size_t count;
    DType dt;
    size_t offset;  // bytes past a 256-byte aligned allocation: 2 makes the buffer misaligned (staged)
    bool one_shot;  // whether the one-shot path must take it (a multiple of 16 bytes, at most max_bytes)
  };
  const std::vector<Case> cases = {
      {4, DType::f32, 0, true},         {7168, DType::bf16, 0, true},  // one bf16 [D] row of K3.1: 14 KB
      {8192, DType::bf16, 2, true},     {16384, DType::f32, 0, true},  // misaligned 16 KB; exactly max_bytes
      {7, DType::bf16, 0, false},       {16388, DType::f32, 0, false},  // 14 bytes; over max_bytes
      {8192, DType::bf16, 0, true},     {1000, DType::f32, 0, true},  {5003, DType::bf16, 0, false}};
  for (int n : {2, 3, 4}) {
    PeerRanks rk(n, max_bytes);
    // One device: n·G spinning blocks on at most half the SMs (peer_allreduce.h, why that cannot deadlock).
    EXPECT_LE(n * rk.peer.blocks(), sms / 2) << "N=" << n;
    // Buffers allocated here, not on the rank threads: cudaMalloc / cudaFree may synchronise the device,
    // and a rank waiting for the device while a peer's kernel waits for it would deadlock.
    std::vector<void*> dev(static_cast<size_t>(n));
    for (void*& d : dev) ASSERT_EQ(cudaMalloc(&d, max_bytes + 256), cudaSuccess);
    int64_t expect_calls = 0;
    for (const Case& c : cases) {
      const size_t bytes = c.count * dtype_size(c.dt);
      std::vector<std::vector<uint8_t>> in(static_cast<size_t>(n), std::vector<uint8_t>(bytes));
      for (auto& v : in) {
        if (c.dt == DType::f32) {
          const auto f = rand_f32(c.count, rng, -4.0f, 4.0f);
          std::memcpy(v.data(), f.data(), bytes);
        } else {
          const auto b = rand_bf16(c.count, rng, -4.0f, 4.0f);
          std::memcpy(v.data(), b.data(), bytes);
        }
      }
      std::vector<const void*> parts;
      for (auto& v : in) parts.push_back(v.data());
      std::vector<uint8_t> ref(bytes);
      parallel::sum_in_rank_order(parts.data(), n, ref.data(), c.count, c.dt);
      std::vector<std::vector<uint8_t>> got(static_cast<size_t>(n), std::vector<uint8_t>(bytes));
      on_ranks(n, [&](int r) {
        const cudaStream_t s = rk.streams[size_t(r)];
        void* buf = static_cast<char*>(dev[size_t(r)]) + c.offset;
        KCHECK(cudaMemcpyAsync(buf, in[size_t(r)].data(), bytes, cudaMemcpyHostToDevice, s) == cudaSuccess, "H2D");
        rk.comms[size_t(r)]->all_reduce_sum(buf, c.count, c.dt);
        KCHECK(cudaMemcpyAsync(got[size_t(r)].data(), buf, bytes, cudaMemcpyDeviceToHost, s) == cudaSuccess, "D2H");
        KCHECK(cudaStreamSynchronize(s) == cudaSuccess, "one-shot all-reduce on rank {}", r);
      });
      const std::string shape = fmt::format("N={} count={} {} offset {}", n, c.count,
                                            c.dt == DType::f32 ? "f32" : "bf16", c.offset);
      for (int r = 0; r < n; ++r) check_exact("one-shot all_reduce", shape, got[size_t(r)].data(), ref.data(), bytes);
      EXPECT_EQ(rk.peer.takes(c.count, c.dt), c.one_shot) << shape;
      if (c.one_shot) expect_calls += n;
      EXPECT_EQ(rk.peer.calls(), expect_calls) << shape << ": one-shot launches";
    }
    for (void* d : dev) cudaFree(d);
  }
}

// µs per 16 KB bf16 all-reduce on this one GPU: the flag's path (a launch per rank on its own stream, fenced
// by the one-device mode's two host rendezvous), the same-device comm, and the kernel alone (all ranks in one
// cooperative launch: its on-device cost without host synchronisation). A note only: one device is not the
// kernel's topology (anchor: 3.5-5.2 µs on 8 GPUs against ~18 µs for NCCL).
TEST(GpuTp, CustomAllReduceTimingNote) {
  const size_t count = 8192, bytes = count * 2;
  for (int n : {2, 4}) {
    PeerRanks rk(n, size_t(1) << 20);
    parallel::SameDeviceGroup plain(n, 0);
    Ranks pr(plain, n);
    std::vector<void*> dev(static_cast<size_t>(n));
    for (void*& d : dev) {
      ASSERT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
      ASSERT_EQ(cudaMemset(d, 0, bytes), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto time_us = [&](std::vector<std::unique_ptr<parallel::Comm>>& comms,
                             const std::vector<cudaStream_t>& streams, int iters) {
      const auto t0 = std::chrono::steady_clock::now();
      on_ranks(n, [&](int r) {
        for (int i = 0; i < iters; ++i) comms[size_t(r)]->all_reduce_sum(dev[size_t(r)], count, DType::bf16);
        KCHECK(cudaStreamSynchronize(streams[size_t(r)]) == cudaSuccess, "rank {}", r);
      });
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
    };
    time_us(rk.comms, rk.streams, 20);  // warm-up
    const double one_shot = time_us(rk.comms, rk.streams, 2000);
    time_us(pr.comms, pr.streams, 5);
    const double comm = time_us(pr.comms, pr.streams, 200);
    EXPECT_EQ(rk.peer.calls(), int64_t(n) * 2020);
    // The kernel alone: n ranks' exchange buffers (u8 [control | 2 halves of 16 KB]) in one cooperative launch.
    cuda::OneShotBuffers b;
    b.n = n;
    b.half_bytes = bytes;
    b.blocks = cuda::one_shot_blocks(bytes);
    std::vector<void*> ex(static_cast<size_t>(n));
    const size_t control = (cuda::kOneShotFlagBytes + 255) / 256 * 256;
    for (int p = 0; p < n; ++p) {
      ASSERT_EQ(cudaMalloc(&ex[size_t(p)], control + 2 * bytes), cudaSuccess);
      ASSERT_EQ(cudaMemset(ex[size_t(p)], 0, control), cudaSuccess);
      b.flags[p] = static_cast<uint32_t*>(ex[size_t(p)]);
      b.data[p] = static_cast<char*>(ex[size_t(p)]) + control;
    }
    std::vector<const void*> in(dev.begin(), dev.end());
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    ASSERT_EQ(cudaEventCreate(&e0), cudaSuccess);
    ASSERT_EQ(cudaEventCreate(&e1), cudaSuccess);
    for (int i = 0; i < 20; ++i) cuda::one_shot_all_reduce_emulated(b, in.data(), dev.data(), count, true, nullptr);
    const int iters = 2000;
    ASSERT_EQ(cudaEventRecord(e0, nullptr), cudaSuccess);
    for (int i = 0; i < iters; ++i) cuda::one_shot_all_reduce_emulated(b, in.data(), dev.data(), count, true, nullptr);
    ASSERT_EQ(cudaEventRecord(e1, nullptr), cudaSuccess);
    ASSERT_EQ(cudaEventSynchronize(e1), cudaSuccess);
    float ms = 0;
    ASSERT_EQ(cudaEventElapsedTime(&ms, e0, e1), cudaSuccess);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    note(fmt::format("{:<28} TP{} 16 KB bf16 on one GPU: flag's path {:.1f} us (two host rendezvous), same-device "
                     "comm {:.1f} us, kernel alone {:.2f} us per call (informational: not the multi-GPU topology)",
                     "custom all-reduce", n, one_shot, comm, 1000.0 * ms / iters));
    for (void* d : ex) cudaFree(d);
    for (void* d : dev) cudaFree(d);
  }
}

// `got` against `ref`, two runs of the same prompts: logits within the TP tolerance (2 % of the row's
// max|logit|) up to where the greedy tokens part, and a parting only at a near tie of ref's top two (2 %).
// Returns the worst |Δ| / max|logit|.
double within_tp_tolerance(const TpRun& ref, const TpRun& got, const std::vector<std::vector<int32_t>>& prompts,
                           int64_t V, int max_tokens, const std::string& name) {
  double worst = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    size_t same = 0;
    while (same < got.tokens[i].size() && same < ref.tokens[i].size() && got.tokens[i][same] == ref.tokens[i][same])
      ++same;
    EXPECT_EQ(got.tokens[i].size(), ref.tokens[i].size()) << name << " request " << i;
    const int64_t P = int64_t(prompts[i].size());
    const int64_t nrows = P + int64_t(std::min(same, size_t(max_tokens - 1)));
    EXPECT_GE(int64_t(got.logits[i].size()), nrows * V) << name;
    EXPECT_GE(int64_t(ref.logits[i].size()), nrows * V) << name;
    if (int64_t(got.logits[i].size()) < nrows * V || int64_t(ref.logits[i].size()) < nrows * V) continue;
    for (int64_t row = 0; row < nrows; ++row) {
      double scale = 0, err = 0;
      for (int64_t v = 0; v < V; ++v) {
        const float a = ref.logits[i][size_t(row * V + v)], b = got.logits[i][size_t(row * V + v)];
        scale = std::max(scale, double(std::fabs(a)));
        err = std::max(err, double(std::fabs(a - b)));
      }
      EXPECT_LE(err, 2e-2 * scale) << name << " request " << i << " row " << row;
      worst = std::max(worst, err / scale);
    }
    if (same < got.tokens[i].size() && same < ref.tokens[i].size()) {
      const float* a = ref.logits[i].data() + (P - 1 + int64_t(same)) * V;
      std::vector<float> v(a, a + V);
      std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
      double scale = 0;
      for (int64_t k = 0; k < V; ++k) scale = std::max(scale, double(std::fabs(a[k])));
      EXPECT_LE(double(v[0] - v[1]) / scale, 2e-2) << name << " request " << i << ": tokens part at output " << same
                                                   << " where the reference's logits are no near tie";
    }
  }
  return worst;
}

// The whole engine with the flag against without (header, 5.): on one device both paths sum in rank order in
// f32 and round once, so the bytes must agree wherever the engine itself is run-to-run deterministic.
TEST(GpuTp, CustomAllReduceGivesTheCommsTokensAndLogits) {
  std::map<int, int> ran;
  for (const std::string& dir : gpu_ckpt_dirs()) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;
    const std::vector<std::vector<int32_t>> prompts = test_prompts(V);
    const int max_tokens = 8;
    for (const ParallelLayout& p : {layout(2, false), layout(4, false), layout(2, true)}) {
      if (!runtime::cuda_tp_problems(cfg, p).empty()) continue;
      const std::string name = p.name() + " on " + dir;
      int64_t calls_off = -1, calls_on = -1;
      const TpRun off = run_tp(cfg, ckpt, w, p, prompts, max_tokens, false, &calls_off);
      const TpRun off2 = run_tp(cfg, ckpt, w, p, prompts, max_tokens, false);
      const TpRun on = run_tp(cfg, ckpt, w, p, prompts, max_tokens, true, &calls_on);
      ++ran[p.tp];
      EXPECT_EQ(calls_off, 0) << name;
      EXPECT_GT(calls_on, 0) << name << ": the flag's one-shot path was never taken";
      const auto same_bytes = [](const TpRun& a, const TpRun& b) {
        if (a.tokens != b.tokens || a.logits.size() != b.logits.size()) return false;
        for (size_t i = 0; i < a.logits.size(); ++i)
          if (a.logits[i].size() != b.logits[i].size() ||
              std::memcmp(a.logits[i].data(), b.logits[i].data(), a.logits[i].size() * sizeof(float)) != 0)
            return false;
        return true;
      };
      if (same_bytes(off, off2)) {
        EXPECT_TRUE(same_bytes(on, off)) << name << ": logits or tokens differ with --enable-custom-all-reduce";
        EXPECT_EQ(on.tokens, off.tokens) << name;
        note(fmt::format("{:<28} {}: {} one-shot all-reduces, tokens and logits bit-identical to the comm's",
                         "custom all-reduce", name, calls_on));
        continue;
      }
      // The engine itself is not bit-reproducible here: the TP tolerance instead.
      const double worst = within_tp_tolerance(off, on, prompts, V, max_tokens, name);
      note(fmt::format("{:<28} {}: {} one-shot all-reduces; the engine is not bit-reproducible without the flag, "
                       "worst |Δ| {:.2e} of max|logit|",
                       "custom all-reduce", name, calls_on, worst));
    }
  }
  EXPECT_GT(ran.count(2), 0u) << "no checkpoint of KESTREL_GPU_CKPTS the GPU runs as TP2 (bench/gpu/run.sh tp)";
  EXPECT_GT(ran.count(4), 0u) << "no checkpoint the GPU splits 4 ways (bench/gpu/run.sh tp makes nano_tp_gpu)";
}

// Where two GPUs exist (not the one-H200 runs): TP2 as rank r on GPU r, the flag's one-shot kernel over
// peer access against NCCL. NCCL sums in its own order, so the TP tolerance applies, not bit equality. GPUs
// without peer access must refuse the flag at start with the reason.
TEST(GpuTp, CustomAllReduceMatchesNcclOnTwoGpus) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "one GPU: the one-device tests above cover the kernel; this needs two";
  int can01 = 0, can10 = 0;
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can01, 0, 1), cudaSuccess);
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can10, 1, 0), cudaSuccess);
  bool ran = false;
  for (const std::string& dir : gpu_ckpt_dirs()) {
    const ModelConfig cfg = load_config(dir);
    const ParallelLayout p = runtime::cuda_tp_problems(cfg, layout(2, false)).empty() ? layout(2, false) : layout(2, true);
    if (!runtime::cuda_tp_problems(cfg, p).empty()) continue;
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const std::string name = p.name() + " on GPUs 0, 1, " + dir;
    if (!can01 || !can10) {
      runtime::CudaTpOptions o;
      o.custom_all_reduce = true;
      try {
        runtime::CudaTpGroup g(cfg, ckpt, p, o);
        ADD_FAILURE() << name << ": accepted without peer access";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("cannot access GPU"), std::string::npos) << e.what();
      }
      return;
    }
    const std::vector<std::vector<int32_t>> prompts = test_prompts(cfg.text.vocab_size);
    const int max_tokens = 8;
    int64_t calls = 0;
    const TpRun nccl = run_tp(cfg, ckpt, w, p, prompts, max_tokens, false, nullptr, false);
    const TpRun one_shot = run_tp(cfg, ckpt, w, p, prompts, max_tokens, true, &calls, false);
    EXPECT_GT(calls, 0) << name;
    const double worst = within_tp_tolerance(nccl, one_shot, prompts, cfg.text.vocab_size, max_tokens, name);
    note(fmt::format("{:<28} {}: {} one-shot all-reduces against NCCL, worst |Δ| {:.2e} of max|logit|",
                     "custom all-reduce", name, calls, worst));
    ran = true;
  }
  EXPECT_TRUE(ran) << "no checkpoint of KESTREL_GPU_CKPTS runs as TP2 (bench/gpu/run.sh tp)";
}

}  // namespace
}  // namespace kestrel::gputest
