// The DSA indexer's scores and top-k (MODEL.md §3.5 steps 5–6) vectorised, bit-identical to the twin
// indexer_select_topk (mla_ops.h), whose exact order the GPU kernel also repeats.
//
// Scores: the twin sums each dot product q_I[t,h]·k_I[s] sequentially over i (multiply, then add:
// this library is compiled with -ffp-contract=off) and the heads in order. Here 16 keys run side by
// side in two vectors, each lane doing exactly that sequence, over keys transposed once per call into
// f32 blocks of 16 keys [S/16][Di][16] (a lane's k_I[s][i] is a contiguous load, and a block is 2 KB
// of consecutive memory at Di = 32); four heads at a time give the eight independent chains that hide
// the add latency. Queries run in groups of kQueryGroup against each key block in turn, so a block
// comes from L2/L3 once per group and from L1 for the rest (one query at a time streamed all S·Di
// keys per query: at 16K tokens 2 MB per query, bound by the cache bandwidth, issue #22).
// O(T·S·Hi·Di) remains the cost, at vector speed.
// Selection: topk_sorted, a radix select (one histogram pass, up to 2048 bins, over the range [min, max] of an
// order-preserving key, nth_element over the one bin that holds the k-th value, one output pass) in
// O(n) instead of a partial sort; exactly topk() + ascending sort, ties to the lower index, NaN tied
// with −inf below every number.
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

// Order-preserving u32 key: larger float → larger key; ±0 equal; NaN equal to −inf (the twin's rule).
// Branch-free (selects, no jumps), so the compiler vectorises the key pass.
inline uint32_t order_key(float f) {
  uint32_t b = std::bit_cast<uint32_t>(f);
  const uint32_t mag = b & 0x7fffffffu;
  b = mag > 0x7f800000u ? 0xff800000u : mag == 0 ? 0u : b;  // NaN → −inf, −0 → +0
  return b ^ (uint32_t(int32_t(b) >> 31) | 0x80000000u);     // negative: all bits flipped; else the sign
}

constexpr int64_t kQueryGroup = 8;  // queries scored together against each key block

// HB heads × the 16 keys of block kb (f32 [Di][16]): adds Σ_h (w_h·scale)·relu(d_h) into acc (the
// twin's order).
template <int HB>
KESTREL_AVX2 inline void heads16(const float* kb, const float* qf, int64_t Di, const float* wscaled, __m256& acc0,
                                 __m256& acc1) {
  __m256 d0[HB], d1[HB];
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h) d0[h] = _mm256_setzero_ps(), d1[h] = _mm256_setzero_ps();
  for (int64_t i = 0; i < Di; ++i) {
    const __m256 k0 = _mm256_loadu_ps(kb + 16 * i), k1 = _mm256_loadu_ps(kb + 16 * i + 8);
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) {
      const __m256 q = _mm256_set1_ps(qf[h * Di + i]);
      d0[h] = _mm256_add_ps(d0[h], _mm256_mul_ps(q, k0));
      d1[h] = _mm256_add_ps(d1[h], _mm256_mul_ps(q, k1));
    }
  }
  const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h) {
    const __m256 w = _mm256_set1_ps(wscaled[h]);
    // std::max(d, 0.0f) = d < 0 ? 0 : d (keeps NaN and −0 as the twin does)
    const __m256 r0 = _mm256_blendv_ps(d0[h], zero, _mm256_cmp_ps(d0[h], zero, _CMP_LT_OQ));
    const __m256 r1 = _mm256_blendv_ps(d1[h], zero, _mm256_cmp_ps(d1[h], zero, _CMP_LT_OQ));
    acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(w, r0));
    acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(w, r1));
  }
}

// Queries q < nq (f32 qf [nq, Hi·Di], weights [nq, Hi]) against the keys they see: score [nq, Sp]
// (row q valid below visible[q]; the rest of its last 16-block is scratch).
KESTREL_AVX2 void scores_avx2(const float* kB, const int64_t* visible, int nq, const float* qf, int64_t Hi,
                              int64_t Di, const float* wscaled, float* score, int64_t Sp) {
  const int64_t most = *std::max_element(visible, visible + nq);
  for (int64_t s0 = 0; s0 < most; s0 += 16) {
    const float* kb = kB + s0 * Di;  // block s0/16: 16·Di floats
    for (int q = 0; q < nq; ++q) {
      if (s0 >= visible[q]) continue;
      const float* qq = qf + q * Hi * Di;
      const float* wq = wscaled + q * Hi;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t h = 0;
      for (; h + 4 <= Hi; h += 4) heads16<4>(kb, qq + h * Di, Di, wq + h, a0, a1);
      for (; h < Hi; ++h) heads16<1>(kb, qq + h * Di, Di, wq + h, a0, a1);
      _mm256_storeu_ps(score + q * Sp + s0, a0);
      _mm256_storeu_ps(score + q * Sp + s0 + 8, a1);
    }
  }
}

void scores_scalar(const float* kB, const int64_t* visible, int nq, const float* qf, int64_t Hi, int64_t Di,
                   const float* wscaled, float* score, int64_t Sp) {
  for (int q = 0; q < nq; ++q)
    for (int64_t s = 0; s < visible[q]; ++s) {
      const float* kb = kB + (s / 16) * 16 * Di + s % 16;
      float acc = 0.0f;
      for (int64_t h = 0; h < Hi; ++h) {
        float d = 0.0f;
        for (int64_t i = 0; i < Di; ++i) d += qf[(q * Hi + h) * Di + i] * kb[16 * i];
        acc += wscaled[q * Hi + h] * std::max(d, 0.0f);
      }
      score[q * Sp + s] = acc;
    }
}

}  // namespace

void topk_sorted(const float* x, int64_t n, int64_t k, int32_t* idx) {
  KCHECK(k >= 0 && k <= n && n < (int64_t(1) << 31), "top-{} of {} values", k, n);
  if (k == 0) return;
  thread_local std::vector<uint32_t> key, cand;
  key.resize(size_t(n));
  // Keys, and their range: the histogram spans [lo, hi] rather than the top bits, because the
  // scores of one query cluster (close exponents): on the top 11 bits many of them can share a bin,
  // which makes the nth_element over that bin long and the same-bin increments wait on each other.
  uint32_t lo = UINT32_MAX, hi = 0;
  for (int64_t s = 0; s < n; ++s) {
    const uint32_t v = order_key(x[s]);
    key[size_t(s)] = v;
    lo = std::min(lo, v), hi = std::max(hi, v);
  }
  // About one bin per two keys (64 to 2048 bins): clearing a histogram larger than the row cost
  // more than filling it.
  const uint32_t bins = uint32_t(1) << std::clamp(int(std::bit_width(uint64_t(n))) - 2, 6, 11);
  int shift = 0;
  while (((hi - lo) >> shift) >= bins) ++shift;
  uint32_t hist[2048];
  std::fill_n(hist, bins, 0u);
  for (int64_t s = 0; s < n; ++s) ++hist[(key[size_t(s)] - lo) >> shift];
  // The bin holding the k-th largest key, and how many keys lie in higher bins.
  int64_t above = 0;
  uint32_t bin = (hi - lo) >> shift;
  while (above + hist[bin] < k) above += hist[bin--];
  // The passes below write unconditionally and advance by a 0/1 count: which keys pass is data, not
  // a pattern the branch predictor can learn (about a quarter of them at 2K tokens).
  cand.resize(size_t(n));
  int64_t nc = 0;
  for (int64_t s = 0; s < n; ++s) {
    const uint32_t v = key[size_t(s)];
    cand[size_t(nc)] = v;
    nc += ((v - lo) >> shift) == bin;
  }
  const int64_t need = k - above;  // 1 ≤ need ≤ nc
  std::nth_element(cand.begin(), cand.begin() + (need - 1), cand.begin() + nc, std::greater<uint32_t>());
  const uint32_t tau = cand[size_t(need - 1)];
  int64_t gt = above;
  for (int64_t c = 0; c < nc; ++c) gt += cand[size_t(c)] > tau;
  const int64_t eq_take = k - gt;  // keys equal to τ: the lowest positions win
  int64_t m = 0, eq_seen = 0;
  int32_t* out = reinterpret_cast<int32_t*>(cand.data());  // the candidates are no longer needed
  for (int64_t s = 0; s < n; ++s) {
    const uint32_t v = key[size_t(s)];
    const bool eq = v == tau;
    out[m] = int32_t(s);
    m += (v > tau) | (eq & (eq_seen < eq_take));
    eq_seen += eq;
  }
  std::copy_n(out, k, idx);
}

void indexer_select_topk_fast(const uint16_t* qi, const uint16_t* keys, const float* hw, int64_t T, int64_t pos0,
                              int64_t Hi, int64_t Di, int64_t Ki, int32_t* sel) {
  KCHECK(Ki > 0, "index_topk must be positive, got {}", Ki);
  const float scale = 1.0f / std::sqrt(float(Hi) * float(Di));
  std::fill(sel, sel + T * Ki, -1);
  const int64_t S = pos0 + T;
  if (S <= Ki) {  // every query sees at most Ki keys: all selected, no scores
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s <= pos0 + t; ++s) sel[t * Ki + s] = int32_t(s);
    return;
  }
  // Keys transposed to f32 blocks [Sp/16][Di][16], zero-padded to a multiple of 16 keys.
  const int64_t Sp = (S + 15) / 16 * 16;
  std::vector<float> kB(size_t(Di * Sp), 0.0f);
  parallel_for(S, S * Di * 4, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s)
      for (int64_t i = 0; i < Di; ++i) kB[size_t((s / 16) * 16 * Di + 16 * i + s % 16)] = bf16_to_f32(keys[s * Di + i]);
  });
  const bool avx2 = isa() >= Isa::avx2;
  // The queries that see more than Ki keys, in groups; the others select every key they see.
  int64_t t_first = 0;
  for (; t_first < T && pos0 + t_first + 1 <= Ki; ++t_first)
    for (int64_t s = 0; s <= pos0 + t_first; ++s) sel[t_first * Ki + s] = int32_t(s);
  const int64_t groups = (T - t_first + kQueryGroup - 1) / kQueryGroup;
  parallel_for_each(groups, (T - t_first) * S * Hi * Di, [&](int64_t g) {
    const int64_t t0 = t_first + g * kQueryGroup;
    const int nq = int(std::min(kQueryGroup, T - t0));
    thread_local std::vector<float> qf, wscaled, score;
    qf.resize(size_t(nq * Hi * Di));
    wscaled.resize(size_t(nq * Hi));
    score.resize(size_t(nq * Sp));
    int64_t visible[kQueryGroup];
    for (int q = 0; q < nq; ++q) {
      const int64_t t = t0 + q;
      visible[q] = pos0 + t + 1;
      bf16_to_f32_n(qi + t * Hi * Di, qf.data() + q * Hi * Di, Hi * Di);
      for (int64_t h = 0; h < Hi; ++h) wscaled[size_t(q * Hi + h)] = hw[t * Hi + h] * scale;
    }
    if (avx2)
      scores_avx2(kB.data(), visible, nq, qf.data(), Hi, Di, wscaled.data(), score.data(), Sp);
    else
      scores_scalar(kB.data(), visible, nq, qf.data(), Hi, Di, wscaled.data(), score.data(), Sp);
    for (int q = 0; q < nq; ++q) topk_sorted(score.data() + q * Sp, visible[q], Ki, sel + (t0 + q) * Ki);
  });
}

}  // namespace kestrel::cpu
