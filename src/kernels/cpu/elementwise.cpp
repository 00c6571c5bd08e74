// Row-wise and element-wise CPU ops: RMSNorm, SiTU-GLU, softmax, top-k (MODEL.md §3, §0.8).
// RMSNorm keeps its FP64 sequential sum of squares (four rows at a time for instruction-level
// parallelism in the scalar twin, eight as register lanes on avx2 and avx512bf16, each row's order
// unchanged) and its AVX2 second pass repeats the scalar roundings exactly. situ_glu is the scalar
// twin; situ_glu_fast the AVX2 one (simd_avx2.h tanh/sigmoid).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

// y = w ⊙ bf16(x · r) for one row, the scalar roundings 8 lanes at a time.
KESTREL_AVX2 void scale_row_avx2(const uint16_t* x, const uint16_t* w, float r, uint16_t* y, int64_t n) {
  int64_t i = 0;
  const __m256 rv = _mm256_set1_ps(r);
  for (; i + 8 <= n; i += 8) {
    // round_bf16(x·r) = bf16 → f32 of the RNE rounding: store and reload through bf16.
    alignas(16) uint16_t tmp[8];
    simd::store_bf16(tmp, _mm256_mul_ps(simd::load_bf16(x + i), rv));
    simd::store_bf16(y + i, _mm256_mul_ps(simd::load_bf16(w + i), simd::load_bf16(tmp)));
  }
  for (; i < n; ++i) y[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
}

// x / d, as a multiplication by 1/d when d is a power of two (then x·(1/d) is the same rounding of
// the same exact quotient, so the same bits): a divide is several times the cost of a multiply, and
// SiTU-GLU was ~5 % of a 2K prefill on an AVX2-only CPU (issue #22; k3-tiny's beta is 4).
KESTREL_AVX2 inline __m256 div_by(__m256 x, __m256 d, __m256 inv, bool pow2) {
  return pow2 ? _mm256_mul_ps(x, inv) : _mm256_div_ps(x, d);
}
bool power_of_two(float d) {
  int e = 0;
  return std::isnormal(d) && std::frexp(d, &e) == 0.5f && std::isnormal(1.0f / d);
}

KESTREL_AVX2 void situ_glu_avx2(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n, float beta,
                                float linear_beta) {
  const __m256 b = _mm256_set1_ps(beta), bl = _mm256_set1_ps(linear_beta);
  const __m256 ib = _mm256_set1_ps(1.0f / beta), ibl = _mm256_set1_ps(1.0f / linear_beta);
  const bool b2 = power_of_two(beta), bl2 = power_of_two(linear_beta);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gf = simd::load_bf16(g + i), uf = simd::load_bf16(u + i);
    const __m256 act = _mm256_mul_ps(_mm256_mul_ps(b, simd::tanh(div_by(gf, b, ib, b2))), simd::sigmoid(gf));
    simd::store_bf16(a + i, _mm256_mul_ps(act, _mm256_mul_ps(bl, simd::tanh(div_by(uf, bl, ibl, bl2)))));
  }
  if (i < n) situ_glu(g + i, u + i, a + i, n - i, beta, linear_beta);
}

KESTREL_AVX2 void add_bf16_avx2(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) simd::store_bf16(y + i, _mm256_add_ps(simd::load_bf16(a + i), simd::load_bf16(b + i)));
  for (; i < n; ++i) y[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

KESTREL_AVX2 void gate_avx2(uint16_t* o, const uint16_t* g, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    simd::store_bf16(o + i, _mm256_mul_ps(simd::load_bf16(o + i), simd::sigmoid(simd::load_bf16(g + i))));
  for (; i < n; ++i) o[i] = f32_to_bf16(bf16_to_f32(o[i]) * sigmoid(bf16_to_f32(g[i])));
}

// The sumsq_rows8 kernels' finish: row r's sum so far (acc[r], elements [0, i)) plus the row's tail [i, n), still
// one double product and one double add per element in index order.
inline void sumsq_tails(const uint16_t* x /* bf16 [nr, n] */, int64_t n, int64_t nr, int64_t i, const double* acc,
                        double* ss /* f64 [nr] */) {
  for (int64_t r = 0; r < nr; ++r) {
    double s = acc[r];
    for (int64_t k = i; k < n; ++k) {
      const double v = double(bf16_to_f32(x[r * n + k]));
      s += v * v;
    }
    ss[r] = s;
  }
}

// Sums of squares of rows [0, nr) (nr ≤ 8) of x (bf16 [nr, n], row stride n) in double, each row's
// terms added in index order — the scalar loop's arithmetic exactly (a double product, then a double
// add, per element), but with the eight rows as the eight lanes of one register: an 8 × 8 block of
// bf16 is loaded row-wise and transposed, so each add serves eight rows. The scalar loop's four
// interleaved chains were bound by the add latency (issue #22: 3.5 % of a 2K prefill profile).
#if defined(__GNUC__) && !defined(__clang__)  // GCC 12's avx512fintrin.h: a false -Wmaybe-uninitialized
#pragma GCC diagnostic push                     // inside _mm512_cvtps_pd (as in gemm_avx512.cpp)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
KESTREL_AVX512BF16 void sumsq_rows8(const uint16_t* x, int64_t n, int64_t nr, double* ss) {
  __m512d acc = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 r[8];
    for (int k = 0; k < 8; ++k)
      r[k] = k < nr ? simd::load_bf16(x + k * n + i) : _mm256_setzero_ps();
    simd::transpose8x8(r);
    for (int j = 0; j < 8; ++j) {  // element i + j of every row, in order
      const __m512d v = _mm512_cvtps_pd(r[j]);
      acc = _mm512_add_pd(acc, _mm512_mul_pd(v, v));
    }
  }
  alignas(64) double a[8];
  _mm512_store_pd(a, acc);
  sumsq_tails(x, n, nr, i, a, ss);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// sumsq_rows8 on AVX2: the same transposed 8 × 8 blocks, the eight rows' doubles in two registers
// (rows 0–3, rows 4–7); each row's terms still one double product and one double add in index
// order, so the same bits. Why: on AVX2-only CPUs the scalar loop was ~2 % of a 2K prefill (issue #22).
KESTREL_AVX2 void sumsq_rows8_avx2(const uint16_t* x /* bf16 [nr, n] */, int64_t n, int64_t nr,
                                   double* ss /* f64 [nr] */) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 r[8];
    for (int k = 0; k < 8; ++k) r[k] = k < nr ? simd::load_bf16(x + k * n + i) : _mm256_setzero_ps();
    simd::transpose8x8(r);
    for (int j = 0; j < 8; ++j) {  // element i + j of every row, in order
      const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(r[j]));     // rows 0–3
      const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(r[j], 1));  // rows 4–7
      lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
      hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
    }
  }
  alignas(32) double acc[8];
  _mm256_store_pd(acc, lo);
  _mm256_store_pd(acc + 4, hi);
  sumsq_tails(x, n, nr, i, acc, ss);
}

}  // namespace

// add_bf16 and sigmoid_gate_bf16 split a prefill's [T, D] over the team in blocks of 1,024 elements
// (element-wise, so any split gives the same bits): on the engine thread alone they were serial
// sections of every layer while the other core waited (issue #22). A decode's few rows stay inline.
void add_bf16(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  const bool avx2 = isa() >= Isa::avx2;
  parallel_for((n + 1023) / 1024, n * 4, [&](int64_t bb, int64_t ee) {
    const int64_t i0 = bb * 1024, i1 = std::min(n, ee * 1024);
    if (avx2) return add_bf16_avx2(a + i0, b + i0, y + i0, i1 - i0);
    for (int64_t i = i0; i < i1; ++i) y[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
  });
}

void sigmoid_gate_bf16(uint16_t* o, const uint16_t* g, int64_t n) {
  const bool avx2 = isa() >= Isa::avx2;
  parallel_for((n + 1023) / 1024, n * 8, [&](int64_t bb, int64_t ee) {
    const int64_t i0 = bb * 1024, i1 = std::min(n, ee * 1024);
    if (avx2) return gate_avx2(o + i0, g + i0, i1 - i0);
    for (int64_t i = i0; i < i1; ++i) o[i] = f32_to_bf16(bf16_to_f32(o[i]) * sigmoid(bf16_to_f32(g[i])));
  });
}

void rmsnorm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t T, int64_t n, float eps) {
  KCHECK(n > 0 && T >= 0, "bad rmsnorm shape T={} n={}", T, n);
  const bool avx2 = isa() >= Isa::avx2, avx512 = isa() >= Isa::avx512bf16;
  const int64_t G = avx2 ? 8 : 4;  // rows per group
  parallel_for((T + G - 1) / G, T * n * 4, [&](int64_t b, int64_t e) {
    for (int64_t t0 = G * b; t0 < std::min(T, G * e); t0 += G) {
      const int64_t nr = std::min<int64_t>(G, T - t0);
      // Sum of squares in double, each row in index order (MODEL.md §0.10's reference precision);
      // independent rows interleaved so the additions overlap (eight in one register on avx512bf16).
      double ss[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
      if (avx512)
        sumsq_rows8(x + t0 * n, n, nr, ss);
      else if (avx2)
        sumsq_rows8_avx2(x + t0 * n, n, nr, ss);
      else
        for (int64_t i = 0; i < n; ++i)
          for (int64_t r = 0; r < 4; ++r) {
            const double v = r < nr ? double(bf16_to_f32(x[(t0 + r) * n + i])) : 0.0;
            ss[r] += v * v;
          }
      for (int64_t r = 0; r < nr; ++r) {
        const float rs = 1.0f / std::sqrt(float(ss[r] / double(n)) + eps);
        const uint16_t* xr = x + (t0 + r) * n;
        uint16_t* yr = y + (t0 + r) * n;
        if (avx2)
          scale_row_avx2(xr, w, rs, yr, n);
        else
          for (int64_t i = 0; i < n; ++i) yr[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * rs));
      }
    }
  });
}

void situ_glu_fast(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n, float beta, float linear_beta) {
  KCHECK(beta > 0 && linear_beta > 0, "SiTU betas must be positive ({}, {})", beta, linear_beta);
  if (isa() < Isa::avx2) return situ_glu(g, u, a, n, beta, linear_beta);
  parallel_for((n + 255) / 256, n * 16, [&](int64_t b, int64_t e) {
    const int64_t i0 = b * 256, i1 = std::min(n, e * 256);
    situ_glu_avx2(g + i0, u + i0, a + i0, i1 - i0, beta, linear_beta);
  });
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
