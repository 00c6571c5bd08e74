// Indexer forward, MODEL.md §3.5 steps 1–6 in order.
#include "model/indexer.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/mla_ops.h"

namespace kestrel::model {

void indexer_select(const IndexerWeights& w, const TextConfig& c, const MlaCacheView& cache, const uint16_t* x,
                    const uint16_t* c_q, int64_t T, int64_t pos0, std::vector<int32_t>& sel, const Shard& sh) {
  // Hl = this rank's heads (all of them on one rank), Hi = the model's.
  const int64_t D = c.hidden_size, Q = c.q_lora_rank, Hl = c.index_n_heads, Hi = Hl * sh.size(),
                Di = c.index_head_dim, Ki = c.index_topk;
  KCHECK(Ki > 0, "index_topk must be positive, got {}", Ki);
  KCHECK(c.index_rope_head_dim == 0, "indexer RoPE (index_rope_head_dim = {}) is not implemented on the CPU path",
         c.index_rope_head_dim);
  KCHECK(cache.Di == Di && cache.capacity() >= pos0 + T, "index-key cache view (Di {}, {} tokens) cannot take {} + {}",
         cache.Di, cache.capacity(), pos0, T);
  // Step 1: q_I = Lin(wq_b)(c_q) → [Hi, Di] (this rank's Hl heads, gathered below).
  Bf16Vec qi(size_t(T * Hi * Di));  // bf16 [T, Hi*Di]
  Bf16Vec ql(sh.split() ? size_t(T * Hl * Di) : 0);  // bf16 [T, Hl*Di]
  cpu::gemm_bf16(c_q, Q, bf16_ptr(w.wq_b), sh.split() ? ql.data() : qi.data(), Hl * Di, T, Q, Hl * Di);
  // Step 2: k_I = LayerNorm_{eps 1e-6}(Lin(wk)(x)) with weight and optional bias, one BF16 rounding.
  Bf16Vec kraw(size_t(T * Di));  // bf16 [T, Di]
  cpu::gemm_bf16(x, D, bf16_ptr(w.wk), kraw.data(), Di, T, D, Di);
  const uint16_t* kn_w = bf16_ptr(w.k_norm);
  const uint16_t* kn_b = w.k_norm_bias.empty() ? nullptr : bf16_ptr(w.k_norm_bias);
  Bf16Vec kn(size_t(T * Di));  // bf16 [T, Di]
  cpu::indexer_key_norm(kraw.data(), kn_w, kn_b, T, Di, kn.data());
  for (int64_t t = 0; t < T; ++t) cache.write_key(pos0 + t, kn.data() + t * Di);
  // Keys as the scores see them: dequantised from the cache (exact for BF16).
  // Skipped while every query still sees at most Ki keys (all selected, no scores).
  Bf16Vec key_cache;  // bf16 [S, Di]
  if (pos0 + T > Ki) {
    key_cache.resize(size_t((pos0 + T) * Di));
    cache.read_keys(pos0 + T, key_cache.data());
  }
  // Step 3: w = weights_proj(x) in FP32 (no BF16 rounding of the output).
  std::vector<float> hw(size_t(T * Hi));  // f32 [T, Hi]
  std::vector<float> hl(sh.split() ? size_t(T * Hl) : 0);  // f32 [T, Hl]
  cpu::gemm_bf16_f32(x, D, bf16_ptr(w.weights_proj), sh.split() ? hl.data() : hw.data(), Hl, T, D, Hl);
  if (sh.split()) {  // heads are head-major: rank p's heads are columns [p·Hl, (p+1)·Hl) of both
    gather_columns(sh, ql.data(), T, Hl * Di, DType::bf16, qi.data());
    gather_columns(sh, hl.data(), T, Hl, DType::f32, hw.data());
  }

  // Steps 5–6: I[t,s] = Σ_h w[t,h]·Hi^−½·Di^−½·ReLU(q_I[t,h]·k_I[s]); top-k over s ≤ p.
  sel.assign(size_t(T * Ki), -1);
  cpu::indexer_select_topk(qi.data(), key_cache.data(), hw.data(), T, pos0, Hi, Di, Ki, sel.data());
}

}  // namespace kestrel::model
