// MLA forward, MODEL.md §3.4 steps 1–5 (+ §3.5 step 7: attend only to the indexer's keys), for a batch
// of sequences (mla.h). Projections run as one GEMM over all rows; the cache writes, the indexer's
// selection and the attention run per sequence (in parallel when there are several; one long
// sequence parallelises inside the kernels). Scores and softmax are FP32; each head's output is
// rounded to BF16 (the attention op's output dtype) before the gate.
#include "model/mla.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/mla_ops.h"
#include "model/common.h"
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
  const MlaSeq one{0, T, pos0, cache};
  mla_forward(w, c, std::span<const MlaSeq>(&one, 1), x, T, out, form, probe, sh);
}

namespace {

// The latent rows one sequence's attention reads (dequantised when the cache is FP8), and its
// selection rewritten to index them. A short step (decode) whose selections cover fewer rows than the
// context gathers just the selected rows; otherwise every row 0..S−1 is read and sel is kept.
void gather_rows(const MlaSeq& s, int64_t CW, int32_t* sel /* i32 [T, Ki] or null */, int64_t Ki,
                 Scratch<uint16_t>& rows /* bf16 [rows read, C+R], every row read from the cache */) {
  const int64_t S = s.pos0 + s.T;
  if (sel && s.T * Ki < S) {
    std::vector<int32_t> pos(sel, sel + s.T * Ki);
    std::sort(pos.begin(), pos.end());
    pos.erase(std::unique(pos.begin(), pos.end()), pos.end());
    if (!pos.empty() && pos.front() < 0) pos.erase(pos.begin());  // the −1 padding
    rows.resize(size_t(int64_t(pos.size()) * CW));
    s.cache.read_latent_rows(pos.data(), int64_t(pos.size()), rows.data());
    for (int64_t i = 0; i < s.T * Ki; ++i)
      if (sel[i] >= 0) sel[i] = int32_t(std::lower_bound(pos.begin(), pos.end(), sel[i]) - pos.begin());
    return;
  }
  rows.resize(size_t(S * CW));
  s.cache.read_latent(S, rows.data());
}

}  // namespace

void mla_forward(const MlaWeights& w, const TextConfig& c, std::span<const MlaSeq> seqs, const uint16_t* x,
                 int64_t rows, uint16_t* out, MlaForm form, const Probe& probe, const Shard& sh) {
  if (sh.dcp > 1) {  // per sequence, in order, on this thread: the DCP collectives match across ranks
    const int64_t D = c.hidden_size;
    for (const MlaSeq& s : seqs) {
      KCHECK(s.row0 >= 0 && s.T > 0 && s.row0 + s.T <= rows, "MLA sequence rows [{}, +{}) outside the {} rows",
             s.row0, s.T, rows);
      mla_forward_dcp(w, c, s.cache, s.pos0, x + s.row0 * D, s.T, out + s.row0 * D, probe, sh);
    }
    return;
  }
  const int64_t D = c.hidden_size, Q = c.q_lora_rank, C = c.kv_lora_rank, R = c.qk_rope_head_dim,
                N = c.qk_nope_head_dim, Dv = c.v_head_dim, Hm = c.num_attention_heads, QK = N + R, CW = C + R;
  for (const MlaSeq& s : seqs) {
    KCHECK(s.cache.C == C && s.cache.R == R, "MLA cache view is for C={} R={}, layer has {} {}", s.cache.C, s.cache.R,
           C, R);
    KCHECK(s.cache.capacity() >= s.pos0 + s.T, "MLA block table covers {} tokens, the step needs {}",
           s.cache.capacity(), s.pos0 + s.T);
    KCHECK(s.row0 >= 0 && s.T > 0 && s.row0 + s.T <= rows, "MLA sequence rows [{}, +{}) outside the {} rows", s.row0,
           s.T, rows);
  }
  const float eps = c.rms_norm_eps;
  const bool gated = !w.g_proj.empty();

  // Step 1: c_q = RMSNorm_{q_a_layernorm}(Lin(q_a_proj)(x)); q = Lin(q_b_proj)(c_q) per head [N | R].
  // Step 2: [c | k_pe] = Lin(kv_a_proj_with_mqa)(x). Step 5's gate input Lin(g_proj)(x) shares x.
  // Scratch (common.h): GEMM and RMSNorm outputs, every element written (no serial zero-fill).
  Scratch<uint16_t> qa(size_t(rows * Q)), cq(size_t(rows * Q));  // bf16 [rows, Q] each
  Scratch<uint16_t> q(size_t(rows * Hm * QK));                   // bf16 [rows, Hm*QK]
  Scratch<uint16_t> kva(size_t(rows * CW));                      // bf16 [rows, C+R]
  Scratch<uint16_t> g(gated ? size_t(rows * Hm * Dv) : 0);       // bf16 [rows, Hm*Dv]
  std::vector<cpu::GemmOut> proj = {{bf16_ptr(w.q_a_proj), Q, qa.data(), nullptr, Q},
                                    {bf16_ptr(w.kv_a_proj), CW, kva.data(), nullptr, CW}};
  if (gated) proj.push_back({bf16_ptr(w.g_proj), Hm * Dv, g.data(), nullptr, Hm * Dv});
  cpu::gemm_bf16_multi(x, D, rows, D, proj);
  cpu::rmsnorm_bf16(qa.data(), bf16_ptr(w.q_a_norm), cq.data(), rows, Q, eps);
  cpu::gemm_bf16(cq.data(), Q, bf16_ptr(w.q_b_proj), q.data(), Hm * QK, rows, Q, Hm * QK);
  // ĉ = RMSNorm_{kv_a_layernorm}(c); k_pe untouched; the row [ĉ | k_pe] goes into the sequence's cache.
  // The rows' norms split over the team (each row alone, as before: the same bits), then the cache
  // writes in order on this thread: done row by row here, the norms kept the other core waiting at
  // every MLA layer of a prefill (issue #22).
  Scratch<uint16_t> kvn(size_t(rows * CW));  // bf16 [rows, C+R], every row written below
  cpu::parallel_for(rows, rows * C * 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* kv = kva.data() + r * CW;
      cpu::rmsnorm_bf16(kv, bf16_ptr(w.kv_a_norm), kvn.data() + r * CW, 1, C, eps);
      std::memcpy(kvn.data() + r * CW + C, kv + C, size_t(R) * 2);
    }
  });
  for (const MlaSeq& s : seqs)
    for (int64_t t = 0; t < s.T; ++t) s.cache.write_latent(s.pos0 + t, kvn.data() + (s.row0 + t) * CW);

  // §3.5: which keys each query sees (dense causal without an indexer).
  std::vector<int32_t> sel;  // i32 [rows, Ksel], ascending, −1 padded
  const int64_t Ksel = w.has_indexer ? c.index_topk : 0;
  if (w.has_indexer) {
    indexer_select(w.indexer, c, seqs, x, cq.data(), rows, sel, sh);
    probe("index_topk", sel.data(), DType::i32, {rows, Ksel});
  }

  // Steps 3–4 per sequence over the rows its cache holds (kernels/cpu/mla_ops.h). Absorbed form:
  // q̃ = W_UKᵀ q_nope for every row at once, attention in the latent space per sequence, then
  // o = W_UV ô for every row at once; the naive form expands k_nope and v per sequence.
  const uint16_t* kvb = bf16_ptr(w.kv_b_proj);  // bf16 [Hm*(N+Dv), C], per head [W_UK (N rows) | W_UV (Dv rows)]
  const cpu::MlaDims dims{Hm, N, R, Dv, C};
  const bool latent_fast = form == MlaForm::absorbed && cpu::isa() >= cpu::Isa::avx2;
  Scratch<float> qt(latent_fast ? size_t(rows * Hm * CW) : 0);       // f32 [rows, Hm, C+R], every row written
  // ô and o: every sequence's rows and heads are written by the attention (ô = 0 where no key is
  // visible), and the sequences are the step's rows, so no zero-fill (a serial 512 KB memset per layer).
  Scratch<float> ohat(latent_fast ? size_t(rows * Hm * C) : 0);      // f32 [rows, Hm, C]
  if (latent_fast) cpu::mla_q_latent(dims, q.data(), kvb, rows, qt.data());
  Scratch<uint16_t> o(size_t(rows * Hm * Dv));  // bf16 [rows, Hm*Dv]
  cpu::parallel_for_each(int64_t(seqs.size()), rows * Hm * 256 * CW * 3, [&](int64_t i) {
    const MlaSeq& s = seqs[size_t(i)];
    const int64_t S = s.pos0 + s.T;
    int32_t* ssel = w.has_indexer ? sel.data() + s.row0 * Ksel : nullptr;  // the indexer's selection, or 0..p
    uint16_t* os = o.data() + s.row0 * Hm * Dv;
    const uint16_t* qs = q.data() + s.row0 * Hm * QK;
    if (form == MlaForm::naive) {
      // Step 3 (naive form): [k_nope | v] = Lin(kv_b_proj)(ĉ) for every cached token; step 4 per head.
      Bf16Vec latent(size_t(S * CW));  // bf16 [S, C+R]: ĉ | k_pe
      s.cache.read_latent(S, latent.data());
      Bf16Vec kv(size_t(S * Hm * (N + Dv)));  // bf16 [S, Hm*(N+Dv)]
      cpu::gemm_bf16(latent.data(), CW, kvb, kv.data(), Hm * (N + Dv), S, C, Hm * (N + Dv));
      cpu::mla_attn_naive(dims, qs, kv.data(), latent.data(), ssel, Ksel, s.T, s.pos0, os);
      return;
    }
    // Absorbed: attention over the 576-wide latent rows (MQA), W_UK and W_UV folded into q and o.
    std::vector<int32_t> local;  // this sequence's selection, rewritten to index the gathered rows
    if (ssel) local.assign(ssel, ssel + s.T * Ksel);
    Scratch<uint16_t> latent;  // bf16 [rows read, C+R]
    gather_rows(s, CW, ssel ? local.data() : nullptr, Ksel, latent);
    const int32_t* lsel = ssel ? local.data() : nullptr;
    if (latent_fast)
      cpu::mla_attn_latent_fast(dims, qt.data() + s.row0 * Hm * CW, latent.data(), lsel, Ksel, s.T, s.pos0,
                                ohat.data() + s.row0 * Hm * C);
    else
      cpu::mla_attn_absorbed(dims, qs, kvb, latent.data(), lsel, Ksel, s.T, s.pos0, os);
  });
  if (latent_fast) cpu::mla_o_latent(dims, ohat.data(), kvb, rows, o.data());

  // Step 5: ô = concat_h(o_h) ⊙ σ(Lin(g_proj)(x)); out = Lin(o_proj)(ô).
  if (gated) cpu::sigmoid_gate_bf16(o.data(), g.data(), rows * Hm * Dv);
  if (!sh.split()) {
    cpu::gemm_bf16(o.data(), Hm * Dv, bf16_ptr(w.o_proj), out, D, rows, Hm * Dv, D);
    return;
  }
  std::vector<float> part(size_t(rows * D));  // f32 [rows, D], this rank's heads only
  cpu::gemm_bf16_f32(o.data(), Hm * Dv, bf16_ptr(w.o_proj), part.data(), D, rows, Hm * Dv, D);
  reduce_to_bf16(sh, part.data(), rows * D, out);
}

}  // namespace kestrel::model
