// The layer stack of the GPU model over one step's stacked rows, MODEL.md §3 (CPU twin: model/model.cpp):
// §3.1 embeddings (image rows over the <|media_pad|> positions, §6), per layer §3.2's AttnRes bookkeeping
// around the attention (KDA §3.3 or MLA §3.4–3.5) and the MLP (dense §3.7 or MoE §3.6), then the final Mix,
// model.norm and lm_head in FP32 (§3.8) over the rows that want logits only.
//
// Fused form (Context::fused(): the default unless KESTREL_FUSE=0 or debug captures are on): each AttnRes
// point is one kernel (attn_res_point) that first applies the pending update of P — step 4 or step 6 of
// the previous sublayer — stores a write layer's block, then mixes and normalises (and, with ptpc-fp8,
// quantises the normalised rows for the FP8 projections that read them); on one rank and without image rows
// the first point also gathers P from the embedding table (§3.1), so the step starts with it. Unfused: the
// separate copy, add and Mix + RMSNorm launches of attn_res.cpp, in the order of §3.2.
#include <string>

#include "kernels/cuda/rows.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void forward_layers(Context& x, const WeightsDev& w, CudaCache& cc, const BatchStep& s, const int32_t* d_ids,
                    const int32_t* d_lrows, int64_t nr, bool lrows_identity, float* logits, const TapsDev* taps) {
  const TextConfig& tc = x.c;
  const int64_t T = s.T, D = tc.hidden_size;
  const bool fused = x.fused();

  // §3.1: P = embed_tokens[id], no stored blocks. Under TP each rank holds V/N rows of the table and
  // looks up its own ids (the others read the zero row appended at upload, cuda_model.cpp), so one
  // all-reduce assembles P exactly (one nonzero term per element).
  // Fused, on one rank and without image rows, the first AttnRes point gathers P itself (attn_res_begin).
  AttnResDev rs =
      attn_res_begin(x, w.embed, d_ids, T, !(fused && x.opt.embed_in_point && !x.split() && s.embed_rows.empty()));
  // §5 DSpark taps: P after layer L. In both forms P holds it once the first AttnRes point of layer L+1 (or
  // the final one) has run: the fused point applies layer L's pending MLP update first, and a point only
  // reads P (a write layer copies it into a block).
  auto tap = [&](int L) {
    if (!taps) return;
    for (int64_t k = 0; k < taps->n; ++k)
      if (taps->layers[k] == L) copy_tap(x, rs, k, taps->n, taps->out);
  };
  tp_all_reduce(x, rs.partial, T * D);
  // §3.1 with §6: the <|media_pad|> positions start from the vision tower's rows instead (after the
  // all-reduce, so under TP every rank's P holds them once).
  for (const BatchStep::EmbedRows& e : s.embed_rows)
    cuda::copy_rows(e.src, nullptr, rs.partial, s.d_embed_dst + e.off, e.n, D * 2, x.stream);
  u16* normed = x.tmp<u16>(T * D);  // bf16 [T, D]: the sublayers' input
  u16* y = x.tmp<u16>(T * D);       // bf16 [T, D]: their output
  Fp8Act n8;                        // normed's FP8 codes (fused ptpc-fp8 only)
  Fp8Act* out8 = fused && x.fp8 ? &n8 : nullptr;
  const u16* pending = nullptr;     // fused: the last sublayer's output, not yet added to P
  for (int L = 0; L < tc.num_hidden_layers; ++L) {
    const LayerWeightsDev& lw = w.layers[size_t(L)];
    const bool write = tc.attn_res_writes(L);
    // §3.2 step 1 and step 3's norm: x = RMSNorm_input_layernorm(Mix([B_0..B_{n−1}, P])); step 2: a write
    // layer stores P as the next block.
    if (fused) {
      attn_res_point(x, rs, pending, pending ? cuda::AttnResAdd::add : cuda::AttnResAdd::none, write,
                     lw.attn_res_norm, lw.attn_res_proj, lw.input_norm, normed, out8);
    } else {
      attn_res_mix_norm(x, rs, lw.attn_res_norm, lw.attn_res_proj, lw.input_norm, normed);
      if (write) attn_res_write_block(x, rs);
    }
    if (L > 0) tap(L - 1);
    x.mark("attn_res");
    // Step 3: a = Attn_L(x).
    if (lw.attn == AttnKind::kda)
      kda_forward(x, lw.kda, cc, s, L, normed, out8, y);
    else
      mla_forward(x, lw.mla, cc, s, L, normed, out8, y);
    if (x.caps.on) x.caps.bf16("L" + std::to_string(L) + ".attn_out", y, T * D, x.stream);
    // Step 4: P := a on a write layer, else P := bf16(P + a). Steps 5–6: m = MLP_L(RMSNorm_post_attention_
    // layernorm(Mix([B.., P]))); P := bf16(P + m).
    if (fused) {
      attn_res_point(x, rs, y, write ? cuda::AttnResAdd::replace : cuda::AttnResAdd::add, false, lw.mlp_res_norm,
                     lw.mlp_res_proj, lw.post_attn_norm, normed, out8);
    } else {
      attn_res_add(x, rs, y, write);
      attn_res_mix_norm(x, rs, lw.mlp_res_norm, lw.mlp_res_proj, lw.post_attn_norm, normed);
    }
    x.mark("attn_res");
    if (lw.mlp == MlpKind::dense) {
      mlp_forward(x, lw.dense, normed, out8, T, y);
      x.mark("dense_mlp");
    } else {
      moe_forward(x, lw.moe, L, normed, out8, T, y);
    }
    if (x.caps.on) x.caps.bf16("L" + std::to_string(L) + ".mlp_out", y, T * D, x.stream);
    if (fused)
      pending = y;
    else
      attn_res_add(x, rs, y, false);
  }
  // §3.2 final Mix, §3.8 model.norm, then lm_head in FP32 over the rows asked for.
  if (fused)
    attn_res_point(x, rs, pending, pending ? cuda::AttnResAdd::add : cuda::AttnResAdd::none, false, w.out_res_norm,
                   w.out_res_proj, w.final_norm, normed, nullptr);
  else
    attn_res_mix_norm(x, rs, w.out_res_norm, w.out_res_proj, w.final_norm, normed);
  tap(tc.num_hidden_layers - 1);
  if (nr > 0) {
    const u16* picked = normed;  // bf16 [nr, D]
    if (!lrows_identity) {
      u16* p = x.tmp<u16>(nr * D);
      cuda::copy_rows(normed, d_lrows, p, nullptr, nr, D * 2, x.stream);
      picked = p;
    }
    // Under TP lm_head holds V/N vocabulary rows: this rank's logits columns, gathered into [nr, V].
    const int64_t Vl = w.lm_head.N;
    float* mine = x.split() ? x.tmp<float>(nr * Vl) : logits;  // f32 [nr, V/N]
    cuda::GemmSegs sg;
    sg.seg[0] = seg_f32(0, mine, Vl);
    sg.n = 1;
    linear(x, w.lm_head, picked, D, nr, sg);
    if (x.split()) tp_gather_columns(x, mine, nr, Vl, DType::f32, logits);
  }
}

}  // namespace kestrel::model::gpu
