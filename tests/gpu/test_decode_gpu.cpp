// The fused decode path's kernels against their CPU twins (harness.h rules: random inputs, NaN-poisoned
// outputs, stated tolerances):
//  - the skinny GEMM (kernels/cuda/gemm_skinny.h) vs cpu::gemm_bf16 / gemm_bf16_f32 and an FP64 reference
//    rounded at the same point, at nano, mini and real per-rank shapes for T = 1, 2, 7, 16, 33, 64; stacked
//    segments with every epilogue; batch invariance (a token's outputs bit-identical for every T ≤ 64) and
//    run-to-run determinism (split-K without float atomics);
//  - the MoE router's top-k in the skinny GEMM's tail (GemmRoute): ids and weights bit-identical to moe_route on the
//    logits of the same launch, the logits bit-identical to the launch without it;
//  - the wide GEMM (gemm_wide.cu, 17–64 rows) the same way, batch invariant over T = 17..64;
//  - PTPC FP8: the GPU quantisation bit-exact vs cpu::quantize_fp8_rows, the FP8 skinny GEMM and cuBLASLt's
//    FP8 GEMM vs cpu::gemm_ptpc_fp8, and (informative) the FP8 error against the BF16 GEMM;
//  - attn_res_step (one kernel per AttnRes point; its one-CTA and cluster kernels) vs model::attn_res_mix +
//    cpu::rmsnorm_bf16;
//  - kda_decode_fused vs the CPU twins of steps 2–7 composed.
// Timings of the skinny GEMM against cuBLASLt at the real shapes are printed as notes (not asserted).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "../test_glu_stack.h"
#include "harness.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/kda_ops.h"
#include "kernels/cpu/kda_scan.h"
#include "kernels/cpu/moe_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_skinny.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/ptpc.h"
#include "model/attn_res.h"

namespace kestrel::gputest {
namespace {

constexpr float kEps = 1e-5f;

// A split-K workspace like the model's (zeroed counters).
struct Ws {
  cuda::DeviceBuffer part{cuda::kSkinnyPartBytes}, counters{size_t(cuda::kSkinnyCounters) * 4};
  Ws() { KCUDA_CHECK(cudaMemset(counters.data(), 0, counters.size())); }
  cuda::SkinnyWorkspace get() {
    return {static_cast<float*>(part.data()), part.size(), static_cast<unsigned*>(counters.data()),
            cuda::kSkinnyCounters};
  }
};

cuda::GemmSegs one_seg(void* y, int64_t ldy, cuda::GemmEpi e = cuda::GemmEpi::bf16) {
  cuda::GemmSegs s;
  s.seg[0] = {0, y, ldy, e, nullptr, 0};
  s.n = 1;
  return s;
}

float time_us(const std::function<void()>& fn, int reps = 20) {
  cudaEvent_t a, b;
  KCUDA_CHECK(cudaEventCreate(&a));
  KCUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    KCUDA_CHECK(cudaEventRecord(a));
    fn();
    KCUDA_CHECK(cudaEventRecord(b));
    KCUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000.0f);
  }
  cudaEventDestroy(a), cudaEventDestroy(b);
  std::nth_element(ts.begin(), ts.begin() + reps / 2, ts.end());
  return ts[size_t(reps / 2)];
}

// FP64 x·Wᵀ for the listed rows, rounded to bf16 (the GEMM's rounding point), as f32 values.
std::vector<float> fp64_ref_rows(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int64_t K, int64_t N,
                                 const std::vector<int64_t>& rows) {
  std::vector<float> out;
  std::vector<double> xd(static_cast<size_t>(K));
  for (int64_t t : rows) {
    for (int64_t k = 0; k < K; ++k) xd[size_t(k)] = bf16_to_f32(x[size_t(t * K + k)]);
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      const uint16_t* wr = w.data() + n * K;
      for (int64_t k = 0; k < K; ++k) s += xd[size_t(k)] * double(bf16_to_f32(wr[k]));
      out.push_back(bf16_to_f32(f32_to_bf16(float(s))));
    }
  }
  return out;
}

struct GemmCase {
  int64_t K, N;
  const char* what;
};
const GemmCase kGemmCases[] = {
    {256, 384, "nano q|k|v"},        {256, 1024, "nano lm_head"},       {32, 128, "nano f_b"},
    {7168, 6284, "mini KDA stack q|k|v|g|f_a|b"}, {1536, 7168, "mini o_proj"}, {7168, 3808, "mini MLA stack"},
    {1536, 6400, "mini q_b|wq_b"},   {7168, 5120, "mini MoE stack"},    {3584, 7168, "mini latent up"},
    {4224, 7168, "mini dense down"}, {768, 7168, "mini shared down"},   {128, 1536, "mini f_b"},
    {7168, 128, "mini wk"},          {7168, 12, "mini b_proj"},         {7168, 8448, "mini dense gate|up"},
    // partial last k-steps: bf16 16- and 32-byte tails, fp8 80 bytes (lanes' pieces in and out of range)
    {200, 96, "K tail 16 B"},        {208, 96, "K tail 32 B (fp8 80 B)"}};

// A decode GEMM under test: one launch over a stack (x bf16 [T, K], W bf16 [N, K]).
using StackedGemm = std::function<void(const uint16_t* x, const uint16_t* w, int64_t T, int64_t K, int64_t N,
                                       const cuda::GemmSegs& s)>;

// Timing at the large shapes (K·N ≥ 8M, notes, not asserted): `gemm` against cuBLASLt over 4 weight copies
// rotated so the 50 MB L2 does not serve them; x bf16 [64, K].
void time_against_lt(const GemmCase& c, const uint16_t* dx, const uint16_t* dw, std::initializer_list<int64_t> Ts,
                     const char* name, const StackedGemm& gemm) {
  if (c.K * c.N < 8000000) return;
  const int copies = 4;
  cuda::DeviceBuffer wc(size_t(copies * c.N * c.K) * 2);
  for (int i = 0; i < copies; ++i)
    KCUDA_CHECK(cudaMemcpy(static_cast<uint16_t*>(wc.data()) + i * c.N * c.K, dw, size_t(c.N * c.K) * 2,
                           cudaMemcpyDeviceToDevice));
  auto wcopy = [&](int i) { return static_cast<const uint16_t*>(wc.data()) + (i % copies) * c.N * c.K; };
  cuda::GemmLt lt;
  auto dy = poisoned<uint16_t>(size_t(64 * c.N));
  for (int64_t T : Ts) {
    int it = 0;
    const float tk = time_us([&] { gemm(dx, wcopy(it++), T, c.K, c.N, one_seg(dy.p(), c.N)); });
    it = 0;
    const float tl = time_us([&] { lt.bf16(dx, c.K, wcopy(it++), dy.p(), c.N, T, c.K, c.N, nullptr); });
    const double gb = double(c.N * c.K * 2) / 1e9;
    note(fmt::format("  timing {} T={} ({:.1f} MB): {} {:.1f} us ({:.2f} TB/s), cuBLASLt {:.1f} us ({:.2f} TB/s)",
                     c.what, T, gb * 1e3, name, tk, gb / tk * 1e3, tl, gb / tl * 1e3));
  }
}

// One kernel vs the twins at shape c: the CPU twin (one BF16 rounding of FP32 sums in another order: ulp;
// cancellation: atol) and FP64 rounded at the same point on the first and last rows, for every T of Ts; batch
// invariance (the rows of Ts' first T bit-identical for every later T); determinism (a second launch, same
// bits); then the timing notes at timing_Ts. `splits` names the split-K count in the failure's shape.
void gemm_matches_twin(const char* name, const GemmCase& c, Rng& rng, const StackedGemm& gemm, int splits,
                       std::initializer_list<int64_t> Ts, std::initializer_list<int64_t> timing_Ts) {
  const int64_t Tmax = 64;
  const auto x = rand_bf16(size_t(Tmax * c.K), rng, -1.0f, 1.0f);
  const auto w = rand_bf16(size_t(c.N * c.K), rng, -0.02f, 0.02f);
  auto dx = upload(x);
  auto dw = upload(w);
  std::vector<uint16_t> ref_all(size_t(Tmax * c.N));
  cpu::gemm_bf16(x.data(), c.K, w.data(), ref_all.data(), c.N, Tmax, c.K, c.N);
  double scale = 0;
  for (uint16_t v : ref_all) scale = std::max(scale, double(std::fabs(bf16_to_f32(v))));
  const std::string what = fmt::format("gemm_{}_bf16", name);
  std::vector<uint16_t> first;  // the outputs at the first T (batch invariance reference)
  for (int64_t T : Ts) {
    auto dy = poisoned<uint16_t>(size_t(T * c.N));
    gemm(dx.p(), dw.p(), T, c.K, c.N, one_seg(dy.p(), c.N));
    sync();
    const auto got = dy.get();
    const std::vector<uint16_t> ref(ref_all.begin(), ref_all.begin() + T * c.N);
    const std::string shape = fmt::format("{} T={} K={} N={} S={}", c.what, T, c.K, c.N, splits);
    check_bf16(what + " vs cpu twin", shape, got, ref, {2e-3 * scale, kBf16Ulp, 2e-3});
    const std::vector<int64_t> rows = T == 1 ? std::vector<int64_t>{0} : std::vector<int64_t>{0, T - 1};
    const auto r64 = fp64_ref_rows(x, w, c.K, c.N, rows);
    std::vector<float> g64;
    for (int64_t t : rows)
      for (int64_t n = 0; n < c.N; ++n) g64.push_back(bf16_to_f32(got[size_t(t * c.N + n)]));
    check(what + " vs fp64", shape, g64.data(), r64.data(), r64.size(), {2e-3 * scale, kBf16Ulp, 1e-2});
    if (first.empty()) first = got;
    check_exact(what + " batch invariance", shape, got.data(), first.data(), first.size() * 2);
    auto dy2 = poisoned<uint16_t>(size_t(T * c.N));
    gemm(dx.p(), dw.p(), T, c.K, c.N, one_seg(dy2.p(), c.N));
    sync();
    check_exact(what + " determinism", shape, dy2.get().data(), got.data(), got.size() * 2);
  }
  time_against_lt(c, dx.p(), dw.p(), timing_Ts, name, gemm);
}

TEST(GpuDecode, SkinnyGemmBf16MatchesTwin) {
  need_gpu();
  Rng rng(101);
  Ws ws;
  const StackedGemm skinny = [&](const uint16_t* x, const uint16_t* w, int64_t T, int64_t K, int64_t N,
                                 const cuda::GemmSegs& s) {
    cuda::gemm_skinny_bf16(x, K, w, T, K, N, s, ws.get(), nullptr);
  };
  for (const GemmCase& c : kGemmCases)
    gemm_matches_twin("skinny", c, rng, skinny, cuda::gemm_skinny_splits(c.N, c.K, false), {1, 2, 7, 16, 33, 64},
                      {1, 16, 64});
}

// Stacked segments with every epilogue in one launch vs separate CPU GEMMs and the CPU elementwise twins.
void stacked_epilogues(const char* kernel, const StackedGemm& gemm, std::initializer_list<int64_t> Ts, uint64_t seed) {
  Rng rng(seed);
  const float beta = 2.0f, lbeta = 1.5f;
  for (int64_t K : {256, 7168}) {
    const int64_t F = 136, Nb = 100, Nf = 12, Na = 64;  // gate/up F rows each, bf16, f32, add segments
    const auto gate = rand_bf16(size_t(F * K), rng, -0.05f, 0.05f), up = rand_bf16(size_t(F * K), rng, -0.05f, 0.05f);
    const auto wb = rand_bf16(size_t(Nb * K), rng, -0.02f, 0.02f), wf = rand_bf16(size_t(Nf * K), rng, -0.02f, 0.02f);
    const auto wa = rand_bf16(size_t(Na * K), rng, -0.02f, 0.02f);
    // The stack: [gate|up interleaved by 8 | bf16 | f32 | add].
    const std::vector<uint16_t> w = testutil::glu_stack(gate, up, F, K, {&wb, &wf, &wa});
    const int64_t N = 2 * F + Nb + Nf + Na;
    auto dw = upload(w);
    for (int64_t T : Ts) {
      const auto x = rand_bf16(size_t(T * K), rng, -1.0f, 1.0f);
      const auto addend = rand_bf16(size_t(T * Na), rng, -1.0f, 1.0f);
      auto dx = upload(x);
      auto da = poisoned<uint16_t>(size_t(T * F));
      auto db = poisoned<uint16_t>(size_t(T * Nb));
      auto df = poisoned<float>(size_t(T * Nf));
      auto dadd = upload(addend);  // in place: y = bf16(bf16(acc) + y)
      cuda::GemmSegs s;
      s.glu_beta = beta, s.glu_linear_beta = lbeta;
      s.seg[0] = {0, da.p(), F, cuda::GemmEpi::situ_glu8, nullptr, 0};
      s.seg[1] = {2 * F, db.p(), Nb, cuda::GemmEpi::bf16, nullptr, 0};
      s.seg[2] = {2 * F + Nb, df.p(), Nf, cuda::GemmEpi::f32, nullptr, 0};
      s.seg[3] = {2 * F + Nb + Nf, dadd.p(), Na, cuda::GemmEpi::add_bf16, dadd.p(), Na};
      s.n = 4;
      gemm(dx.p(), dw.p(), T, K, N, s);
      sync();
      std::vector<uint16_t> g(size_t(T * F)), u(size_t(T * F)), a(size_t(T * F)), yb(size_t(T * Nb)),
          ya(size_t(T * Na));
      std::vector<float> yf(size_t(T * Nf));
      cpu::gemm_bf16(x.data(), K, gate.data(), g.data(), F, T, K, F);
      cpu::gemm_bf16(x.data(), K, up.data(), u.data(), F, T, K, F);
      cpu::situ_glu(g.data(), u.data(), a.data(), T * F, beta, lbeta);
      cpu::gemm_bf16(x.data(), K, wb.data(), yb.data(), Nb, T, K, Nb);
      cpu::gemm_bf16_f32(x.data(), K, wf.data(), yf.data(), Nf, T, K, Nf);
      cpu::gemm_bf16(x.data(), K, wa.data(), ya.data(), Na, T, K, Na);
      for (size_t i = 0; i < ya.size(); ++i) ya[i] = f32_to_bf16(bf16_to_f32(ya[i]) + bf16_to_f32(addend[i]));
      const std::string shape =
          fmt::format("{} K={} T={} [glu {} | bf16 {} | f32 {} | add {}]", kernel, K, T, 2 * F, Nb, Nf, Na);
      // GLU: its inputs are one-ulp-close BF16 values, so the output is within a few ulps.
      check_bf16("epilogue situ_glu8", shape, da.get(), a, {1e-3, 4 * kBf16Ulp, 1e-2});
      check_bf16("epilogue bf16", shape, db.get(), yb, {1e-3, kBf16Ulp, 2e-3});
      double fs = 0;
      for (float v : yf) fs = std::max(fs, double(std::fabs(v)));
      check("epilogue f32", shape, df.get().data(), yf.data(), yf.size(), {1e-5 * fs + 1e-6, 1e-4, 1e-5});
      check_bf16("epilogue add_bf16 (in place)", shape, dadd.get(), ya, {1e-3, 2 * kBf16Ulp, 2e-3});
    }
  }
}

TEST(GpuDecode, SkinnyGemmStackedEpilogues) {
  need_gpu();
  Ws ws;
  stacked_epilogues("skinny", [&](const uint16_t* x, const uint16_t* w, int64_t T, int64_t K, int64_t N,
                                  const cuda::GemmSegs& s) {
    ASSERT_TRUE(cuda::gemm_skinny_ok(x, K, w, T, K, N, s, false));
    cuda::gemm_skinny_bf16(x, K, w, T, K, N, s, ws.get(), nullptr);
  }, {1, 7, 64}, 102);
}

// The MoE in-projection's stack at the mini's per-rank shapes ([shared gate|up 2·768 | z 3,584 | router X] × 7,168)
// with the router's top-k in the launch's tail: the outputs bit-identical to the same launch without it, the ids
// and weights bit-identical to moe_route on those logits (the same selection and arithmetic on the device), and
// the ids the CPU twin's (weights within its ulps: the device's expf). X = 4 (the reduced mini, one tile), 112 (the
// mini's EP share, 8 tiles), 256 (the bound); T = 1..16; a stack whose router rows start inside a tile.
TEST(GpuDecode, SkinnyGemmRouteTail) {
  need_gpu();
  Rng rng(103);
  Ws ws;
  const int64_t K = 7168;
  struct Case {
    int64_t F, Z, X, Kt;
  };
  for (const Case c : {Case{768, 3584, 4, 2}, Case{768, 3584, 112, 2}, Case{0, 3576, 256, 8}, Case{0, 40, 112, 32}}) {
    const int64_t N = 2 * c.F + c.Z + c.X;
    const auto w = rand_bf16(size_t(N * K), rng, -0.02f, 0.02f);
    const auto bias = rand_f32(size_t(c.X), rng, -0.1f, 0.1f);
    auto dw = upload(w);
    auto db = upload(bias);
    for (int64_t T : {1, 2, 7, 16}) {
      const auto x = rand_bf16(size_t(T * K), rng, -1.0f, 1.0f);
      auto dx = upload(x);
      const std::string shape = fmt::format("[glu {} | z {} | router {}] K={} top-{} T={}", 2 * c.F, c.Z, c.X, K, c.Kt, T);
      std::vector<uint16_t> outs[2];
      std::vector<float> logits[2];
      std::vector<int32_t> ids[2];
      std::vector<float> wts[2];
      for (int with : {0, 1}) {
        auto da = poisoned<uint16_t>(size_t(std::max<int64_t>(T * c.F, 1)));
        auto dz = poisoned<uint16_t>(size_t(T * c.Z));
        auto dl = poisoned<float>(size_t(T * c.X));
        auto dids = poisoned<int32_t>(size_t(T * c.Kt));
        auto dwt = poisoned<float>(size_t(T * c.Kt));
        cuda::GemmSegs s;
        if (c.F > 0) s.seg[s.n++] = {0, da.p(), c.F, cuda::GemmEpi::situ_glu8, nullptr, 0};
        s.seg[s.n++] = {2 * c.F, dz.p(), c.Z, cuda::GemmEpi::bf16, nullptr, 0};
        if (with) s.route = {s.n, db.p(), int(c.Kt), true, 2.5f, dids.p(), dwt.p()};
        s.seg[s.n++] = {2 * c.F + c.Z, dl.p(), c.X, cuda::GemmEpi::f32, nullptr, 0};
        if (with) {
          ASSERT_TRUE(cuda::gemm_skinny_route_ok(T, s, N, ws.get())) << shape;
        }
        cuda::gemm_skinny_bf16(dx.p(), K, dw.p(), T, K, N, s, ws.get(), nullptr);
        if (!with) cuda::moe_route(dl.p(), db.p(), T, c.X, c.Kt, true, 2.5f, dids.p(), dwt.p(), nullptr);
        sync();
        outs[with] = dz.get();
        if (c.F > 0) {
          const auto a = da.get();
          outs[with].insert(outs[with].end(), a.begin(), a.end());
        }
        logits[with] = dl.get(), ids[with] = dids.get(), wts[with] = dwt.get();
      }
      check_exact("route tail: outputs vs the launch without it", shape, outs[1].data(), outs[0].data(),
                  outs[0].size() * 2);
      check_exact("route tail: logits vs the launch without it", shape, logits[1].data(), logits[0].data(),
                  logits[0].size() * 4);
      check_exact("route tail: ids vs moe_route", shape, ids[1].data(), ids[0].data(), ids[0].size() * 4);
      check_exact("route tail: weights vs moe_route", shape, wts[1].data(), wts[0].data(), wts[0].size() * 4);
      std::vector<int32_t> rid(size_t(T * c.Kt));
      std::vector<float> rw(size_t(T * c.Kt));
      cpu::moe_route(logits[1].data(), bias.data(), T, c.X, c.Kt, true, 2.5f, rid.data(), rw.data());
      check_exact("route tail: ids vs cpu::moe_route", shape, ids[1].data(), rid.data(), rid.size() * 4);
      check("route tail: weights vs cpu::moe_route", shape, wts[1].data(), rw.data(), rw.size(), {1e-7, 1e-5, 1e-6});
    }
  }
  // What the tail refuses (linear() then launches moe_route after the GEMM): more than 16 tokens, more than 256
  // experts, more picks than 32, a route on a non-FP32 segment.
  cuda::GemmSegs s;
  float* fake = reinterpret_cast<float*>(16);
  s.seg[s.n++] = {0, fake, 300, cuda::GemmEpi::f32, nullptr, 0};
  s.route = {0, fake, 2, true, 1.0f, reinterpret_cast<int32_t*>(16), fake};
  EXPECT_FALSE(cuda::gemm_skinny_route_ok(1, s, 300, ws.get()));
  EXPECT_TRUE(cuda::gemm_skinny_route_ok(1, s, 256, ws.get()));
  EXPECT_FALSE(cuda::gemm_skinny_route_ok(17, s, 256, ws.get()));
  s.route.K = 33;
  EXPECT_FALSE(cuda::gemm_skinny_route_ok(1, s, 256, ws.get()));
  s.route.K = 2, s.seg[0].epi = cuda::GemmEpi::bf16;
  EXPECT_FALSE(cuda::gemm_skinny_route_ok(1, s, 256, ws.get()));
}

TEST(GpuDecode, WideGemmStackedEpilogues) {
  need_gpu();
  Ws ws;
  stacked_epilogues("wide", [&](const uint16_t* x, const uint16_t* w, int64_t T, int64_t K, int64_t N,
                                const cuda::GemmSegs& s) {
    ASSERT_TRUE(cuda::gemm_wide_ok(x, K, w, T, K, N, s, ws.get()));
    cuda::gemm_wide_bf16(x, K, w, T, K, N, s, ws.get(), nullptr);
  }, {17, 40, 64}, 104);
}

// The wide GEMM (17–64 rows) vs the same twins, at every shape with K % 128 == 0; batch invariance over
// T = 17..64 (a token's outputs bit-identical), determinism; timings vs cuBLASLt at T = 32 and 64 as notes.
TEST(GpuDecode, WideGemmBf16MatchesTwin) {
  need_gpu();
  Rng rng(105);
  Ws ws;
  {  // what it refuses: K not a multiple of 128, more than 64 rows, a null output
    cuda::DeviceBuffer a(size_t(65 * 256) * 2), b(size_t(96 * 256) * 2), y(size_t(65 * 96) * 2);
    const auto* xa = static_cast<const uint16_t*>(a.data());
    const auto* wb = static_cast<const uint16_t*>(b.data());
    EXPECT_TRUE(cuda::gemm_wide_ok(xa, 256, wb, 64, 256, 96, one_seg(y.data(), 96), ws.get()));
    EXPECT_FALSE(cuda::gemm_wide_ok(xa, 200, wb, 64, 200, 96, one_seg(y.data(), 96), ws.get()));
    EXPECT_FALSE(cuda::gemm_wide_ok(xa, 256, wb, 65, 256, 96, one_seg(y.data(), 96), ws.get()));
    EXPECT_FALSE(cuda::gemm_wide_ok(xa, 256, wb, 64, 256, 96, one_seg(nullptr, 96), ws.get()));
  }
  const StackedGemm wide = [&](const uint16_t* x, const uint16_t* w, int64_t T, int64_t K, int64_t N,
                               const cuda::GemmSegs& s) {
    ASSERT_TRUE(cuda::gemm_wide_ok(x, K, w, T, K, N, s, ws.get()));
    cuda::gemm_wide_bf16(x, K, w, T, K, N, s, ws.get(), nullptr);
  };
  int ran = 0;
  for (const GemmCase& c : kGemmCases) {
    if (c.K % 128 != 0) continue;
    ++ran;
    gemm_matches_twin("wide", c, rng, wide, cuda::gemm_wide_splits(c.N, c.K, ws.get()), {17, 24, 32, 33, 64}, {32, 64});
  }
  EXPECT_GE(ran, 12);
}

TEST(GpuDecode, PtpcFp8QuantAndGemm) {
  need_gpu();
  Rng rng(103);
  Ws ws;
  cuda::GemmLt lt;
  for (const GemmCase& c : kGemmCases) {
    if (c.K % 16 != 0) continue;
    const auto w = rand_bf16(size_t(c.N * c.K), rng, -0.02f, 0.02f);
    auto dw = upload(w);
    // Weights: per-output-channel codes and scales, bit-exact vs the twin.
    auto dq = poisoned<uint8_t>(size_t(c.N * c.K));
    auto ds = poisoned<float>(size_t(c.N));
    cuda::quantize_fp8_rows(dw.p(), c.K, c.N, c.K, dq.p(), ds.p(), nullptr);
    sync();
    std::vector<uint8_t> wq(size_t(c.N * c.K));
    std::vector<float> wsc(static_cast<size_t>(c.N));
    cpu::quantize_fp8_rows(w.data(), c.K, c.N, c.K, wq.data(), wsc.data());
    const std::string wshape = fmt::format("{} N={} K={}", c.what, c.N, c.K);
    check_exact("quantize_fp8_rows (weights, codes)", wshape, dq.get().data(), wq.data(), wq.size());
    check_exact("quantize_fp8_rows (weights, scales)", wshape, ds.get().data(), wsc.data(), wsc.size() * 4);
    for (int64_t T : {1, 7, 64, 200}) {
      const auto x = rand_bf16(size_t(T * c.K), rng, -1.0f, 1.0f);
      auto dx = upload(x);
      auto dxq = poisoned<uint8_t>(size_t(T * c.K));
      auto dxs = poisoned<float>(size_t(T));
      cuda::quantize_fp8_rows(dx.p(), c.K, T, c.K, dxq.p(), dxs.p(), nullptr);
      std::vector<uint8_t> xq(size_t(T * c.K));
      std::vector<float> xs(static_cast<size_t>(T));
      cpu::quantize_fp8_rows(x.data(), c.K, T, c.K, xq.data(), xs.data());
      sync();
      const std::string shape = fmt::format("{} T={} K={} N={}", c.what, T, c.K, c.N);
      check_exact("quantize_fp8_rows (tokens, codes)", shape, dxq.get().data(), xq.data(), xq.size());
      check_exact("quantize_fp8_rows (tokens, scales)", shape, dxs.get().data(), xs.data(), xs.size() * 4);
      std::vector<uint16_t> ref(size_t(T * c.N));
      cpu::gemm_ptpc_fp8(xq.data(), xs.data(), wq.data(), wsc.data(), ref.data(), c.N, T, c.K, c.N);
      double scale = 0;
      for (uint16_t v : ref) scale = std::max(scale, double(std::fabs(bf16_to_f32(v))));
      auto dy = poisoned<uint16_t>(size_t(T * c.N));
      if (T <= cuda::kSkinnyMaxT) {
        cuda::gemm_skinny_fp8(dxq.p(), c.K, dxs.p(), dq.p(), ds.p(), T, c.K, c.N, one_seg(dy.p(), c.N), ws.get(),
                              nullptr);
        sync();
        check_bf16("gemm_skinny_fp8 vs cpu twin", shape, dy.get(), ref, {2e-3 * scale, kBf16Ulp, 2e-3});
      }
      if (c.N % 16 == 0) {
        auto dl = poisoned<uint16_t>(size_t(T * c.N));
        lt.fp8_ptpc(dxq.p(), c.K, dxs.p(), dq.p(), ds.p(), dl.p(), c.N, T, c.K, c.N, nullptr);
        sync();
        check_bf16("cuBLASLt fp8_ptpc vs cpu twin", shape, dl.get(), ref, {2e-3 * scale, kBf16Ulp, 2e-3});
      }
      if (T == 7) {  // informative: what PTPC FP8 costs against the BF16 product
        std::vector<uint16_t> bf(size_t(T * c.N));
        cpu::gemm_bf16(x.data(), c.K, w.data(), bf.data(), c.N, T, c.K, c.N);
        double num = 0, den = 0;
        for (size_t i = 0; i < bf.size(); ++i) {
          const double d = double(bf16_to_f32(ref[i])) - bf16_to_f32(bf[i]);
          num += d * d, den += double(bf16_to_f32(bf[i])) * bf16_to_f32(bf[i]);
        }
        note(fmt::format("  ptpc-fp8 vs bf16 GEMM {}: rel L2 {:.2e}", shape, std::sqrt(num / den)));
      }
    }
  }
}

TEST(GpuDecode, AttnResStepMatchesTwin) {
  need_gpu();
  Rng rng(104);
  const int default_bound = cuda::attn_res_cluster_max_t();
  struct Case {
    int64_t T, D;
    int nb;
    cuda::AttnResAdd mode;
    bool store, fp8;
  };
  using M = cuda::AttnResAdd;
  for (Case c : {Case{3, 256, 0, M::none, true, false}, Case{3, 256, 2, M::add, false, true},
                 Case{1, 7168, 4, M::add, true, true}, Case{1, 7168, 1, M::replace, false, false},
                 Case{16, 7168, 3, M::replace, true, true}, Case{64, 7168, 2, M::add, false, false},
                 // decode launch shape: the row over a cluster of CTAs — every source slot (15 blocks + P), a
                 // row that does not split evenly (129 vectors over 3 CTAs), the largest decode bucket
                 Case{1, 7168, 15, M::add, true, true}, Case{2, 1032, 5, M::none, true, true},
                 Case{64, 7168, 9, M::add, true, true},
                 // prefill launch shape (256 threads looping over the row)
                 Case{600, 7168, 3, M::add, true, true}, Case{512, 256, 1, M::replace, false, false}}) {
    model::AttnResStream s(c.T, c.D, c.nb + 1);
    for (int i = 0; i <= c.nb; ++i) {
      const float sc = 0.5f + float(i % 4);
      auto v = rand_bf16(size_t(c.T * c.D), rng, -sc, sc);
      std::copy(v.begin(), v.end(), i < c.nb ? s.blocks.begin() + int64_t(i) * c.T * c.D : s.partial.begin());
    }
    s.num_blocks = c.nb;
    const auto a = rand_bf16(size_t(c.T * c.D), rng, -1.0f, 1.0f);
    const auto norm_w = rand_bf16(size_t(c.D), rng, 0.5f, 1.5f), proj_w = rand_bf16(size_t(c.D), rng, -0.05f, 0.05f);
    const auto rms_w = rand_bf16(size_t(c.D), rng, 0.5f, 1.5f);
    auto dblocks = upload(std::vector<uint16_t>(s.blocks.begin(), s.blocks.begin() + std::max(c.nb, 1) * c.T * c.D));
    auto dp = upload(std::vector<uint16_t>(s.partial.begin(), s.partial.end()));
    auto da = upload(a);
    auto dstore = poisoned<uint16_t>(size_t(c.T * c.D));
    auto dnw = upload(norm_w), dpw = upload(proj_w), drw = upload(rms_w);
    auto dy = poisoned<uint16_t>(size_t(c.T * c.D));
    auto dq = poisoned<uint8_t>(size_t(c.T * c.D));
    auto dqs = poisoned<float>(size_t(c.T));
    const auto p0 = dp.get();
    auto run = [&] {
      dp.buf.copy_from_host(p0.data(), p0.size() * 2);  // P is updated in place
      const std::vector<uint8_t> junk(size_t(c.T * c.D) * 2, 0xFF);  // outputs NaN-poisoned again for each kernel
      dy.buf.copy_from_host(junk.data(), size_t(c.T * c.D) * 2);
      dstore.buf.copy_from_host(junk.data(), size_t(c.T * c.D) * 2);
      dq.buf.copy_from_host(junk.data(), size_t(c.T * c.D));
      dqs.buf.copy_from_host(junk.data(), size_t(c.T) * 4);
      cuda::attn_res_step(dblocks.p(), c.T * c.D, c.nb, dp.p(), c.mode == M::none ? nullptr : da.p(), c.mode,
                          c.store ? dstore.p() : nullptr, dnw.p(), dpw.p(), drw.p(), kEps, dy.p(),
                          c.fp8 ? dq.p() : nullptr, dqs.p(), c.T, c.D, nullptr);
      sync();
    };
    // CPU: the pending update of P, then Mix + RMSNorm.
    for (size_t i = 0; i < s.partial.size(); ++i) {
      if (c.mode == M::add) s.partial[i] = f32_to_bf16(bf16_to_f32(s.partial[i]) + bf16_to_f32(a[i]));
      if (c.mode == M::replace) s.partial[i] = a[i];
    }
    std::vector<uint16_t> h(size_t(c.T * c.D)), y(size_t(c.T * c.D));
    model::attn_res_mix(s, norm_w.data(), proj_w.data(), kEps, h.data());
    cpu::rmsnorm_bf16(h.data(), rms_w.data(), y.data(), c.T, c.D, kEps);
    const std::vector<uint16_t> pnew(s.partial.begin(), s.partial.end());
    // Both kernels at every case: the one-CTA kernel (cluster bound 0) and the cluster kernel (bound 64, where
    // T ≤ 64).
    std::vector<uint16_t> y_by[2];
    for (int k = 0; k < 2; ++k) {
      const int bound = k == 0 ? 0 : 64;
      if (bound > 0 && c.T > bound) continue;
      cuda::set_attn_res_cluster_max_t(bound);
      run();
      const std::string shape = fmt::format("T={} D={} nb={} mode={} store={} fp8={} {}", c.T, c.D, c.nb,
                                            int(c.mode), c.store, c.fp8, k == 0 ? "one-CTA" : "cluster");
      check_exact("attn_res_step (P updated)", shape, dp.get().data(), pnew.data(), pnew.size() * 2);
      if (c.store) check_exact("attn_res_step (stored block)", shape, dstore.get().data(), pnew.data(), pnew.size() * 2);
      const auto got = dy.get();
      check_bf16("attn_res_step (y)", shape, got, y, {1e-3, 3 * kBf16Ulp, 2e-3});
      if (c.fp8) {  // the codes of the kernel's own y, by the twin's rule
        std::vector<uint8_t> q(got.size());
        std::vector<float> qs(static_cast<size_t>(c.T));
        cpu::quantize_fp8_rows(got.data(), c.D, c.T, c.D, q.data(), qs.data());
        check_exact("attn_res_step (fp8 codes)", shape, dq.get().data(), q.data(), q.size());
        check_exact("attn_res_step (fp8 scales)", shape, dqs.get().data(), qs.data(), qs.size() * 4);
      }
      y_by[k] = got;
    }
    // Where the row fits one warp (D = 256: 32 vectors) the two kernels do the same operations in the same order.
    if (c.D == 256 && !y_by[1].empty())
      check_exact("attn_res_step cluster == one-CTA (D = 256)", fmt::format("T={} nb={}", c.T, c.nb), y_by[1].data(),
                  y_by[0].data(), y_by[0].size() * 2);
  }
  cuda::set_attn_res_cluster_max_t(default_bound);
}

// The first point of a step gathers P from the embedding table itself (attn_res_step's a_ids, replace mode):
// the same bits as embed_gather followed by the point with P left as it is — P, the stored block B_0, y and the
// FP8 codes — on both kernels, with repeated ids and the table's last row.
TEST(GpuDecode, AttnResFirstPointGathersEmbedding) {
  need_gpu();
  Rng rng(105);
  const int default_bound = cuda::attn_res_cluster_max_t();
  using M = cuda::AttnResAdd;
  for (const int64_t D : {256, 7168})
    for (const int64_t T : {1, 3, 70}) {
      const int64_t V = 50;
      const auto table = rand_bf16(size_t(V * D), rng, -2.0f, 2.0f);
      std::vector<int32_t> ids(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = t == 0 ? int32_t(V - 1) : int32_t(rng.next() % uint64_t(V));
      if (T > 2) ids[2] = ids[1];
      const auto norm_w = rand_bf16(size_t(D), rng, 0.5f, 1.5f), proj_w = rand_bf16(size_t(D), rng, -0.05f, 0.05f);
      const auto rms_w = rand_bf16(size_t(D), rng, 0.5f, 1.5f);
      auto dt = upload(table);
      auto di = upload(ids);
      auto dnw = upload(norm_w), dpw = upload(proj_w), drw = upload(rms_w);
      for (const bool fp8 : {false, true})
        for (const int bound : {0, 64}) {
          cuda::set_attn_res_cluster_max_t(bound);
          std::vector<uint16_t> out[2][3];  // [path][P, block, y]
          std::vector<uint8_t> q[2];
          std::vector<float> qs[2];
          for (int path = 0; path < 2; ++path) {
            auto dp = poisoned<uint16_t>(size_t(T * D));
            auto dstore = poisoned<uint16_t>(size_t(T * D));
            auto dy = poisoned<uint16_t>(size_t(T * D));
            auto dq = poisoned<uint8_t>(size_t(T * D));
            auto dqs = poisoned<float>(size_t(T));
            if (path == 0) {  // embed_gather, then the point with P as it is
              cuda::embed_gather(dt.p(), di.p(), T, D, dp.p(), nullptr);
              cuda::attn_res_step(nullptr, T * D, 0, dp.p(), nullptr, M::none, dstore.p(), dnw.p(), dpw.p(), drw.p(),
                                  kEps, dy.p(), fp8 ? dq.p() : nullptr, dqs.p(), T, D, nullptr);
            } else {  // the point gathers
              cuda::attn_res_step(nullptr, T * D, 0, dp.p(), dt.p(), M::replace, dstore.p(), dnw.p(), dpw.p(),
                                  drw.p(), kEps, dy.p(), fp8 ? dq.p() : nullptr, dqs.p(), T, D, nullptr, di.p());
            }
            sync();
            out[path][0] = dp.get(), out[path][1] = dstore.get(), out[path][2] = dy.get();
            if (fp8) q[path] = dq.get(), qs[path] = dqs.get();
          }
          const std::string shape = fmt::format("T={} D={} fp8={} cluster bound {}", T, D, fp8, bound);
          std::vector<uint16_t> rows(size_t(T * D));
          for (int64_t t = 0; t < T; ++t)
            std::copy_n(table.begin() + int64_t(ids[size_t(t)]) * D, D, rows.begin() + t * D);
          check_exact("first point: P is the embedding rows", shape, out[1][0].data(), rows.data(), rows.size() * 2);
          check_exact("first point: P", shape, out[1][0].data(), out[0][0].data(), rows.size() * 2);
          check_exact("first point: stored block", shape, out[1][1].data(), out[0][1].data(), rows.size() * 2);
          check_exact("first point: y", shape, out[1][2].data(), out[0][2].data(), rows.size() * 2);
          if (fp8) {
            check_exact("first point: fp8 codes", shape, q[1].data(), q[0].data(), q[0].size());
            check_exact("first point: fp8 scales", shape, qs[1].data(), qs[0].data(), qs[0].size() * 4);
          }
        }
    }
  cuda::set_attn_res_cluster_max_t(default_bound);
}

TEST(GpuDecode, KdaDecodeFusedMatchesTwins) {
  need_gpu();
  Rng rng(105);
  const int64_t W = 4;
  struct Shape {
    int64_t H, Dk;
    const char* what;
  };
  for (const Shape& sh : {Shape{4, 32, "nano"}, Shape{2, 64, "Dk 64"}, Shape{12, 128, "mini"}}) {
    const int64_t H = sh.H, Dk = sh.Dk, HD = H * Dk, C3 = 3 * HD;
    for (int64_t B : {1, 5, 64}) {
      const int64_t n_slots = B + 3;
      // Rows: B real + 1 padded (empty cu range) pointing at the last slot, which must stay untouched.
      const int64_t rows = B + 1;
      std::vector<int32_t> slots(static_cast<size_t>(rows)), cu(size_t(rows + 1));
      std::iota(slots.begin(), slots.end(), 0);
      for (size_t i = slots.size(); i > 1; --i) std::swap(slots[i - 1], slots[rng.next() % i]);
      slots[size_t(B)] = int32_t(n_slots - 1);
      for (int64_t b = 0; b <= rows; ++b) cu[size_t(b)] = int32_t(std::min(b, B));
      const auto qkv = rand_bf16(size_t(rows * C3), rng, -2.0f, 2.0f);
      const auto gate = rand_bf16(size_t(rows * HD), rng, -3.0f, 3.0f);
      const auto fa = rand_bf16(size_t(rows * Dk), rng, -1.0f, 1.0f);
      const auto bl = rand_bf16(size_t(rows * H), rng, -3.0f, 3.0f);
      const auto conv = rand_f32(size_t(C3 * W), rng, -0.7f, 0.7f);
      const auto f_b = rand_bf16(size_t(HD * Dk), rng, -0.3f, 0.3f);
      const auto dt_bias = rand_f32(size_t(HD), rng, -1.0f, 1.0f), a_log = rand_f32(size_t(H), rng, -1.0f, 1.5f);
      const auto o_norm = rand_f32(size_t(Dk), rng, 0.5f, 1.5f);
      auto hist = rand_bf16(size_t(n_slots * (W - 1) * C3), rng, -2.0f, 2.0f);
      auto state = rand_f32(size_t(n_slots * H * Dk * Dk), rng, -0.2f, 0.2f);
      const float lower = -5.0f;
      auto d_qkv = upload(qkv), d_gate = upload(gate), d_fa = upload(fa), d_bl = upload(bl);
      auto d_conv = upload(conv);
      auto d_fb = upload(f_b);
      auto d_dt = upload(dt_bias), d_al = upload(a_log), d_on = upload(o_norm), d_state = upload(state);
      auto d_hist = upload(hist);
      auto d_slots = upload(slots), d_cu = upload(cu);
      auto d_o = poisoned<uint16_t>(size_t(rows * HD));
      const cuda::KdaDecodeIn in{d_qkv.p(), C3, d_gate.p(), HD, d_fa.p(), Dk, d_bl.p(), H, d_cu.p()};
      const cuda::KdaDecodeWeights wt{d_conv.p(), d_fb.p(), d_dt.p(), d_al.p(), d_on.p(), lower, kEps};
      cuda::kda_decode_fused(in, wt, d_hist.p(), d_slots.p(), d_state.p(), d_o.p(), rows, H, Dk, W, nullptr);
      sync();
      // CPU: steps 2–7 per real row with the twins.
      std::vector<uint16_t> o_ref(size_t(B * HD));
      for (int64_t b = 0; b < B; ++b) {
        const int32_t sl = slots[size_t(b)];
        std::vector<float> y(static_cast<size_t>(C3)), g(static_cast<size_t>(HD)), beta(static_cast<size_t>(H)),
            o(static_cast<size_t>(HD));
        cpu::kda_conv_silu(qkv.data() + b * C3, C3, conv.data(), hist.data() + sl * (W - 1) * C3, y.data(), C3, 1, C3,
                           W);
        std::vector<uint16_t> z(static_cast<size_t>(HD));
        cpu::gemm_bf16(fa.data() + b * Dk, Dk, f_b.data(), z.data(), HD, 1, Dk, HD);
        float* q = y.data();
        float* k = y.data() + HD;
        cpu::kda_qk_norm_gates(q, k, z.data(), dt_bias.data(), a_log.data(), bl.data() + b * H, lower, g.data(),
                               beta.data(), 1, H, Dk);
        for (int64_t h = 0; h < H; ++h) {
          const cpu::KdaHeadIo io{q + h * Dk, k + h * Dk, y.data() + 2 * HD + h * Dk, g.data() + h * Dk,
                                  beta.data() + h, HD, H, o.data() + h * Dk};
          cpu::kda_scan_recurrent(io, 1, Dk, state.data() + (int64_t(sl) * H + h) * Dk * Dk);
        }
        cpu::kda_out_norm_gate(o.data(), gate.data() + b * HD, o_norm.data(), kEps, o_ref.data() + b * HD, 1, H, Dk);
      }
      const std::string shape = fmt::format("{} H={} Dk={} B={} (+1 padded row)", sh.what, H, Dk, B);
      auto o_got = d_o.get();
      o_got.resize(size_t(B * HD));  // the padded row is not written
      check_bf16("kda_decode_fused (ô)", shape, o_got, o_ref, {2e-3, 2 * kBf16Ulp, 3e-3});
      // State: z is the f_b product rounded to bf16; a sum that lands on a rounding boundary can round the other
      // way on the GPU (FP32 order), moving one channel's decay by a few %: one row of one head's S. So the
      // per-element bound is loose and the rel L2 over the pool tight.
      const auto st = d_state.get();
      double smax = 0;
      for (float v : state) smax = std::max(smax, double(std::fabs(v)));
      check("kda_decode_fused (state)", shape, st.data(), state.data(), state.size(), {5e-3 * smax, 5e-2, 1e-4});
      const auto hs = d_hist.get();
      check_exact("kda_decode_fused (conv history)", shape, hs.data(), hist.data(), hist.size() * 2);
    }
  }
}

}  // namespace
}  // namespace kestrel::gputest
