// Indexer forward, MODEL.md §3.5 steps 1–6 in order, for a batch of sequences (indexer.h).
#include "model/indexer.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/mla_ops.h"

namespace kestrel::model {

void indexer_select(const IndexerWeights& w, const TextConfig& c, const MlaCacheView& cache, const uint16_t* x,
                    const uint16_t* c_q, int64_t T, int64_t pos0, std::vector<int32_t>& sel, const Shard& sh) {
  const MlaSeq one{0, T, pos0, cache};
  indexer_select(w, c, std::span<const MlaSeq>(&one, 1), x, c_q, T, sel, sh);
}

void indexer_select(const IndexerWeights& w, const TextConfig& c, std::span<const MlaSeq> seqs, const uint16_t* x,
                    const uint16_t* c_q, int64_t rows, std::vector<int32_t>& sel, const Shard& sh) {
  // Hl = this rank's heads (all of them on one rank), Hi = the model's.
  const int64_t D = c.hidden_size, Q = c.q_lora_rank, Hl = c.index_n_heads, Hi = Hl * sh.size(),
                Di = c.index_head_dim, Ki = c.index_topk;
  KCHECK(Ki > 0, "index_topk must be positive, got {}", Ki);
  KCHECK(c.index_rope_head_dim == 0, "indexer RoPE (index_rope_head_dim = {}) is not implemented on the CPU path",
         c.index_rope_head_dim);
  for (const MlaSeq& s : seqs)
    KCHECK(s.cache.Di == Di && s.cache.capacity() >= s.pos0 + s.T,
           "index-key cache view (Di {}, {} tokens) cannot take {} + {}", s.cache.Di, s.cache.capacity(), s.pos0, s.T);
  // Step 1: q_I = Lin(wq_b)(c_q) → [Hi, Di] (this rank's Hl heads, gathered below).
  // Scratch (common.h): GEMM outputs (or the gather's), every element written: no serial zero-fill.
  Scratch<uint16_t> qi(size_t(rows * Hi * Di));                   // bf16 [rows, Hi*Di]
  Scratch<uint16_t> ql(sh.split() ? size_t(rows * Hl * Di) : 0);  // bf16 [rows, Hl*Di]
  cpu::gemm_bf16(c_q, Q, bf16_ptr(w.wq_b), sh.split() ? ql.data() : qi.data(), Hl * Di, rows, Q, Hl * Di);
  // Step 2 input: Lin(wk)(x); step 3: w = weights_proj(x) in FP32 (no BF16 rounding of the output).
  Scratch<uint16_t> kraw(size_t(rows * Di));                       // bf16 [rows, Di]
  Scratch<float> hw(size_t(rows * Hi));                            // f32 [rows, Hi]
  Scratch<float> hl(sh.split() ? size_t(rows * Hl) : 0);           // f32 [rows, Hl]
  const cpu::GemmOut proj[] = {{bf16_ptr(w.wk), Di, kraw.data(), nullptr, Di},
                               {bf16_ptr(w.weights_proj), Hl, nullptr, sh.split() ? hl.data() : hw.data(), Hl}};
  cpu::gemm_bf16_multi(x, D, rows, D, proj);
  if (sh.split()) {  // heads are head-major: rank p's heads are columns [p·Hl, (p+1)·Hl) of both
    gather_columns(sh, ql.data(), rows, Hl * Di, DType::bf16, qi.data());
    gather_columns(sh, hl.data(), rows, Hl, DType::f32, hw.data());
  }
  // Step 2: k_I = LayerNorm_{eps 1e-6}(Lin(wk)(x)) with weight and optional bias, one BF16 rounding.
  const uint16_t* kn_w = bf16_ptr(w.k_norm);
  const uint16_t* kn_b = w.k_norm_bias.empty() ? nullptr : bf16_ptr(w.k_norm_bias);
  Scratch<uint16_t> kn(size_t(rows * Di));  // bf16 [rows, Di], every row normed
  cpu::indexer_key_norm(kraw.data(), kn_w, kn_b, rows, Di, kn.data());

  // Per sequence: write its keys, then steps 5–6 over the keys as the scores see them (dequantised
  // from the cache, exact for BF16): I[t,s] = Σ_h w[t,h]·Hi^−½·Di^−½·ReLU(q_I[t,h]·k_I[s]); top-k over s ≤ p.
  sel.assign(size_t(rows * Ki), -1);
  cpu::parallel_for_each(int64_t(seqs.size()), rows * Hi * Di * 64, [&](int64_t i) {
    const MlaSeq& s = seqs[size_t(i)];
    for (int64_t t = 0; t < s.T; ++t) s.cache.write_key(s.pos0 + t, kn.data() + (s.row0 + t) * Di);
    Bf16Vec key_cache;  // bf16 [S, Di]; not read while every query still sees at most Ki keys
    if (s.pos0 + s.T > Ki) {
      key_cache.resize(size_t((s.pos0 + s.T) * Di));
      s.cache.read_keys(s.pos0 + s.T, key_cache.data());
    }
    cpu::indexer_select_topk_fast(qi.data() + s.row0 * Hi * Di, key_cache.data(), hw.data() + s.row0 * Hi, s.T, s.pos0,
                                  Hi, Di, Ki, sel.data() + s.row0 * Ki);
  });
}

}  // namespace kestrel::model
