// DSpark speculation on the GPU (issue #19; docs/speculative.md "The serving engine (GPU)"), on the nano
// checkpoint of KESTREL_GPU_CKPTS (the first directory with hidden size 256) and its random draft:
// KESTREL_GPU_DSPARK, else "<that directory>-dspark" (python3 reference/make_draft.py --config nano --out DIR
// --seed 1; bench/gpu/run.sh spec makes both).
//  1. GpuSpec.VerifyRowsTapsAndKeep (the model): the taps of a GPU prefill against the CPU model's taps; a
//     verify sequence [t0..t3] gives the logits and taps the four one-token decodes of the same tokens give
//     (same kernels row by row: the argmax equal except at near ties, rel L2 ≤ 1e-2); keep_verified(t = 1)
//     leaves the state of "decoded t0, t1" — decoding t2, t3 next gives the decodes' rows again — while a keep
//     at the wrong position (t = 3) is measurably off (the test can fail).
//  2. GpuSpec.BatchedGreedyEqualsNoSpeculation (the engine): five requests (two share a 48-token prefix:
//     prefix-cache hits; one wants logprobs: served without speculation) on the GPU engine without speculation
//     (the reference, every row's logits kept), then with the random draft at γ = 2 and 4 and a page pool of 8
//     pages (preemption). Every request gets the reference tokens; the GPU path is not batch invariant (the
//     verify steps stack more rows than the plain decodes: the MoE and attention kernels plan by row count,
//     a pure one-token step runs KDA's fused kernel; the projections are kept row invariant: the model runs
//     the skinny GEMM up to 64 rows), so a divergence is allowed only where the reference logits' top two
//     are within 1% of max |logit|, reported (the bound of GpuEngine.BatchedStaggeredMatchesSoloAndCpu). The
//     caches' bookkeeping must be intact.
//  3. GpuSpec.AnAgreeingDraftIsAcceptedWhole: SpecServing::oracle proposes the reference tokens: every draft
//     token is accepted (where the run kept the reference tokens), and the tokens are the reference's.
//  0. GpuSpec.TracedKdaKernelsEqualPerTokenLaunches: kda_decode_traced / kda_conv_decode_traced (one launch over
//     several requests' runs of tokens) give bit for bit the outputs, final states and per-token states of one
//     kda_decode / kda_conv_decode launch per token followed by a copy of the slot (no checkpoint needed).
//  4. GpuSpec.DraftOpsMatchTwins: the draft's own kernels (kernels/cuda/dspark.h) against their CPU twins,
//     and their batched forms (per-row RoPE positions, the varlen attention) bit for bit against the
//     per-request ones.
//  5. GpuSpec.DraftMatchesCpuTwin: the GPU draft (model/cuda/dspark.h) injected with the GPU target's taps of a
//     prompt gives the base logits of the CPU draft (model::Draft) injected with the same taps (rel L2 ≤ 2e-2),
//     and the same greedy draft tokens except at near ties; its greedy chain on the device (greedy_tokens) gives
//     exactly the host chain's tokens over the GPU base logits.
//  6. GpuSpec.BatchedDraftEqualsPerRequest: the batched draft (inject_batch, base_logits_batch,
//     greedy_tokens_batch) over B = 3, 5 requests of different context lengths at once gives bit for bit the
//     base logits and tokens of B = 1 calls made one request at a time (the per-request calls are the batched
//     code with B = 1, so this checks that a request's rows do not depend on the others in its batch: the
//     varlen attention's key ranges, the per-row positions, the stacked index arrays); the same tokens through
//     its CUDA graphs (captured, replayed with other requests of the same shape).
// Tests 2 and 3 run with the draft on the host and on the GPU (CudaExecutorOptions::draft_on_gpu).
// About 720 lines, past the ~600 guide: the seven tests share this file's checkpoint and draft loading, the
// CPU-twin helpers and the engine runner, which a split would have to copy or export.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cache/layout.h"
#include "harness.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dspark.h"
#include "kernels/cuda/kda.h"
#include "loader/config.h"
#include "loader/dspark.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/dspark.h"
#include "model/dspark.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/executor_cuda.h"

namespace kestrel::gputest {
namespace {

// The nano target, its random draft and the draft bound to it, loaded once.
struct SpecSetup {
  std::string dir, draft_dir;
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt, draft_ckpt;
  ModelWeights w;
  DraftConfig dcfg;
  DraftWeights dw;
  std::unique_ptr<model::Draft> draft;
  std::unique_ptr<model::CudaModel> gm;
};

const SpecSetup* setup() {
  static SpecSetup* s = [] () -> SpecSetup* {
    for (const std::string& d : gpu_ckpt_dirs()) {
      auto* p = new SpecSetup;
      p->cfg = load_config(d);
      if (p->cfg.text.hidden_size != 256) {
        delete p;
        continue;
      }
      p->dir = d;
      const char* e = std::getenv("KESTREL_GPU_DSPARK");
      p->draft_dir = e ? e : d + "-dspark";
      p->ckpt = std::make_unique<Checkpoint>(d);
      p->w = bind_weights(p->cfg, *p->ckpt);
      p->dcfg = load_draft_config(p->draft_dir, p->cfg);
      p->draft_ckpt = std::make_unique<Checkpoint>(p->draft_dir);
      p->dw = bind_draft_weights(p->dcfg, *p->draft_ckpt);
      p->draft = std::make_unique<model::Draft>(p->dcfg, p->dw, p->w);
      // The skinny GEMM for every projection of up to 64 rows (linear.h; it is row invariant there), so a
      // verify step's stacked rows and a plain decode step's see the same GEMM arithmetic; read once by the
      // model's constructor, then the environment is put back for the other tests of the binary.
      const char* old = std::getenv("KESTREL_SKINNY_MAX_T");
      const std::string keep = old ? old : "";
      setenv("KESTREL_SKINNY_MAX_T", "64", 1);
      p->gm = std::make_unique<model::CudaModel>(p->cfg, p->w);
      if (old) setenv("KESTREL_SKINNY_MAX_T", keep.c_str(), 1);
      else unsetenv("KESTREL_SKINNY_MAX_T");
      return p;
    }
    return static_cast<SpecSetup*>(nullptr);
  }();
  return s;
}

#define REQUIRE_SETUP(s)                                                                                    \
  ASSERT_TRUE((s) != nullptr) << "KESTREL_GPU_CKPTS holds no nano checkpoint (hidden 256): run through "   \
                                 "bench/gpu/run.sh spec (the draft: KESTREL_GPU_DSPARK or <nano>-dspark)"

int32_t argmax(const float* x, int64_t V) { return int32_t(std::max_element(x, x + V) - x); }
std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_f32(b[i]);
  return f;
}

TEST(GpuSpec, VerifyRowsTapsAndKeep) {
  const SpecSetup* S = setup();
  REQUIRE_SETUP(S);
  const ModelConfig& cfg = S->cfg;
  model::CudaModel& gm = *S->gm;
  const int64_t V = cfg.text.vocab_size, W = S->dcfg.tap_width(), P = 21, G = 4;
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < P; ++i) prompt.push_back(int32_t((i * 7919 + 13) % std::min<int64_t>(V, 1000)));
  gm.set_taps(S->dcfg.target_layer_ids);
  const int page = 16;
  auto cache = gm.new_cache(8, 2, CacheFormats{page, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
  const std::vector<int32_t> ta{0, 1, 2, 3}, tb{4, 5, 6, 7};  // slot 0 / slot 1
  auto fwd = [&](std::span<const int32_t> toks, int64_t pos0, int32_t slot, const std::vector<int32_t>& table,
                 model::CudaSeq::Logits which, bool verify, std::vector<float>& logits, std::vector<uint16_t>& taps) {
    model::CudaSeq q{toks, pos0, slot, table, which};
    q.verify = verify;
    const int64_t rows = gm.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
    logits.resize(size_t(rows * V));
    gm.copy_logits(logits.data());
    taps.resize(size_t(int64_t(toks.size()) * W));
    gm.copy_taps(0, int64_t(toks.size()), taps.data());
  };
  std::vector<float> lg;
  std::vector<uint16_t> tp;

  // Prefill on slot 0: taps against the CPU model (BF16 noise of the target layers on both sides).
  fwd(prompt, 0, 0, ta, model::CudaSeq::Logits::last, false, lg, tp);
  {
    model::State st(cfg);
    model::Bf16Vec cpu_taps(size_t(P * W));
    model::ForwardOptions opt;
    opt.tap_layers = S->dcfg.target_layer_ids;
    opt.taps_out = cpu_taps.data();
    std::vector<float> cl(size_t(P * V));
    model::prefill(S->w, cfg, st, prompt, cl.data(), opt);
    const auto g = widen(tp), c = widen(std::vector<uint16_t>(cpu_taps.begin(), cpu_taps.end()));
    const double e = rel_l2(g.data(), c.data(), P * W);
    note(fmt::format("{:<28} {:<34} rel L2 {:.2e} (tol 3e-2)", "taps GPU vs CPU", "nano prefill", e));
    EXPECT_LT(e, 3e-2) << "GPU taps differ from the CPU model's";
  }
  // Decodes t0..t3 on slot 0 (greedy): the reference rows and taps.
  std::vector<int32_t> t{argmax(lg.data(), V)};
  std::vector<float> dec_lg;        // f32 [G, V]
  std::vector<uint16_t> dec_taps;  // bf16 [G, W]
  for (int64_t j = 0; j < G; ++j) {
    fwd(std::span<const int32_t>(&t[size_t(j)], 1), P + j, 0, ta, model::CudaSeq::Logits::last, false, lg, tp);
    dec_lg.insert(dec_lg.end(), lg.begin(), lg.end());
    dec_taps.insert(dec_taps.end(), tp.begin(), tp.end());
    t.push_back(argmax(lg.data(), V));
  }
  t.resize(size_t(G));
  // Slot 1: the same prefill, then ONE verify forward over t0..t3.
  auto verify_from_scratch = [&](std::vector<float>& vlg, std::vector<uint16_t>& vtaps) {
    gm.zero_slot(*cache, 1);
    fwd(prompt, 0, 1, tb, model::CudaSeq::Logits::last, false, lg, tp);
    fwd(t, P, 1, tb, model::CudaSeq::Logits::all, true, vlg, vtaps);
  };
  std::vector<float> vlg;
  std::vector<uint16_t> vtaps;
  verify_from_scratch(vlg, vtaps);
  ASSERT_EQ(vlg.size(), size_t(G * V));
  for (int64_t j = 0; j < G; ++j) {
    const float* a = dec_lg.data() + j * V;
    const double e = rel_l2(vlg.data() + j * V, a, V);
    note(fmt::format("{:<28} {:<34} rel L2 {:.2e} (tol 1e-2)", "verify row vs decode", fmt::format("nano row {}", j), e));
    EXPECT_LT(e, 1e-2) << "verify row " << j;
    if (argmax(vlg.data() + j * V, V) != argmax(a, V)) {
      EXPECT_LT(rel_gap(a, V), 1e-2) << "verify row " << j << ": another argmax where the decode's is no near tie";
    }
  }
  {
    const auto g = widen(vtaps), r = widen(dec_taps);
    EXPECT_LT(rel_l2(g.data(), r.data(), G * W), 1e-2) << "the verify rows' taps differ from the decodes'";
  }
  // Keep position 1 (t0, t1 accepted), decode t2 and t3 after it: the decodes' rows 2 and 3.
  gm.keep_verified(*cache, 0, 1);
  double err_keep = 0;
  for (int64_t j = 2; j < G; ++j) {
    fwd(std::span<const int32_t>(&t[size_t(j)], 1), P + j, 1, tb, model::CudaSeq::Logits::last, false, lg, tp);
    err_keep = std::max(err_keep, rel_l2(lg.data(), dec_lg.data() + j * V, V));
  }
  // The same with the state kept at the wrong position (after t3): row 2 must be off by much more.
  verify_from_scratch(vlg, vtaps);
  gm.keep_verified(*cache, 0, 3);
  fwd(std::span<const int32_t>(&t[2], 1), P + 2, 1, tb, model::CudaSeq::Logits::last, false, lg, tp);
  const double err_wrong = rel_l2(lg.data(), dec_lg.data() + 2 * V, V);
  note(fmt::format("{:<28} {:<34} rel L2 {:.2e} (tol 1e-2); wrong position {:.2e}", "keep_verified then decode",
                   "nano t = 1", err_keep, err_wrong));
  EXPECT_LT(err_keep, 1e-2) << "decoding after keep_verified(1) should continue the decodes";
  EXPECT_GT(err_wrong, 4 * err_keep + 1e-4) << "a keep at the wrong position should be visible";
  gm.set_taps({});
}

TEST(GpuSpec, TracedKdaKernelsEqualPerTokenLaunches) {
  Rng r(7);
  const int64_t H = 2, W = 4, slots_n = 6, row0 = 2;  // rows 0, 1 belong to no request (decodes before)
  const std::vector<int32_t> cu{2, 5, 6, 11}, slots{4, 0, 2};  // three requests of 3, 1 and 5 tokens
  const int64_t B = 3, T = cu.back();
  std::vector<int32_t> iota(size_t(T + 1));
  std::iota(iota.begin(), iota.end(), 0);
  auto dcu = upload(cu), dslots = upload(slots), diota = upload(iota);
  for (int64_t Dk : {int64_t(32), int64_t(64), int64_t(128)}) {
    const int64_t HD = H * Dk, Se = H * Dk * Dk;
    const std::string shape = fmt::format("H={} Dk={} runs 3,1,5", H, Dk);
    // Step 6: the recurrent scan.
    const auto q = rand_f32(size_t(T * HD), r, -0.2f, 0.2f), k = rand_f32(size_t(T * HD), r, -0.2f, 0.2f);
    const auto v = rand_f32(size_t(T * HD), r, -1.0f, 1.0f), g = rand_f32(size_t(T * HD), r, -0.5f, 0.0f);
    const auto beta = rand_f32(size_t(T * H), r, 0.0f, 1.0f), pool0 = rand_f32(size_t(slots_n * Se), r, -0.5f, 0.5f);
    auto dq = upload(q), dk = upload(k), dv = upload(v), dg = upload(g), db = upload(beta);
    auto pa = upload(pool0), pb = upload(pool0);
    auto oa = poisoned<float>(size_t(T * HD)), ob = poisoned<float>(size_t(T * HD));
    auto ta = poisoned<float>(size_t((T - row0) * Se)), tb = poisoned<float>(size_t((T - row0) * Se));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = cu[size_t(b)]; t < cu[size_t(b) + 1]; ++t) {
        cuda::kda_decode(dq.p(), dk.p(), dv.p(), dg.p(), HD, db.p(), H, diota.p() + t, dslots.p() + b, pa.p(), oa.p(),
                         1, H, Dk, nullptr);
        KCUDA_CHECK(cudaMemcpyAsync(ta.p() + (t - row0) * Se, pa.p() + int64_t(slots[size_t(b)]) * Se,
                                    size_t(Se) * 4, cudaMemcpyDeviceToDevice, nullptr));
      }
    cuda::kda_decode_traced(dq.p(), dk.p(), dv.p(), dg.p(), HD, db.p(), H, dcu.p(), dslots.p(), pb.p(), ob.p(), B, H,
                            Dk, tb.p(), row0, nullptr);
    sync();
    const auto oa_h = oa.get(), ob_h = ob.get();
    check_exact("kda_decode_traced o", shape, ob_h.data() + row0 * HD, oa_h.data() + row0 * HD,
                size_t((T - row0) * HD) * 4);
    check_exact("kda_decode_traced state", shape, pb.get().data(), pa.get().data(), size_t(slots_n * Se) * 4);
    check_exact("kda_decode_traced trace", shape, tb.get().data(), ta.get().data(), size_t((T - row0) * Se) * 4);
    // Step 2: the short conv over q|k|v.
    const int64_t C = 3 * HD, Ce = (W - 1) * C;
    const auto x = rand_bf16(size_t(T * C), r, -1.0f, 1.0f), h0 = rand_bf16(size_t(slots_n * Ce), r, -1.0f, 1.0f);
    const auto w = rand_f32(size_t(C * W), r, -0.5f, 0.5f);
    auto dx = upload(x), ha = upload(h0), hb = upload(h0);
    auto dw = upload(w);
    auto ya = poisoned<uint16_t>(size_t(T * C)), yb = poisoned<uint16_t>(size_t(T * C));
    auto ca = poisoned<uint16_t>(size_t((T - row0) * Ce)), cb = poisoned<uint16_t>(size_t((T - row0) * Ce));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = cu[size_t(b)]; t < cu[size_t(b) + 1]; ++t) {
        cuda::kda_conv_decode(dx.p() + t * C, C, dw.p(), ha.p(), dslots.p() + b, ya.p() + t * C, C, 1, C, W, nullptr);
        KCUDA_CHECK(cudaMemcpyAsync(ca.p() + (t - row0) * Ce, ha.p() + int64_t(slots[size_t(b)]) * Ce, size_t(Ce) * 2,
                                    cudaMemcpyDeviceToDevice, nullptr));
      }
    cuda::kda_conv_decode_traced(dx.p(), C, dw.p(), hb.p(), dcu.p(), dslots.p(), yb.p(), C, B, C, W, cb.p(), row0,
                                 nullptr);
    sync();
    const auto ya_h = ya.get(), yb_h = yb.get();
    check_exact("kda_conv_decode_traced y", shape, yb_h.data() + row0 * C, ya_h.data() + row0 * C,
                size_t((T - row0) * C) * 2);
    check_exact("kda_conv_decode_traced history", shape, hb.get().data(), ha.get().data(), size_t(slots_n * Ce) * 2);
    check_exact("kda_conv_decode_traced trace", shape, cb.get().data(), ca.get().data(), size_t((T - row0) * Ce) * 2);
  }
}

// ---- the engine ------------------------------------------------------------------------------------------

std::vector<int32_t> random_prompt(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& x : p) x = int32_t(rng() % 768);  // ordinary ids, never EOS
  return p;
}

struct Case {
  std::vector<int32_t> prompt;
  int32_t max_tokens;
  bool logprobs = false;  // served without speculation
};

// As tests/unit/test_spec_engine.cpp: two requests share a 48-token prefix (a prefix-cache hit for the later).
std::vector<Case> cases() {
  const std::vector<int32_t> shared = random_prompt(48, 5);
  std::vector<int32_t> a = shared, b = shared;
  a.insert(a.end(), {11, 12, 13});
  b.insert(b.end(), {21, 22});
  return {{a, 14}, {random_prompt(37, 6), 12}, {b, 13}, {random_prompt(20, 7), 15, true}, {random_prompt(9, 8), 11}};
}

struct SpecRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;  // per request f32 [positions, V] (want_logits)
  EngineStats stats;
  IntegrityReport integrity;
};

// The first case alone (it fills the prefix cache), then the rest together, on a GPU engine.
SpecRun run_gpu(const SpecSetup& S, const std::vector<Case>& cs, std::optional<runtime::SpecServing> spec, int pages,
                bool want_logits, bool draft_on_gpu = false) {
  runtime::EngineConfig ec;
  ec.formats.block_size = 16;
  ec.max_running = 4;
  ec.checkpoint_slots = 4;
  ec.max_num_batched_tokens = 64;
  const cache::CacheLayout l = cache::CacheLayout::from_config(S.cfg.text, ec.formats);
  ec.memory_budget = l.total_state_bytes(ec.max_running + ec.checkpoint_slots) + l.total_page_bytes(pages);
  ec.speculative = spec;
  ec.executor_speculates = true;
  model::CudaModel* gm = S.gm.get();
  const ModelConfig* cp = &S.cfg;
  ec.make_executor = [gm, cp, spec, draft_on_gpu](const CacheFormats& f, const cache::CacheConfig& cc) {
    runtime::CudaExecutorOptions eo;
    eo.speculative = spec;
    eo.draft_on_gpu = draft_on_gpu;
    return std::unique_ptr<runtime::StepExecutor>(std::make_unique<runtime::CudaExecutor>(*gm, *cp, f, cc, eo));
  };
  runtime::Engine e(S.w, S.cfg, ec);
  SpecRun out;
  out.tokens.resize(cs.size());
  out.logits.resize(cs.size());
  std::mutex mu;
  std::string error;
  auto submit = [&](size_t i) {
    Request r;
    r.prompt = cs[i].prompt;
    r.max_tokens = cs[i].max_tokens;
    r.ignore_eos = true;
    if (cs[i].logprobs) r.sampling.logprobs = 2;
    if (want_logits)
      r.on_logits = [&out, i](int64_t, std::span<const float> row) {
        out.logits[i].insert(out.logits[i].end(), row.begin(), row.end());
      };
    e.submit(std::move(r), [&, i](const TokenEvent& ev) {
      std::lock_guard<std::mutex> lk(mu);
      if (ev.token >= 0) out.tokens[i].push_back(ev.token);
      if (ev.finish == FinishReason::error) error = ev.error;
    });
  };
  submit(0);
  e.wait_idle();
  for (size_t i = 1; i < cs.size(); ++i) submit(i);
  e.wait_idle();
  EXPECT_EQ(error, "");
  out.integrity = e.check_integrity();
  out.stats = e.stats();
  for (size_t i = 0; i < cs.size(); ++i) EXPECT_EQ(out.tokens[i].size(), size_t(cs[i].max_tokens)) << "request " << i;
  return out;
}

// Every request's tokens equal the reference's, or differ first where the reference logits are a near tie.
// Returns the number of requests equal throughout.
int compare_to_reference(const std::vector<Case>& cs, const SpecRun& ref, const SpecRun& got, int64_t V,
                         const std::string& what) {
  int equal = 0;
  for (size_t i = 0; i < cs.size(); ++i) {
    const auto& a = ref.tokens[i];
    const auto& b = got.tokens[i];
    size_t d = 0;
    while (d < a.size() && d < b.size() && a[d] == b[d]) ++d;
    if (d == a.size() && a.size() == b.size()) {
      ++equal;
      continue;
    }
    const int64_t row = int64_t(cs[i].prompt.size()) - 1 + int64_t(d);
    if (size_t((row + 1) * V) > ref.logits[i].size()) {
      ADD_FAILURE() << what << " request " << i << ": no reference logits for position " << row;
      continue;
    }
    const double gap = rel_gap(ref.logits[i].data() + row * V, V);
    note(fmt::format("  {} request {}: differs from no speculation at output {} (top-2 gap {:.2e} of max|logit|)",
                     what, i, d, gap));
    EXPECT_LE(gap, 1e-2) << what << " request " << i << ": tokens differ from no speculation at output " << d
                         << " where the reference logits are no near tie";
  }
  return equal;
}

TEST(GpuSpec, BatchedGreedyEqualsNoSpeculation) {
  const SpecSetup* S = setup();
  REQUIRE_SETUP(S);
  const auto cs = cases();
  const int64_t V = S->cfg.text.vocab_size;
  const SpecRun ref = run_gpu(*S, cs, std::nullopt, 64, true);
  for (auto [gamma, on_gpu] : {std::pair{2, false}, std::pair{4, false}, std::pair{4, true}}) {  // nano: 4-token blocks
    runtime::SpecServing s;
    s.draft = S->draft.get();
    s.num_speculative_tokens = gamma;
    // 8 pages of 16 tokens: the four later requests need up to 4 pages each, so some are preempted.
    const SpecRun got = run_gpu(*S, cs, s, 8, false, on_gpu);
    const std::string what = fmt::format("gamma {}, draft on the {}", gamma, on_gpu ? "GPU" : "host");
    const int equal = compare_to_reference(cs, ref, got, V, what);
    const EngineStats& st = got.stats;
    note(fmt::format("{:<28} {:<34} {}/{} requests equal; {} drafts, {} draft tokens, {} accepted, {} preemptions, "
                     "{} prefix-hit tokens", "engine speculative (GPU)", what, equal, cs.size(), st.spec_drafts,
                     st.spec_draft_tokens, st.spec_accepted_tokens, st.preemptions, st.prefix_hit_tokens));
    EXPECT_GT(st.spec_drafts, 0);
    EXPECT_LE(st.spec_draft_tokens, st.spec_drafts * gamma);
    EXPECT_LT(st.spec_accepted_tokens, st.spec_draft_tokens) << "a random draft should be rejected sometimes";
    EXPECT_GT(st.preemptions, 0) << "the small page pool was meant to force preemption";
    EXPECT_GT(st.prefix_hit_tokens, 0);
    EXPECT_EQ(st.generation_tokens, 14 + 12 + 13 + 15 + 11);
    EXPECT_EQ(got.integrity.pages_held, 0);
    EXPECT_EQ(got.integrity.slots_free + got.integrity.checkpoints, got.integrity.slots_total);
  }
}

TEST(GpuSpec, AnAgreeingDraftIsAcceptedWhole) {
  const SpecSetup* S = setup();
  REQUIRE_SETUP(S);
  auto cs = cases();
  cs.resize(3);
  const int64_t V = S->cfg.text.vocab_size;
  const SpecRun ref = run_gpu(*S, cs, std::nullopt, 64, true);
  runtime::SpecServing s;
  s.draft = S->draft.get();
  s.num_speculative_tokens = 4;
  // Engine ids are 1, 2, ... in submission order: request id k is case k − 1.
  const auto* toks = &ref.tokens;
  s.oracle = [toks](RequestId id, int64_t j) -> int32_t {
    const auto& p = toks->at(size_t(id - 1));
    return j < int64_t(p.size()) ? p[size_t(j)] : -1;
  };
  for (bool on_gpu : {false, true}) {
    const SpecRun got = run_gpu(*S, cs, s, 64, false, on_gpu);
    const std::string what = fmt::format("oracle draft, draft on the {}", on_gpu ? "GPU" : "host");
    const int equal = compare_to_reference(cs, ref, got, V, what);
    const EngineStats& st = got.stats;
    note(fmt::format("{:<28} {:<34} {}/{} requests equal; {} drafts, {} draft tokens, {} accepted",
                     "engine agreeing draft (GPU)", what, equal, cs.size(), st.spec_drafts, st.spec_draft_tokens,
                     st.spec_accepted_tokens));
    EXPECT_GT(st.spec_drafts, 0) << what;
    // With the reference tokens kept throughout (no near-tie divergence), every proposal is accepted; a near
    // tie that flips a token (allowed above) costs at most the rest of that request's proposals.
    if (equal == int(cs.size())) {
      EXPECT_EQ(st.spec_accepted_tokens, st.spec_draft_tokens) << what;
    }
    EXPECT_GE(st.spec_accepted_tokens * 10, st.spec_draft_tokens * 7) << what << ": the agreeing draft was mostly rejected";
  }
}

// ---- the draft on the GPU --------------------------------------------------------------------------------

TEST(GpuSpec, DraftOpsMatchTwins) {
  Rng r(19);
  const int64_t T = 4, Hm = 4, N = 32, R = 16, Dv = 32, C = 64, QK = N + R, CW = C + R;
  // Interleaved RoPE over the rope dims of every head of q (nano draft's YaRN table).
  const SpecSetup* S = setup();
  REQUIRE_SETUP(S);
  const model::DraftRope& rope = S->draft->rope;
  ASSERT_EQ(int64_t(rope.inv_freq.size()) * 2, R) << "the nano draft's rope dims changed";
  {
    std::vector<uint16_t> q = rand_bf16(size_t(T * Hm * QK), r, -2.0f, 2.0f), ref = q;
    for (int64_t h = 0; h < Hm; ++h) model::rope_interleaved(rope, ref.data() + h * QK + N, Hm * QK, T, 37, R);
    auto dq = upload(q);
    auto dinv = upload(rope.inv_freq);
    cuda::dspark_rope_interleaved(dq.p() + N, Hm * QK, T, Hm, QK, 37, dinv.p(), rope.cos_sin_mul, R, nullptr);
    sync();
    check_bf16("dspark_rope_interleaved", "T=4 Hm=4 R=16 pos0=37", dq.get(), ref, Tol{1e-2, 1.0 / 128, 4e-3});
  }
  // Non-causal attention over S keys (context + block).
  for (int64_t Skeys : {int64_t(5), int64_t(300)}) {
    const float scale = rope.softmax_scale;
    std::vector<uint16_t> q = rand_bf16(size_t(T * Hm * QK), r, -1.0f, 1.0f);
    std::vector<uint16_t> kv = rand_bf16(size_t(Skeys * Hm * (N + Dv)), r, -1.0f, 1.0f);
    std::vector<uint16_t> lat = rand_bf16(size_t(Skeys * CW), r, -1.0f, 1.0f);
    std::vector<uint16_t> ref(size_t(T * Hm * Dv));
    model::draft_attend(Hm, N, R, Dv, C, scale, q.data(), kv.data(), lat.data(), T, Skeys, ref.data());
    auto dq = upload(q), dkv = upload(kv), dl = upload(lat);
    auto scratch = poisoned<float>(size_t(T * Hm * Skeys));
    auto o = poisoned<uint16_t>(size_t(T * Hm * Dv));
    cuda::dspark_attend(dq.p(), dkv.p(), dl.p(), T, Skeys, Hm, N, R, Dv, C, scale, scratch.p(), o.p(), nullptr);
    sync();
    check_bf16("dspark_attend", fmt::format("T=4 S={} Hm=4", Skeys), o.get(), ref, Tol{2e-3, 1.0 / 128, 4e-3});
  }
  // The batched forms against the per-request ones, bit for bit: RoPE at per-row positions (two requests'
  // rows at 37.. and 5..) and the attention varlen over two requests' keys (5 and 300: their rows stacked,
  // their keys concatenated, the second at an offset).
  {
    std::vector<uint16_t> q = rand_bf16(size_t(2 * T * Hm * QK), r, -2.0f, 2.0f);
    auto one = upload(q), both = upload(q);
    auto dinv = upload(rope.inv_freq);
    std::vector<int32_t> pos;
    for (int64_t t = 0; t < T; ++t) pos.push_back(int32_t(37 + t));
    for (int64_t t = 0; t < T; ++t) pos.push_back(int32_t(5 + t));
    auto dpos = upload(pos);
    cuda::dspark_rope_interleaved(one.p() + N, Hm * QK, T, Hm, QK, 37, dinv.p(), rope.cos_sin_mul, R, nullptr);
    cuda::dspark_rope_interleaved(one.p() + T * Hm * QK + N, Hm * QK, T, Hm, QK, 5, dinv.p(), rope.cos_sin_mul, R,
                                  nullptr);
    cuda::dspark_rope_interleaved(both.p() + N, Hm * QK, 2 * T, Hm, QK, 0, dinv.p(), rope.cos_sin_mul, R, nullptr,
                                  dpos.p());
    sync();
    EXPECT_EQ(both.get(), one.get()) << "dspark_rope_interleaved with per-row positions";
    const int64_t S1 = 5, S2 = 300, Sk = S1 + S2;
    std::vector<uint16_t> kv = rand_bf16(size_t(Sk * Hm * (N + Dv)), r, -1.0f, 1.0f);
    std::vector<uint16_t> lat = rand_bf16(size_t(Sk * CW), r, -1.0f, 1.0f);
    auto dq = upload(q), dkv = upload(kv), dl = upload(lat);
    auto scratch = poisoned<float>(size_t(2 * T * Hm * (Sk + 7)));  // ≥ f32 [2T, Hm, S2 + 7]
    auto o1 = poisoned<uint16_t>(size_t(2 * T * Hm * Dv)), o2 = poisoned<uint16_t>(size_t(2 * T * Hm * Dv));
    const float scale = rope.softmax_scale;
    cuda::dspark_attend(dq.p(), dkv.p(), dl.p(), T, S1, Hm, N, R, Dv, C, scale, scratch.p(), o1.p(), nullptr);
    cuda::dspark_attend(dq.p() + T * Hm * QK, dkv.p() + S1 * Hm * (N + Dv), dl.p() + S1 * CW, T, S2, Hm, N, R, Dv, C,
                        scale, scratch.p(), o1.p() + T * Hm * Dv, nullptr);
    std::vector<int32_t> kbeg(size_t(2 * T), 0), klen(size_t(2 * T), int32_t(S1));
    for (int64_t t = T; t < 2 * T; ++t) kbeg[size_t(t)] = int32_t(S1), klen[size_t(t)] = int32_t(S2);
    auto dkb = upload(kbeg), dkl = upload(klen);
    cuda::dspark_attend_varlen(dq.p(), dkv.p(), dl.p(), 2 * T, dkb.p(), dkl.p(), S2 + 7, Hm, N, R, Dv, C, scale,
                               scratch.p(), o2.p(), nullptr);
    sync();
    EXPECT_EQ(o2.get(), o1.get()) << "dspark_attend_varlen against one dspark_attend per request";
  }
  // SwiGLU.
  {
    const size_t n = 1000;
    std::vector<uint16_t> g = rand_bf16(n, r, -4.0f, 4.0f), u = rand_bf16(n, r, -2.0f, 2.0f), ref(n);
    for (size_t i = 0; i < n; ++i) {
      const float x = bf16_to_f32(g[i]);
      ref[i] = f32_to_bf16(x * (1.0f / (1.0f + std::exp(-x))) * bf16_to_f32(u[i]));
    }
    auto dg = upload(g), du = upload(u);
    auto a = poisoned<uint16_t>(n);
    cuda::dspark_swiglu(dg.p(), du.p(), a.p(), int64_t(n), nullptr);
    sync();
    check_bf16("dspark_swiglu", "n=1000", a.get(), ref, Tol{1e-2, 1.0 / 128, 4e-3});
  }
}

TEST(GpuSpec, DraftMatchesCpuTwin) {
  const SpecSetup* S = setup();
  REQUIRE_SETUP(S);
  const ModelConfig& cfg = S->cfg;
  const model::Draft& draft = *S->draft;
  const int64_t V = cfg.text.vocab_size, W = S->dcfg.tap_width(), Nb = S->dcfg.block_size, ctx = 29;
  model::CudaModel& gm = *S->gm;
  // The target's taps of a prompt, from the GPU forward.
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < ctx + 1; ++i) prompt.push_back(int32_t((i * 613 + 7) % std::min<int64_t>(V, 1000)));
  gm.set_taps(S->dcfg.target_layer_ids);
  const int page = 16;
  auto cache = gm.new_cache(4, 1, CacheFormats{page, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
  const std::vector<int32_t> table{2, 0, 3};  // not in order: the pools go through the block table
  {
    const model::CudaSeq q{std::span<const int32_t>(prompt.data(), size_t(ctx)), 0, 0, table,
                           model::CudaSeq::Logits::last};
    gm.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
  }
  std::vector<uint16_t> taps(size_t(ctx * W));  // bf16 [ctx, n·Dt]
  gm.copy_taps(0, ctx, taps.data());
  gm.set_taps({});
  // CPU: inject, block, base logits.
  model::DraftState ds(S->dcfg);
  const auto views = ds.views(draft.mla_cfg, ctx + Nb);
  draft.inject(views, 0, taps.data(), ctx);
  std::vector<int32_t> blk(size_t(Nb), S->dcfg.mask_token_id);
  blk[0] = prompt[size_t(ctx)];
  model::Bf16Vec hn(size_t(Nb * S->dcfg.hidden_size));
  draft.block(views, ctx, blk, hn.data());
  std::vector<float> cpu_base(size_t(Nb * V)), gpu_base(size_t(Nb * V));
  draft.base_logits(hn.data(), Nb, cpu_base.data());
  // GPU: the same taps injected in two calls (as two steps would), then the block.
  std::unique_ptr<model::CudaDraft> gd = gm.new_draft(draft, 4, page);
  gd->inject_host(table, 0, taps.data(), 17);
  gd->inject_host(table, 17, taps.data() + 17 * W, ctx - 17);
  gd->base_logits(table, ctx, blk, gpu_base.data());
  const double e = rel_l2(gpu_base.data(), cpu_base.data(), Nb * V);
  note(fmt::format("{:<28} {:<34} rel L2 {:.2e} (tol 2e-2)", "GPU draft base logits", fmt::format("nano ctx {}", ctx), e));
  EXPECT_LT(e, 2e-2);
  // The greedy chain on both.
  auto greedy = [&](const std::vector<float>& base) {
    std::vector<int32_t> toks(static_cast<size_t>(Nb));
    std::vector<double> gaps;
    draft.draft_from_base(base.data(), blk[0], 0, [&](int, std::span<const float> lg) {
      gaps.push_back(rel_gap(lg.data(), int64_t(lg.size())));
      return argmax(lg.data(), int64_t(lg.size()));
    }, toks.data());
    return std::pair{toks, gaps};
  };
  const auto [ct, cgaps] = greedy(cpu_base);
  const auto [gt, ggaps] = greedy(gpu_base);
  for (int64_t i = 0; i < Nb; ++i) {
    if (ct[size_t(i)] == gt[size_t(i)]) continue;
    EXPECT_LT(cgaps[size_t(i)], 1e-2) << "draft token " << i << " differs where the CPU draft's logits are no near tie";
    break;  // later tokens follow another chain
  }
  // The greedy chain on the device (CudaDraft::greedy_tokens, the executor's greedy path): from the same GPU
  // base logits, the host chain's bits, so exactly the host chain's tokens — all Nb, and a shorter run.
  std::vector<int32_t> dev(static_cast<size_t>(Nb), -7), dev3(3, -7);
  gd->greedy_tokens(table, ctx, blk, Nb, dev.data());
  gd->greedy_tokens(table, ctx, blk, 3, dev3.data());
  EXPECT_EQ(dev, gt) << "the device Markov chain differs from the host chain over the same base logits";
  EXPECT_EQ(dev3, std::vector<int32_t>(gt.begin(), gt.begin() + 3));
}


// The batched draft (CudaDraft::inject_batch / base_logits_batch / greedy_tokens_batch, the executor's path
// unless KESTREL_DRAFT_BATCHED=0) against one call per request on a second draft (the same code with B = 1, one
// request at a time: inject_host, base_logits, greedy_tokens): B = 1, 3, 5 requests of
// different context lengths, injected in two batched calls (as two steps would: the second at pos0 > 0, from
// taps rows further down the step's buffer), then the blocks together. Bit for bit: every op of the batched
// forward is per row or per request (RoPE at each row's position, the varlen attention over the request's own
// keys in the same order), and every GEMM here has ≤ 64 rows, where the skinny GEMM (setup() puts its bound
// at 64) gives a row the same bits whatever the row count (gemm_skinny.h "Determinism").
TEST(GpuSpec, BatchedDraftEqualsPerRequest) {
  const SpecSetup* S = setup();
  REQUIRE_SETUP(S);
  const model::Draft& draft = *S->draft;
  const int64_t V = S->cfg.text.vocab_size, W = S->dcfg.tap_width(), Nb = S->dcfg.block_size;
  const int page = 16, pages = 8;
  const std::vector<int64_t> ctx{5, 12, 1, 9, 3};    // context lengths; Σ(ctx + Nb) stays ≤ 64 rows
  const std::vector<int64_t> first{2, 7, 0, 9, 1};   // rows injected by the first call, the rest by the second
  const int64_t B = int64_t(ctx.size());
  ASSERT_LE(std::accumulate(ctx.begin(), ctx.end(), int64_t(0)) + B * Nb, 64) << "the nano draft's block grew";
  std::vector<std::vector<int32_t>> tables;                  // one page each, not in request order
  for (int64_t b = 0; b < B; ++b) tables.push_back({int32_t((3 * b + 2) % pages)});
  std::vector<int64_t> off(size_t(B), 0);                    // request b's first taps row
  for (int64_t b = 1; b < B; ++b) off[size_t(b)] = off[size_t(b - 1)] + ctx[size_t(b - 1)];
  Rng r(1919);
  const std::vector<uint16_t> taps = rand_bf16(size_t((off.back() + ctx.back()) * W), r, -2.0f, 2.0f);
  std::vector<int32_t> anchors;
  for (int64_t b = 0; b < B; ++b) anchors.push_back(int32_t((b * 977 + 31) % std::min<int64_t>(V, 1000)));

  model::CudaModel& gm = *S->gm;
  std::unique_ptr<model::CudaDraft> one = gm.new_draft(draft, pages, page), all = gm.new_draft(draft, pages, page);
  auto dtaps = upload(taps);
  std::vector<model::CudaDraft::InjectSeq> part1, part2;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t a = first[size_t(b)], o = off[size_t(b)];
    one->inject_host(tables[size_t(b)], 0, taps.data() + o * W, a);
    one->inject_host(tables[size_t(b)], a, taps.data() + (o + a) * W, ctx[size_t(b)] - a);
    part1.push_back({tables[size_t(b)], 0, o, a});
    part2.push_back({tables[size_t(b)], a, o + a, ctx[size_t(b)] - a});
  }
  all->inject_batch(part1, dtaps.p());
  all->inject_batch(part2, dtaps.p());
  // Per request: base logits f32 [Nb, V] and the Nb greedy tokens.
  std::vector<std::vector<float>> base1(size_t(B), std::vector<float>(size_t(Nb * V)));
  std::vector<std::vector<int32_t>> tok1(size_t(B), std::vector<int32_t>(size_t(Nb), -7));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> blk(size_t(Nb), S->dcfg.mask_token_id);
    blk[0] = anchors[size_t(b)];
    one->base_logits(tables[size_t(b)], ctx[size_t(b)], blk, base1[size_t(b)].data());
    one->greedy_tokens(tables[size_t(b)], ctx[size_t(b)], blk, Nb, tok1[size_t(b)].data());
  }
  for (int64_t n : {int64_t(1), int64_t(3), int64_t(5)}) {
    // The first n requests, in reverse order (the batch order is the caller's, not the tables').
    std::vector<model::CudaDraft::BlockSeq> reqs;
    for (int64_t b = n - 1; b >= 0; --b) reqs.push_back({tables[size_t(b)], ctx[size_t(b)], anchors[size_t(b)]});
    std::vector<float> base(size_t(n * Nb * V), -1.0f);
    std::vector<int32_t> toks(size_t(n * Nb), -7), toks2(size_t(n * 2), -7);
    all->base_logits_batch(reqs, base.data());
    all->greedy_tokens_batch(reqs, Nb, toks.data());
    all->greedy_tokens_batch(reqs, 2, toks2.data());
    int64_t differing = 0;
    for (int64_t k = 0; k < n; ++k) {
      const size_t b = size_t(n - 1 - k);
      const float* got = base.data() + k * Nb * V;
      for (int64_t i = 0; i < Nb * V; ++i) differing += std::memcmp(&got[i], &base1[b][size_t(i)], 4) != 0;
      EXPECT_EQ(std::vector<int32_t>(toks.begin() + k * Nb, toks.begin() + (k + 1) * Nb), tok1[b])
          << "B=" << n << " request " << b << " (ctx " << ctx[b] << "): batched greedy tokens";
      EXPECT_EQ(std::vector<int32_t>(toks2.begin() + k * 2, toks2.begin() + (k + 1) * 2),
                std::vector<int32_t>(tok1[b].begin(), tok1[b].begin() + 2))
          << "B=" << n << " request " << b << ": a shorter chain";
    }
    EXPECT_EQ(differing, 0) << "B=" << n << ": batched base logits differ bitwise from the per-request draft's";
    note(fmt::format("{:<28} {:<34} {} of {} base logits differ bitwise", "GPU batched draft",
                     fmt::format("nano B={}", n), differing, n * Nb * V));
  }
  // The same through CUDA graphs (set_graphs: one per (B, steps, bounds), the latent rows padded to 64 —
  // within the skinny GEMM, so still bit for bit): captured on first use, then replayed with other requests
  // of the same shape (other tables, contexts and anchors through the graph's fixed index buffer).
  std::unique_ptr<model::CudaDraft> grf = gm.new_draft(draft, pages, page);
  grf->set_graphs(true);
  grf->inject_batch(part1, dtaps.p());
  grf->inject_batch(part2, dtaps.p());
  auto graph_check = [&](const std::vector<int64_t>& which, int64_t steps) {
    std::vector<model::CudaDraft::BlockSeq> reqs;
    for (int64_t b : which) reqs.push_back({tables[size_t(b)], ctx[size_t(b)], anchors[size_t(b)]});
    std::vector<int32_t> toks(which.size() * size_t(steps), -7), want;
    grf->greedy_tokens_batch(reqs, steps, toks.data());
    for (int64_t b : which) want.insert(want.end(), tok1[size_t(b)].begin(), tok1[size_t(b)].begin() + steps);
    EXPECT_EQ(toks, want) << "graph draft, " << which.size() << " requests from " << which[0] << ", " << steps
                          << " steps";
  };
  for (int rep = 0; rep < 2; ++rep) {  // capture, then replay
    graph_check({0}, Nb);
    graph_check({2, 1, 0}, Nb);
    graph_check({4, 3, 2, 1, 0}, Nb);
  }
  graph_check({3}, Nb);          // B = 1 again: other table, context, anchor
  graph_check({2, 3, 4}, Nb);    // B = 3 again
  graph_check({1, 0, 4}, 2);     // a shorter chain: its own graph
  grf->set_graphs(false);
  graph_check({4, 3, 2, 1, 0}, Nb);  // eager again
  // The base logits are no constant: the requests' contexts must matter (else the test could not fail).
  EXPECT_NE(std::memcmp(base1[0].data(), base1[1].data(), size_t(Nb * V) * 4), 0);
}

}  // namespace
}  // namespace kestrel::gputest
