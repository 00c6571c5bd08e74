// MLA on the GPU, MODEL.md §3.4 steps 1–5 with the §3.5 indexer (CPU twins: model/mla.cpp and
// model/indexer.cpp). Projections run over every row of the step; the new latent rows (ĉ | k_pe) and
// index keys go into their pages (quantised on write for FP8 / MXFP4, byte-identical to the CPU's
// MlaCacheView). The attention itself is an island (graphs.h: its shapes follow the contexts):
//  - the indexer scores every row of the batch through the block tables on the tensor cores, in key
//    chunks with a running top-k per row (kernels/cuda/indexer.h); its selection equals the CPU twin's
//    except for keys inside the FP32-reordering band around each row's threshold;
//  - the absorbed decode (§3.4 absorbed form) covers every T = 1 sequence in one launch, reading the
//    pools through the block tables (tensor cores, split-KV, log-sum-exp merge);
//  - every longer sequence's rows go through one flash-form prefill launch in the same absorbed form
//    (MQA over the shared latent, as FlashMLA's sparse prefill), straight from the pages. The CPU prefill
//    default is the naive form: equal in exact arithmetic; q̂ and P are rounded to BF16 here.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/paged.h"
#include "kernels/cuda/rows.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {
namespace {

// The rows the attention covers: decode rows 0..nd−1 and all of them, Treal. Every row of a whole-step graph
// (padded rows see their own hidden row), else the real ones.
struct AttendedRows {
  int64_t nd, Treal;
};
AttendedRows attended_rows(const BatchStep& s) {
  return {s.attn_padded ? s.nd : std::min(s.nd, s.n_real), s.attn_padded || s.n_real == s.n ? s.T : s.n_real};
}

// §3.5 steps 5–6 and §3.4 steps 3–4 for the real sequences of the step: selects with the indexer (qi,
// hw null without one), then attends, writing the o rows. Runs as an island.
// Hi: the model's indexer heads (under TP q_I and w arrive gathered over the ranks: every rank scores all
// heads and selects the same keys, docs/parallel.md §3); Hm = the config's, this rank's.
// gate (non-null only when every attended row is a decode row): step 5's σ(g) applied by the absorbed decode.
void mla_attend(Context& x, const MlaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer,
                const u16* q /* bf16 [T, Hm·(N+R)] */, const u16* qi /* bf16 [T, Hi·Di] */,
                const float* hw /* f32 [T, Hi] */, int64_t Hi, u16* o /* bf16 [T, Hm·Dv] */,
                const u16* gate /* bf16 [T, Hm·Dv] or null */) {
  const TextConfig& c = x.c;
  const int64_t C = c.kv_lora_rank, R = c.qk_rope_head_dim, N = c.qk_nope_head_dim, Dv = c.v_head_dim,
                Hm = c.num_attention_heads, QK = N + R, Ki = c.index_topk;
  const auto [nd, Treal] = attended_rows(s);
  KCHECK(!gate || (nd == Treal && s.nvr == 0), "mla: the gate in the decode needs a pure-decode step");
  // Plans (key splits, chunks) follow the context bound, not the exact longest context, so an eager step and
  // the whole-step graph of its bucket run the same plan (graphs.h).
  const int64_t bound_all = attn_bound(s.max_S), bound_dec = attn_bound(s.max_dec_S);
  const cuda::PagedMlaCache pv = cc.mla_view(layer, s.d_tables, s.bt_stride);
  // §3.5 steps 5–6: I = Σ_h w·(Hi·Di)^−½·ReLU(q_h·k) over the visible keys, top Ki per row.
  int32_t* sel = nullptr;  // i32 [Treal, Ki], ascending, −1 padded
  if (w.has_indexer) {
    sel = x.tmp<int32_t>(Treal * Ki);
    // Scored in key chunks with a running top-k per row: the workspace is bounded, never [rows, max_S].
    const size_t ws_bytes = cuda::indexer_select_paged_tc_workspace_bytes(Treal, bound_all, Ki);
    void* ws = x.tmp<char>(int64_t(ws_bytes));
    cuda::indexer_select_paged_tc(qi, hw, pv, s.d_row_lens, s.d_row_req, Treal, bound_all, Hi, Ki, ws, ws_bytes, sel,
                                  x.stream);
    x.caps.ids_i32(layer, "index_topk", sel, Treal * Ki, x.stream);
    x.mark("mla.indexer");
  }
  const cuda::MlaDims dims{Hm, N, R, Dv, C};
  if (nd > 0) {
    // Absorbed decode: every T = 1 sequence in one launch (they are rows 0..nd−1).
    const int64_t max_keys = sel ? std::min(bound_dec, Ki) : bound_dec;
    const cuda::MlaPagedBatch bt{s.d_dec_lens, nullptr, sel, Ki, nd, max_keys};
    void* ws = x.tmp<char>(int64_t(cuda::mla_decode_paged_workspace_bytes(dims, nd, max_keys)));
    cuda::mla_decode_paged(x.lt, dims, q, w.kv_b, pv, bt, ws, o, x.stream, gate);
  }
  if (s.nvr > 0) {
    // DSpark verify rows (§5, rows nd .. nd+nvr−1, never in a graph): the absorbed decode again, one query per
    // row with the row's own visible keys (position + 1) and its sequence's block table, as each row would
    // run as a decode.
    const int64_t bound_ver = attn_bound(s.max_ver_S), max_keys = sel ? std::min(bound_ver, Ki) : bound_ver;
    const cuda::MlaPagedBatch vb{s.d_row_lens + nd, s.d_row_req + nd, sel ? sel + nd * Ki : nullptr, Ki, s.nvr,
                                 max_keys};
    void* ws = x.tmp<char>(int64_t(cuda::mla_decode_paged_workspace_bytes(dims, s.nvr, max_keys)));
    cuda::mla_decode_paged(x.lt, dims, q + nd * Hm * QK, w.kv_b, pv, vb, ws, o + nd * Hm * Dv, x.stream);
  }
  if (Treal > nd + s.nvr) {
    // Prefill rows (every sequence with T > 1, one launch): the absorbed form in flash-attention style over
    // the pages, dense or over each row's selection; nothing gathered, no per-token kv_b expansion.
    const int64_t p0 = nd + s.nvr;  // first prefill row
    const int64_t Tp = Treal - p0, max_keys = sel ? std::min(s.max_S, Ki) : s.max_S;
    const cuda::MlaPagedBatch pb{s.d_row_lens + p0, s.d_row_req + p0, sel ? sel + p0 * Ki : nullptr, Ki, Tp, max_keys};
    void* ws = x.tmp<char>(int64_t(cuda::mla_prefill_paged_workspace_bytes(dims, Tp, max_keys)));
    cuda::mla_prefill_paged(x.lt, dims, q + p0 * Hm * QK, w.kv_b, pv, pb, ws, o + p0 * Hm * Dv, x.stream);
  }
  x.mark("mla.attn");
}

}  // namespace

void mla_forward(Context& x, const MlaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer, const u16* in,
                 const Fp8Act* in8, u16* out) {
  const TextConfig& c = x.c;
  const int64_t T = s.T, D = c.hidden_size, Q = c.q_lora_rank, C = c.kv_lora_rank, R = c.qk_rope_head_dim,
                Dv = c.v_head_dim, Hm = c.num_attention_heads, QK = c.qk_nope_head_dim + R, CW = C + R;
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
  const float eps = c.rms_norm_eps;
  // Every projection of x at once (one stacked GEMM): §3.4 step 1's Lin(q_a_proj)(x), step 2's
  // [c | k_pe] = Lin(kv_a_proj_with_mqa)(x), step 5's gate input Lin(g_proj)(x), and the indexer's (§3.5)
  // Lin(wk)(x) and head weights w = weights_proj(x) in FP32.
  u16* qa = x.tmp<u16>(T * Q);     // bf16 [T, Q]
  u16* rows = x.tmp<u16>(T * CW);  // bf16 [T, C+R]: [c | k_pe], normalised in place into ĉ | k_pe below
  u16* kraw = w.has_indexer ? x.tmp<u16>(T * Di) : nullptr;      // bf16 [T, Di]
  u16* g = w.has_gate ? x.tmp<u16>(T * Hm * Dv) : nullptr;       // bf16 [T, Hm·Dv]
  float* hw = w.has_indexer ? x.tmp<float>(T * Hi) : nullptr;    // f32 [T, Hi]
  {
    cuda::GemmSegs sg;
    sg.seg[sg.n++] = seg_bf16(0, qa, Q);
    sg.seg[sg.n++] = seg_bf16(w.off_kv, rows, CW);
    if (w.off_wk >= 0) sg.seg[sg.n++] = seg_bf16(w.off_wk, kraw, Di);
    if (w.off_g >= 0) sg.seg[sg.n++] = seg_bf16(w.off_g, g, Hm * Dv);
    if (w.off_hw >= 0) sg.seg[sg.n++] = seg_f32(w.off_hw, hw, Hi);
    linear(x, w.in_proj, in, D, T, sg, in8);
    if (w.has_indexer && w.off_hw < 0) {  // ptpc-fp8: the FP32 head weights stay a BF16 GEMM of their own
      cuda::GemmSegs hs;
      hs.seg[0] = seg_f32(0, hw, Hi);
      hs.n = 1;
      linear(x, w.head_w, in, D, T, hs);
    }
  }
  // §3.4 step 1: c_q = RMSNorm_{q_a_layernorm}(q_a); q = Lin(q_b_proj)(c_q) per head [N | R], and the
  // indexer's queries q_I = Lin(wq_b)(c_q) (§3.5 step 1) in the same GEMM.
  u16* cq = x.tmp<u16>(T * Q);       // bf16 [T, Q]
  u16* q = x.tmp<u16>(T * Hm * QK);  // bf16 [T, Hm·(N+R)]
  u16* qi = w.has_indexer ? x.tmp<u16>(T * Hi * Di) : nullptr;  // bf16 [T, Hi·Di]
  u16* knew = w.has_indexer ? x.tmp<u16>(T * Di) : nullptr;  // bf16 [T, Di]: the indexer's new keys
  // Fused (one launch, before q_proj): this norm, step 2's norm and cache write and §3.5 step 2's below.
  const bool one_launch = x.fused() && x.opt.mla_norms;
  if (one_launch) {
    cuda::MlaProjNorms pn;
    pn.qa = qa, pn.cq = cq, pn.q_a_norm = w.q_a_norm, pn.Q = Q, pn.rows = rows, pn.kv_a_norm = w.kv_a_norm;
    if (w.has_indexer) pn.kraw = kraw, pn.knew = knew, pn.k_norm = w.k_norm, pn.k_norm_bias = w.k_norm_bias;
    pn.eps = eps;
    cuda::mla_norms_and_writes(cc.mla_view(layer, nullptr, 0), pn, s.d_pool_rows, T, x.stream);
  } else {
    cuda::rmsnorm_bf16(qa, Q, w.q_a_norm, cq, Q, T, Q, eps, x.stream);
  }
  {
    cuda::GemmSegs sg;
    sg.seg[sg.n++] = seg_bf16(0, q, Hm * QK);
    if (w.has_indexer) sg.seg[sg.n++] = seg_bf16(Hm * QK, qi, Hi * Di);
    linear(x, w.q_proj, cq, Q, T, sg);
  }
  // Step 2: ĉ = RMSNorm(c) in place next to k_pe (each thread of the norm rewrites only what it read), and
  // the new rows go into their pages.
  if (!one_launch) {
    cuda::rmsnorm_bf16(rows, CW, w.kv_a_norm, rows, CW, T, C, eps, x.stream);
    if (cc.formats.latent == LatentFormat::bf16)
      cuda::copy_rows(rows, nullptr, cc.latent[size_t(layer)], s.d_pool_rows, T, CW * 2, x.stream);
    else  // quantise on write, byte-identical to MlaCacheView::write_latent
      cuda::paged_write_latent(cc.mla_view(layer, nullptr, 0), rows, CW, s.d_pool_rows, T, x.stream);
  }
  // §3.5 step 2: the indexer keys k_I = LayerNorm(Lin(wk)(x)) into their pages.
  if (w.has_indexer && !one_launch) {
    cuda::indexer_key_norm(kraw, w.k_norm, w.k_norm_bias, T, Di, knew, x.stream);
    if (cc.formats.index_keys == IndexKeyFormat::bf16)
      cuda::copy_rows(knew, nullptr, cc.index_k[size_t(layer)], s.d_pool_rows, T, Di * 2, x.stream);
    else  // quantise on write, byte-identical to MlaCacheView::write_key
      cuda::paged_write_keys(cc.mla_view(layer, nullptr, 0), knew, Di, s.d_pool_rows, T, x.stream);
  }
  // Under TP q_I and w hold this rank's Hi/N heads: gathered to all heads (head-major, so rank p's heads
  // are columns [p·Hi/N, (p+1)·Hi/N) of both).
  int64_t Hi_all = Hi;
  if (w.has_indexer && x.split()) {
    Hi_all = Hi * x.tp.size;
    u16* qi_all = x.tmp<u16>(T * Hi_all * Di);  // bf16 [T, Hi·Di], all heads
    float* hw_all = x.tmp<float>(T * Hi_all);  // f32 [T, Hi], all heads
    tp_gather_columns(x, qi, T, Hi * Di, DType::bf16, qi_all);
    tp_gather_columns(x, hw, T, Hi, DType::f32, hw_all);
    qi = qi_all, hw = hw_all;
  }
  x.mark("mla.proj");
  // §3.5 steps 5–6 and §3.4 steps 3–4: everything whose shape depends on the contexts (an island of the
  // graph unless the step's attention is captured, graphs.h).
  u16* o = x.tmp<u16>(T * Hm * Dv);  // bf16 [T, Hm·Dv]
  // Step 5's gate inside the absorbed decode's last launch when it covers every attended row (rows past them are
  // padding, whose outputs are dropped): one launch fewer on the decode chain, the same bits. Decided from the
  // step's shape, which a graph bucket's replays share with its capture (pure decodes, or verify rows).
  const AttendedRows ar = attended_rows(s);
  const bool gate_in_attn = g && x.fused() && x.opt.mla_gate_in_merge && ar.nd > 0 && ar.nd == ar.Treal && s.nvr == 0;
  const u16* attn_gate = gate_in_attn ? g : nullptr;
  x.island(s, [&x, &w, &cc, layer, q, qi, hw, Hi_all, o, attn_gate](const BatchStep& st) {
    mla_attend(x, w, cc, st, layer, q, qi, hw, Hi_all, o, attn_gate);
  });
  // Step 5: ô = concat_h(o_h) ⊙ σ(Lin(g_proj)(x)); out = Lin(o_proj)(ô). Under TP: this rank's Hm/N heads
  // through its o_proj columns, a partial sum, all-reduced.
  if (g && !gate_in_attn) cuda::sigmoid_gate_bf16(o, g, T * Hm * Dv, x.stream);
  linear(x, w.o_proj, o, Hm * Dv, T, out, D);
  tp_all_reduce(x, out, T * D);
  x.mark("mla.gate+o_proj");
}

}  // namespace kestrel::model::gpu
