// CPU kernels against plain scalar twins written here, over a few shapes with random inputs.
//
// Tolerances: GEMM paths accumulate in FP32 (sequentially over k) against a double-precision twin, so
// FP32 outputs must agree to 2e-5 relative to the row's |x|·|w| mass; BF16 outputs may then differ
// by one BF16 ulp where the FP32 sum sits next to a rounding boundary. Exact (==) where the order is
// the contract: avx2 vs portable GEMM and MXFP4 (gemm_kernels.h), and row / thread / packing
// invariance on every ISA the CPU has (the CPU engine's batch invariance rests on it). The avx512bf16
// MXFP4 product (ORDER_B32) has the GEMM tolerance and the exact invariances.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <tuple>
#include <random>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel {
namespace {

std::vector<uint16_t> rand_bf16(size_t n, std::mt19937_64& rng, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}

// |a − b| measured in BF16 ulps of b.
float bf16_ulps(float a, float b) {
  if (a == b) return 0.0f;
  const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(b), 1e-30f)) - 7);
  return std::fabs(a - b) / ulp;
}

struct GemmShape {
  int64_t T, in, out;
};

void check_gemm(const GemmShape& s, std::mt19937_64& rng) {
  const auto x = rand_bf16(size_t(s.T * s.in), rng);
  const auto w = rand_bf16(size_t(s.out * s.in), rng, 0.1f);
  std::vector<float> y(size_t(s.T * s.out));
  std::vector<uint16_t> yb(size_t(s.T * s.out));
  cpu::gemm_bf16_f32(x.data(), s.in, w.data(), y.data(), s.out, s.T, s.in, s.out);
  cpu::gemm_bf16(x.data(), s.in, w.data(), yb.data(), s.out, s.T, s.in, s.out);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t r = 0; r < s.out; ++r) {
      double ref = 0.0, mass = 0.0;
      for (int64_t c = 0; c < s.in; ++c) {
        const double p = double(bf16_to_f32(x[size_t(t * s.in + c)])) * bf16_to_f32(w[size_t(r * s.in + c)]);
        ref += p;
        mass += std::fabs(p);
      }
      const size_t i = size_t(t * s.out + r);
      ASSERT_NEAR(y[i], ref, 2e-5 * mass + 1e-30) << "T=" << s.T << " in=" << s.in << " t=" << t << " r=" << r;
      ASSERT_EQ(yb[i], f32_to_bf16(y[i])) << "bf16 output is the rounded f32 output";
      ASSERT_LE(bf16_ulps(bf16_to_f32(yb[i]), float(ref)), 1.0f + float(2e-5 * mass / std::max(std::fabs(ref), 1e-30)) * 256);
    }
}

// The ISAs this CPU can run, best first (the tests force each in turn).
std::vector<cpu::Isa> isas() {
  std::vector<cpu::Isa> v;
  for (int i = int(cpu::detected_isa()); i >= 0; --i) v.push_back(cpu::Isa(i));
  return v;
}
struct IsaCap {
  explicit IsaCap(cpu::Isa i) { cpu::force_isa(i); }
  ~IsaCap() { cpu::force_isa(cpu::Isa::avx512bf16); }
};

TEST(KernelsCpu, GemmMatchesScalarTwinAllPaths) {
  std::mt19937_64 rng(1);
  // Odd K (the kPairs layout pads), N past and below a 16-wide panel, T past the 6-row micro-tile;
  // sized for the -O0 ASan build (the double twin is the cost).
  const GemmShape shapes[] = {{1, 256, 64}, {1, 300, 129}, {1, 4096, 48}, {3, 256, 64}, {17, 96, 33},
                              {64, 128, 80}, {7, 33, 17}, {2, 255, 47}, {1, 1, 1}, {4, 3, 5}, {13, 2, 16}};
  for (cpu::Isa i : isas()) {
    IsaCap cap(i);
    for (const auto& s : shapes) check_gemm(s, rng);
  }
}

// Every path, every shape: one call over T rows equals the rows run alone and in other groups, with
// 1 or 2 threads, with or without packed weights — bit for bit. avx2 equals portable bit for bit.
TEST(KernelsCpu, GemmRowThreadAndPackingInvariantAndAvx2EqualsPortable) {
  std::mt19937_64 rng(7);
  const GemmShape shapes[] = {{13, 256, 200}, {9, 64, 16}, {20, 37, 33}, {6, 1024, 40}};
  for (const auto& s : shapes) {
    const auto x = rand_bf16(size_t(s.T * s.in), rng);
    const auto w = rand_bf16(size_t(s.out * s.in), rng, 0.1f);
    std::vector<std::vector<float>> per_isa;
    for (cpu::Isa i : isas()) {
      IsaCap cap(i);
      std::vector<float> all(size_t(s.T * s.out)), part(all.size());
      cpu::set_num_threads(2);
      cpu::gemm_bf16_f32(x.data(), s.in, w.data(), all.data(), s.out, s.T, s.in, s.out);
      cpu::set_num_threads(1);
      for (int64_t group : {1, 3, 7}) {
        cpu::PackedWeights pw;
        const cpu::PackedScope scope(group == 3 ? &pw : nullptr);
        for (int64_t t0 = 0; t0 < s.T; t0 += group) {
          const int64_t n = std::min(group, s.T - t0);
          cpu::gemm_bf16_f32(x.data() + t0 * s.in, s.in, w.data(), part.data() + t0 * s.out, s.out, n, s.in, s.out);
        }
        ASSERT_EQ(part, all) << cpu::isa_name(i) << " T=" << s.T << " in=" << s.in << " group=" << group;
      }
      cpu::set_num_threads(0);
      per_isa.push_back(all);
    }
    // isas() ends with avx2 (when present), then portable.
    if (per_isa.size() >= 2) EXPECT_EQ(per_isa[per_isa.size() - 2], per_isa.back()) << "avx2 == portable";
  }
}

TEST(KernelsCpu, GemmMultiKmajorAndF32InputsMatchSingleCalls) {
  std::mt19937_64 rng(8);
  const int64_t T = 5, in = 48, n1 = 40, n2 = 17;
  const auto x = rand_bf16(size_t(T * in), rng);
  const auto w1 = rand_bf16(size_t(n1 * in), rng), w2 = rand_bf16(size_t(n2 * in), rng);
  for (cpu::Isa i : isas()) {
    IsaCap cap(i);
    std::vector<uint16_t> a1(size_t(T * n1)), b1(a1.size());
    std::vector<float> a2(size_t(T * n2)), b2(a2.size());
    cpu::gemm_bf16(x.data(), in, w1.data(), a1.data(), n1, T, in, n1);
    cpu::gemm_bf16_f32(x.data(), in, w2.data(), a2.data(), n2, T, in, n2);
    const cpu::GemmOut outs[] = {{w1.data(), n1, b1.data(), nullptr, n1}, {w2.data(), n2, nullptr, b2.data(), n2}};
    cpu::gemm_bf16_multi(x.data(), in, T, in, outs);
    EXPECT_EQ(a1, b1);
    EXPECT_EQ(a2, b2);
    // The same weight stored k-major (W[n, k] at wt[k·n1 + n]) gives the same products.
    std::vector<uint16_t> wt(w1.size());
    for (int64_t n = 0; n < n1; ++n)
      for (int64_t k = 0; k < in; ++k) wt[size_t(k * n1 + n)] = w1[size_t(n * in + k)];
    std::vector<uint16_t> c1(a1.size());
    const cpu::GemmOut kt{wt.data(), n1, c1.data(), nullptr, n1, n1, true};
    cpu::gemm_bf16_multi(x.data(), in, T, in, std::span<const cpu::GemmOut>(&kt, 1));
    EXPECT_EQ(c1, a1) << cpu::isa_name(i);
  }
  // f32 activations holding bf16 values: the same as the bf16 path on the ORDER_K ISAs.
  IsaCap cap(cpu::Isa::avx2);
  std::vector<float> xf(x.size()), y1(size_t(T * n1)), y2(y1.size());
  for (size_t k = 0; k < x.size(); ++k) xf[k] = bf16_to_f32(x[k]);
  cpu::gemm_bf16_f32(x.data(), in, w1.data(), y1.data(), n1, T, in, n1);
  cpu::gemm_f32_bf16w(xf.data(), in, w1.data(), y2.data(), n1, T, in, n1);
  EXPECT_EQ(y1, y2);
}

TEST(KernelsCpu, GemmRowStrides) {
  std::mt19937_64 rng(2);
  const int64_t T = 4, in = 64, out = 16, ldx = 80, ldy = 20;
  const auto x = rand_bf16(size_t(T * ldx), rng);
  const auto w = rand_bf16(size_t(out * in), rng);
  std::vector<float> y(size_t(T * ldy), -7.0f), yc(size_t(T * out));
  std::vector<uint16_t> xc(size_t(T * in));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < in; ++c) xc[size_t(t * in + c)] = x[size_t(t * ldx + c)];
  cpu::gemm_bf16_f32(x.data(), ldx, w.data(), y.data(), ldy, T, in, out);
  cpu::gemm_bf16_f32(xc.data(), in, w.data(), yc.data(), out, T, in, out);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t r = 0; r < out; ++r) EXPECT_EQ(y[size_t(t * ldy + r)], yc[size_t(t * out + r)]);
    for (int64_t r = out; r < ldy; ++r) EXPECT_EQ(y[size_t(t * ldy + r)], -7.0f) << "padding untouched";
  }
}

TEST(KernelsCpu, Mxfp4GemmEqualsDequantisedProductExactly) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto [T, out, in] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 128}, {5, 33, 64}, {2, 128, 96}, {3, 7, 32},
                            {17, 50, 192}, {7, 7, 64}, {42, 20, 128}}) {  // batch tiles' row and output tails
    std::vector<uint8_t> packed(size_t(out * in / 2)), scale(size_t(out * in / 32));
    for (int64_t r = 0; r < out; ++r)
      for (int64_t b = 0; b < in / 32; ++b) {
        float blk[32];
        const float mag = std::ldexp(1.0f, int(rng() % 9) - 6);  // scales spread over several octaves
        for (float& v : blk) v = nd(rng) * mag;
        scale[size_t(r * (in / 32) + b)] = mxfp4_quantize_block(blk, &packed[size_t(r * (in / 2) + b * 16)]);
      }
    std::vector<float> x(size_t(T * in));
    for (float& v : x) v = nd(rng);
    std::vector<float> wd(static_cast<size_t>(in));
    for (cpu::Isa i : isas()) {
      IsaCap cap(i);
      std::vector<float> y(size_t(T * out));
      cpu::mxfp4_gemm(packed.data(), scale.data(), x.data(), y.data(), T, out, in);
      for (int64_t r = 0; r < out; ++r) {
        mxfp4_dequantize_row(&packed[size_t(r * (in / 2))], &scale[size_t(r * (in / 32))], wd.data(), size_t(in));
        for (int64_t t = 0; t < T; ++t) {
          // ORDER16: lane j takes elements 16g+2j, then 16g+2j+1, per 16-group g; a fixed final tree.
          float l[8] = {};
          for (int64_t g = 0; g < in / 16; ++g)
            for (int j = 0; j < 8; ++j)
              for (int64_t c : {16 * g + 2 * j, 16 * g + 2 * j + 1}) l[j] = std::fma(wd[size_t(c)], x[size_t(t * in + c)], l[j]);
          const float ref = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
          ASSERT_EQ(y[size_t(t * out + r)], ref) << cpu::isa_name(i) << " T=" << T << " r=" << r << " t=" << t;
        }
      }
    }
  }
}

// The avx512bf16 expert product (ORDER_B32, mxfp4_avx512.cpp): the same products as the dequantised
// weight times the bf16 inputs, so against a double twin within the GEMM tolerance (2e-5 of the |x|·|w|
// mass; vdpbf16ps's internal rounding is the CPU's, so no exact scalar twin); exact where the engine
// needs it: a row's result alone equals its result in any batch, with 1 or 2 threads, and the bf16
// output is the rounded f32 output.
TEST(KernelsCpu, Mxfp4Bf16ProductMatchesDequantisedAndIsRowAndThreadInvariant) {
  if (cpu::detected_isa() < cpu::Isa::avx512bf16) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto [T, out, in] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 128}, {5, 33, 64}, {3, 7, 32},
                            {17, 50, 192}, {42, 20, 128}, {4, 16, 96}, {6, 1, 32}}) {  // row and token tails
    std::vector<uint8_t> packed(size_t(out * in / 2)), scale(size_t(out * in / 32));
    for (int64_t r = 0; r < out; ++r)
      for (int64_t b = 0; b < in / 32; ++b) {
        float blk[32];
        const float mag = std::ldexp(1.0f, int(rng() % 9) - 6);
        for (float& v : blk) v = nd(rng) * mag;
        scale[size_t(r * (in / 32) + b)] = mxfp4_quantize_block(blk, &packed[size_t(r * (in / 2) + b * 16)]);
      }
    const int64_t ldx = in + 3;  // a row stride past the width
    const auto x = rand_bf16(size_t(T * ldx), rng);
    std::vector<float> y(size_t(T * out)), y1(y.size());
    std::vector<uint16_t> yb(y.size());
    cpu::set_num_threads(2);
    cpu::gemm_detail::mxfp4_rows_bf16(packed.data(), scale.data(), x.data(), ldx, T, out, in, y.data(), nullptr, out);
    cpu::gemm_detail::mxfp4_rows_bf16(packed.data(), scale.data(), x.data(), ldx, T, out, in, nullptr, yb.data(), out);
    cpu::set_num_threads(1);
    for (int64_t t = 0; t < T; ++t)  // each row alone
      cpu::gemm_detail::mxfp4_rows_bf16(packed.data(), scale.data(), x.data() + t * ldx, ldx, 1, out, in,
                                        y1.data() + t * out, nullptr, out);
    cpu::set_num_threads(0);
    ASSERT_EQ(y1, y) << "T=" << T << " out=" << out << " in=" << in;
    std::vector<float> wd(static_cast<size_t>(in));
    for (int64_t r = 0; r < out; ++r) {
      mxfp4_dequantize_row(&packed[size_t(r * (in / 2))], &scale[size_t(r * (in / 32))], wd.data(), size_t(in));
      for (int64_t t = 0; t < T; ++t) {
        double ref = 0.0, mass = 0.0;
        for (int64_t c = 0; c < in; ++c) {
          const double p = double(wd[size_t(c)]) * bf16_to_f32(x[size_t(t * ldx + c)]);
          ref += p, mass += std::fabs(p);
        }
        const size_t i = size_t(t * out + r);
        ASSERT_LE(std::fabs(y[i] - ref), 2e-5 * mass) << "T=" << T << " r=" << r << " t=" << t;
        ASSERT_EQ(yb[i], f32_to_bf16(y[i]));
      }
    }
  }
}

TEST(KernelsCpu, Mxfp4RejectsRaggedWidth) {
  uint8_t p[8] = {}, s[1] = {127};
  float x[16] = {}, y[1];
  EXPECT_THROW(cpu::mxfp4_gemm(p, s, x, y, 1, 1, 16), Error);
}

TEST(KernelsCpu, RmsNormMatchesFormula) {
  std::mt19937_64 rng(4);
  // The avx2 row scaling's 8-wide body and its tails; T = 3 and 13: row groups of 4 (avx2) and 8
  // (avx512bf16's sums of squares) with a partial last group.
  for (auto [n, T] : {std::pair<int64_t, int64_t>{1, 3}, {7, 3}, {8, 13}, {9, 3}, {16, 13}, {17, 13}, {256, 13},
                      {1000, 3}}) {
    const auto x = rand_bf16(size_t(T * n), rng, 3.0f);
    const auto w = rand_bf16(size_t(n), rng);
    std::vector<uint16_t> y(size_t(T * n)), yp(y.size());
    {
      IsaCap cap(cpu::Isa::portable);
      cpu::rmsnorm_bf16(x.data(), w.data(), yp.data(), T, n, 1e-5f);
    }
    cpu::rmsnorm_bf16(x.data(), w.data(), y.data(), T, n, 1e-5f);
    ASSERT_EQ(y, yp) << "n=" << n << " T=" << T << ": the vector path rounds exactly as the scalar one";
    for (int64_t t = 0; t < T; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += std::pow(double(bf16_to_f32(x[size_t(t * n + i)])), 2);
      const double r = 1.0 / std::sqrt(ss / double(n) + 1e-5);
      for (int64_t i = 0; i < n; ++i) {
        // The FP32 rsqrt may land one f32 ulp from the double one; that moves the bf16 result by at most
        // one bf16 ulp per rounding, and only at a rounding boundary.
        const float normed = round_bf16(float(bf16_to_f32(x[size_t(t * n + i)]) * r));
        const float ref = round_bf16(bf16_to_f32(w[size_t(i)]) * normed);
        ASSERT_LE(bf16_ulps(bf16_to_f32(y[size_t(t * n + i)]), ref), 2.0f) << "n=" << n << " i=" << i;
      }
    }
  }
}

TEST(KernelsCpu, SituGluMatchesFormula) {
  std::mt19937_64 rng(5);
  const auto g = rand_bf16(512, rng, 10.0f), u = rand_bf16(512, rng, 40.0f);
  std::vector<uint16_t> a(512);
  cpu::situ_glu(g.data(), u.data(), a.data(), 512, 4.0f, 25.0f);
  for (size_t i = 0; i < 512; ++i) {
    const double gf = bf16_to_f32(g[i]), uf = bf16_to_f32(u[i]);
    const double ref = 4.0 * std::tanh(gf / 4.0) / (1.0 + std::exp(-gf)) * 25.0 * std::tanh(uf / 25.0);
    ASSERT_LE(bf16_ulps(bf16_to_f32(a[i]), float(ref)), 1.0f) << i;
  }
  // Saturation: |a| < β·βl for any input.
  const uint16_t big = f32_to_bf16(1e30f), nbig = f32_to_bf16(-1e30f);
  uint16_t out;
  cpu::situ_glu(&big, &big, &out, 1, 4.0f, 25.0f);
  EXPECT_EQ(bf16_to_f32(out), 100.0f);
  cpu::situ_glu(&nbig, &big, &out, 1, 4.0f, 25.0f);
  EXPECT_EQ(bf16_to_f32(out), -0.0f);
}

TEST(KernelsCpu, SoftmaxMatchesFormula) {
  std::vector<float> x = {1000.0f, 999.0f, -5.0f, 0.5f};
  std::vector<double> ref(x.size());
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += (ref[i] = std::exp(double(x[i]) - 1000.0));
  cpu::softmax_inplace(x.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], ref[i] / s, 1e-7);
}

TEST(KernelsCpu, TopkOrderAndTies) {
  const float x[] = {0.0f, 3.0f, 1.0f, 3.0f, NAN, 0.0f, 2.0f, 0.0f};
  int32_t idx[6];
  cpu::topk(x, 8, 6, idx);
  const int32_t want[] = {1, 3, 6, 2, 0, 5};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(idx[i], want[i]) << i;
  // Random check against a stable sort twin.
  std::mt19937_64 rng(6);
  std::vector<float> v(300);
  for (auto& f : v) f = float(rng() % 7);  // many ties
  std::vector<int32_t> got(40), order(300);
  cpu::topk(v.data(), 300, 40, got.data());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[size_t(a)] > v[size_t(b)]; });
  for (int i = 0; i < 40; ++i) EXPECT_EQ(got[size_t(i)], order[size_t(i)]);
  EXPECT_THROW(cpu::topk(x, 8, 9, idx), Error);
}

}  // namespace
}  // namespace kestrel
