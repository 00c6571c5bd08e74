// The layer stack of the GPU model over one step's stacked rows, MODEL.md §3 (CPU twin: model/model.cpp):
// §3.1 embeddings, per layer §3.2's AttnRes bookkeeping around the attention (KDA §3.3 or MLA §3.4–3.5)
// and the MLP (dense §3.7 or MoE §3.6), then the final Mix, model.norm and lm_head in FP32 (§3.8) over
// the rows that want logits only.
#include <string>

#include "kernels/cuda/rows.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void forward_layers(Context& x, const WeightsDev& w, CudaCache& cc, const BatchStep& s, const int32_t* d_ids,
                    const int32_t* d_lrows, int64_t nr, float* logits) {
  const TextConfig& tc = x.c;
  const int64_t T = s.T, D = tc.hidden_size, V = tc.vocab_size;
  // §3.1: P = embed_tokens[id], no stored blocks.
  AttnResDev rs = attn_res_begin(x, w.embed, d_ids, T);
  u16* normed = x.tmp<u16>(T * D);  // bf16 [T, D]: the sublayers' input
  u16* y = x.tmp<u16>(T * D);       // bf16 [T, D]: their output
  for (int L = 0; L < tc.num_hidden_layers; ++L) {
    const LayerWeightsDev& lw = w.layers[size_t(L)];
    // §3.2 step 1 and step 3's norm: x = RMSNorm_input_layernorm(Mix([B_0..B_{n−1}, P])).
    attn_res_mix_norm(x, rs, lw.attn_res_norm, lw.attn_res_proj, lw.input_norm, normed);
    // Step 2: a write layer stores P as the next block.
    const bool write = tc.attn_res_writes(L);
    if (write) attn_res_write_block(x, rs);
    x.mark("attn_res");
    // Step 3: a = Attn_L(x).
    if (lw.attn == AttnKind::kda)
      kda_forward(x, lw.kda, cc, s, L, normed, y);
    else
      mla_forward(x, lw.mla, cc, s, L, normed, y);
    if (x.caps.on) x.caps.bf16("L" + std::to_string(L) + ".attn_out", y, T * D, x.stream);
    // Step 4: P := a on a write layer, else P := bf16(P + a).
    attn_res_add(x, rs, y, write);
    // Steps 5–6: m = MLP_L(RMSNorm_post_attention_layernorm(Mix([B.., P]))); P := bf16(P + m).
    attn_res_mix_norm(x, rs, lw.mlp_res_norm, lw.mlp_res_proj, lw.post_attn_norm, normed);
    x.mark("attn_res");
    if (lw.mlp == MlpKind::dense) {
      mlp_forward(x, lw.dense, normed, T, y);
      x.mark("dense_mlp");
    } else {
      moe_forward(x, lw.moe, L, normed, T, y);
    }
    if (x.caps.on) x.caps.bf16("L" + std::to_string(L) + ".mlp_out", y, T * D, x.stream);
    attn_res_add(x, rs, y, false);
  }
  // §3.2 final Mix, §3.8 model.norm, then lm_head in FP32 over the rows asked for.
  attn_res_mix_norm(x, rs, w.out_res_norm, w.out_res_proj, w.final_norm, normed);
  if (nr > 0) {
    u16* picked = x.tmp<u16>(nr * D);  // bf16 [nr, D]
    cuda::copy_rows(normed, d_lrows, picked, nullptr, nr, D * 2, x.stream);
    x.lt.bf16_f32(picked, D, w.lm_head, logits, V, nr, D, V, x.stream);
  }
}

}  // namespace kestrel::model::gpu
