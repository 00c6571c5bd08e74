// AVX-512 BF16 block of the GEMM (gemm_kernels.h, "AVX512BF16"): vdpbf16ps multiplies bf16 pairs of
// activations and weights straight from their storage (no widening) and accumulates into 16 FP32
// lanes; tiles of 4 rows × 4 outputs (16 of the 32 zmm registers), 1 × 8 for one or few rows.
// The K mod 32 tail is read with zero-masked loads, so no element is read past the row.
// Numerics: products of two bf16 are exact in FP32; vdpbf16ps flushes denormal inputs and outputs
// to zero (bf16 denormals never matter at the model's scales). Compiled for every x86-64 build, run
// only where the CPU reports AVX512_BF16 (isa.h).
#include <immintrin.h>

// GCC 12's avx512fintrin.h initialises a register from itself (_mm256_undefined_pd) inside
// _mm512_castps512_ps256 / _mm512_extractf64x4_pd, a known false -Wuninitialized in that header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "core/dtype.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"

namespace kestrel::cpu::gemm_detail {
namespace {

// Lanes i and i+8 first, then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
KESTREL_AVX512BF16 inline float reduce16(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 a = _mm256_add_ps(lo, hi);
  const __m128 p = _mm_hadd_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_hadd_ps(p, p);
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

template <int MR, int NR>
KESTREL_AVX512BF16 inline void tile(const Block& b, int64_t m0, int64_t n0) {
  const int64_t G = b.K / 32, tail = b.K % 32;
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  const uint16_t* xr = b.xb + m0 * b.ldx;
  const uint16_t* wr = b.w + n0 * b.ldw;
  for (int64_t g = 0; g <= G; ++g) {
    if (g == G && tail == 0) break;
    const __mmask32 mask = g < G ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << tail) - 1u);
    __m512i wv[NR];
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) wv[n] = _mm512_maskz_loadu_epi16(mask, wr + n * b.ldw + 32 * g);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr + m * b.ldx + 32 * g);
#pragma GCC unroll 8
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)xv, (__m512bh)wv[n]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) {
      const float s = reduce16(acc[m][n]);
      if (b.yb)
        b.yb[(m0 + m) * b.ldy + n0 + n] = f32_to_bf16(s);
      else
        b.y[(m0 + m) * b.ldy + n0 + n] = s;
    }
}

template <int NR>
KESTREL_AVX512BF16 void rows(const Block& b, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= b.M; m += 4) tile<4, NR>(b, m, n0);
  switch (b.M - m) {
    case 3: tile<3, NR>(b, m, n0); break;
    case 2: tile<2, NR>(b, m, n0); break;
    case 1: tile<1, NR>(b, m, n0); break;
    default: break;
  }
}

}  // namespace

KESTREL_AVX512BF16 void block_avx512bf16(const Block& b) {
  int64_t n = 0;
  if (b.M < 4) {
    for (; n + 8 <= b.N; n += 8)
      for (int64_t m = 0; m < b.M; ++m) tile<1, 8>(b, m, n);
  }
  for (; n + 4 <= b.N; n += 4) rows<4>(b, n);
  for (; n < b.N; ++n) rows<1>(b, n);
}

}  // namespace kestrel::cpu::gemm_detail
