// CPU kernels against plain scalar twins written here, over a few shapes with random inputs.
//
// Tolerances: GEMM paths accumulate in FP32 in a different order than the double-precision twin, so
// FP32 outputs must agree to 1e-5 relative to the row's |x|·|w| mass; BF16 outputs may then differ
// by one BF16 ulp where the FP32 sum sits next to a rounding boundary. The MXFP4 product must equal
// the dequantise-first product bit for bit (same lane order, see cpu_ops.h).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <tuple>
#include <random>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

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
      ASSERT_NEAR(y[i], ref, 1e-5 * mass + 1e-30) << "T=" << s.T << " in=" << s.in << " t=" << t << " r=" << r;
      ASSERT_EQ(yb[i], f32_to_bf16(y[i])) << "bf16 output is the rounded f32 output";
      ASSERT_LE(bf16_ulps(bf16_to_f32(yb[i]), float(ref)), 1.0f + float(1e-5 * mass / std::max(std::fabs(ref), 1e-30)) * 256);
    }
}

TEST(KernelsCpu, GemmMatchesScalarTwinAllPaths) {
  std::mt19937_64 rng(1);
  const GemmShape shapes[] = {{1, 256, 64}, {1, 300, 129}, {1, 4096, 512}, {3, 256, 64}, {17, 96, 33}, {64, 512, 256}};
  for (bool portable : {false, true}) {
    cpu::gemv_force_portable(portable);
    for (const auto& s : shapes) check_gemm(s, rng);
  }
  cpu::gemv_force_portable(false);
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
  for (auto [T, out, in] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 128}, {5, 33, 64}, {2, 128, 96}}) {
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
    std::vector<float> y(size_t(T * out));
    cpu::mxfp4_gemm(packed.data(), scale.data(), x.data(), y.data(), T, out, in);
    std::vector<float> wd(static_cast<size_t>(in));
    for (int64_t r = 0; r < out; ++r) {
      mxfp4_dequantize_row(&packed[size_t(r * (in / 2))], &scale[size_t(r * (in / 32))], wd.data(), size_t(in));
      for (int64_t t = 0; t < T; ++t) {
        float l[8] = {};
        for (int64_t c = 0; c < in; ++c) l[c % 8] += wd[size_t(c)] * x[size_t(t * in + c)];
        const float ref = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        ASSERT_EQ(y[size_t(t * out + r)], ref) << "T=" << T << " r=" << r << " t=" << t;
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
  for (int64_t n : {16, 256, 1000}) {
    const int64_t T = 3;
    const auto x = rand_bf16(size_t(T * n), rng, 3.0f);
    const auto w = rand_bf16(size_t(n), rng);
    std::vector<uint16_t> y(size_t(T * n));
    cpu::rmsnorm_bf16(x.data(), w.data(), y.data(), T, n, 1e-5f);
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
