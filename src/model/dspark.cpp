// DSpark draft forward, MODEL.md §5 in order: RoPE tables, context injection, the block through the draft
// layers, lm_head + Markov head, the sequential drafting chain. See dspark.h for the cache contract.
#include "model/dspark.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::model {
namespace {

double yarn_mscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

}  // namespace

// Non-causal MLA attention, naive form (§3.4 steps 3–4): every query sees every one of the S keys
// (the context rows and the whole block). Scores and softmax FP32; each head's output rounded to BF16.
void draft_attend(int64_t Hm, int64_t N, int64_t R, int64_t Dv, int64_t C, float scale,
                  const uint16_t* q /* bf16 [T, Hm, N+R] */, const uint16_t* kv /* bf16 [S, Hm, N+Dv] */,
                  const uint16_t* latent /* bf16 [S, C+R] */, int64_t T, int64_t S, uint16_t* o /* bf16 [T, Hm*Dv] */) {
  const int64_t QK = N + R, CW = C + R;
  for (int64_t t = 0; t < T; ++t) {
#pragma omp parallel for schedule(static) if (2 * Hm * S * CW >= cpu::kParallelMinWork)
    for (int64_t h = 0; h < Hm; ++h) {
      const uint16_t* qh = q + (t * Hm + h) * QK;
      std::vector<float> pr(static_cast<size_t>(S)), acc(static_cast<size_t>(Dv), 0.0f);
      for (int64_t j = 0; j < S; ++j) {
        const uint16_t* kn = kv + (j * Hm + h) * (N + Dv);
        const uint16_t* kpe = latent + j * CW + C;
        float s = 0.0f;
        for (int64_t d = 0; d < N; ++d) s += bf16_to_f32(qh[d]) * bf16_to_f32(kn[d]);
        for (int64_t d = 0; d < R; ++d) s += bf16_to_f32(qh[N + d]) * bf16_to_f32(kpe[d]);
        pr[size_t(j)] = s * scale;
      }
      cpu::softmax_inplace(pr.data(), S);
      for (int64_t j = 0; j < S; ++j) {
        const uint16_t* v = kv + (j * Hm + h) * (N + Dv) + N;
        for (int64_t d = 0; d < Dv; ++d) acc[size_t(d)] += pr[size_t(j)] * bf16_to_f32(v[d]);
      }
      cpu::f32_to_bf16_n(acc.data(), o + (t * Hm + h) * Dv, Dv);
    }
  }
}

DraftRope draft_rope(const DraftConfig& c) {
  const int64_t R = c.qk_rope_head_dim;
  DraftRope r;
  std::vector<double> inv(size_t(R / 2)), pos_freq(size_t(R / 2));
  for (int64_t i = 0; i < R / 2; ++i) {
    pos_freq[size_t(i)] = std::pow(double(c.rope.theta), double(2 * i) / double(R));
    inv[size_t(i)] = 1.0 / pos_freq[size_t(i)];
  }
  double scale = 1.0 / std::sqrt(double(c.qk_nope_head_dim + R));
  if (c.rope.yarn) {
    // DeepSeek-YaRN: dims below `low` keep their frequency, above `high` are divided by the factor, a linear
    // ramp between (the correction range of beta_fast / beta_slow rotations over the original context).
    const double f = c.rope.factor, orig = double(c.rope.original_max_position_embeddings), base = c.rope.theta;
    auto corr_dim = [&](double rot) { return (double(R) * std::log(orig / (rot * 2.0 * std::numbers::pi))) / (2.0 * std::log(base)); };
    const double low = std::max(std::floor(corr_dim(c.rope.beta_fast)), 0.0);
    double high = std::min(std::ceil(corr_dim(c.rope.beta_slow)), double(R - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < R / 2; ++i) {
      const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
      const double keep = 1.0 - ramp;  // weight of the original (extrapolated) frequency
      inv[size_t(i)] = (1.0 / (f * pos_freq[size_t(i)])) * (1.0 - keep) + inv[size_t(i)] * keep;
    }
    r.cos_sin_mul = float(yarn_mscale(f, c.rope.mscale) / yarn_mscale(f, c.rope.mscale_all_dim));
    if (c.rope.mscale_all_dim != 0.0f) scale *= std::pow(yarn_mscale(f, c.rope.mscale_all_dim), 2);
  }
  r.inv_freq.assign(inv.begin(), inv.end());
  r.softmax_scale = float(scale);
  return r;
}

void rope_interleaved(const DraftRope& r, uint16_t* x, int64_t ld, int64_t T, int64_t pos0, int64_t R) {
  KCHECK(int64_t(r.inv_freq.size()) * 2 == R, "RoPE table has {} frequencies for {} dims", r.inv_freq.size(), R);
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* row = x + t * ld;
    const float p = float(pos0 + t);
    for (int64_t i = 0; i < R / 2; ++i) {
      const float ang = p * r.inv_freq[size_t(i)];
      const float c = std::cos(ang) * r.cos_sin_mul, s = std::sin(ang) * r.cos_sin_mul;
      const float x0 = bf16_to_f32(row[2 * i]), x1 = bf16_to_f32(row[2 * i + 1]);
      row[2 * i] = f32_to_bf16(x0 * c - x1 * s);
      row[2 * i + 1] = f32_to_bf16(x1 * c + x0 * s);
    }
  }
}

Draft::Draft(const DraftConfig& c, const DraftWeights& dw, const ModelWeights& t)
    : cfg(&c), w(&dw), target(&t), rope(draft_rope(c)), mla_cfg(c.mla_text_config()) {
  KCHECK(dw.layers.size() == size_t(c.num_hidden_layers), "draft weights have {} layers, config {}", dw.layers.size(),
         c.num_hidden_layers);
  KCHECK(t.embed.shape.rank == 2 && t.embed.shape[1] == c.hidden_size, "target embedding width differs from the draft's");
}

void Draft::inject(std::span<const MlaCacheView> caches, int64_t pos0, const uint16_t* taps, int64_t T,
                   const Probe& probe) const {
  const DraftConfig& c = *cfg;
  const int64_t D = c.hidden_size, In = c.tap_width(), C = c.kv_lora_rank, R = c.qk_rope_head_dim, CW = C + R;
  KCHECK(caches.size() == size_t(c.num_hidden_layers), "draft needs {} cache views, got {}", c.num_hidden_layers, caches.size());
  if (T == 0) return;
  // H_ctx = RMSNorm_{context_norm}(Lin(context_proj)(concat taps)).
  Bf16Vec proj(size_t(T * D)), hctx(size_t(T * D));  // bf16 [T, D]
  cpu::gemm_bf16(taps, In, bf16_ptr(w->context_proj), proj.data(), D, T, In, D);
  cpu::rmsnorm_bf16(proj.data(), bf16_ptr(w->context_norm), hctx.data(), T, D, c.rms_norm_eps);
  probe("h_ctx", hctx.data(), DType::bf16, {T, D});
  // Per layer: [c | k_pe] = Lin(kv_a_proj)(H_ctx); ĉ = RMSNorm(c); k_pe = RoPE(k_pe, pos); write the row.
  Bf16Vec kva(size_t(T * CW)), rows(size_t(T * CW));  // bf16 [T, C+R]
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const DraftLayerWeights& L = w->layers[size_t(l)];
    const MlaCacheView& cache = caches[size_t(l)];
    KCHECK(cache.C == C && cache.R == R, "draft cache view of layer {} is for C={} R={}", l, cache.C, cache.R);
    KCHECK(cache.capacity() >= pos0 + T, "draft cache of layer {} covers {} tokens, injection needs {}", l,
           cache.capacity(), pos0 + T);
    cpu::gemm_bf16(hctx.data(), D, bf16_ptr(L.kv_a_proj), kva.data(), CW, T, D, CW);
    for (int64_t t = 0; t < T; ++t) {
      cpu::rmsnorm_bf16(kva.data() + t * CW, bf16_ptr(L.kv_a_norm), rows.data() + t * CW, 1, C, c.rms_norm_eps);
      std::memcpy(rows.data() + t * CW + C, kva.data() + t * CW + C, size_t(R) * 2);
    }
    rope_interleaved(rope, rows.data() + C, CW, T, pos0, R);
    for (int64_t t = 0; t < T; ++t) cache.write_latent(pos0 + t, rows.data() + t * CW);
    if (probe.active()) probe(fmt::format("D{}.ctx_latent", l), rows.data(), DType::bf16, {T, CW});
  }
}

void Draft::block(std::span<const MlaCacheView> caches, int64_t ctx, std::span<const int32_t> tokens, uint16_t* hn,
                  const Probe& probe) const {
  const DraftConfig& c = *cfg;
  const int64_t T = int64_t(tokens.size()), D = c.hidden_size, V = c.vocab_size, F = c.intermediate_size;
  const int64_t Hm = c.num_attention_heads, Q = c.q_lora_rank, C = c.kv_lora_rank, N = c.qk_nope_head_dim,
                R = c.qk_rope_head_dim, Dv = c.v_head_dim, QK = N + R, CW = C + R, S = ctx + T;
  const float eps = c.rms_norm_eps;
  KCHECK(T > 0, "empty draft block");
  KCHECK(caches.size() == size_t(c.num_hidden_layers), "draft needs {} cache views, got {}", c.num_hidden_layers, caches.size());
  // Inputs are the target's embeddings of the block tokens.
  Bf16Vec h(size_t(T * D));  // bf16 [T, D] residual stream
  const uint16_t* embed = bf16_ptr(target->embed);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t id = tokens[size_t(t)];
    if (id < 0 || id >= V) fail("draft block token {} at {} is outside [0, {})", id, t, V);
    std::memcpy(h.data() + t * D, embed + int64_t(id) * D, size_t(D) * 2);
  }
  Bf16Vec x(size_t(T * D)), y(size_t(T * D));                           // bf16 [T, D]
  Bf16Vec qa(size_t(T * Q)), cq(size_t(T * Q)), q(size_t(T * Hm * QK));   // bf16 [T, Q], [T, Q], [T, Hm*QK]
  Bf16Vec kva(size_t(T * CW)), latent(size_t(S * CW));                   // bf16 [T, C+R], [S, C+R]
  Bf16Vec kv(size_t(S * Hm * (N + Dv))), o(size_t(T * Hm * Dv));         // bf16 [S, Hm*(N+Dv)], [T, Hm*Dv]
  Bf16Vec g(size_t(T * F)), u(size_t(T * F)), a(size_t(T * F));          // bf16 [T, Fd]
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const DraftLayerWeights& L = w->layers[size_t(l)];
    const MlaCacheView& cache = caches[size_t(l)];
    KCHECK(cache.C == C && cache.R == R && cache.capacity() >= ctx, "draft cache view of layer {} does not fit", l);
    const Probe lp{probe.observer, -1};
    // h += MLA(RMSNorm(h)): §3.4 with RoPE on the rope dims and no output gate.
    cpu::rmsnorm_bf16(h.data(), bf16_ptr(L.input_norm), x.data(), T, D, eps);
    cpu::gemm_bf16(x.data(), D, bf16_ptr(L.q_a_proj), qa.data(), Q, T, D, Q);
    cpu::rmsnorm_bf16(qa.data(), bf16_ptr(L.q_a_norm), cq.data(), T, Q, eps);
    cpu::gemm_bf16(cq.data(), Q, bf16_ptr(L.q_b_proj), q.data(), Hm * QK, T, Q, Hm * QK);
    for (int64_t hh = 0; hh < Hm; ++hh) rope_interleaved(rope, q.data() + hh * QK + N, Hm * QK, T, ctx, R);
    // Context rows from the cache, then the block's own rows (never written to the cache).
    cache.read_latent(ctx, latent.data());
    cpu::gemm_bf16(x.data(), D, bf16_ptr(L.kv_a_proj), kva.data(), CW, T, D, CW);
    uint16_t* blk = latent.data() + ctx * CW;
    for (int64_t t = 0; t < T; ++t) {
      cpu::rmsnorm_bf16(kva.data() + t * CW, bf16_ptr(L.kv_a_norm), blk + t * CW, 1, C, eps);
      std::memcpy(blk + t * CW + C, kva.data() + t * CW + C, size_t(R) * 2);
    }
    rope_interleaved(rope, blk + C, CW, T, ctx, R);
    if (lp.active()) lp(fmt::format("D{}.block_latent", l), blk, DType::bf16, {T, CW});
    cpu::gemm_bf16(latent.data(), CW, bf16_ptr(L.kv_b_proj), kv.data(), Hm * (N + Dv), S, C, Hm * (N + Dv));
    draft_attend(Hm, N, R, Dv, C, rope.softmax_scale, q.data(), kv.data(), latent.data(), T, S, o.data());
    cpu::gemm_bf16(o.data(), Hm * Dv, bf16_ptr(L.o_proj), y.data(), D, T, Hm * Dv, D);
    if (lp.active()) lp(fmt::format("D{}.attn_out", l), y.data(), DType::bf16, {T, D});
    for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(y[i]));
    // h += MLP(RMSNorm(h)): SwiGLU, silu(g)·u in FP32, one rounding.
    cpu::rmsnorm_bf16(h.data(), bf16_ptr(L.post_attn_norm), x.data(), T, D, eps);
    cpu::gemm_bf16(x.data(), D, bf16_ptr(L.gate_proj), g.data(), F, T, D, F);
    cpu::gemm_bf16(x.data(), D, bf16_ptr(L.up_proj), u.data(), F, T, D, F);
    for (size_t i = 0; i < a.size(); ++i) a[i] = f32_to_bf16(cpu::silu(bf16_to_f32(g[i])) * bf16_to_f32(u[i]));
    cpu::gemm_bf16(a.data(), F, bf16_ptr(L.down_proj), y.data(), D, T, F, D);
    if (lp.active()) lp(fmt::format("D{}.mlp_out", l), y.data(), DType::bf16, {T, D});
    for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(y[i]));
    if (lp.active()) lp(fmt::format("D{}.hidden", l), h.data(), DType::bf16, {T, D});
  }
  cpu::rmsnorm_bf16(h.data(), bf16_ptr(w->final_norm), hn, T, D, eps);
  probe("block_normed", hn, DType::bf16, {T, D});
}

void Draft::base_logits(const uint16_t* hn, int64_t T, float* out) const {
  const int64_t D = cfg->hidden_size, V = cfg->vocab_size;
  const TensorView& head = target->lm_head.empty() ? target->embed : target->lm_head;
  cpu::gemm_bf16_f32(hn, D, bf16_ptr(head), out, V, T, D, V);
}

void Draft::markov_logits(const float* base, int32_t prev, int topk, float* out) const {
  const int64_t V = cfg->vocab_size, r = cfg->markov_rank;
  KCHECK(prev >= 0 && prev < V, "Markov head: previous token {} outside [0, {})", prev, V);
  const uint16_t* w1 = bf16_ptr(w->markov_w1) + int64_t(prev) * r;  // bf16 [r]
  const uint16_t* w2 = bf16_ptr(w->markov_w2);                      // bf16 [V, r]
  std::vector<float> e(static_cast<size_t>(r));
  cpu::bf16_to_f32_n(w1, e.data(), r);
  // logits = base + W2 · W1[prev] (FP32, no rounding).
  for (int64_t v = 0; v < V; ++v) {
    float s = 0.0f;
    for (int64_t k = 0; k < r; ++k) s += bf16_to_f32(w2[v * r + k]) * e[size_t(k)];
    out[v] = base[v] + s;
  }
  if (topk > 0 && topk < V) {
    // Top-k pruning: the correction only reranks the base top-k; every other token is −inf.
    std::vector<int32_t> keep(static_cast<size_t>(topk));
    cpu::topk(base, V, topk, keep.data());
    std::vector<float> kept(static_cast<size_t>(topk));
    for (int i = 0; i < topk; ++i) kept[size_t(i)] = out[keep[size_t(i)]];
    std::fill(out, out + V, -std::numeric_limits<float>::infinity());
    for (int i = 0; i < topk; ++i) out[keep[size_t(i)]] = kept[size_t(i)];
  }
}

void Draft::draft(std::span<const MlaCacheView> caches, int64_t ctx, int32_t anchor, int topk, const Pick& pick,
                  int32_t* tokens, const Probe& probe) const {
  const int64_t Nb = cfg->block_size, D = cfg->hidden_size, V = cfg->vocab_size;
  // Anchor-as-first-prediction: [anchor, mask × (Nb−1)] at ctx..ctx+Nb−1; position i predicts token i+1.
  std::vector<int32_t> blk(static_cast<size_t>(Nb), cfg->mask_token_id);
  blk[0] = anchor;
  Bf16Vec hn(size_t(Nb * D));                                   // bf16 [Nb, D]
  block(caches, ctx, blk, hn.data(), probe);
  std::vector<float> base(static_cast<size_t>(Nb * V));         // f32 [Nb, V]
  base_logits(hn.data(), Nb, base.data());
  draft_from_base(base.data(), anchor, topk, pick, tokens);
}

void Draft::draft_from_base(const float* base, int32_t anchor, int topk, const Pick& pick, int32_t* tokens) const {
  const int64_t Nb = cfg->block_size, V = cfg->vocab_size;
  std::vector<float> lg(static_cast<size_t>(V));  // f32 [V]
  int32_t prev = anchor;
  for (int64_t i = 0; i < Nb; ++i) {
    markov_logits(base + i * V, prev, topk, lg.data());
    prev = tokens[i] = pick(int(i), lg);
    KCHECK(prev >= 0 && prev < V, "draft pick returned {}", prev);
  }
}

std::vector<MlaCacheView> DraftState::views(const TextConfig& mla_cfg, int64_t n) {
  std::vector<MlaCacheView> v;
  for (MlaCache& c : layers) v.push_back(c.view(mla_cfg, n));
  return v;
}

}  // namespace kestrel::model
