// MLA attention core and indexer selection; moved here from model/mla.cpp and model/indexer.cpp
// unchanged in arithmetic (see mla_ops.h).
#include "kernels/cpu/mla_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::cpu {
namespace {

std::vector<int32_t> key_list(const int32_t* sel, int64_t Ksel, int64_t t, int64_t p) {
  std::vector<int32_t> keys;
  if (sel) {
    for (int64_t i = 0; i < Ksel && sel[t * Ksel + i] >= 0; ++i) keys.push_back(sel[t * Ksel + i]);
  } else {
    for (int64_t s = 0; s <= p; ++s) keys.push_back(int32_t(s));
  }
  return keys;
}

}  // namespace

void mla_attn_naive(const MlaDims& dm, const uint16_t* q, const uint16_t* kv, const uint16_t* latent,
                    const int32_t* sel, int64_t Ksel, int64_t T, int64_t pos0, uint16_t* o) {
  const int64_t Hm = dm.Hm, N = dm.N, R = dm.R, Dv = dm.Dv, C = dm.C, QK = dm.qk(), CW = dm.cw();
  const float scale = 1.0f / std::sqrt(float(QK));
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<int32_t> keys = key_list(sel, Ksel, t, pos0 + t);
    const int64_t nk = int64_t(keys.size());
    parallel_for(Hm, 2 * Hm * nk * CW, [&](int64_t hb, int64_t he) {
    for (int64_t h = hb; h < he; ++h) {
      const uint16_t* qh = q + (t * Hm + h) * QK;  // [q_nope N | q_pe R]
      std::vector<float> pr(static_cast<size_t>(nk));
      std::vector<float> acc;
      // Step 4: s_j = (q_h · [k_nope,h,j | k_pe,j]) · (N+R)^−½; softmax; o_h = Σ_j p_j v_h,j.
      for (int64_t i = 0; i < nk; ++i) {
        const int64_t j = keys[size_t(i)];
        const uint16_t* kn = kv + (j * Hm + h) * (N + Dv);
        const uint16_t* kpe = latent + j * CW + C;
        float s = 0.0f;
        for (int64_t d = 0; d < N; ++d) s += bf16_to_f32(qh[d]) * bf16_to_f32(kn[d]);
        for (int64_t d = 0; d < R; ++d) s += bf16_to_f32(qh[N + d]) * bf16_to_f32(kpe[d]);
        pr[size_t(i)] = s * scale;
      }
      softmax_inplace(pr.data(), nk);
      acc.assign(size_t(Dv), 0.0f);
      for (int64_t i = 0; i < nk; ++i) {
        const uint16_t* v = kv + (int64_t(keys[size_t(i)]) * Hm + h) * (N + Dv) + N;
        for (int64_t d = 0; d < Dv; ++d) acc[size_t(d)] += pr[size_t(i)] * bf16_to_f32(v[d]);
      }
      f32_to_bf16_n(acc.data(), o + (t * Hm + h) * Dv, Dv);
    }
    });
  }
}

void mla_attn_absorbed(const MlaDims& dm, const uint16_t* q, const uint16_t* kvb, const uint16_t* latent,
                       const int32_t* sel, int64_t Ksel, int64_t T, int64_t pos0, uint16_t* o) {
  const int64_t Hm = dm.Hm, N = dm.N, R = dm.R, Dv = dm.Dv, C = dm.C, QK = dm.qk(), CW = dm.cw();
  const float scale = 1.0f / std::sqrt(float(QK));
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<int32_t> keys = key_list(sel, Ksel, t, pos0 + t);
    const int64_t nk = int64_t(keys.size());
    parallel_for(Hm, 2 * Hm * nk * CW, [&](int64_t hb, int64_t he) {
    for (int64_t h = hb; h < he; ++h) {
      const uint16_t* qh = q + (t * Hm + h) * QK;  // [q_nope N | q_pe R]
      std::vector<float> pr(static_cast<size_t>(nk));
      std::vector<float> acc;
      // Absorbed: q̃_h = W_UK,hᵀ q_nope,h ∈ R^C; s_j = (q̃_h·ĉ_j + q_pe,h·k_pe,j)·(N+R)^−½;
      // ô_h = Σ_j p_j ĉ_j; o_h = W_UV,h ô_h.
      const uint16_t* wuk = kvb + h * (N + Dv) * C;  // bf16 [N, C]
      const uint16_t* wuv = wuk + N * C;             // bf16 [Dv, C]
      std::vector<float> qt(static_cast<size_t>(CW), 0.0f), ohat(static_cast<size_t>(C), 0.0f);
      for (int64_t n = 0; n < N; ++n) {
        const float qn = bf16_to_f32(qh[n]);
        for (int64_t cc = 0; cc < C; ++cc) qt[size_t(cc)] += qn * bf16_to_f32(wuk[n * C + cc]);
      }
      for (int64_t d = 0; d < R; ++d) qt[size_t(C + d)] = bf16_to_f32(qh[N + d]);
      for (int64_t i = 0; i < nk; ++i) {
        const uint16_t* row = latent + int64_t(keys[size_t(i)]) * CW;
        float s = 0.0f;
        for (int64_t d = 0; d < CW; ++d) s += qt[size_t(d)] * bf16_to_f32(row[d]);
        pr[size_t(i)] = s * scale;
      }
      softmax_inplace(pr.data(), nk);
      for (int64_t i = 0; i < nk; ++i) {
        const uint16_t* row = latent + int64_t(keys[size_t(i)]) * CW;
        for (int64_t cc = 0; cc < C; ++cc) ohat[size_t(cc)] += pr[size_t(i)] * bf16_to_f32(row[cc]);
      }
      acc.assign(size_t(Dv), 0.0f);
      for (int64_t d = 0; d < Dv; ++d) {
        float s = 0.0f;
        for (int64_t cc = 0; cc < C; ++cc) s += bf16_to_f32(wuv[d * C + cc]) * ohat[size_t(cc)];
        acc[size_t(d)] = s;
      }
      f32_to_bf16_n(acc.data(), o + (t * Hm + h) * Dv, Dv);
    }
    });
  }
}

void indexer_key_norm(const uint16_t* kraw, const uint16_t* kn_w, const uint16_t* kn_b, int64_t T, int64_t Di,
                      uint16_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* k = kraw + t * Di;
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < Di; ++i) mean += bf16_to_f32(k[i]);
    mean /= double(Di);
    for (int64_t i = 0; i < Di; ++i) var += std::pow(bf16_to_f32(k[i]) - mean, 2);
    const float rstd = float(1.0 / std::sqrt(var / double(Di) + 1e-6));
    for (int64_t i = 0; i < Di; ++i) {
      const float b = kn_b ? bf16_to_f32(kn_b[i]) : 0.0f;
      out[t * Di + i] = f32_to_bf16((bf16_to_f32(k[i]) - float(mean)) * rstd * bf16_to_f32(kn_w[i]) + b);
    }
  }
}

void indexer_select_topk(const uint16_t* qi, const uint16_t* keys, const float* hw, int64_t T, int64_t pos0,
                         int64_t Hi, int64_t Di, int64_t Ki, int32_t* sel) {
  KCHECK(Ki > 0, "index_topk must be positive, got {}", Ki);
  const float scale = 1.0f / std::sqrt(float(Hi) * float(Di));
  std::fill(sel, sel + T * Ki, -1);
  std::vector<float> score;
  std::vector<float> qf(size_t(Hi * Di));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = pos0 + t, visible = p + 1;
    int32_t* out = sel + t * Ki;
    if (visible <= Ki) {
      for (int64_t s = 0; s < visible; ++s) out[s] = int32_t(s);
      continue;
    }
    bf16_to_f32_n(qi + t * Hi * Di, qf.data(), Hi * Di);
    score.assign(size_t(visible), 0.0f);
    parallel_for(visible, visible * Hi * Di, [&](int64_t sb, int64_t se) {
    for (int64_t s = sb; s < se; ++s) {
      const uint16_t* k = keys + s * Di;
      float acc = 0.0f;
      for (int64_t h = 0; h < Hi; ++h) {
        float d = 0.0f;
        for (int64_t i = 0; i < Di; ++i) d += qf[size_t(h * Di + i)] * bf16_to_f32(k[i]);
        acc += hw[size_t(t * Hi + h)] * scale * std::max(d, 0.0f);
      }
      score[size_t(s)] = acc;
    }
    });
    topk(score.data(), visible, Ki, out);
    std::sort(out, out + Ki);
  }
}

}  // namespace kestrel::cpu
