// MLA forward, MODEL.md §3.4 steps 1–5 (+ §3.5 step 7: attend only to the indexer's keys).
// Projections run as one GEMM over the T new tokens; attention then loops query × head, heads in
// parallel. Scores and softmax are FP32; each head's output is rounded to BF16 (the attention op's
// output dtype) before the gate.
#include "model/mla.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/mla_ops.h"
#include "model/indexer.h"
#include "model/tp.h"

namespace kestrel::model {

void mla_forward(const MlaWeights& w, const TextConfig& c, MlaCache& cache, const uint16_t* x, int64_t T,
                 uint16_t* out, MlaForm form, const Probe& probe) {
  const MlaCacheView v = cache.view(c, cache.len + T);
  mla_forward(w, c, v, cache.len, x, T, out, form, probe);
  cache.len += T;
}

void mla_forward(const MlaWeights& w, const TextConfig& c, const MlaCacheView& cache, int64_t pos0, const uint16_t* x,
                 int64_t T, uint16_t* out, MlaForm form, const Probe& probe, const Shard& sh) {
  if (sh.dcp > 1) return mla_forward_dcp(w, c, cache, pos0, x, T, out, probe, sh);
  const int64_t D = c.hidden_size, Q = c.q_lora_rank, C = c.kv_lora_rank, R = c.qk_rope_head_dim,
                N = c.qk_nope_head_dim, Dv = c.v_head_dim, Hm = c.num_attention_heads, QK = N + R, CW = C + R;
  const int64_t S = pos0 + T;
  KCHECK(cache.C == C && cache.R == R, "MLA cache view is for C={} R={}, layer has {} {}", cache.C, cache.R, C, R);
  KCHECK(cache.capacity() >= S, "MLA block table covers {} tokens, the step needs {}", cache.capacity(), S);
  const float eps = c.rms_norm_eps;
  using cpu::gemm_bf16;

  // Step 1: c_q = RMSNorm_{q_a_layernorm}(Lin(q_a_proj)(x)); q = Lin(q_b_proj)(c_q) per head [N | R].
  Bf16Vec qa(size_t(T * Q)), cq(size_t(T * Q)), q(size_t(T * Hm * QK));  // bf16 [T, Q], [T, Q], [T, Hm*QK]
  gemm_bf16(x, D, bf16_ptr(w.q_a_proj), qa.data(), Q, T, D, Q);
  cpu::rmsnorm_bf16(qa.data(), bf16_ptr(w.q_a_norm), cq.data(), T, Q, eps);
  gemm_bf16(cq.data(), Q, bf16_ptr(w.q_b_proj), q.data(), Hm * QK, T, Q, Hm * QK);
  // Step 2: [c | k_pe] = Lin(kv_a_proj_with_mqa)(x); ĉ = RMSNorm_{kv_a_layernorm}(c); k_pe untouched.
  Bf16Vec kva(size_t(T * CW));  // bf16 [T, C+R]
  gemm_bf16(x, D, bf16_ptr(w.kv_a_proj), kva.data(), CW, T, D, CW);
  Bf16Vec row(static_cast<size_t>(CW));  // bf16 [C+R]
  for (int64_t t = 0; t < T; ++t) {
    cpu::rmsnorm_bf16(kva.data() + t * CW, bf16_ptr(w.kv_a_norm), row.data(), 1, C, eps);
    std::memcpy(row.data() + C, kva.data() + t * CW + C, size_t(R) * 2);
    cache.write_latent(pos0 + t, row.data());
  }
  // Every cached row as the attention sees it (dequantised when the cache is FP8).
  Bf16Vec latent(size_t(S * CW));  // bf16 [S, C+R]: ĉ | k_pe
  cache.read_latent(S, latent.data());

  // §3.5: which keys each query sees (dense causal without an indexer).
  std::vector<int32_t> sel;  // i32 [T, Ksel], ascending, −1 padded
  int64_t Ksel = 0;
  if (w.has_indexer) {
    indexer_select(w.indexer, c, cache, x, cq.data(), T, pos0, sel, sh);
    Ksel = c.index_topk;
    probe("index_topk", sel.data(), DType::i32, {T, Ksel});
  }

  const uint16_t* kvb = bf16_ptr(w.kv_b_proj);  // bf16 [Hm*(N+Dv), C], per head [W_UK (N rows) | W_UV (Dv rows)]
  const cpu::MlaDims dims{Hm, N, R, Dv, C};
  const int32_t* keys = w.has_indexer ? sel.data() : nullptr;  // the indexer's selection, or 0..p
  Bf16Vec o(size_t(T * Hm * Dv));  // bf16 [T, Hm*Dv]
  if (form == MlaForm::naive) {
    // Step 3 (naive form): [k_nope | v] for every cached token; step 4 per head (kernels/cpu/mla_ops.h).
    Bf16Vec kv(size_t(S * Hm * (N + Dv)));  // bf16 [S, Hm*(N+Dv)]
    gemm_bf16(latent.data(), CW, kvb, kv.data(), Hm * (N + Dv), S, C, Hm * (N + Dv));
    cpu::mla_attn_naive(dims, q.data(), kv.data(), latent.data(), keys, Ksel, T, pos0, o.data());
  } else {
    cpu::mla_attn_absorbed(dims, q.data(), kvb, latent.data(), keys, Ksel, T, pos0, o.data());
  }

  // Step 5: ô = concat_h(o_h) ⊙ σ(Lin(g_proj)(x)); out = Lin(o_proj)(ô).
  if (!w.g_proj.empty()) {
    Bf16Vec g(size_t(T * Hm * Dv));  // bf16 [T, Hm*Dv]
    gemm_bf16(x, D, bf16_ptr(w.g_proj), g.data(), Hm * Dv, T, D, Hm * Dv);
    for (size_t i = 0; i < o.size(); ++i) o[i] = f32_to_bf16(bf16_to_f32(o[i]) * cpu::sigmoid(bf16_to_f32(g[i])));
  }
  if (!sh.split()) {
    gemm_bf16(o.data(), Hm * Dv, bf16_ptr(w.o_proj), out, D, T, Hm * Dv, D);
    return;
  }
  std::vector<float> part(size_t(T * D));  // f32 [T, D], this rank's heads only
  cpu::gemm_bf16_f32(o.data(), Hm * Dv, bf16_ptr(w.o_proj), part.data(), D, T, Hm * Dv, D);
  reduce_to_bf16(sh, part.data(), T * D, out);
}

}  // namespace kestrel::model
