// DSpark verify steps in CUDA graphs (model/cuda/graphs.h, issue #19), on the nano checkpoint of
// KESTREL_GPU_CKPTS (the first directory with hidden size 256; no draft needed: the taps are three fixed
// layers of the target):
//  1. GpuSpecGraph.VerifyReplayBitIdenticalToEager: for B ∈ {1, 3} verify sequences of 1 + γ rows, γ ∈ {2, 7}
//     (contexts past nano's index_topk, blocks crossing a page boundary), the step run eagerly, through the
//     capture of its verify bucket and through a replay gives bit for bit the same logits of every row, taps,
//     KDA trace (recurrent and conv state after each position, what keep_verified copies) and final slot
//     states (KDA slots restored from backups between the runs). A change of the tap layers recaptures the
//     bucket (its taps again equal the eager step's).
//  2. GpuSpecGraph.PaddedVerifyBucket: with KESTREL_SPEC_GRAPH_PAD=1, B = 3 sequences of 3 rows run in the
//     bucket of 4 (12 rows, in the skinny GEMM): the padded sequence must not disturb the real ones — trace
//     and slot states of the real sequences and their logits against the eager step's (rel L2 ≤ 1e-3,
//     identical argmax per row; bit equality reported, as GpuGraphs.ReplayBitIdenticalToEagerPerBucket does
//     for padded decode buckets); capture == replay bit for bit.
//  3. GpuSpecGraph.DeviceGreedyEqualsHostGreedy: CudaModel::greedy_rows over a verify step's rows (all of
//     them, and a sub-range) gives the ids of the host's argmax of the copied rows (the first maximum, as
//     runtime/spec_decode.cpp's), so verify_greedy on either accepts the same prefix.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "kernels/cuda/cuda_check.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cache.h"
#include "model/cuda/cuda_model.h"
#include "runtime/spec_verify.h"

namespace kestrel::gputest {
namespace {

// The nano target, loaded once.
struct Nano {
  std::string dir;
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  ModelWeights w;
};
const Nano* nano() {
  static Nano* n = []() -> Nano* {
    for (const std::string& d : gpu_ckpt_dirs()) {
      ModelConfig c = load_config(d);
      if (c.text.hidden_size != 256) continue;
      auto* p = new Nano;
      p->dir = d;
      p->cfg = c;
      p->ckpt = std::make_unique<Checkpoint>(d);
      p->w = bind_weights(p->cfg, *p->ckpt);
      return p;
    }
    return static_cast<Nano*>(nullptr);
  }();
  return n;
}
#define REQUIRE_NANO(n) \
  ASSERT_TRUE((n) != nullptr) << "KESTREL_GPU_CKPTS holds no nano checkpoint (hidden 256): run through bench/gpu/run.sh"

// A model built with one environment variable set (DecodeOptions are read once, by the constructor), the
// environment put back afterwards for the other tests of the binary.
std::unique_ptr<model::CudaModel> model_with_env(const Nano& n, const char* name, const char* value) {
  const char* old = name ? std::getenv(name) : nullptr;
  const std::string keep = old ? old : "";
  if (name) setenv(name, value, 1);
  auto m = std::make_unique<model::CudaModel>(n.cfg, n.w);
  if (name) {
    if (old) setenv(name, keep.c_str(), 1);
    else unsetenv(name);
  }
  return m;
}

int32_t host_argmax(const float* x, int64_t V) { return int32_t(std::max_element(x, x + V) - x); }

// Everything a verify step leaves behind, copied to the host.
struct StepOut {
  std::vector<float> logits;             // f32 [rows, V]
  std::vector<uint16_t> taps;            // bf16 [rows, n·D]
  std::vector<uint8_t> trace_S, trace_conv;  // per KDA layer, rows · state bytes, concatenated
  std::vector<uint8_t> slots_S, slots_conv;  // per KDA layer, the B real slots' final states, concatenated
};

// B requests with contexts past nano's index_topk, prefilled once on slots 0..B−1 (backups on B..2B−1); each
// verify step runs their blocks of R rows at the end of their contexts, then restores the slots.
struct VerifyBench {
  model::CudaModel& m;
  const ModelConfig& cfg;
  int64_t B, R, V, width;
  static constexpr int kPage = 16;
  model::CudaCachePtr cache;
  std::vector<std::vector<int32_t>> tables, prompts, blocks;

  VerifyBench(model::CudaModel& mm, const ModelConfig& c, int64_t b, int64_t r, int64_t tap_width)
      : m(mm), cfg(c), B(b), R(r), V(c.text.vocab_size), width(tap_width),
        cache(nullptr, nullptr) {
    const int64_t ctx_max = 66 + 5 * (B - 1), per = (ctx_max + R + kPage - 1) / kPage;
    cache = m.new_cache(int32_t(B * per), int32_t(2 * B),
                        CacheFormats{kPage, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
    const int64_t Vs = std::min<int64_t>(V, 1000);
    m.enable_cuda_graphs(false);
    for (int64_t s = 0; s < B; ++s) {
      tables.emplace_back();
      prompts.emplace_back();
      blocks.emplace_back();
      for (int64_t i = 0; i < per; ++i) tables.back().push_back(int32_t(s * per + i));
      // Contexts 66, 71, 76: the blocks cross the page boundary at 80 for the longer ones.
      for (int64_t i = 0; i < 66 + 5 * s; ++i) prompts.back().push_back(int32_t((i * 31 + s * 17 + 5) % Vs));
      for (int64_t i = 0; i < R; ++i) blocks.back().push_back(int32_t((i * 101 + s * 13 + 7) % Vs));
      model::CudaSeq q{prompts.back(), 0, int32_t(s), tables.back(), model::CudaSeq::Logits::none};
      m.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
      m.copy_slot(*cache, int32_t(s), int32_t(B + s));  // backup
    }
  }

  StepOut step(bool graphs) {
    std::vector<model::CudaSeq> seqs;
    for (int64_t s = 0; s < B; ++s) {
      model::CudaSeq q{blocks[size_t(s)], int64_t(prompts[size_t(s)].size()), int32_t(s), tables[size_t(s)],
                       model::CudaSeq::Logits::all};
      q.verify = true;
      seqs.push_back(q);
    }
    m.enable_cuda_graphs(graphs);
    const int64_t rows = m.forward_batch(*cache, seqs);
    EXPECT_EQ(rows, B * R);
    StepOut o;
    o.logits.resize(size_t(rows * V));
    m.copy_logits(o.logits.data());  // synchronises the model's stream
    if (width > 0) {
      o.taps.resize(size_t(rows * width));
      m.copy_taps(0, rows, o.taps.data());
    }
    const model::CudaCache& cc = *cache;
    const int64_t sb = cc.layout.kda_recurrent_bytes, cb = cc.layout.kda_conv_bytes;
    for (size_t L = 0; L < cc.kda_S.size(); ++L) {
      if (!cc.kda_S[L]) continue;
      auto get = [](std::vector<uint8_t>& out, const void* src, int64_t bytes) {
        const size_t at = out.size();
        out.resize(at + size_t(bytes));
        KCUDA_CHECK(cudaMemcpy(out.data() + at, src, size_t(bytes), cudaMemcpyDeviceToHost));
      };
      get(o.trace_S, cc.trace_S[L], rows * sb);
      get(o.trace_conv, cc.trace_conv[L], rows * cb);
      get(o.slots_S, cc.kda_S[L], B * sb);  // slots 0..B−1
      get(o.slots_conv, cc.kda_conv[L], B * cb);
    }
    for (int64_t s = 0; s < B; ++s) m.copy_slot(*cache, int32_t(B + s), int32_t(s));  // restore
    KCUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(m.stream())));
    return o;
  }
};

void expect_same(const std::string& what, const std::string& shape, const StepOut& got, const StepOut& ref) {
  ASSERT_EQ(got.logits.size(), ref.logits.size());
  ASSERT_EQ(got.taps.size(), ref.taps.size());
  ASSERT_EQ(got.trace_S.size(), ref.trace_S.size());
  check_exact(what + " logits", shape, got.logits.data(), ref.logits.data(), ref.logits.size() * 4);
  check_exact(what + " taps", shape, got.taps.data(), ref.taps.data(), ref.taps.size() * 2);
  check_exact(what + " KDA trace S", shape, got.trace_S.data(), ref.trace_S.data(), ref.trace_S.size());
  check_exact(what + " KDA trace conv", shape, got.trace_conv.data(), ref.trace_conv.data(), ref.trace_conv.size());
  check_exact(what + " KDA slots S", shape, got.slots_S.data(), ref.slots_S.data(), ref.slots_S.size());
  check_exact(what + " KDA slots conv", shape, got.slots_conv.data(), ref.slots_conv.data(), ref.slots_conv.size());
}

std::vector<int> tap_layers(const ModelConfig& c, int variant) {
  const int L = c.text.num_hidden_layers;
  if (variant == 0) return {0, L / 2, L - 1};
  return {1, L - 2};
}

TEST(GpuSpecGraph, VerifyReplayBitIdenticalToEager) {
  const Nano* n = nano();
  REQUIRE_NANO(n);
  auto m = model_with_env(*n, nullptr, nullptr);
  const int64_t D = n->cfg.text.hidden_size;
  for (int64_t gamma : {int64_t(2), int64_t(7)})
    for (int64_t B : {int64_t(1), int64_t(3)}) {
      const auto taps = tap_layers(n->cfg, 0);
      m->set_taps(taps);
      VerifyBench vb(*m, n->cfg, B, 1 + gamma, int64_t(taps.size()) * D);
      const std::string shape = fmt::format("nano B={} gamma={}", B, gamma);
      const int64_t before = m->graph_steps();
      const StepOut eager = vb.step(false);
      const StepOut captured = vb.step(true);
      const StepOut replayed = vb.step(true);
      EXPECT_EQ(m->graph_steps(), before + 2) << shape << ": the verify step did not run through its bucket";
      expect_same("verify graph capture == eager", shape, captured, eager);
      expect_same("verify graph replay == eager", shape, replayed, eager);
      // Other tap layers: the bucket is captured again and copies the new ones.
      const auto taps2 = tap_layers(n->cfg, 1);
      m->set_taps(taps2);
      vb.width = int64_t(taps2.size()) * D;
      const StepOut eager2 = vb.step(false);
      const StepOut graph2 = vb.step(true);
      expect_same("verify graph, new taps == eager", shape, graph2, eager2);
      m->set_taps({});
    }
}

TEST(GpuSpecGraph, PaddedVerifyBucket) {
  const Nano* n = nano();
  REQUIRE_NANO(n);
  auto m = model_with_env(*n, "KESTREL_SPEC_GRAPH_PAD", "1");
  const int64_t D = n->cfg.text.hidden_size, V = n->cfg.text.vocab_size, B = 3, R = 3;
  const auto taps = tap_layers(n->cfg, 0);
  m->set_taps(taps);
  VerifyBench vb(*m, n->cfg, B, R, int64_t(taps.size()) * D);
  const std::string shape = "nano B=3 gamma=2 in bucket 4";
  const int64_t before = m->graph_steps();
  const StepOut eager = vb.step(false);
  const StepOut captured = vb.step(true);
  const StepOut replayed = vb.step(true);
  EXPECT_EQ(m->graph_steps(), before + 2) << shape << ": the verify step did not run through its bucket";
  expect_same("padded verify replay == capture", shape, replayed, captured);
  ASSERT_EQ(captured.logits.size(), eager.logits.size());
  const double rel = rel_l2(captured.logits.data(), eager.logits.data(), int64_t(eager.logits.size()));
  bool same_argmax = true;
  for (int64_t r = 0; r < B * R; ++r)
    same_argmax = same_argmax &&
                  host_argmax(captured.logits.data() + r * V, V) == host_argmax(eager.logits.data() + r * V, V);
  auto bits = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  note(fmt::format("{:<28} {:<34} rel L2 {:.2e}, argmax {}, bit-identical: logits {} taps {} trace {} slots {}",
                   "verify graph padded vs eager", shape, rel, same_argmax ? "equal" : "DIFFERS",
                   bits(captured.logits, eager.logits) ? "yes" : "no", bits(captured.taps, eager.taps) ? "yes" : "no",
                   bits(captured.trace_S, eager.trace_S) && bits(captured.trace_conv, eager.trace_conv) ? "yes" : "no",
                   bits(captured.slots_S, eager.slots_S) && bits(captured.slots_conv, eager.slots_conv) ? "yes"
                                                                                                       : "no"));
  EXPECT_LE(rel, 1e-3) << shape;
  EXPECT_TRUE(same_argmax) << shape;
  // The real sequences' KDA state (the trace rows of the real sequences, the final slots): the padded
  // sequence ran on the hidden slot with an empty range, so these follow the real rows' arithmetic only.
  auto widen_f32 = [](const std::vector<uint8_t>& b) {
    std::vector<float> f(b.size() / 4);
    std::memcpy(f.data(), b.data(), f.size() * 4);
    return f;
  };
  const auto ts_g = widen_f32(captured.trace_S), ts_e = widen_f32(eager.trace_S);
  const auto ss_g = widen_f32(captured.slots_S), ss_e = widen_f32(eager.slots_S);
  const double rel_trace = rel_l2(ts_g.data(), ts_e.data(), int64_t(ts_e.size()));
  const double rel_slots = rel_l2(ss_g.data(), ss_e.data(), int64_t(ss_e.size()));
  note(fmt::format("{:<28} {:<34} KDA trace rel L2 {:.2e}, slots rel L2 {:.2e}", "verify graph padded vs eager",
                   shape, rel_trace, rel_slots));
  EXPECT_LE(rel_trace, 1e-3) << shape;
  EXPECT_LE(rel_slots, 1e-3) << shape;
  m->set_taps({});
}

TEST(GpuSpecGraph, DeviceGreedyEqualsHostGreedy) {
  const Nano* n = nano();
  REQUIRE_NANO(n);
  auto m = model_with_env(*n, nullptr, nullptr);
  const int64_t V = n->cfg.text.vocab_size, B = 3, R = 8;
  VerifyBench vb(*m, n->cfg, B, R, 0);
  for (bool graphs : {false, true}) {
    const StepOut o = vb.step(graphs);
    // step() restored the slots but the logits of the step are still the model's: all rows, then a sub-range.
    std::vector<int32_t> dev(size_t(B * R), -7), sub(size_t(R), -7);
    m->greedy_rows(0, B * R, dev.data());
    m->greedy_rows(R, R, sub.data());
    for (int64_t r = 0; r < B * R; ++r)
      EXPECT_EQ(dev[size_t(r)], host_argmax(o.logits.data() + r * V, V)) << "row " << r << " graphs " << graphs;
    for (int64_t r = 0; r < R; ++r) EXPECT_EQ(sub[size_t(r)], dev[size_t(R + r)]) << "sub-range row " << r;
    // verify_greedy on the device ids and on the host ids: drafts that agree for two tokens, then differ.
    for (int64_t s = 0; s < B; ++s) {
      std::vector<int32_t> host(static_cast<size_t>(R)), draft(static_cast<size_t>(R - 1));
      for (int64_t r = 0; r < R; ++r) host[size_t(r)] = host_argmax(o.logits.data() + (s * R + r) * V, V);
      for (int64_t i = 0; i < R - 1; ++i) draft[size_t(i)] = i < 2 ? host[size_t(i)] : (host[size_t(i)] + 1) % int32_t(V);
      const runtime::VerifyOutcome a =
          runtime::verify_greedy(std::span<const int32_t>(dev.data() + s * R, size_t(R)), draft);
      const runtime::VerifyOutcome b = runtime::verify_greedy(host, draft);
      EXPECT_EQ(a.accepted, b.accepted);
      EXPECT_EQ(a.next, b.next);
      EXPECT_EQ(a.accepted, 2);
    }
  }
  EXPECT_THROW(m->greedy_rows(B * R - 1, 2, nullptr), std::exception);
}

}  // namespace
}  // namespace kestrel::gputest
