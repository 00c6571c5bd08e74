// The CPU twin of PTPC FP8 (kernels/cpu/fp8_ptpc.cpp): the quantisation's contract checked on its own
// (scale = amax/448, the row's largest magnitude maps to ±448, every code is the nearest e4m3 value of
// x/scale, an all-zero row gets scale 1), and gemm_ptpc_fp8 against the same products summed in FP64.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel {
namespace {

std::vector<uint16_t> rand_rows(int64_t R, int64_t C, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<uint16_t> x(size_t(R * C));
  for (auto& v : x) v = f32_to_bf16(u(g) * std::exp2(float(int(g() % 9) - 4)));
  return x;
}

TEST(Fp8Ptpc, QuantiseRowsContract) {
  const int64_t R = 7, C = 96;
  auto x = rand_rows(R, C, 1);
  for (int64_t c = 0; c < C; ++c) x[size_t(3 * C + c)] = 0;  // an all-zero row
  std::vector<uint8_t> q(size_t(R * C));
  std::vector<float> s(static_cast<size_t>(R));
  cpu::quantize_fp8_rows(x.data(), C, R, C, q.data(), s.data());
  for (int64_t r = 0; r < R; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < C; ++c) amax = std::max(amax, std::fabs(bf16_to_f32(x[size_t(r * C + c)])));
    if (amax == 0) {
      EXPECT_EQ(s[size_t(r)], 1.0f);
      for (int64_t c = 0; c < C; ++c) EXPECT_EQ(f8e4m3_to_f32(q[size_t(r * C + c)]), 0.0f);
      continue;
    }
    EXPECT_EQ(s[size_t(r)], amax / 448.0f) << "row " << r;
    float qmax = 0;
    for (int64_t c = 0; c < C; ++c) {
      const float v = bf16_to_f32(x[size_t(r * C + c)]) / s[size_t(r)];
      const float got = f8e4m3_to_f32(q[size_t(r * C + c)]);
      qmax = std::max(qmax, std::fabs(got));
      // The nearest e4m3 value: no other code is closer.
      const float err = std::fabs(got - v);
      for (int code = 0; code < 256; ++code) {
        const float alt = f8e4m3_to_f32(uint8_t(code));
        if (std::isfinite(alt)) {
          EXPECT_LE(err, std::fabs(alt - v) + 1e-6f * std::fabs(v)) << "row " << r << " col " << c;
        }
      }
    }
    EXPECT_EQ(qmax, 448.0f) << "the row's amax maps to the largest e4m3 magnitude";
  }
}

TEST(Fp8Ptpc, GemmMatchesFp64OfTheCodes) {
  const int64_t T = 5, K = 160, N = 24;
  const auto x = rand_rows(T, K, 2), w = rand_rows(N, K, 3);
  std::vector<uint8_t> xq(size_t(T * K)), wq(size_t(N * K));
  std::vector<float> xs(static_cast<size_t>(T)), ws(static_cast<size_t>(N));
  cpu::quantize_fp8_rows(x.data(), K, T, K, xq.data(), xs.data());
  cpu::quantize_fp8_rows(w.data(), K, N, K, wq.data(), ws.data());
  std::vector<uint16_t> y(size_t(T * N));
  cpu::gemm_ptpc_fp8(xq.data(), xs.data(), wq.data(), ws.data(), y.data(), N, T, K, N);
  double num = 0, den = 0, qnum = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0, exact = 0;
      for (int64_t k = 0; k < K; ++k) {
        acc += double(f8e4m3_to_f32(xq[size_t(t * K + k)])) * f8e4m3_to_f32(wq[size_t(n * K + k)]);
        exact += double(bf16_to_f32(x[size_t(t * K + k)])) * bf16_to_f32(w[size_t(n * K + k)]);
      }
      const double ref = acc * ws[size_t(n)] * xs[size_t(t)], got = bf16_to_f32(y[size_t(t * N + n)]);
      EXPECT_LE(std::fabs(got - ref), 1.0 / 128 * std::fabs(ref) + 1e-6) << t << "," << n;
      num += (got - ref) * (got - ref), den += ref * ref, qnum += (ref - exact) * (ref - exact);
    }
  EXPECT_LE(std::sqrt(num / den), 4e-3);
  // PTPC's quantisation error itself: well under 10 % rel L2 on these well-scaled rows.
  EXPECT_LE(std::sqrt(qnum / den), 0.1);
}

}  // namespace
}  // namespace kestrel
