// The absorbed MLA attention core (mla_ops.h) vectorised: the CPU engine's form for prefill and decode
// alike, so a query's output never depends on the chunk or batch it runs in.
//
// One (query, head) pair at a time, pairs spread over the thread pool:
//   q̃ = W_UKᵀ q_nope (FP32, sum over the nope index in order) | q_pe, laid out in ORDER16;
//   s_j = q̃·[ĉ_j | k_pe,j]·(N+R)^−½ straight from the bf16 latent rows (8 keys at a time, one
//   accumulator each); softmax in FP32 with the vector exp; ô = Σ_j p_j ĉ_j accumulated in the
//   ORDER16 layout, which is what the W_UV product (the GEMM block kernel, ORDER16) takes as input.
// Against the scalar twin mla_attn_absorbed: FMA contraction, lane sums and the vector exp, i.e.
// FP32 rounding noise before the BF16 output rounding (tests/unit/test_kernels_cpu.cpp bounds it).
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
  std::vector<float> qt, qtp, score, ohat;
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

// ô (permuted, C wide) = Σ_i p_i ĉ_i over the first C elements of each row; `NG` 16-groups at a time.
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
  for (int a = 0; a < 2 * NG; ++a) _mm256_storeu_ps(ohat + c0 + 8 * a, acc[a]);
}

KESTREL_AVX2 void one_pair(const MlaDims& dm, const uint16_t* qh, const uint16_t* wuk, const uint16_t* wuv,
                           const uint16_t* rows, const int32_t* keys, int64_t nk, float scale, uint16_t* out,
                           Scratch& sc) {
  const int64_t N = dm.N, R = dm.R, C = dm.C, CW = dm.cw(), Dv = dm.Dv;
  sc.qt.resize(size_t(CW));
  sc.qtp.resize(size_t(CW));
  sc.score.resize(size_t(std::max<int64_t>(nk, 1)));
  sc.ohat.resize(size_t(C));
  float* qt = sc.qt.data();
  // q̃[c] = Σ_n q_nope[n]·W_UK[n, c], n in order.
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t n = 0; n < N; ++n) {
      const __m256 qn = _mm256_set1_ps(bf16_to_f32(qh[n]));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) a[v] = _mm256_fmadd_ps(qn, simd::load_bf16(wuk + n * C + c + 8 * v), a[v]);
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(qt + c + 8 * v, a[v]);
  }
  for (; c < C; ++c) {
    float a = 0.0f;
    for (int64_t n = 0; n < N; ++n) a = __builtin_fmaf(bf16_to_f32(qh[n]), bf16_to_f32(wuk[n * C + c]), a);
    qt[c] = a;
  }
  for (int64_t d = 0; d < R; ++d) qt[C + d] = bf16_to_f32(qh[N + d]);
  gemm_detail::permute_row_f32(qt, CW, sc.qtp.data());

  float* s = sc.score.data();
  int64_t i = 0;
  for (; i + 8 <= nk; i += 8) scores_n<8>(sc.qtp.data(), rows, keys + i, CW, scale, s + i);
  for (; i < nk; ++i) scores_n<1>(sc.qtp.data(), rows, keys + i, CW, scale, s + i);

  // Softmax over the nk scores (FP32, max subtracted).
  float m = -INFINITY;
  for (int64_t j = 0; j < nk; ++j) m = std::max(m, s[j]);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= nk; j += 8) {
    const __m256 e = simd::exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = simd::reduce8(sum8);
  for (; j < nk; ++j) sum += (s[j] = std::exp(s[j] - m));
  const float inv = 1.0f / sum;
  for (j = 0; j < nk; ++j) s[j] *= inv;

  // ô in the ORDER16 layout (per 16-group: evens, then odds; the C mod 16 tail as is).
  float* oh = sc.ohat.data();
  const int64_t G = C / 16;
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) values_chunk<4>(rows, keys, s, nk, CW, 16 * g, oh);
  for (; g < G; ++g) values_chunk<1>(rows, keys, s, nk, CW, 16 * g, oh);
  for (int64_t cc = 16 * G; cc < C; ++cc) {
    float a = 0.0f;
    for (int64_t k = 0; k < nk; ++k) a = __builtin_fmaf(s[k], bf16_to_f32(rows[int64_t(keys[k]) * CW + cc]), a);
    oh[cc] = a;
  }
  // o_h = W_UV,h ô_h, rounded to BF16 (the attention op's output dtype).
  gemm_detail::Block blk;
  blk.xp = oh, blk.ldx = C;
  blk.w = wuv, blk.ldw = C;
  blk.M = 1, blk.N = Dv, blk.K = C;
  blk.yb = out, blk.ldy = Dv;
  gemm_detail::block_avx2(blk);
}

}  // namespace

void mla_attn_absorbed_fast(const MlaDims& dm, const uint16_t* q, const uint16_t* kvb, const uint16_t* rows,
                            const int32_t* sel, int64_t Ksel, int64_t T, int64_t pos0, uint16_t* o) {
  if (isa() < Isa::avx2) return mla_attn_absorbed(dm, q, kvb, rows, sel, Ksel, T, pos0, o);
  const int64_t Hm = dm.Hm, N = dm.N, Dv = dm.Dv, C = dm.C, QK = dm.qk();
  const float scale = 1.0f / std::sqrt(float(QK));
  const int64_t avg_keys = sel ? Ksel : pos0 + (T + 1) / 2;
  parallel_for(T * Hm, T * Hm * avg_keys * dm.cw() * 3, [&](int64_t b, int64_t e) {
    thread_local Scratch sc;
    for (int64_t item = b; item < e; ++item) {
      const int64_t t = item / Hm, h = item % Hm;
      // This query's keys: the selection (ascending, −1 ends it) or every position up to its own.
      int64_t nk = 0;
      if (sel) {
        while (nk < Ksel && sel[t * Ksel + nk] >= 0) ++nk;
        sc.keys.assign(sel + t * Ksel, sel + t * Ksel + nk);
      } else {
        nk = pos0 + t + 1;
        sc.keys.resize(size_t(nk));
        for (int64_t k = 0; k < nk; ++k) sc.keys[size_t(k)] = int32_t(k);
      }
      const uint16_t* wuk = kvb + h * (N + Dv) * C;  // bf16 [N, C]
      one_pair(dm, q + (t * Hm + h) * QK, wuk, wuk + N * C, rows, sc.keys.data(), nk, scale, o + (t * Hm + h) * Dv, sc);
    }
  });
}

}  // namespace kestrel::cpu
