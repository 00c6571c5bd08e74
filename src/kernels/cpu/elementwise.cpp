// Row-wise and element-wise CPU ops: RMSNorm, SiTU-GLU, softmax, top-k (MODEL.md §3, §0.8).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::cpu {

void rmsnorm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t T, int64_t n, float eps) {
  KCHECK(n > 0 && T >= 0, "bad rmsnorm shape T={} n={}", T, n);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* xr = x + t * n;
    // Sum of squares in double: cheap here and keeps the reference-precision promise of MODEL.md §0.10.
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double v = bf16_to_f32(xr[i]);
      ss += v * v;
    }
    const float r = 1.0f / std::sqrt(float(ss / double(n)) + eps);
    for (int64_t i = 0; i < n; ++i)
      y[t * n + i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * r));
  }
}

void situ_glu(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n, float beta, float linear_beta) {
  KCHECK(beta > 0 && linear_beta > 0, "SiTU betas must be positive ({}, {})", beta, linear_beta);
  for (int64_t i = 0; i < n; ++i) {
    const float gf = bf16_to_f32(g[i]), uf = bf16_to_f32(u[i]);
    const float act = beta * std::tanh(gf / beta) * sigmoid(gf);
    a[i] = f32_to_bf16(act * (linear_beta * std::tanh(uf / linear_beta)));
  }
}

void softmax_inplace(float* x, int64_t n) {
  KCHECK(n > 0, "softmax of an empty row");
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  const float inv = float(1.0 / s);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void topk(const float* x, int64_t n, int64_t k, int32_t* idx) {
  KCHECK(k >= 0 && k <= n, "top-{} of {} values", k, n);
  KCHECK(n < (int64_t(1) << 31), "top-k over {} values", n);
  auto key = [x](int32_t i) { return std::isnan(x[i]) ? -std::numeric_limits<float>::infinity() : x[i]; };
  // Strict total order: larger value first, then lower index, so the result is unique.
  auto better = [&](int32_t a, int32_t b) {
    const float ka = key(a), kb = key(b);
    return ka > kb || (ka == kb && a < b);
  };
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  std::copy(order.begin(), order.begin() + k, idx);
}

}  // namespace kestrel::cpu
