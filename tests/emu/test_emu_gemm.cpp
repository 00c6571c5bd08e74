// The skinny decode GEMM (src/kernels/cuda/gemm_skinny.cu) on the CPU emulation of simt.h, against the CPU
// twins with the tolerances of tests/gpu/test_decode_gpu.cpp: both paths at T ≤ 16 (W staged through the
// shared-memory ring, or in registers), the 32- and 64-token instantiations, split-K over CTAs (the last CTA's
// sum, the counters left at zero), a 16-byte K tail, the stacked epilogues (SiTU-GLU, bf16, f32, in-place add)
// in one launch, the FP8 (PTPC) variant, batch invariance, what lies beyond each output row's ldy, and the MoE
// router's top-k in the kernel's tail (GemmRoute: ids and weights bit-exact against cpu::moe_route). This
// catches index, fragment-layout and split-K mistakes in CI, where no GPU exists; tests/gpu adds the real
// tensor cores, the launchers' split choice and timing. The launch geometry is the kernel file's own plan() and
// dispatch() (the table run() launches through), so what runs here is what run() would launch.
#include <gtest/gtest.h>

#include "simt.h"  // first: defines the CUDA surface the kernel source below is written against

#include "kernels/cuda/gemm_skinny.cu"
//
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "../test_glu_stack.h"
#include "../test_rng.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/moe_ops.h"

namespace kestrel {
namespace {

using testutil::Rng;

std::vector<uint16_t> rand_bf16(size_t n, Rng& rng, float lo, float hi) {
  std::vector<uint16_t> x(n);
  for (auto& e : x) e = f32_to_bf16(rng.uniform(lo, hi));
  return x;
}

// |got − ref| ≤ atol + rtol·|ref| element-wise (NaN fails) and the relative L2 error ≤ l2.
void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref, double atol,
                  double rtol, double l2) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double num = 0, den = 0;
  size_t bad = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - double(ref[i]);
    num += d * d, den += double(ref[i]) * double(ref[i]);
    if (!std::isfinite(got[i]) || std::fabs(d) > atol + rtol * std::fabs(double(ref[i]))) {
      if (first == got.size()) first = i;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " out of tolerance, first at " << first
                     << " (got " << (first < got.size() ? got[first] : 0.0f) << ", want "
                     << (first < got.size() ? ref[first] : 0.0f) << ")";
  EXPECT_LE(den > 0 ? std::sqrt(num / den) : std::sqrt(num), l2) << what << ": relative L2 error";
}
std::vector<float> to_f32(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_f32(b[i]);
  return f;
}
double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

// A [rows, ld] output of `cols` columns, every element NaN-poisoned (bf16 0xFFFF / f32 0xFFFFFFFF): what the
// kernel does not write keeps the poison.
template <typename T>
struct Out {
  int64_t rows, cols, ld;
  std::vector<T> v;
  Out(int64_t r, int64_t c, int64_t l) : rows(r), cols(c), ld(l), v(size_t(r * l)) { std::memset(v.data(), 0xFF, v.size() * sizeof(T)); }
  std::vector<T> packed() const {  // [rows, cols]
    std::vector<T> p;
    for (int64_t t = 0; t < rows; ++t) p.insert(p.end(), v.begin() + t * ld, v.begin() + t * ld + cols);
    return p;
  }
  bool padding_poisoned() const {
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t c = cols; c < ld; ++c) {
        T e;
        std::memset(&e, 0xFF, sizeof(T));
        if (std::memcmp(&v[size_t(t * ld + c)], &e, sizeof(T)) != 0) return false;
      }
    return true;
  }
};

cuda::GemmSegs one_seg(void* y, int64_t ldy, cuda::GemmEpi epi = cuda::GemmEpi::bf16) {
  cuda::GemmSegs s;
  s.seg[0] = {0, y, ldy, epi, nullptr, 0};
  s.n = 1;
  return s;
}

// One launch of the skinny kernel on the emulator, as run() makes it: plan() for at most S0 splits, a split-K
// workspace (partials NaN-poisoned, counters zero) and the instantiation dispatch() picks. Returns the splits.
int launch(const void* x, int64_t ldx_bytes, const void* w, const float* x_scale, const float* w_scale, int64_t T,
           int64_t K, int64_t N, const cuda::GemmSegs& segs, bool fp8, bool staged, int S0) {
  cuda::Params p{};
  p.x = static_cast<const uint8_t*>(x), p.ldx = ldx_bytes, p.w = static_cast<const uint8_t*>(w);
  p.x_scale = x_scale, p.w_scale = w_scale, p.segs = segs;
  const int NT = cuda::plan(p, T, K, N, fp8, S0);
  std::vector<float> part(size_t(p.splits) * size_t(p.tiles) * 32 * size_t(NT * 4), std::nanf(""));
  std::vector<unsigned> counters(size_t(p.tiles), 0u);
  p.part = part.data(), p.counters = counters.data();
  unsigned route_counter = 0;  // the workspace's last counter in run()
  const bool route = segs.route.seg >= 0;
  if (route) p.route_counter = &route_counter, cuda::plan_route(p);
  auto go = [&]<auto Kernel>(int smem) {
    simt::launch(dim3(unsigned(p.tiles), unsigned(p.splits)), dim3(cuda::kThreads), size_t(smem), [&] { Kernel(p); });
  };
  if (fp8) cuda::dispatch<true>(NT, staged, go);
  else cuda::dispatch<false>(NT, staged, go, route);
  for (size_t i = 0; i < counters.size(); ++i)
    EXPECT_EQ(counters[i], 0u) << "split-K counter " << i << " not reset (T=" << T << " K=" << K << " N=" << N << ")";
  EXPECT_EQ(route_counter, 0u) << "route counter not reset (T=" << T << " N=" << N << ")";
  return p.splits;
}

// BF16 y = x·Wᵀ over Ts against cpu::gemm_bf16 (one BF16 rounding of FP32 sums in another order: an ulp;
// cancellation: atol), with rows padded past N (ldy = N + 5) left poisoned, and batch invariance: a token's
// outputs bit-identical for every T of Ts and both paths.
void bf16_matches_twin(int64_t K, int64_t N, const std::vector<int64_t>& Ts, const std::vector<int>& S0s,
                       uint64_t seed) {
  Rng rng(seed);
  const int64_t Tmax = *std::max_element(Ts.begin(), Ts.end());
  const auto x = rand_bf16(size_t(Tmax * K), rng, -1.0f, 1.0f);
  const auto w = rand_bf16(size_t(N * K), rng, -0.02f, 0.02f);
  std::vector<uint16_t> ref_all(size_t(Tmax * N));
  cpu::gemm_bf16(x.data(), K, w.data(), ref_all.data(), N, Tmax, K, N);
  const double scale = max_abs(to_f32(ref_all));
  for (int S0 : S0s) {
    std::vector<uint16_t> first;  // token 0's outputs at the first T
    for (int64_t T : Ts)
      for (bool staged : {true, false}) {
        if (!staged && T > 16) continue;  // one path above 16 tokens
        Out<uint16_t> y(T, N, N + 5);
        const int S = launch(x.data(), K * 2, w.data(), nullptr, nullptr, T, K, N, one_seg(y.v.data(), y.ld), false,
                             staged, S0);
        const std::string shape = "bf16 K=" + std::to_string(K) + " N=" + std::to_string(N) + " T=" +
                                  std::to_string(T) + " S=" + std::to_string(S) + (staged ? " staged" : " registers");
        const auto got = y.packed();
        expect_close(shape + " vs cpu::gemm_bf16", to_f32(got),
                     to_f32(std::vector<uint16_t>(ref_all.begin(), ref_all.begin() + T * N)), 2e-3 * scale,
                     1.0 / 128, 2e-3);
        EXPECT_TRUE(y.padding_poisoned()) << shape << ": wrote past column N of a row";
        if (first.empty()) first.assign(got.begin(), got.begin() + N);
        EXPECT_EQ(0, std::memcmp(first.data(), got.data(), size_t(N) * 2)) << shape << ": token 0 not batch invariant";
      }
  }
}

// The stacked epilogues in one launch: [gate|up interleaved by 8 (SiTU-GLU) | bf16 | f32 | add in place],
// against separate CPU GEMMs and cpu::situ_glu, at a 16-byte K tail (K = 200) and a whole one.
void stacked_epilogues(int64_t K, const std::vector<int64_t>& Ts, uint64_t seed) {
  Rng rng(seed);
  const float beta = 2.0f, lbeta = 1.5f;
  const int64_t F = 24, Nb = 20, Nf = 12, Na = 16;  // gate/up F rows each, then the bf16, f32, add segments
  const auto gate = rand_bf16(size_t(F * K), rng, -0.05f, 0.05f), up = rand_bf16(size_t(F * K), rng, -0.05f, 0.05f);
  const auto wb = rand_bf16(size_t(Nb * K), rng, -0.02f, 0.02f), wf = rand_bf16(size_t(Nf * K), rng, -0.02f, 0.02f);
  const auto wa = rand_bf16(size_t(Na * K), rng, -0.02f, 0.02f);
  const std::vector<uint16_t> w = testutil::glu_stack(gate, up, F, K, {&wb, &wf, &wa});
  const int64_t N = 2 * F + Nb + Nf + Na;
  for (int64_t T : Ts) {
    const auto x = rand_bf16(size_t(T * K), rng, -1.0f, 1.0f);
    const auto addend = rand_bf16(size_t(T * Na), rng, -1.0f, 1.0f);
    Out<uint16_t> ya(T, F, F + 3), yb(T, Nb, Nb + 1);
    Out<float> yf(T, Nf, Nf + 2);
    std::vector<uint16_t> yadd = addend;  // in place: y = bf16(bf16(acc) + y)
    cuda::GemmSegs s;
    s.glu_beta = beta, s.glu_linear_beta = lbeta;
    s.seg[0] = {0, ya.v.data(), ya.ld, cuda::GemmEpi::situ_glu8, nullptr, 0};
    s.seg[1] = {2 * F, yb.v.data(), yb.ld, cuda::GemmEpi::bf16, nullptr, 0};
    s.seg[2] = {2 * F + Nb, yf.v.data(), yf.ld, cuda::GemmEpi::f32, nullptr, 0};
    s.seg[3] = {2 * F + Nb + Nf, yadd.data(), Na, cuda::GemmEpi::add_bf16, yadd.data(), Na};
    s.n = 4;
    launch(x.data(), K * 2, w.data(), nullptr, nullptr, T, K, N, s, false, true, 3);
    std::vector<uint16_t> g(size_t(T * F)), u(size_t(T * F)), a(size_t(T * F)), rb(size_t(T * Nb)), ra(size_t(T * Na));
    std::vector<float> rf(size_t(T * Nf));
    cpu::gemm_bf16(x.data(), K, gate.data(), g.data(), F, T, K, F);
    cpu::gemm_bf16(x.data(), K, up.data(), u.data(), F, T, K, F);
    cpu::situ_glu(g.data(), u.data(), a.data(), T * F, beta, lbeta);
    cpu::gemm_bf16(x.data(), K, wb.data(), rb.data(), Nb, T, K, Nb);
    cpu::gemm_bf16_f32(x.data(), K, wf.data(), rf.data(), Nf, T, K, Nf);
    cpu::gemm_bf16(x.data(), K, wa.data(), ra.data(), Na, T, K, Na);
    for (size_t i = 0; i < ra.size(); ++i) ra[i] = f32_to_bf16(bf16_to_f32(ra[i]) + bf16_to_f32(addend[i]));
    const std::string shape = "stack K=" + std::to_string(K) + " T=" + std::to_string(T);
    // GLU: its inputs are ulp-close BF16 values, so the output is within a few ulps.
    expect_close(shape + " situ_glu8", to_f32(ya.packed()), to_f32(a), 1e-3, 4.0 / 128, 1e-2);
    expect_close(shape + " bf16", to_f32(yb.packed()), to_f32(rb), 1e-3, 1.0 / 128, 2e-3);
    expect_close(shape + " f32", yf.packed(), rf, 1e-5 * max_abs(rf) + 1e-6, 1e-4, 1e-5);
    expect_close(shape + " add_bf16 (in place)", to_f32(yadd), to_f32(ra), 1e-3, 2.0 / 128, 2e-3);
    EXPECT_TRUE(ya.padding_poisoned() && yb.padding_poisoned() && yf.padding_poisoned()) << shape;
  }
}

// PTPC FP8: codes and scales from cpu::quantize_fp8_rows, y against cpu::gemm_ptpc_fp8 (e4m3 products exact,
// FP32 sums in another order).
void fp8_matches_twin(int64_t K, int64_t N, const std::vector<int64_t>& Ts, int S0, uint64_t seed) {
  Rng rng(seed);
  const int64_t Tmax = *std::max_element(Ts.begin(), Ts.end());
  const auto x = rand_bf16(size_t(Tmax * K), rng, -1.0f, 1.0f);
  const auto w = rand_bf16(size_t(N * K), rng, -0.02f, 0.02f);
  std::vector<uint8_t> xq(size_t(Tmax * K)), wq(size_t(N * K));
  std::vector<float> xs(static_cast<size_t>(Tmax)), ws(static_cast<size_t>(N));
  cpu::quantize_fp8_rows(x.data(), K, Tmax, K, xq.data(), xs.data());
  cpu::quantize_fp8_rows(w.data(), K, N, K, wq.data(), ws.data());
  std::vector<uint16_t> ref_all(size_t(Tmax * N));
  cpu::gemm_ptpc_fp8(xq.data(), xs.data(), wq.data(), ws.data(), ref_all.data(), N, Tmax, K, N);
  const double scale = max_abs(to_f32(ref_all));
  for (int64_t T : Ts)
    for (bool staged : {true, false}) {
      if (!staged && T > 16) continue;
      Out<uint16_t> y(T, N, N);
      const int S = launch(xq.data(), K, wq.data(), xs.data(), ws.data(), T, K, N, one_seg(y.v.data(), N), true,
                           staged, S0);
      const std::string shape = "fp8 K=" + std::to_string(K) + " N=" + std::to_string(N) + " T=" + std::to_string(T) +
                                " S=" + std::to_string(S) + (staged ? " staged" : " registers");
      expect_close(shape + " vs cpu::gemm_ptpc_fp8", to_f32(y.packed()),
                   to_f32(std::vector<uint16_t>(ref_all.begin(), ref_all.begin() + T * N)), 2e-3 * scale, 1.0 / 128,
                   2e-3);
    }
}

// The router's top-k in the kernel's tail (GemmRoute): a stack [bf16 rows | router logits f32 [T, X] | bf16 rows
// (when `after`)] with the router's rows starting at row `off` (inside a 16-row tile or on its edge, so its rows
// span one or several tiles, each possibly split over CTAs). The ids and weights must be cpu::moe_route's on the
// logits the launch wrote, bit for bit (the emulation's expf is the twin's), and nothing past [T, Kt] written;
// the logits themselves within the f32 tolerance of cpu::gemm_bf16_f32.
enum class RouteLogits { random, ties, nan_bias };
void route_tail_matches_twin(int64_t K, int64_t off, int64_t X, int64_t Kt, bool after, const std::vector<int64_t>& Ts,
                             const std::vector<int>& S0s, RouteLogits kind, bool renorm, uint64_t seed) {
  Rng rng(seed);
  const int64_t Na = after ? 8 : 0, N = off + X + Na, Tmax = *std::max_element(Ts.begin(), Ts.end());
  const auto x = rand_bf16(size_t(Tmax * K), rng, -1.0f, 1.0f);
  auto w = rand_bf16(size_t(N * K), rng, -0.05f, 0.05f);
  std::vector<float> bias(static_cast<size_t>(X));
  for (auto& b : bias) b = rng.uniform(-0.1f, 0.1f);
  if (kind == RouteLogits::ties) {  // expert pairs with equal rows (equal logits, bit for bit) and no bias
    for (int64_t e = 1; e < X; e += 2)
      std::copy_n(w.begin() + (off + e - 1) * K, K, w.begin() + (off + e) * K);
    std::fill(bias.begin(), bias.end(), 0.0f);
  } else if (kind == RouteLogits::nan_bias) {  // NaN keys rank below every number
    for (int64_t e = 0; e < X; e += 3) bias[size_t(e)] = std::nanf("");
  }
  const float scaling = 2.5f;
  for (int S0 : S0s)
    for (int64_t T : Ts) {
      std::vector<uint16_t> ya(size_t(T * off + 1)), yc(size_t(T * Na + 1));
      Out<float> logits(T, X, X);
      std::vector<int32_t> ids(size_t(T * Kt + 4), -7);
      std::vector<float> wts(size_t(T * Kt + 4), -7.0f);
      cuda::GemmSegs s;
      s.seg[s.n++] = {0, ya.data(), off, cuda::GemmEpi::bf16, nullptr, 0};
      s.route = {s.n, bias.data(), int(Kt), renorm, scaling, ids.data(), wts.data()};
      s.seg[s.n++] = {off, logits.v.data(), X, cuda::GemmEpi::f32, nullptr, 0};
      if (after) s.seg[s.n++] = {off + X, yc.data(), Na, cuda::GemmEpi::bf16, nullptr, 0};
      const int S = launch(x.data(), K * 2, w.data(), nullptr, nullptr, T, K, N, s, false, true, S0);
      const std::string shape = "route K=" + std::to_string(K) + " off=" + std::to_string(off) + " X=" +
                                std::to_string(X) + " top-" + std::to_string(Kt) + " T=" + std::to_string(T) +
                                " S=" + std::to_string(S) + (after ? " +after" : "") +
                                (kind == RouteLogits::ties ? " ties" : kind == RouteLogits::nan_bias ? " NaN bias" : "");
      std::vector<float> ref_logits(size_t(T * X));
      cpu::gemm_bf16_f32(x.data(), K, w.data() + off * K, ref_logits.data(), X, T, K, X);
      expect_close(shape + " logits", logits.v, ref_logits, 1e-5 * max_abs(ref_logits) + 1e-6, 1e-4, 1e-5);
      std::vector<int32_t> rid(size_t(T * Kt));
      std::vector<float> rw(size_t(T * Kt));
      cpu::moe_route(logits.v.data(), bias.data(), T, X, Kt, renorm, scaling, rid.data(), rw.data());
      EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + T * Kt), rid) << shape << ": ids";
      EXPECT_EQ(0, std::memcmp(wts.data(), rw.data(), rw.size() * 4)) << shape << ": weights not bit-exact";
      for (int64_t i = T * Kt; i < T * Kt + 4; ++i)
        EXPECT_TRUE(ids[size_t(i)] == -7 && wts[size_t(i)] == -7.0f) << shape << ": wrote past [T, K]";
    }
}

// Every shape table runs in scripts/test.sh (about 6 s on the 2-core CI machine): each instantiation (NT = 1,
// 2 staged and in registers, 4, 8) at every bucket boundary of T, unsplit and split over CTAs, K with a 16-byte
// tail (bf16 K = 200), an 80-byte one (fp8 K = 208) and whole steps.
TEST(EmuGemm, SkinnyBf16Shapes) {
  for (int64_t K : {200, 512, 1024})
    for (int64_t N : {16, 24, 40}) bf16_matches_twin(K, N, {1, 5, 8, 9, 16, 17, 32, 33, 64}, {1, 3, 8}, uint64_t(K + N));
}
TEST(EmuGemm, SkinnyStackedEpilogues) {
  for (int64_t K : {200, 1024}) stacked_epilogues(K, {1, 7, 16, 40, 64}, uint64_t(K));
}
TEST(EmuGemm, SkinnyFp8Shapes) {
  for (int64_t K : {208, 1024})
    for (int S0 : {1, 4}) fp8_matches_twin(K, 40, {1, 8, 16, 17, 33, 64}, S0, uint64_t(K + S0));
}

// The reduced mini's router (4 experts, top-2, its rows inside one tile after 5,120 others: here 40), the mini's
// EP share (112, top-2) and nano's (16, top-4), the bound (256 experts, 8 slots a lane; 32 picks), ties, NaN keys,
// several tiles each split over CTAs (S0 = 3), T from 1 to 16 (all four warps route).
TEST(EmuGemm, SkinnyRouteTailMatchesTwin) {
  route_tail_matches_twin(256, 40, 4, 2, false, {1, 3, 16}, {1, 3}, RouteLogits::random, true, 71);
  route_tail_matches_twin(256, 37, 112, 2, true, {1, 5}, {1, 3}, RouteLogits::random, true, 72);
  route_tail_matches_twin(200, 16, 16, 4, true, {2, 9}, {1}, RouteLogits::ties, true, 73);
  route_tail_matches_twin(256, 3, 256, 32, false, {1, 4}, {3}, RouteLogits::random, false, 74);
  route_tail_matches_twin(256, 21, 40, 8, true, {6}, {1, 3}, RouteLogits::nan_bias, true, 75);
  route_tail_matches_twin(256, 0, 5, 5, true, {2}, {1}, RouteLogits::random, true, 76);  // every expert picked
  // The tail's flag crosses a barrier and the counter CTAs: every schedule gives the twin's bits.
  for (const simt::Schedule sch : {simt::Schedule::threads_reverse, simt::Schedule::warps, simt::Schedule::warps_reverse,
                                   simt::Schedule::ctas}) {
    simt::g_schedule = sch;
    route_tail_matches_twin(256, 37, 112, 2, true, {5}, {3}, RouteLogits::random, true, 77);
    simt::g_schedule = simt::Schedule::threads;
  }
}

// Results must not depend on the order threads run in: a missing barrier or cp.async wait lets some schedule read
// shared memory not yet written (NaN-poisoned) or already overwritten (the CTA's warp-order sum, the staged ring).
TEST(EmuGemm, SkinnyScheduleOrderDoesNotMatter) {
  Rng rng(61);
  const int64_t K = 1024, N = 40, Tmax = 40;
  const auto x = rand_bf16(size_t(Tmax * K), rng, -1.0f, 1.0f);
  const auto w = rand_bf16(size_t(N * K), rng, -0.02f, 0.02f);
  struct Case {
    int64_t T;
    bool staged;
  };
  for (const Case c : {Case{5, true}, Case{12, true}, Case{5, false}, Case{33, false}}) {
    std::vector<uint16_t> first;
    for (const simt::Schedule sch : {simt::Schedule::threads, simt::Schedule::threads_reverse, simt::Schedule::warps,
                                     simt::Schedule::warps_reverse, simt::Schedule::ctas}) {
      simt::g_schedule = sch;
      std::vector<uint16_t> y(size_t(c.T * N));
      launch(x.data(), K * 2, w.data(), nullptr, nullptr, c.T, K, N, one_seg(y.data(), N), false, c.staged, 4);
      simt::g_schedule = simt::Schedule::threads;
      if (first.empty()) first = y;
      EXPECT_EQ(0, std::memcmp(y.data(), first.data(), y.size() * 2))
          << "T=" << c.T << (c.staged ? " staged" : " registers") << " schedule " << int(sch);
    }
  }
}

}  // namespace
}  // namespace kestrel
