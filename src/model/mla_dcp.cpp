// MLA with decode context parallelism, MODEL.md §3.4 steps 1–5 and §3.5, as docs/parallel.md §5 lays it
// out, for a DCP group that is the whole TP group (sh.dcp == sh.size() = N; each rank has Hm/N heads).
//
// Placement: token t lives on rank t mod N at local row ⌊t/N⌋ of that rank's latent and index-key
// pages, so a request's cache is spread evenly and N ranks hold N× the context of one. The new tokens'
// latent and index key are computed on every rank (kv_a_proj and wk are whole) and written by the owner.
// Indexer: every rank scores all Hi heads (q_I and w all-gathered, as under TP) over its own keys with
// the kernel's arithmetic (cpu::indexer_select_topk: same per-key sum, same order, so the same scores),
// keeps its top Ki as (score, global position) and one all-gather lets every rank pick the same global
// top Ki (ties to the lower position) — exactly the keys one rank would pick from identical inputs.
// Attention (absorbed form): q̃_h = W_UK,hᵀ q_nope,h needs the head's own kv_b rows, so each rank forms
// q̃ for its heads and one all-gather hands every rank all Hm; each rank then attends for every head over
// its own selected keys, keeping the running max m, the sum l = Σ exp(s − m) and ô = Σ exp(s − m)·ĉ
// (unnormalised); an all-to-all sends each head's N partials to the head's rank, which merges them by
// log-sum-exp (M = max m_q, ô = Σ_q e^{m_q−M} ô_q / Σ_q e^{m_q−M} l_q) and applies W_UV. A rank without a
// selected key contributes l = 0 and is skipped. Against one rank the sums run in another order, so the
// result is equal to f32 rounding before each BF16 rounding.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/mla_ops.h"
#include "model/mla.h"
#include "parallel/comm.h"

namespace kestrel::model {

namespace {

// Owned positions in [0, n) of rank r among N: r, r + N, ...
int64_t owned_below(int64_t n, int r, int N) { return n > r ? (n - r + N - 1) / N : 0; }

// §3.5 over a spread key cache: sel_local (i32 [T, Ki]) = this rank's share of each query's selected keys
// as local rows, ascending, −1 padded; sel_global (i32 [T, Ki]) = the whole selection, as one rank has it.
void indexer_select_dcp(const IndexerWeights& w, const TextConfig& c, const MlaCacheView& cache, const uint16_t* x,
                        const uint16_t* c_q, int64_t T, int64_t pos0, const Shard& sh, std::vector<int32_t>& sel_local,
                        std::vector<int32_t>& sel_global) {
  const int N = sh.size(), r = sh.rank();
  const int64_t D = c.hidden_size, Q = c.q_lora_rank, Hl = c.index_n_heads, Hi = Hl * N, Di = c.index_head_dim,
                Ki = c.index_topk;
  KCHECK(Ki > 0 && c.index_rope_head_dim == 0, "indexer: index_topk {} / index_rope_head_dim {} unsupported", Ki,
         c.index_rope_head_dim);
  // Steps 1–3 as indexer_select: this rank's heads of q_I and w, gathered to all Hi.
  Bf16Vec ql(size_t(T * Hl * Di)), qi(size_t(T * Hi * Di));  // bf16 [T, Hl*Di], [T, Hi*Di]
  cpu::gemm_bf16(c_q, Q, bf16_ptr(w.wq_b), ql.data(), Hl * Di, T, Q, Hl * Di);
  gather_columns(sh, ql.data(), T, Hl * Di, DType::bf16, qi.data());
  Bf16Vec kraw(size_t(T * Di)), kn(size_t(T * Di));  // bf16 [T, Di]
  cpu::gemm_bf16(x, D, bf16_ptr(w.wk), kraw.data(), Di, T, D, Di);
  cpu::indexer_key_norm(kraw.data(), bf16_ptr(w.k_norm), w.k_norm_bias.empty() ? nullptr : bf16_ptr(w.k_norm_bias), T,
                        Di, kn.data());
  for (int64_t t = 0; t < T; ++t)
    if ((pos0 + t) % N == r) cache.write_key((pos0 + t) / N, kn.data() + t * Di);
  std::vector<float> hl(size_t(T * Hl)), hw(size_t(T * Hi));  // f32 [T, Hl], [T, Hi]
  cpu::gemm_bf16_f32(x, D, bf16_ptr(w.weights_proj), hl.data(), Hl, T, D, Hl);
  gather_columns(sh, hl.data(), T, Hl, DType::f32, hw.data());

  const int64_t S = pos0 + T, Sl = owned_below(S, r, N);
  Bf16Vec keys(size_t(Sl * Di));  // bf16 [Sl, Di]: this rank's keys, local rows
  if (S > Ki) cache.read_keys(Sl, keys.data());
  // Step 5 on own keys, then this rank's top Ki candidates per query (score desc, position asc).
  const float scale = 1.0f / std::sqrt(float(Hi) * float(Di));
  std::vector<float> cand_s(size_t(T * Ki), -std::numeric_limits<float>::infinity());  // f32 [T, Ki]
  std::vector<int32_t> cand_p(size_t(T * Ki), -1);                                      // i32 [T, Ki]
  std::vector<float> qf(size_t(Hi * Di));
  std::vector<std::pair<float, int32_t>> sc;
  const auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = pos0 + t;
    if (p + 1 <= Ki) continue;  // every visible key is selected: no scores (as one rank)
    cpu::bf16_to_f32_n(qi.data() + t * Hi * Di, qf.data(), Hi * Di);
    sc.clear();
    for (int64_t l = 0, s = r; s <= p; ++l, s += N) {
      const uint16_t* k = keys.data() + l * Di;
      float acc = 0.0f;
      for (int64_t h = 0; h < Hi; ++h) {
        float d = 0.0f;
        for (int64_t i = 0; i < Di; ++i) d += qf[size_t(h * Di + i)] * bf16_to_f32(k[i]);
        acc += hw[size_t(t * Hi + h)] * scale * std::max(d, 0.0f);
      }
      sc.emplace_back(std::isnan(acc) ? -std::numeric_limits<float>::infinity() : acc, int32_t(s));
    }
    const size_t keep = std::min(sc.size(), size_t(Ki));
    std::partial_sort(sc.begin(), sc.begin() + ptrdiff_t(keep), sc.end(), better);
    for (size_t i = 0; i < keep; ++i) cand_s[size_t(t * Ki) + i] = sc[i].first, cand_p[size_t(t * Ki) + i] = sc[i].second;
  }
  // Step 6: every rank's candidates → the same global top Ki everywhere.
  std::vector<float> all_s(size_t(N) * size_t(T * Ki));     // f32 [N, T, Ki]
  std::vector<int32_t> all_p(size_t(N) * size_t(T * Ki));   // i32 [N, T, Ki]
  sh.comm->all_gather(cand_s.data(), all_s.data(), size_t(T * Ki), DType::f32);
  sh.comm->all_gather(cand_p.data(), all_p.data(), size_t(T * Ki), DType::i32);
  sel_global.assign(size_t(T * Ki), -1);
  sel_local.assign(size_t(T * Ki), -1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = pos0 + t;
    int32_t* g = sel_global.data() + t * Ki;
    int64_t n = 0;
    if (p + 1 <= Ki) {
      for (int64_t s = 0; s <= p; ++s) g[n++] = int32_t(s);
    } else {
      sc.clear();
      for (int q = 0; q < N; ++q)
        for (int64_t i = 0; i < Ki; ++i) {
          const size_t at = size_t(q) * size_t(T * Ki) + size_t(t * Ki + i);
          if (all_p[at] >= 0) sc.emplace_back(all_s[at], all_p[at]);
        }
      const size_t keep = std::min(sc.size(), size_t(Ki));
      std::partial_sort(sc.begin(), sc.begin() + ptrdiff_t(keep), sc.end(), better);
      for (size_t i = 0; i < keep; ++i) g[n++] = sc[i].second;
      std::sort(g, g + n);
    }
    int32_t* loc = sel_local.data() + t * Ki;
    for (int64_t i = 0, m = 0; i < n; ++i)
      if (g[i] % N == r) loc[m++] = g[i] / N;
  }
}

}  // namespace

void mla_forward_dcp(const MlaWeights& w, const TextConfig& c, const MlaCacheView& cache, int64_t pos0,
                     const uint16_t* x, int64_t T, uint16_t* out, const Probe& probe, const Shard& sh) {
  const int N = sh.size(), r = sh.rank();
  const int64_t D = c.hidden_size, Q = c.q_lora_rank, C = c.kv_lora_rank, R = c.qk_rope_head_dim,
                Nn = c.qk_nope_head_dim, Dv = c.v_head_dim, Hl = c.num_attention_heads, Hm = Hl * N, QK = Nn + R,
                CW = C + R;
  KCHECK(sh.dcp == N && N > 1, "decode context parallelism over {} of {} ranks: only the whole group is supported",
         sh.dcp, N);
  const int64_t S = pos0 + T, Sl = owned_below(S, r, N);
  KCHECK(cache.C == C && cache.R == R, "MLA cache view is for C={} R={}, layer has {} {}", cache.C, cache.R, C, R);
  KCHECK(cache.capacity() >= Sl, "MLA block table covers {} local tokens, the step needs {}", cache.capacity(), Sl);
  const float eps = c.rms_norm_eps;
  using cpu::gemm_bf16;

  // Steps 1–2 as mla_forward (this rank's Hl heads of q); the owner stores each new latent row.
  Bf16Vec qa(size_t(T * Q)), cq(size_t(T * Q)), q(size_t(T * Hl * QK));  // bf16 [T, Q], [T, Q], [T, Hl*QK]
  gemm_bf16(x, D, bf16_ptr(w.q_a_proj), qa.data(), Q, T, D, Q);
  cpu::rmsnorm_bf16(qa.data(), bf16_ptr(w.q_a_norm), cq.data(), T, Q, eps);
  gemm_bf16(cq.data(), Q, bf16_ptr(w.q_b_proj), q.data(), Hl * QK, T, Q, Hl * QK);
  Bf16Vec kva(size_t(T * CW)), row(static_cast<size_t>(CW));  // bf16 [T, C+R], [C+R]
  gemm_bf16(x, D, bf16_ptr(w.kv_a_proj), kva.data(), CW, T, D, CW);
  for (int64_t t = 0; t < T; ++t) {
    if ((pos0 + t) % N != r) continue;
    cpu::rmsnorm_bf16(kva.data() + t * CW, bf16_ptr(w.kv_a_norm), row.data(), 1, C, eps);
    std::memcpy(row.data() + C, kva.data() + t * CW + C, size_t(R) * 2);
    cache.write_latent((pos0 + t) / N, row.data());
  }
  Bf16Vec latent(size_t(Sl * CW));  // bf16 [Sl, C+R]: this rank's rows
  cache.read_latent(Sl, latent.data());

  // §3.5: this rank's share of each query's keys (local rows), or every owned row ≤ p without an indexer.
  const int64_t Ki = c.index_topk;
  std::vector<int32_t> sel, sel_global;
  if (w.has_indexer) {
    indexer_select_dcp(w.indexer, c, cache, x, cq.data(), T, pos0, sh, sel, sel_global);
    probe("index_topk", sel_global.data(), DType::i32, {T, Ki});
  }

  // q̃ for this rank's heads (W_UK,hᵀ q_nope,h | q_pe,h), f32, gathered to all Hm heads.
  const uint16_t* kvb = bf16_ptr(w.kv_b_proj);  // bf16 [Hl*(N+Dv), C]
  std::vector<float> qt_l(size_t(T * Hl * CW), 0.0f), qt(size_t(T * Hm * CW));  // f32 [T, Hl, CW], [T, Hm, CW]
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hl; ++h) {
      const uint16_t* qh = q.data() + (t * Hl + h) * QK;
      const uint16_t* wuk = kvb + h * (Nn + Dv) * C;  // bf16 [N, C]
      float* dst = qt_l.data() + (t * Hl + h) * CW;
      for (int64_t n = 0; n < Nn; ++n) {
        const float qn = bf16_to_f32(qh[n]);
        for (int64_t cc = 0; cc < C; ++cc) dst[cc] += qn * bf16_to_f32(wuk[n * C + cc]);
      }
      for (int64_t d = 0; d < R; ++d) dst[C + d] = bf16_to_f32(qh[Nn + d]);
    }
  gather_columns(sh, qt_l.data(), T, Hl * CW, DType::f32, qt.data());

  // Partial attention of every head over this rank's selected rows: [ô (C) | m | l] per (t, h), laid
  // out by destination rank (head h goes to rank h / Hl) for the all-to-all.
  const int64_t PW = C + 2;
  const float scale = 1.0f / std::sqrt(float(QK));
  std::vector<float> part(size_t(N) * size_t(T * Hl * PW), 0.0f);  // f32 [N, T, Hl, C+2]
  std::vector<int32_t> keys;
  std::vector<float> s;
  for (int64_t t = 0; t < T; ++t) {
    keys.clear();
    if (w.has_indexer) {
      for (int64_t i = 0; i < Ki && sel[size_t(t * Ki + i)] >= 0; ++i) keys.push_back(sel[size_t(t * Ki + i)]);
    } else {
      for (int64_t l = 0; l < owned_below(pos0 + t + 1, r, N); ++l) keys.push_back(int32_t(l));
    }
    const int64_t nk = int64_t(keys.size());
    s.resize(size_t(nk));
    for (int64_t h = 0; h < Hm; ++h) {
      float* dst = part.data() + ((size_t(h / Hl) * size_t(T) + size_t(t)) * size_t(Hl) + size_t(h % Hl)) * size_t(PW);
      if (nk == 0) {
        dst[C] = -std::numeric_limits<float>::infinity();  // l = dst[C+1] = 0: skipped in the merge
        continue;
      }
      const float* qh = qt.data() + (t * Hm + h) * CW;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < nk; ++i) {
        const uint16_t* rw = latent.data() + int64_t(keys[size_t(i)]) * CW;
        float acc = 0.0f;
        for (int64_t d = 0; d < CW; ++d) acc += qh[d] * bf16_to_f32(rw[d]);
        s[size_t(i)] = acc * scale;
        m = std::max(m, s[size_t(i)]);
      }
      float l = 0.0f;
      for (int64_t i = 0; i < nk; ++i) {
        const float e = std::exp(s[size_t(i)] - m);
        l += e;
        const uint16_t* rw = latent.data() + int64_t(keys[size_t(i)]) * CW;
        for (int64_t cc = 0; cc < C; ++cc) dst[cc] += e * bf16_to_f32(rw[cc]);
      }
      dst[C] = m, dst[C + 1] = l;
    }
  }
  std::vector<float> got(part.size());  // f32 [N (source), T, Hl, C+2]: every rank's partials of my heads
  sh.comm->all_to_all(part.data(), got.data(), size_t(T * Hl * PW), DType::f32);

  // Log-sum-exp merge per own head, then o_h = W_UV,h ô_h rounded to BF16 (the attention op's output).
  Bf16Vec o(size_t(T * Hl * Dv));  // bf16 [T, Hl*Dv]
  std::vector<float> ohat(static_cast<size_t>(C)), acc(static_cast<size_t>(Dv));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hl; ++h) {
      auto at = [&](int src) { return got.data() + ((size_t(src) * size_t(T) + size_t(t)) * size_t(Hl) + size_t(h)) * size_t(PW); };
      float M = -std::numeric_limits<float>::infinity();
      for (int src = 0; src < N; ++src)
        if (at(src)[C + 1] > 0.0f) M = std::max(M, at(src)[C]);
      float L = 0.0f;
      std::fill(ohat.begin(), ohat.end(), 0.0f);
      for (int src = 0; src < N; ++src) {
        const float* p = at(src);
        if (!(p[C + 1] > 0.0f)) continue;
        const float f = std::exp(p[C] - M);
        L += f * p[C + 1];
        for (int64_t cc = 0; cc < C; ++cc) ohat[size_t(cc)] += f * p[cc];
      }
      KCHECK(L > 0.0f, "DCP attention: query at position {} has no key on any rank", pos0 + t);
      for (int64_t cc = 0; cc < C; ++cc) ohat[size_t(cc)] /= L;
      const uint16_t* wuv = kvb + (h * (Nn + Dv) + Nn) * C;  // bf16 [Dv, C]
      for (int64_t d = 0; d < Dv; ++d) {
        float v = 0.0f;
        for (int64_t cc = 0; cc < C; ++cc) v += bf16_to_f32(wuv[d * C + cc]) * ohat[size_t(cc)];
        acc[size_t(d)] = v;
      }
      cpu::f32_to_bf16_n(acc.data(), o.data() + (t * Hl + h) * Dv, Dv);
    }

  // Step 5 as mla_forward: gate, o_proj columns of this rank's heads, one all-reduce.
  if (!w.g_proj.empty()) {
    Bf16Vec g(size_t(T * Hl * Dv));  // bf16 [T, Hl*Dv]
    gemm_bf16(x, D, bf16_ptr(w.g_proj), g.data(), Hl * Dv, T, D, Hl * Dv);
    for (size_t i = 0; i < o.size(); ++i) o[i] = f32_to_bf16(bf16_to_f32(o[i]) * cpu::sigmoid(bf16_to_f32(g[i])));
  }
  std::vector<float> y(size_t(T * D));  // f32 [T, D]
  cpu::gemm_bf16_f32(o.data(), Hl * Dv, bf16_ptr(w.o_proj), y.data(), D, T, Hl * Dv, D);
  reduce_to_bf16(sh, y.data(), T * D, out);
}

}  // namespace kestrel::model
