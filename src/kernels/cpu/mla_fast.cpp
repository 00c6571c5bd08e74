// The absorbed MLA attention core (mla_ops.h) vectorised: the CPU engine's form for prefill and decode
// alike, so a query's output never depends on the chunk or batch it runs in.
//
// Three stages (the model runs the first and last over every row of a step, the middle per sequence):
//   mla_q_latent:   q̃_h = W_UK,hᵀ q_nope,h (one GEMM per head) | q_pe, FP32;
//   mla_attn_latent_fast, one query at a time over the thread pool, its heads four at a time (on
//                   avx512bf16 CPUs: mla_avx512.cpp, its own order):
//                   s_j = q̃·[ĉ_j | k_pe,j]·(N+R)^−½ straight from the bf16 latent rows (one
//                   accumulator per (key, head), ORDER16 lanes); softmax in FP32 with the vector exp;
//                   ô = Σ_j p_j ĉ_j (FP32, one FMA chain per column in key order);
//   mla_o_latent:   o_h = W_UV,h ô_h (one GEMM per head), rounded to BF16.
// Against the scalar twin mla_attn_absorbed: FMA contraction, lane sums and the vector exp, i.e.
// FP32 rounding noise before the BF16 output rounding (tests/unit/test_kernels_cpu.cpp bounds it).
// Heads four at a time (heads4): the latent rows are shared by every head (MQA), so a row's 16-group
// is loaded and split into even / odd f32 once for four heads' FMAs instead of once per head — the
// load and the two ALU ops had been as many as the FMAs (issue #22: scores_n and values_chunk were
// ~8 % of a 2K prefill on an AVX2-only CPU). Every (query, head) keeps one_pair's arithmetic, op for
// op, so the result is bit-identical to the pair kernel (mla_attn_latent_pairs; tested); a remainder
// of Hm mod 4 heads runs one_pair.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

struct Scratch {
  std::vector<float> qtp, score;
  std::vector<int32_t> keys;
};

// NK keys' scores: ORDER16 dot of the permuted q̃ with each bf16 row.
template <int NK>
KESTREL_AVX2 inline void scores_n(const float* qtp, const uint16_t* rows, const int32_t* keys, int64_t CW, float scale,
                                  float* out) {
  const int64_t G = CW / 16;
  const __m256i hi = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 acc[NK];
  const uint16_t* r[NK];
#pragma GCC unroll 8
  for (int n = 0; n < NK; ++n) acc[n] = _mm256_setzero_ps(), r[n] = rows + int64_t(keys[n]) * CW;
  for (int64_t g = 0; g < G; ++g) {
    const __m256 qe = _mm256_loadu_ps(qtp + 16 * g), qo = _mm256_loadu_ps(qtp + 16 * g + 8);
#pragma GCC unroll 8
    for (int n = 0; n < NK; ++n) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[n] + 16 * g));
      acc[n] = _mm256_fmadd_ps(qe, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), acc[n]);
      acc[n] = _mm256_fmadd_ps(qo, _mm256_castsi256_ps(_mm256_and_si256(v, hi)), acc[n]);
    }
  }
#pragma GCC unroll 8
  for (int n = 0; n < NK; ++n) {
    float s = simd::reduce8(acc[n]);
    for (int64_t k = 16 * G; k < CW; ++k) s = __builtin_fmaf(qtp[k], bf16_to_f32(r[n][k]), s);
    out[n] = s * scale;
  }
}

// Interleaves the even (e) and odd (o) halves of a 16-group back into natural order.
KESTREL_AVX2 inline void store_natural(float* dst, __m256 e, __m256 o) {
  const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);  // e0 o0 e1 o1 | e4 o4 e5 o5, …
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(lo, hi, 0x20));
  _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

// ô (natural order, C wide) = Σ_i p_i ĉ_i over the first C elements of each row; NG 16-groups at a time.
template <int NG>
KESTREL_AVX2 inline void values_chunk(const uint16_t* rows, const int32_t* keys, const float* p, int64_t nk, int64_t CW,
                                      int64_t c0, float* ohat) {
  const __m256i hi = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 acc[2 * NG];
#pragma GCC unroll 8
  for (int a = 0; a < 2 * NG; ++a) acc[a] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nk; ++i) {
    const uint16_t* row = rows + int64_t(keys[i]) * CW + c0;
    const __m256 pi = _mm256_set1_ps(p[i]);
#pragma GCC unroll 8
    for (int gg = 0; gg < NG; ++gg) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * gg));
      acc[2 * gg] = _mm256_fmadd_ps(pi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), acc[2 * gg]);
      acc[2 * gg + 1] = _mm256_fmadd_ps(pi, _mm256_castsi256_ps(_mm256_and_si256(v, hi)), acc[2 * gg + 1]);
    }
  }
#pragma GCC unroll 8
  for (int gg = 0; gg < NG; ++gg) store_natural(ohat + c0 + 16 * gg, acc[2 * gg], acc[2 * gg + 1]);
}

// One (query, head): scores over its keys, softmax, ô.
KESTREL_AVX2 void one_pair(int64_t C, int64_t CW, const float* qt /* f32 [CW] */, const uint16_t* rows,
                           const int32_t* keys, int64_t nk, float scale, float* ohat /* f32 [C] */, Scratch& sc) {
  sc.qtp.resize(size_t(CW));
  sc.score.resize(size_t(std::max<int64_t>(nk, 1)));
  gemm_detail::permute_row_f32(qt, CW, sc.qtp.data());
  float* s = sc.score.data();
  int64_t i = 0;
  for (; i + 8 <= nk; i += 8) scores_n<8>(sc.qtp.data(), rows, keys + i, CW, scale, s + i);
  for (; i < nk; ++i) scores_n<1>(sc.qtp.data(), rows, keys + i, CW, scale, s + i);

  simd::softmax_inplace(s, nk);  // FP32, max subtracted

  // ô = Σ_j p_j ĉ_j.
  const int64_t G = C / 16;
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) values_chunk<4>(rows, keys, s, nk, CW, 16 * g, ohat);
  for (; g < G; ++g) values_chunk<1>(rows, keys, s, nk, CW, 16 * g, ohat);
  for (int64_t cc = 16 * G; cc < C; ++cc) {
    float a = 0.0f;
    for (int64_t k = 0; k < nk; ++k) a = __builtin_fmaf(s[k], bf16_to_f32(rows[int64_t(keys[k]) * CW + cc]), a);
    ohat[cc] = a;
  }
}

// kH4 heads' scores against NK keys: s [kH4, lds] at columns j0.., times scale. qtp holds the heads'
// permuted q̃ rows (f32 [kH4, CW]). Per (key, head) the same FMAs, lane sum and tail as scores_n.
constexpr int kH4 = 4;
template <int NK>
KESTREL_AVX2 inline void scores_heads(const float* qtp, const uint16_t* rows, const int32_t* keys, int64_t CW,
                                      float scale, float* s, int64_t lds) {
  const int64_t G = CW / 16;
  const __m256i hi = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 acc[NK][kH4];
  const uint16_t* r[NK];
#pragma GCC unroll 4
  for (int n = 0; n < NK; ++n) {
    r[n] = rows + int64_t(keys[n]) * CW;
#pragma GCC unroll 4
    for (int h = 0; h < kH4; ++h) acc[n][h] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int n = 0; n < NK; ++n) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[n] + 16 * g));
      const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), o = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
#pragma GCC unroll 4
      for (int h = 0; h < kH4; ++h) {
        acc[n][h] = _mm256_fmadd_ps(_mm256_loadu_ps(qtp + h * CW + 16 * g), e, acc[n][h]);
        acc[n][h] = _mm256_fmadd_ps(_mm256_loadu_ps(qtp + h * CW + 16 * g + 8), o, acc[n][h]);
      }
    }
  }
#pragma GCC unroll 4
  for (int n = 0; n < NK; ++n)
#pragma GCC unroll 4
    for (int h = 0; h < kH4; ++h) {
      float x = simd::reduce8(acc[n][h]);
      for (int64_t k = 16 * G; k < CW; ++k) x = __builtin_fmaf(qtp[h * CW + k], bf16_to_f32(r[n][k]), x);
      s[h * lds + n] = x * scale;
    }
}

// ô_h[c0, c0 + 16) = Σ_i p_h,i ĉ_i for kH4 heads (p [kH4, ldp], ohat [kH4, C]): values_chunk<1>'s
// FMA chain per column, the row's group split once for the four heads.
KESTREL_AVX2 inline void values_heads(const uint16_t* rows, const int32_t* keys, const float* p, int64_t ldp,
                                      int64_t nk, int64_t CW, int64_t C, int64_t c0, float* ohat) {
  const __m256i hi = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 acc[kH4][2];
#pragma GCC unroll 4
  for (int h = 0; h < kH4; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nk; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + int64_t(keys[i]) * CW + c0));
    const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), o = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
#pragma GCC unroll 4
    for (int h = 0; h < kH4; ++h) {
      const __m256 ph = _mm256_set1_ps(p[h * ldp + i]);
      acc[h][0] = _mm256_fmadd_ps(ph, e, acc[h][0]);
      acc[h][1] = _mm256_fmadd_ps(ph, o, acc[h][1]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kH4; ++h) store_natural(ohat + h * C + c0, acc[h][0], acc[h][1]);
}

// kH4 heads of one query (qt f32 [kH4, CW] → ohat f32 [kH4, C]): one_pair for each, row loads shared.
KESTREL_AVX2 void heads4(int64_t C, int64_t CW, const float* qt, const uint16_t* rows, const int32_t* keys, int64_t nk,
                         float scale, float* ohat, Scratch& sc) {
  sc.qtp.resize(size_t(kH4 * CW));
  const int64_t ld = std::max<int64_t>(nk, 1);
  sc.score.resize(size_t(kH4 * ld));
  for (int h = 0; h < kH4; ++h) gemm_detail::permute_row_f32(qt + h * CW, CW, sc.qtp.data() + h * CW);
  float* s = sc.score.data();
  int64_t j = 0;
  for (; j + 2 <= nk; j += 2) scores_heads<2>(sc.qtp.data(), rows, keys + j, CW, scale, s + j, ld);
  for (; j < nk; ++j) scores_heads<1>(sc.qtp.data(), rows, keys + j, CW, scale, s + j, ld);
  for (int h = 0; h < kH4; ++h) simd::softmax_inplace(s + h * ld, nk);
  const int64_t G = C / 16;
  for (int64_t g = 0; g < G; ++g) values_heads(rows, keys, s, ld, nk, CW, C, 16 * g, ohat);
  for (int h = 0; h < kH4; ++h)
    for (int64_t cc = 16 * G; cc < C; ++cc) {
      float a = 0.0f;
      for (int64_t k = 0; k < nk; ++k)
        a = __builtin_fmaf(s[h * ld + k], bf16_to_f32(rows[int64_t(keys[k]) * CW + cc]), a);
      ohat[h * C + cc] = a;
    }
}

// Query t's keys: the selection (ascending, −1 ends it) or every position up to its own.
const int32_t* query_keys(const int32_t* sel, int64_t Ksel, int64_t t, int64_t pos0, Scratch& sc, int64_t& nk) {
  nk = 0;
  if (sel) {
    while (nk < Ksel && sel[t * Ksel + nk] >= 0) ++nk;
    return sel + t * Ksel;
  }
  nk = pos0 + t + 1;
  if (int64_t(sc.keys.size()) < nk) {
    const int64_t old = int64_t(sc.keys.size());
    sc.keys.resize(size_t(nk));
    for (int64_t k = old; k < nk; ++k) sc.keys[size_t(k)] = int32_t(k);
  }
  return sc.keys.data();
}

}  // namespace

void mla_attn_latent_fast(const MlaDims& dm, const float* qt, const uint16_t* rows, const int32_t* sel, int64_t Ksel,
                          int64_t T, int64_t pos0, float* ohat) {
  if (isa() >= Isa::avx512bf16) return mla_attn_latent_avx512(dm, qt, rows, sel, Ksel, T, pos0, ohat);
  const int64_t Hm = dm.Hm, C = dm.C, CW = dm.cw();
  KCHECK(isa() >= Isa::avx2, "mla_attn_latent_fast needs AVX2");
  const float scale = 1.0f / std::sqrt(float(dm.qk()));
  const int64_t avg_keys = sel ? Ksel : pos0 + (T + 1) / 2;
  parallel_for(T, T * Hm * avg_keys * CW * 3, [&](int64_t b, int64_t e) {
    thread_local Scratch sc;
    for (int64_t t = b; t < e; ++t) {
      int64_t nk = 0;
      const int32_t* keys = query_keys(sel, Ksel, t, pos0, sc, nk);
      int64_t h = 0;
      for (; h + kH4 <= Hm; h += kH4)
        heads4(C, CW, qt + (t * Hm + h) * CW, rows, keys, nk, scale, ohat + (t * Hm + h) * C, sc);
      for (; h < Hm; ++h) one_pair(C, CW, qt + (t * Hm + h) * CW, rows, keys, nk, scale, ohat + (t * Hm + h) * C, sc);
    }
  });
}

void mla_attn_latent_pairs(const MlaDims& dm, const float* qt, const uint16_t* rows, const int32_t* sel, int64_t Ksel,
                           int64_t T, int64_t pos0, float* ohat) {
  const int64_t Hm = dm.Hm, C = dm.C, CW = dm.cw();
  KCHECK(isa() >= Isa::avx2, "mla_attn_latent_pairs needs AVX2");
  const float scale = 1.0f / std::sqrt(float(dm.qk()));
  Scratch sc;
  for (int64_t t = 0; t < T; ++t) {
    int64_t nk = 0;
    const int32_t* keys = query_keys(sel, Ksel, t, pos0, sc, nk);
    for (int64_t h = 0; h < Hm; ++h)
      one_pair(C, CW, qt + (t * Hm + h) * CW, rows, keys, nk, scale, ohat + (t * Hm + h) * C, sc);
  }
}

void mla_q_latent(const MlaDims& dm, const uint16_t* q, const uint16_t* kvb, int64_t T, float* qt) {
  const int64_t Hm = dm.Hm, N = dm.N, R = dm.R, C = dm.C, Dv = dm.Dv, QK = dm.qk(), CW = dm.cw();
  // q̃_h = W_UK,hᵀ q_nope,h: W_UK,h is bf16 [N, C], i.e. the k-major form of the [C, N] weight.
  for (int64_t h = 0; h < Hm; ++h) {
    const GemmOut o{kvb + h * (N + Dv) * C, C, nullptr, qt + h * CW, Hm * CW, C, true};
    gemm_multi(q + h * QK, nullptr, Hm * QK, T, N, std::span<const GemmOut>(&o, 1));
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hm; ++h)
      for (int64_t d = 0; d < R; ++d) qt[(t * Hm + h) * CW + C + d] = bf16_to_f32(q[(t * Hm + h) * QK + N + d]);
}

void mla_o_latent(const MlaDims& dm, const float* ohat, const uint16_t* kvb, int64_t T, uint16_t* o) {
  const int64_t Hm = dm.Hm, N = dm.N, C = dm.C, Dv = dm.Dv;
  // o_h = W_UV,h ô_h: W_UV,h is bf16 [Dv, C] (row-major), rounded to BF16 (the attention op's output).
  for (int64_t h = 0; h < Hm; ++h) {
    const GemmOut g{kvb + (h * (N + Dv) + N) * C, Dv, o + h * Dv, nullptr, Hm * Dv, C, false};
    gemm_multi(nullptr, ohat + h * C, Hm * C, T, C, std::span<const GemmOut>(&g, 1));
  }
}

void mla_attn_absorbed_fast(const MlaDims& dm, const uint16_t* q, const uint16_t* kvb, const uint16_t* rows,
                            const int32_t* sel, int64_t Ksel, int64_t T, int64_t pos0, uint16_t* o) {
  if (isa() < Isa::avx2) return mla_attn_absorbed(dm, q, kvb, rows, sel, Ksel, T, pos0, o);
  std::vector<float> qt(size_t(T * dm.Hm * dm.cw())), ohat(size_t(T * dm.Hm * dm.C));
  mla_q_latent(dm, q, kvb, T, qt.data());
  mla_attn_latent_fast(dm, qt.data(), rows, sel, Ksel, T, pos0, ohat.data());
  mla_o_latent(dm, ohat.data(), kvb, T, o);
}

}  // namespace kestrel::cpu
