// The CPU engine's vectorised kernels (*_fast, kernels/cpu/*_fast.cpp) against their scalar twins, the
// SIMD math against double precision, and the thread pool.
//
// Tolerances, and why:
//  - exp / tanh (simd_avx2.h): ≤ 2 / 3 ulp against the double-precision function on ~1e6 points.
//  - Ops whose only difference is that math and FMA contraction (SiTU-GLU, gates, conv, norms), then
//    a BF16 rounding: ≤ 1 BF16 ulp per element, and at most 1 % of elements differ at all (an f32
//    difference of a few ulps flips the rounding for about 2^-14 of values).
//  - FP32 results before any rounding (KDA scan, attention ô): relative L2 ≤ 1e-5.
//  - Exact where the twin's order is the contract: indexer scores and top-k (the GPU repeats the twin),
//    topk_sorted against topk + sort, add_bf16, RMSNorm.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kda_ops.h"
#include "kernels/cpu/kda_scan.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cpu/moe_ops.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel {
namespace {

bool have_avx2() { return cpu::detected_isa() >= cpu::Isa::avx2; }

std::vector<uint16_t> fast_rand_bf16(size_t n, std::mt19937_64& rng, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}

double ulps(float a, double ref) {
  if (double(a) == ref) return 0;
  const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(ref), 1e-37)) - 23);
  return std::fabs(double(a) - ref) / ulp;
}

// |a − b| in BF16 ulps of b, and how many elements differ at all.
void expect_bf16_close(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  size_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    ++diff;
    const float fa = bf16_to_f32(a[i]), fb = bf16_to_f32(b[i]);
    const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(fb), 1e-30f)) - 7);
    ASSERT_LE(std::fabs(fa - fb), ulp * 1.01f) << what << " element " << i << ": " << fa << " vs " << fb;
  }
  EXPECT_LE(double(diff), 0.01 * double(a.size()) + 1) << what << ": " << diff << " of " << a.size() << " differ";
}

double fast_rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, 1e-300));
}

KESTREL_AVX2 void simd_exp_tanh(const float* x, float* e, float* t, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(e + i, cpu::simd::exp(_mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(t + i, cpu::simd::tanh(_mm256_loadu_ps(x + i)));
  }
}

TEST(SimdMath, ExpAndTanhWithinAFewUlps) {
  if (!have_avx2()) GTEST_SKIP() << "no AVX2";
  // ~2e6 points when optimised; 10x fewer in the -O0 sanitizer build (CI time), same ranges.
#ifdef __OPTIMIZE__
  const float sparse = 1.0f;
#else
  const float sparse = 10.0f;
#endif
  std::vector<float> x;
  for (float v = -100.0f; v <= 90.0f; v += 0.000371f * sparse) x.push_back(v);
  for (float v = -1.0f; v <= 1.0f; v += 1.3e-6f * sparse) x.push_back(v);  // tanh's polynomial range, densely
  x.resize(x.size() / 8 * 8);
  std::vector<float> e(x.size()), t(x.size());
  simd_exp_tanh(x.data(), e.data(), t.data(), int64_t(x.size()));
  double we = 0, wt = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double re = std::exp(double(x[i])), rt = std::tanh(double(x[i]));
    if (re < 1.1754943508222875e-38) {  // subnormal results: absolute error at the smallest normal's ulp
      EXPECT_LE(std::fabs(double(e[i]) - re), 2.0 * 1.4e-45 * 2) << x[i];
    } else if (re <= double(std::numeric_limits<float>::max())) {  // finite up to ln(FLT_MAX) ≈ 88.7228
      we = std::max(we, ulps(e[i], re));
    } else {
      EXPECT_TRUE(std::isinf(e[i])) << x[i];
    }
    wt = std::max(wt, ulps(t[i], rt));
  }
  EXPECT_LE(we, 2.0);
  EXPECT_LE(wt, 3.0);
  RecordProperty("exp_max_ulps", std::to_string(we));
  RecordProperty("tanh_max_ulps", std::to_string(wt));
  const float odd[8] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-30f, -1e-30f, 88.8f};
  float oe[8], ot[8];
  simd_exp_tanh(odd, oe, ot, 8);
  EXPECT_TRUE(std::isnan(oe[0]) && std::isnan(ot[0]));
  EXPECT_TRUE(std::isinf(oe[1]) && ot[1] == 1.0f);
  EXPECT_TRUE(oe[2] == 0.0f && ot[2] == -1.0f);
  EXPECT_TRUE(oe[3] == 1.0f && ot[3] == 0.0f && oe[4] == 1.0f);
  EXPECT_EQ(ot[5], 1e-30f);
  EXPECT_EQ(ot[6], -1e-30f);
  EXPECT_TRUE(std::isinf(oe[7]));
}

// Shape tables: small, with sizes below, at and past a vector width and with every tail length the
// kernels have (the ASan build runs these at -O0, so they stay a few thousand elements).
TEST(KernelsFast, SituGateAddAgainstTwins) {
  std::mt19937_64 rng(21);
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 31, 33, 5003}) {  // vector widths 8 and 16; scalar tails
  SCOPED_TRACE("n=" + std::to_string(n));
  const auto g = fast_rand_bf16(size_t(n), rng, 3.0f), u = fast_rand_bf16(size_t(n), rng, 30.0f);
  std::vector<uint16_t> a(static_cast<size_t>(n)), b(a.size());
  cpu::situ_glu(g.data(), u.data(), a.data(), n, 4.0f, 25.0f);
  cpu::situ_glu_fast(g.data(), u.data(), b.data(), n, 4.0f, 25.0f);
  expect_bf16_close(b, a, "situ_glu");
  std::vector<uint16_t> oa = g, ob = g;
  for (int64_t i = 0; i < n; ++i) oa[size_t(i)] = f32_to_bf16(bf16_to_f32(g[size_t(i)]) * cpu::sigmoid(bf16_to_f32(u[size_t(i)])));
  cpu::sigmoid_gate_bf16(ob.data(), u.data(), n);
  expect_bf16_close(ob, oa, "sigmoid gate");
  std::vector<uint16_t> s(a.size());
  cpu::add_bf16(g.data(), u.data(), s.data(), n);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(s[size_t(i)], f32_to_bf16(bf16_to_f32(g[size_t(i)]) + bf16_to_f32(u[size_t(i)]))) << i;
  }
}

TEST(KernelsFast, AttnResMixRowsAgainstScalarPath) {
  std::mt19937_64 rng(22);
  for (auto [T, D, n] : {std::tuple<int64_t, int64_t, int>{37, 260, 4}, {1, 1, 1}, {3, 7, 2}, {2, 17, 3}, {5, 64, 9}}) {
  SCOPED_TRACE("T=" + std::to_string(T) + " D=" + std::to_string(D) + " n=" + std::to_string(n));
  std::vector<std::vector<uint16_t>> src;
  for (int i = 0; i < n; ++i) src.push_back(fast_rand_bf16(size_t(T * D), rng, 1.0f + float(i)));
  std::vector<const uint16_t*> p;
  for (auto& v : src) p.push_back(v.data());
  std::vector<float> u(static_cast<size_t>(D));
  std::normal_distribution<float> nd;
  for (auto& v : u) v = 0.1f * nd(rng);
  std::vector<uint16_t> a(size_t(T * D)), b(a.size());
  {
    cpu::force_isa(cpu::Isa::portable);
    cpu::attn_res_mix_rows(p.data(), n, u.data(), 1e-5f, T, D, a.data());
    cpu::force_isa(cpu::Isa::avx512bf16);
  }
  cpu::attn_res_mix_rows(p.data(), n, u.data(), 1e-5f, T, D, b.data());
  expect_bf16_close(b, a, "attn_res mix");
  }
}

TEST(KernelsFast, KdaOpsAndScanAgainstTwins) {
  std::mt19937_64 rng(23);
  std::normal_distribution<float> nd;
  // Dk below, at and past the 8- and 32-wide chunks, with tails; T = 1 is a decode step.
  for (auto [T, H, Dk, W] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{41, 3, 40, 4}, {1, 1, 8, 4}, {7, 2, 13, 2},
                             {5, 1, 64, 4}, {3, 2, 33, 3}}) {
  SCOPED_TRACE("T=" + std::to_string(T) + " H=" + std::to_string(H) + " Dk=" + std::to_string(Dk));
  const int64_t HD = H * Dk;
  // Conv + SiLU through the history.
  const auto x = fast_rand_bf16(size_t(T * HD), rng);
  std::vector<float> w(size_t(HD * W));
  for (auto& v : w) v = 0.5f * nd(rng);
  std::vector<uint16_t> h1(size_t((W - 1) * HD)), h2;
  for (auto& v : h1) v = f32_to_bf16(nd(rng));
  h2 = h1;
  std::vector<float> y1(size_t(T * HD)), y2(y1.size());
  cpu::kda_conv_silu(x.data(), HD, w.data(), h1.data(), y1.data(), HD, T, HD, W);
  cpu::kda_conv_silu_fast(x.data(), HD, w.data(), h2.data(), y2.data(), HD, T, HD, W);
  EXPECT_EQ(h1, h2) << "the history shifts identically";
  std::vector<uint16_t> b1(y1.size()), b2(y2.size());
  cpu::f32_to_bf16_n(y1.data(), b1.data(), int64_t(y1.size()));
  cpu::f32_to_bf16_n(y2.data(), b2.data(), int64_t(y2.size()));
  expect_bf16_close(b2, b1, "conv silu");
  // Norms and gates.
  std::vector<float> q1(size_t(T * HD)), k1(q1.size());
  for (auto& v : q1) v = nd(rng);
  for (auto& v : k1) v = nd(rng);
  std::vector<float> q2 = q1, k2 = k1, v(q1.size());
  for (auto& e : v) e = nd(rng);
  const auto z = fast_rand_bf16(size_t(T * HD), rng), bl = fast_rand_bf16(size_t(T * H), rng);
  std::vector<float> dt(static_cast<size_t>(HD)), alog(static_cast<size_t>(H));
  for (auto& e : dt) e = nd(rng);
  for (auto& e : alog) e = 0.3f * nd(rng);
  std::vector<float> g1(size_t(T * HD)), g2(g1.size()), be1(size_t(T * H)), be2(be1.size());
  cpu::kda_qk_norm_gates(q1.data(), k1.data(), z.data(), dt.data(), alog.data(), bl.data(), -5.0f, g1.data(), be1.data(), T, H, Dk);
  cpu::kda_qk_norm_gates_fast(q2.data(), k2.data(), z.data(), dt.data(), alog.data(), bl.data(), -5.0f, g2.data(), be2.data(), T, H, Dk);
  EXPECT_LT(fast_rel_l2(q2, q1), 1e-6);
  EXPECT_LT(fast_rel_l2(k2, k1), 1e-6);
  EXPECT_LT(fast_rel_l2(g2, g1), 1e-6);
  EXPECT_EQ(be2, be1);
  // The recurrent scan from the same non-zero state, over all T tokens.
  for (int64_t h = 0; h < H; ++h) {
    std::vector<float> S1(size_t(Dk * Dk)), S2, o1(size_t(T * HD), 0.0f), o2(o1.size(), 0.0f);
    for (auto& e : S1) e = 0.1f * nd(rng);
    S2 = S1;
    const cpu::KdaHeadIo io1{q1.data() + h * Dk, k1.data() + h * Dk, v.data() + h * Dk, g1.data() + h * Dk,
                             be1.data() + h, HD, H, o1.data() + h * Dk};
    cpu::KdaHeadIo io2 = io1;
    io2.o = o2.data() + h * Dk;
    cpu::kda_scan_recurrent(io1, T, Dk, S1.data());
    cpu::kda_scan_recurrent_fast(io2, T, Dk, S2.data());
    EXPECT_LT(fast_rel_l2(S2, S1), 1e-5) << "head " << h;
    EXPECT_LT(fast_rel_l2(o2, o1), 1e-5) << "head " << h;
  }
  // Output norm and gate.
  const auto gate = fast_rand_bf16(size_t(T * HD), rng);
  std::vector<float> onorm(static_cast<size_t>(Dk));
  for (auto& e : onorm) e = 1.0f + 0.1f * nd(rng);
  std::vector<uint16_t> oh1(size_t(T * HD)), oh2(oh1.size());
  cpu::kda_out_norm_gate(q1.data(), gate.data(), onorm.data(), 1e-5f, oh1.data(), T, H, Dk);
  cpu::kda_out_norm_gate_fast(q1.data(), gate.data(), onorm.data(), 1e-5f, oh2.data(), T, H, Dk);
  expect_bf16_close(oh2, oh1, "kda out norm gate");
  }
}

TEST(KernelsFast, MlaAbsorbedAgainstTwinWithSelectionAndDense) {
  if (!have_avx2()) GTEST_SKIP() << "no AVX2 (the fast path is the twin)";
  std::mt19937_64 rng(24);
  // {Hm, N, R, Dv, C}: C = 80 is one 4-group chunk and one 16-group; C = 40 leaves an 8-element tail,
  // C + R = 45 a 13-element tail in the scores; T, pos0 and Ks give key counts with and without an
  // 8-key tail; Hm = 6 with C = 160: the AVX-512 kernel's 4 + 2 heads and 64 + 64 + 32 columns.
  for (auto [d, T, pos0, Ks] : {std::tuple<cpu::MlaDims, int64_t, int64_t, int64_t>{{3, 24, 16, 32, 80}, 9, 50, 20},
                                {{1, 8, 5, 8, 40}, 1, 0, 1}, {{2, 16, 8, 24, 16}, 4, 13, 9}, {{2, 8, 16, 16, 64}, 2, 70, 16},
                                {{6, 16, 8, 16, 160}, 3, 40, 23}, {{4, 48, 16, 64, 128}, 5, 30, 17},
                                {{8, 16, 8, 16, 40}, 2, 9, 6}}) {
  SCOPED_TRACE("C=" + std::to_string(d.C) + " R=" + std::to_string(d.R) + " T=" + std::to_string(T));
  const int64_t S = pos0 + T;
  const auto q = fast_rand_bf16(size_t(T * d.Hm * d.qk()), rng), kvb = fast_rand_bf16(size_t(d.Hm * (d.N + d.Dv) * d.C), rng, 0.2f);
  const auto lat = fast_rand_bf16(size_t(S * d.cw()), rng);
  std::vector<int32_t> sel(size_t(T * Ks), -1);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(pos0 + t + 1));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const int64_t n = t == 0 ? std::min<int64_t>(7, pos0 + 1) : std::min(Ks, pos0 + t + 1);  // short lists, −1 padded
    std::sort(all.begin(), all.begin() + n);
    std::copy(all.begin(), all.begin() + n, sel.begin() + t * Ks);
  }
  for (const int32_t* s : {(const int32_t*)sel.data(), (const int32_t*)nullptr}) {
    std::vector<uint16_t> a(size_t(T * d.Hm * d.Dv)), b(a.size());
    cpu::mla_attn_absorbed(d, q.data(), kvb.data(), lat.data(), s, Ks, T, pos0, a.data());
    cpu::mla_attn_absorbed_fast(d, q.data(), kvb.data(), lat.data(), s, Ks, T, pos0, b.data());
    expect_bf16_close(b, a, s ? "mla absorbed (selection)" : "mla absorbed (dense)");
  }
  }
}

// The AVX2 scan runs a call's tokens column chunk by column chunk with two tokens' passes fused; a
// token must still get exactly what a scan of it alone gives (decode, chunked prefill, any batch).
// Dk: 64 (k3-tiny), 40 (16-chunks and an 8-chunk), 13 and 33 (scalar tails), 8.
TEST(KernelsFast, KdaScanRunEqualsTokenByTokenBitForBit) {
  std::mt19937_64 rng(32);
  std::normal_distribution<float> nd;
  for (int64_t Dk : {64, 40, 13, 33, 8}) {
    SCOPED_TRACE("Dk=" + std::to_string(Dk));
    const int64_t T = 9, H = 2, HD = H * Dk;
    std::vector<float> q(size_t(T * HD)), k(q.size()), v(q.size()), g(q.size()), beta(size_t(T * H));
    for (auto* x : {&q, &k, &v}) for (auto& e : *x) e = 0.3f * nd(rng);
    for (auto& e : g) e = -std::abs(nd(rng));
    for (auto& e : beta) e = 0.5f + 0.1f * nd(rng);
    std::vector<float> S0(size_t(Dk * Dk));
    for (auto& e : S0) e = 0.1f * nd(rng);
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float> S1 = S0, S2 = S0, o1(q.size(), 0.0f), o2(q.size(), 0.0f);
      const cpu::KdaHeadIo run{q.data() + h * Dk, k.data() + h * Dk, v.data() + h * Dk, g.data() + h * Dk,
                               beta.data() + h, HD, H, o1.data() + h * Dk};
      cpu::kda_scan_recurrent_fast(run, T, Dk, S1.data());
      for (int64_t t = 0; t < T; ++t) {
        const int64_t off = t * HD + h * Dk;
        const cpu::KdaHeadIo one{q.data() + off, k.data() + off, v.data() + off, g.data() + off,
                                 beta.data() + t * H + h, HD, H, o2.data() + off};
        cpu::kda_scan_recurrent_fast(one, 1, Dk, S2.data());
      }
      for (size_t i = 0; i < S1.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(S1[i]), std::bit_cast<uint32_t>(S2[i])) << "state element " << i;
      for (size_t i = 0; i < o1.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(o1[i]), std::bit_cast<uint32_t>(o2[i])) << "output element " << i;
    }
  }
}

// The AVX2 latent attention takes a query's heads four at a time, sharing each widened latent row;
// every (query, head) must keep the pair kernel's arithmetic exactly. Shapes: Hm = 4 (k3-tiny), 8
// (two groups), 6 and 5 (a group and a remainder run by the pair kernel), 3 (remainder only); C with
// and without a tail past 16-groups; C + R with a score tail; key counts 0, 1, odd; selection and dense.
TEST(KernelsFast, MlaLatentFourHeadsBitIdenticalToPairs) {
  if (!have_avx2()) GTEST_SKIP() << "no AVX2";
  std::mt19937_64 rng(31);
  std::normal_distribution<float> nd;
  cpu::force_isa(cpu::Isa::avx2);  // on avx512bf16 CPUs mla_attn_latent_fast would take its own kernel
  for (auto [d, T, pos0, Ks] : {std::tuple<cpu::MlaDims, int64_t, int64_t, int64_t>{{4, 48, 16, 64, 128}, 6, 40, 19},
                                {{8, 16, 8, 16, 40}, 3, 5, 4}, {{6, 16, 13, 16, 80}, 4, 21, 9},
                                {{5, 8, 8, 8, 48}, 2, 0, 1}, {{3, 8, 5, 8, 32}, 3, 11, 7}}) {
    SCOPED_TRACE("Hm=" + std::to_string(d.Hm) + " C=" + std::to_string(d.C) + " R=" + std::to_string(d.R));
    const int64_t S = pos0 + T, CW = d.cw();
    std::vector<float> qt(size_t(T * d.Hm * CW));
    for (auto& v : qt) v = nd(rng);
    const auto lat = fast_rand_bf16(size_t(S * CW), rng);
    std::vector<int32_t> sel(size_t(T * Ks), -1);  // query 0 sees nothing (all −1), the others up to Ks keys
    for (int64_t t = 1; t < T; ++t) {
      std::vector<int32_t> all(static_cast<size_t>(pos0 + t + 1));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      const int64_t n = std::min(Ks, pos0 + t + 1 - (t % 2));
      std::sort(all.begin(), all.begin() + n);
      std::copy(all.begin(), all.begin() + n, sel.begin() + t * Ks);
    }
    for (const int32_t* s : {(const int32_t*)sel.data(), (const int32_t*)nullptr}) {
      std::vector<float> a(size_t(T * d.Hm * d.C), -1.0f), b(a.size(), -2.0f);
      cpu::mla_attn_latent_pairs(d, qt.data(), lat.data(), s, Ks, T, pos0, a.data());
      cpu::mla_attn_latent_fast(d, qt.data(), lat.data(), s, Ks, T, pos0, b.data());
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(b[i]), std::bit_cast<uint32_t>(a[i]))
            << (s ? "selection" : "dense") << " element " << i;
    }
  }
  cpu::force_isa(cpu::Isa::avx512bf16);
}

TEST(KernelsFast, TopkSortedEqualsTopkThenSort) {
  std::mt19937_64 rng(25);
#ifdef __OPTIMIZE__
  const int reps = 300;
#else
  const int reps = 60;  // the -O0 sanitizer build (CI time)
#endif
  for (int rep = 0; rep < reps; ++rep) {
    const int64_t n = 1 + int64_t(rng() % 3000), k = int64_t(rng() % uint64_t(n + 1));
    std::vector<float> x(static_cast<size_t>(n));
    const int kind = rep % 5;
    for (auto& v : x) {
      const uint64_t r = rng();
      if (kind == 0) v = float(int(r % 7)) - 3.0f;            // heavy ties
      else if (kind == 1) v = std::ldexp(float(r % 1000), -int(r % 40));
      else if (kind == 4) v = 0.5f + std::ldexp(float(r % 5000), -24);  // one exponent, as a query's scores
      else v = float(std::normal_distribution<float>()(rng));
      if (kind == 3 && r % 17 == 0) v = (r % 2) ? NAN : -INFINITY;
      if (kind == 3 && r % 23 == 0) v = (r % 2) ? 0.0f : -0.0f;
    }
    std::vector<int32_t> a(static_cast<size_t>(k)), b(static_cast<size_t>(k));
    cpu::topk(x.data(), n, k, a.data());
    std::sort(a.begin(), a.end());
    cpu::topk_sorted(x.data(), n, k, b.data());
    ASSERT_EQ(a, b) << "rep " << rep << " n=" << n << " k=" << k;
  }
}

TEST(KernelsFast, IndexerSelectionIsBitIdenticalToTwin) {
  std::mt19937_64 rng(26);
  for (auto [Hi, Di, Ki, T, pos0] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{4, 32, 16, 9, 40},
                                     {3, 20, 8, 30, 0}, {5, 16, 64, 3, 500}, {2, 32, 64, 70, 0}}) {
    const int64_t S = pos0 + T;
    const auto qi = fast_rand_bf16(size_t(T * Hi * Di), rng), keys = fast_rand_bf16(size_t(S * Di), rng);
    std::vector<float> hw(size_t(T * Hi));
    std::normal_distribution<float> nd;
    for (auto& v : hw) v = nd(rng);
    hw[0] = 0.0f;  // ties: a zero weight
    std::vector<int32_t> a(size_t(T * Ki)), b(a.size());
    cpu::indexer_select_topk(qi.data(), keys.data(), hw.data(), T, pos0, Hi, Di, Ki, a.data());
    for (cpu::Isa i : {cpu::detected_isa(), cpu::Isa::portable}) {
      cpu::force_isa(i);
      cpu::indexer_select_topk_fast(qi.data(), keys.data(), hw.data(), T, pos0, Hi, Di, Ki, b.data());
      cpu::force_isa(cpu::Isa::avx512bf16);
      ASSERT_EQ(a, b) << cpu::isa_name(i) << " Hi=" << Hi << " Di=" << Di << " T=" << T << " pos0=" << pos0;
    }
  }
}

TEST(KernelsFast, MoeExpertsFastMatchesTwin) {
  std::mt19937_64 rng(27);
  std::normal_distribution<float> nd;
  const int64_t X = 6, K = 2;
  // T ≤ 3 takes the in-register decode path of the MXFP4 product, larger T the panel path; Lt / I
  // below and past one 16-row panel.
  for (auto [Lt, I, T] : {std::tuple<int64_t, int64_t, int64_t>{64, 96, 23}, {32, 32, 1}, {64, 32, 2}, {32, 160, 3},
                          {96, 64, 7}}) {
  SCOPED_TRACE("Lt=" + std::to_string(Lt) + " I=" + std::to_string(I) + " T=" + std::to_string(T));
  struct M {
    std::vector<uint8_t> p, s;
  };
  std::vector<M> m(size_t(3 * X));
  auto make = [&](M& mm, int64_t rows, int64_t cols) {
    mm.p.resize(size_t(rows * cols / 2)), mm.s.resize(size_t(rows * cols / 32));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cols / 32; ++b) {
        float blk[32];
        for (float& v : blk) v = nd(rng) * 0.2f;
        mm.s[size_t(r * (cols / 32) + b)] = mxfp4_quantize_block(blk, &mm.p[size_t(r * (cols / 2) + b * 16)]);
      }
  };
  std::vector<cpu::ExpertPtrs> ex(static_cast<size_t>(X));
  for (int64_t e = 0; e < X; ++e) {
    make(m[size_t(3 * e)], I, Lt), make(m[size_t(3 * e + 1)], I, Lt), make(m[size_t(3 * e + 2)], Lt, I);
    ex[size_t(e)] = {{m[size_t(3 * e)].p.data(), m[size_t(3 * e)].s.data()},
                     {m[size_t(3 * e + 1)].p.data(), m[size_t(3 * e + 1)].s.data()},
                     {m[size_t(3 * e + 2)].p.data(), m[size_t(3 * e + 2)].s.data()}};
  }
  const auto z = fast_rand_bf16(size_t(T * Lt), rng);
  std::vector<int32_t> ids(size_t(T * K));
  std::vector<float> wts(ids.size());
  for (int64_t t = 0; t < T; ++t) {
    ids[size_t(t * K)] = int32_t(t % X), ids[size_t(t * K + 1)] = int32_t((t * 7 + 1) % X);
    if (ids[size_t(t * K + 1)] == ids[size_t(t * K)]) ids[size_t(t * K + 1)] = int32_t((t + 1) % X);
    wts[size_t(t * K)] = 0.6f, wts[size_t(t * K + 1)] = 0.4f;
  }
  ids[0] = 5, ids[1] = 4;  // expert 5 has a single token (when T < 6)
  std::vector<uint16_t> a(size_t(T * Lt)), b(a.size());
  cpu::moe_experts(z.data(), ids.data(), wts.data(), ex.data(), T, X, K, Lt, I, 4.0f, 25.0f, a.data());
  cpu::moe_experts_fast(z.data(), ids.data(), wts.data(), ex.data(), T, X, K, Lt, I, 4.0f, 25.0f, b.data());
  expect_bf16_close(b, a, "moe experts");
  }
}

TEST(ThreadPool, CoversEveryIndexOnceNestsAndRethrows) {
  for (int threads : {1, 2, 3}) {
    cpu::set_num_threads(threads);
    EXPECT_EQ(cpu::num_threads(), threads);
    for (int64_t n : {int64_t(1), int64_t(5), int64_t(1000)}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      cpu::parallel_for(n, int64_t(1) << 30, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          hits[size_t(i)]++;
          // A nested loop runs inline in the task and still covers its range.
          int64_t inner = 0;
          cpu::parallel_for(3, int64_t(1) << 30, [&](int64_t b2, int64_t e2) { inner += e2 - b2; });
          EXPECT_EQ(inner, 3);
        }
      });
      for (auto& h : hits) ASSERT_EQ(h.load(), 1);
      std::vector<std::atomic<int>> each(static_cast<size_t>(n));
      cpu::parallel_for_each(n, int64_t(1) << 30, [&](int64_t i) { each[size_t(i)]++; });
      for (auto& h : each) ASSERT_EQ(h.load(), 1);
    }
    // The range holding the last index fails: with 1 thread that is the caller's only range, else
    // whichever thread claims it.
    EXPECT_THROW(cpu::parallel_for(100, int64_t(1) << 30,
                                   [](int64_t b, int64_t e) {
                                     if (e == 100) fail("task [{}, {}) failed", b, e);
                                   }),
                 Error);
    // The pool still works after an exception.
    std::atomic<int64_t> sum{0};
    cpu::parallel_for(100, int64_t(1) << 30, [&](int64_t b, int64_t e) { sum += e - b; });
    EXPECT_EQ(sum.load(), 100);
  }
  cpu::set_num_threads(0);
}

}  // namespace
}  // namespace kestrel
