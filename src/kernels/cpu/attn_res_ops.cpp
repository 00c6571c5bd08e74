// AttnRes Mix (MODEL.md §3.2) for a block of tokens: per token the source logits
// ℓ_i = (v_i·u) / sqrt(mean(v_i²) + ε) in FP64, their softmax, and h = Σ_i α_i v_i in FP32 (sources in
// order), rounded to BF16. The AVX2 path sums the FP64 dot products four lanes at a time (a different
// order from the scalar twin's sequential sum, ~1e-16 relative: the FP32 logits it feeds agree to the
// last bit but for once-in-2^29 ties) and repeats the FP32 weighted sum exactly.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

void logits_scalar(const uint16_t* const* src, int64_t n, const float* u, float eps, int64_t D, int64_t t,
                   float* logit) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* v = src[i] + t * D;
    double dot = 0.0, ss = 0.0;
    for (int64_t k = 0; k < D; ++k) {
      const double x = bf16_to_f32(v[k]);
      dot += x * u[k];
      ss += x * x;
    }
    logit[i] = float(dot / std::sqrt(ss / double(D) + double(eps)));
  }
}

KESTREL_AVX2 double hsum(__m256d v) {
  const __m128d a = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(a, _mm_unpackhi_pd(a, a)));
}

KESTREL_AVX2 void logits_avx2(const uint16_t* const* src, int64_t n, const float* u, float eps, int64_t D, int64_t t,
                              float* logit) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* v = src[i] + t * D;
    __m256d d0 = _mm256_setzero_pd(), d1 = d0, s0 = d0, s1 = d0;
    int64_t k = 0;
    for (; k + 8 <= D; k += 8) {
      const __m256 x = simd::load_bf16(v + k), uu = _mm256_loadu_ps(u + k);
      const __m256d xl = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), xh = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      const __m256d ul = _mm256_cvtps_pd(_mm256_castps256_ps128(uu)), uh = _mm256_cvtps_pd(_mm256_extractf128_ps(uu, 1));
      d0 = _mm256_fmadd_pd(xl, ul, d0);
      d1 = _mm256_fmadd_pd(xh, uh, d1);
      s0 = _mm256_fmadd_pd(xl, xl, s0);
      s1 = _mm256_fmadd_pd(xh, xh, s1);
    }
    double dot = hsum(_mm256_add_pd(d0, d1)), ss = hsum(_mm256_add_pd(s0, s1));
    for (; k < D; ++k) {
      const double x = bf16_to_f32(v[k]);
      dot += x * u[k];
      ss += x * x;
    }
    logit[i] = float(dot / std::sqrt(ss / double(D) + double(eps)));
  }
}

KESTREL_AVX2 void combine_avx2(const uint16_t* const* src, int64_t n, const float* alpha, int64_t D, int64_t t,
                               uint16_t* o) {
  int64_t k = 0;
  for (; k + 8 <= D; k += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i)
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(alpha[i]), simd::load_bf16(src[i] + t * D + k)));
    simd::store_bf16(o + k, acc);
  }
  for (; k < D; ++k) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) acc += alpha[i] * bf16_to_f32(src[i][t * D + k]);
    o[k] = f32_to_bf16(acc);
  }
}

}  // namespace

void attn_res_mix_rows(const uint16_t* const* src, int64_t n, const float* u, float eps, int64_t T, int64_t D,
                       uint16_t* out) {
  KCHECK(n >= 1 && D > 0 && T >= 0, "bad AttnRes mix shape n={} T={} D={}", n, T, D);
  const bool avx2 = isa() >= Isa::avx2;
  parallel_for(T, T * n * D * 4, [&](int64_t b, int64_t e) {
    std::vector<float> alpha(static_cast<size_t>(n));
    for (int64_t t = b; t < e; ++t) {
      uint16_t* o = out + t * D;
      if (n == 1) {  // a single source: h is that source exactly
        std::memcpy(o, src[0] + t * D, size_t(D) * 2);
        continue;
      }
      if (avx2)
        logits_avx2(src, n, u, eps, D, t, alpha.data());
      else
        logits_scalar(src, n, u, eps, D, t, alpha.data());
      softmax_inplace(alpha.data(), n);
      if (avx2) {
        combine_avx2(src, n, alpha.data(), D, t, o);
        continue;
      }
      for (int64_t k = 0; k < D; ++k) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; ++i) acc += alpha[size_t(i)] * bf16_to_f32(src[i][t * D + k]);
        o[k] = f32_to_bf16(acc);
      }
    }
  });
}

}  // namespace kestrel::cpu
