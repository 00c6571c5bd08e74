// Internal to kernels/cpu: AVX2 helpers shared by the kernels — bf16 loads and RNE stores, exp / tanh /
// sigmoid on 8 floats, an 8 × 8 transpose and an in-place softmax of a score row. Every function carries KESTREL_AVX2; include only from files that
// call them from AVX2 kernels chosen at run time (isa.h).
//
// Accuracy: exp uses Cody–Waite reduction (x = n·ln2 + r, |r| ≤ ln2/2) and the degree-7 Taylor
// polynomial of e^r (truncation < 0.1 ulp), then 2^n in two halves so subnormal results and overflow
// to +inf come out right; about 1 ulp against a correctly rounded exp. tanh: the odd Taylor series to
// x^17 for |x| < 0.5625 (truncation < 0.1 ulp), else 1 − 2/(e^{2|x|} + 1) with the sign restored
// (no cancellation there: the subtracted term is < 0.5); about 2 ulp. NaN in, NaN out. The scalar
// ops (std::exp, std::tanh) they replace differ by these ulps, far below the BF16 rounding that
// follows every use (tests/unit/test_kernels_cpu.cpp bounds the effect on each op).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/isa.h"

namespace kestrel::cpu::simd {

// 8 bf16 → 8 f32 (bf16 is the high half of an f32).
KESTREL_AVX2 inline __m256 load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 f32 → 8 bf16, round to nearest even, NaN kept quiet with its sign (core/dtype.h f32_to_bf16).
KESTREL_AVX2 inline void store_bf16(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
  const __m256i w = _mm256_blendv_epi8(r, nanv, isnan);  // 8 × u16 in the low halves of the dwords
  const __m256i packed = _mm256_packus_epi32(w, w);       // per 128-bit lane: 4 words, repeated
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);  // lane 0 words, then lane 1 words
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
}

// The f32 value of store_bf16's rounding (round_bf16 of core/dtype.h), kept in a register.
KESTREL_AVX2 inline __m256 round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)),
                                     _mm256_set1_epi32(int32_t(0xffff0000u)));
  const __m256i nanv = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(int32_t(0xffff0000u))),
                                       _mm256_set1_epi32(0x00400000));
  const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, nanv, isnan));
}

KESTREL_AVX2 inline __m256 exp(__m256 x) {
  // Clamp so n stays in range (e^-104 is 0 in f32, e^89 is +inf); max/min keep a NaN x (second operand).
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 = 0.693359375 − 2.12194440e-4
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n = 2^a · 2^b with a = n >> 1, b = n − a, both within the normal exponent range.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i a = _mm256_srai_epi32(ni, 1), b = _mm256_sub_epi32(ni, a);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 sa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
  const __m256 sb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, sa), sb);
}

KESTREL_AVX2 inline __m256 sigmoid(__m256 x) {  // 1 / (1 + e^−x), as the scalar cpu::sigmoid
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

KESTREL_AVX2 inline __m256 tanh(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 ax = _mm256_andnot_ps(sign, x);
  // Each lane takes one of two forms; a vector whose lanes all take the same one skips the other (the
  // common case: SiTU's tanh(u/25) is nearly always small), with the same per-lane result.
  const __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.5625f), _CMP_LT_OQ);  // false for NaN
  const int mask = _mm256_movemask_ps(is_small);
  __m256 small = _mm256_setzero_ps(), bigs = _mm256_setzero_ps();
  if (mask != 0) {
    // Small |x|: x + x³·P(x²), Taylor coefficients of tanh.
    const __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(6404582.0f / 10854718875.0f);
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-929569.0f / 638512875.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(21844.0f / 6081075.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1382.0f / 155925.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(62.0f / 2835.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-17.0f / 315.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.0f / 15.0f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.0f / 3.0f));
    small = _mm256_fmadd_ps(_mm256_mul_ps(p, x2), x, x);
    if (mask == 0xFF) return small;
  }
  // Large |x|: 1 − 2/(e^{2|x|} + 1), sign of x.
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp(_mm256_add_ps(ax, ax));
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  bigs = _mm256_or_ps(big, _mm256_and_ps(x, sign));
  return mask == 0 ? bigs : _mm256_blendv_ps(bigs, small, is_small);
}

// Sum of 8 lanes as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
KESTREL_AVX2 inline float reduce8(__m256 v) {
  const __m128 p = _mm_hadd_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_hadd_ps(p, p);
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// reduce8 of four vectors at once: lane j = ((vj0+vj1)+(vj2+vj3))+((vj4+vj5)+(vj6+vj7)), the same
// additions in the same order (hadd adds neighbours), so bit-identical to reduce8 lane by lane.
KESTREL_AVX2 inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b);   // a01 a23 b01 b23 | a45 a67 b45 b67
  const __m256 cd = _mm256_hadd_ps(c, d);   // c01 c23 d01 d23 | c45 c67 d45 d67
  const __m256 q = _mm256_hadd_ps(ab, cd);  // a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567
  return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

// 8 × 8 transpose of f32 lanes (or any 32-bit words): on return r[i] = (r[0][i], …, r[7][i]) of the
// input. Shared by RMSNorm's eight-row sums (elementwise.cpp) and the AVX2 panel packing
// (gemm_panels.cpp); the AVX-512 callers inline it too (their target is a superset of this one).
KESTREL_AVX2 inline void transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Softmax of nk scores in place (FP32, the maximum subtracted, exp 8 lanes at a time, the tail with
// std::exp, one reciprocal of the sum): one query head's attention weights in both MLA kernels
// (mla_fast.cpp AVX2, mla_avx512.cpp), so the two give the same weights from the same scores.
KESTREL_AVX2 inline void softmax_inplace(float* s, int64_t nk) {
  float m = -INFINITY;
  for (int64_t j = 0; j < nk; ++j) m = std::max(m, s[j]);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= nk; j += 8) {
    const __m256 e = exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = reduce8(sum8);
  for (; j < nk; ++j) sum += (s[j] = std::exp(s[j] - m));
  const float inv = 1.0f / sum;
  for (j = 0; j < nk; ++j) s[j] *= inv;
}

}  // namespace kestrel::cpu::simd
