// The absorbed MLA attention core's middle stage (mla_ops.h: mla_attn_latent_fast) on AVX-512, for
// CPUs of the avx512bf16 ISA: one query at a time with all its heads together.
//
// Why: the latent rows are shared by every head (MQA over [ĉ | k_pe]) and the selection is per query,
// so (query, head) items each read and widened the same 256 rows again (the AVX2 kernel now shares
// them over four heads too, in its own order); here a row's 32-element group is widened once and
// multiplied into up to four heads' accumulators, in 16-wide registers (32 of them: 4 keys × 4 heads
// of scores, or 4 heads × 64 columns of ô, stay in registers). It was 12 % of a 2K-token prefill
// profile (issue #22).
// Rows are read 32 bf16 at a time and split into even and odd elements by a shift and a mask (no
// widening shuffle); q̃ is split the same way once per query.
// Order per (query, head): score_j = Σ over 32-element groups of the even then the odd products (FMA
// per lane, then the fixed lane tree of reduce16), softmax simd::softmax_inplace (the AVX2 kernel's),
// ô = Σ_j p_j ĉ_j with one FMA chain per column in key order. A function of the query's keys alone, never of the
// batch or chunk; FP32 noise against the scalar twin (tests/unit/test_kernels_fast.cpp bounds it).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

// GCC 12's avx512fintrin.h: a false -Wuninitialized inside its own casts (as in gemm_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "core/check.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

constexpr int kH = 4;  // heads per pass
constexpr int kK = 4;  // keys per score tile

// 32 bf16 (the first n of them when n < 32; the rest read as 0) split for free into f32 vectors of
// the even elements (dword << 16) and the odd ones (dword & 0xFFFF0000): no widening shuffle.
struct EvenOdd {
  __m512 e, o;
};
KESTREL_AVX512BF16 inline EvenOdd split32(const uint16_t* p, int64_t n) {
  const __m512i v = n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))))};
}

// Lane sums of 16 accumulators: out[a] = the sum of acc[a]'s lanes, every a by the same tree
// (lane i + lane i+8, then +4, +2, +1).
KESTREL_AVX512BF16 inline void reduce16(const __m512* a, float* out) {
  __m512 p[8], q[4], r[2];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k)
    p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k)
    q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0xDD));
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k)
    r[k] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * k], q[2 * k + 1], 0x44), _mm512_shuffle_ps(q[2 * k], q[2 * k + 1], 0xEE));
  alignas(64) float s[16];
  _mm512_store_ps(s, _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD)));
  for (int i = 0; i < 16; ++i) out[i] = s[4 * (i % 4) + i / 4];  // element 4·(a mod 4) + a/4 holds a
}

// Scores of heads [0, nh) against keys[0, nk): s [nh, nk] (row stride lds), times scale. qp holds the
// heads' q̃ split like the rows (per 32-group: 16 even elements, then 16 odd ones; zero past CW).
KESTREL_AVX512BF16 void scores(const float* qp, int nh, int64_t CW, const uint16_t* rows, const int32_t* keys,
                               int64_t nk, float scale, float* s, int64_t lds) {
  const int64_t G = (CW + 31) / 32;
  for (int64_t j0 = 0; j0 < nk; j0 += kK) {
    const int kn = int(std::min<int64_t>(kK, nk - j0));
    const uint16_t* r[kK];
#pragma GCC unroll 4
    for (int k = 0; k < kK; ++k) r[k] = rows + int64_t(keys[j0 + std::min(k, kn - 1)]) * CW;  // a tail repeats a key
    __m512 acc[kK * kH];  // [key][head]
#pragma GCC unroll 16
    for (int a = 0; a < kK * kH; ++a) acc[a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = std::min<int64_t>(32, CW - 32 * g);
      __m512 qe[kH], qo[kH];
#pragma GCC unroll 4
      for (int h = 0; h < kH; ++h) {
        qe[h] = _mm512_loadu_ps(qp + (h * G + g) * 32);
        qo[h] = _mm512_loadu_ps(qp + (h * G + g) * 32 + 16);
      }
#pragma GCC unroll 4
      for (int k = 0; k < kK; ++k) {
        const EvenOdd kv = split32(r[k] + 32 * g, n);
#pragma GCC unroll 4
        for (int h = 0; h < kH; ++h) {
          acc[k * kH + h] = _mm512_fmadd_ps(qe[h], kv.e, acc[k * kH + h]);
          acc[k * kH + h] = _mm512_fmadd_ps(qo[h], kv.o, acc[k * kH + h]);
        }
      }
    }
    float out[kK * kH];
    reduce16(acc, out);
    for (int k = 0; k < kn; ++k)
      for (int h = 0; h < nh; ++h) s[h * lds + j0 + k] = out[k * kH + h] * scale;
  }
}

// ô_h[c0, c0 + 64) = Σ_j p_h,j ĉ_j for heads [0, nh): p [nh, nk] (row stride ldp), ohat rows of C.
// Accumulated as even and odd columns (split32), interleaved back once at the end.
KESTREL_AVX512BF16 void values(const float* p, int64_t ldp, int nh, const uint16_t* rows, const int32_t* keys,
                               int64_t nk, int64_t CW, int64_t C, int64_t c0, float* ohat) {
  constexpr int kG = 2;  // 32-column groups per pass
  const int ng = int(std::min<int64_t>(kG, (C - c0 + 31) / 32));
  __m512 ae[kH][kG], ao[kH][kG];
#pragma GCC unroll 4
  for (int h = 0; h < kH; ++h)
#pragma GCC unroll 2
    for (int g = 0; g < kG; ++g) ae[h][g] = ao[h][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; ++j) {
    const uint16_t* row = rows + int64_t(keys[j]) * CW + c0;
    EvenOdd v[kG];
#pragma GCC unroll 2
    for (int g = 0; g < kG; ++g)
      v[g] = g < ng ? split32(row + 32 * g, std::min<int64_t>(32, C - c0 - 32 * g)) : EvenOdd{_mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 4
    for (int h = 0; h < kH; ++h) {
      if (h >= nh) break;
      const __m512 ph = _mm512_set1_ps(p[h * ldp + j]);
#pragma GCC unroll 2
      for (int g = 0; g < kG; ++g) {
        ae[h][g] = _mm512_fmadd_ps(ph, v[g].e, ae[h][g]);
        ao[h][g] = _mm512_fmadd_ps(ph, v[g].o, ao[h][g]);
      }
    }
  }
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int h = 0; h < nh; ++h)
    for (int g = 0; g < ng; ++g) {
      const int64_t n = std::min<int64_t>(32, C - c0 - 32 * g);  // columns c0 + 32g + [0, n)
      float* dst = ohat + h * C + c0 + 32 * g;
      const __m512 first = _mm512_permutex2var_ps(ae[h][g], lo, ao[h][g]);
      const __m512 second = _mm512_permutex2var_ps(ae[h][g], hi, ao[h][g]);
      _mm512_mask_storeu_ps(dst, __mmask16(n >= 16 ? 0xFFFFu : (1u << n) - 1u), first);
      if (n > 16) _mm512_mask_storeu_ps(dst + 16, __mmask16(n >= 32 ? 0xFFFFu : (1u << (n - 16)) - 1u), second);
    }
}

// q̃ rows of heads [0, nh) (f32 [nh, CW]) → qp (per head G = ⌈CW/32⌉ groups of 16 even, 16 odd; 0 past CW).
void split_q(const float* qt, int nh, int64_t CW, float* qp) {
  const int64_t G = (CW + 31) / 32;
  for (int h = 0; h < nh; ++h)
    for (int64_t c = 0; c < 32 * G; ++c) qp[(h * G + c / 32) * 32 + (c % 2) * 16 + (c % 32) / 2] = c < CW ? qt[h * CW + c] : 0.0f;
}

}  // namespace

void mla_attn_latent_avx512(const MlaDims& dm, const float* qt, const uint16_t* rows, const int32_t* sel,
                            int64_t Ksel, int64_t T, int64_t pos0, float* ohat) {
  const int64_t Hm = dm.Hm, C = dm.C, CW = dm.cw();
  KCHECK(isa() >= Isa::avx512bf16, "mla_attn_latent_avx512 needs AVX-512");
  const float scale = 1.0f / std::sqrt(float(dm.qk()));
  const int64_t avg_keys = sel ? Ksel : pos0 + (T + 1) / 2;
  parallel_for(T, T * Hm * avg_keys * CW * 3, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> s;       // f32 [kH, nk]: one head group's scores, then weights
    thread_local std::vector<float> qp;      // f32 [kH, ⌈CW/32⌉·32]: q̃ split as the rows (split_q)
    thread_local std::vector<int32_t> iota;  // 0, 1, 2, …: the dense case's keys
    for (int64_t t = b; t < e; ++t) {
      // This query's keys: the selection (ascending, −1 ends it) or every position up to its own.
      int64_t nk = 0;
      const int32_t* keys;
      if (sel) {
        while (nk < Ksel && sel[t * Ksel + nk] >= 0) ++nk;
        keys = sel + t * Ksel;
      } else {
        nk = pos0 + t + 1;
        for (int64_t k = int64_t(iota.size()); k < nk; ++k) iota.push_back(int32_t(k));
        keys = iota.data();
      }
      s.resize(size_t(kH * std::max<int64_t>(nk, 1)));
      for (int64_t h0 = 0; h0 < Hm; h0 += kH) {
        const int nh = int(std::min<int64_t>(kH, Hm - h0));
        const float* q = qt + (t * Hm + h0) * CW;
        float* o = ohat + (t * Hm + h0) * C;
        if (nk == 0) {  // nothing visible (a −1-only selection): ô = 0, as the AVX2 kernel gives
          std::fill(o, o + nh * C, 0.0f);
          continue;
        }
        qp.assign(size_t(kH * ((CW + 31) / 32) * 32), 0.0f);
        split_q(q, nh, CW, qp.data());
        scores(qp.data(), nh, CW, rows, keys, nk, scale, s.data(), nk);
        for (int h = 0; h < nh; ++h) simd::softmax_inplace(s.data() + h * nk, nk);
        for (int64_t c0 = 0; c0 < C; c0 += 64) values(s.data(), nk, nh, rows, keys, nk, CW, C, c0, o);
      }
    }
  });
}

}  // namespace kestrel::cpu
