// Layer stack of MODEL.md §3: AttnRes bookkeeping (§3.2 steps 1–6) around KDA/MLA attention and
// dense/MoE MLPs, then the final Mix, model.norm and lm_head (§3.8).
#include "model/model.h"

#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/attn_res.h"
#include "model/mlp.h"
#include "model/moe.h"
#include "parallel/comm.h"

namespace kestrel::model {

State::State(const ModelConfig& c) { reset(c); }

void State::reset(const ModelConfig& c) {
  const TextConfig& t = c.text;
  kda.assign(size_t(t.num_hidden_layers), KdaState{});
  mla.assign(size_t(t.num_hidden_layers), MlaCache{});
  for (int L = 0; L < t.num_hidden_layers; ++L)
    if (t.attn_kind[size_t(L)] == AttnKind::kda) kda[size_t(L)].reset(t);
  pos = 0;
}

void prefill(const ModelWeights& w, const ModelConfig& c, State& st, std::span<const int32_t> tokens, float* logits_out,
             const ForwardOptions& opt) {
  const TextConfig& tc = c.text;
  const int64_t T = int64_t(tokens.size());
  KCHECK(T > 0, "empty token list");
  SeqCacheView v;
  v.pos = st.pos;
  v.kda.resize(size_t(tc.num_hidden_layers));
  v.mla.resize(size_t(tc.num_hidden_layers));
  for (int L = 0; L < tc.num_hidden_layers; ++L) {
    if (tc.attn_kind[size_t(L)] == AttnKind::kda)
      v.kda[size_t(L)] = st.kda[size_t(L)].view();
    else
      v.mla[size_t(L)] = st.mla[size_t(L)].view(tc, st.pos + T);
  }
  forward(w, c, v, tokens, logits_out, opt);
  st.pos += T;
  for (int L = 0; L < tc.num_hidden_layers; ++L)
    if (tc.attn_kind[size_t(L)] != AttnKind::kda) st.mla[size_t(L)].len = st.pos;
}

void forward(const ModelWeights& w, const ModelConfig& c, const SeqCacheView& st, std::span<const int32_t> tokens,
             float* logits_out, const ForwardOptions& opt) {
  const TextConfig& tc = c.text;
  const cpu::RowInvariantScope row_invariant(opt.row_invariant);
  const int64_t T = int64_t(tokens.size()), D = tc.hidden_size, V = tc.vocab_size;
  KCHECK(T > 0, "empty token list");
  KCHECK(int64_t(w.layers.size()) == tc.num_hidden_layers, "weights have {} layers, config {}", w.layers.size(),
         tc.num_hidden_layers);
  for (int64_t i = 0; i < T; ++i)
    if (tokens[size_t(i)] < 0 || tokens[size_t(i)] >= V) fail("token id {} at position {} is outside [0, {})", tokens[size_t(i)], i, V);
  const MlaForm mla_form = T == 1 ? opt.mla_form_decode : opt.mla_form_prefill;
  const float eps = tc.rms_norm_eps;
  const Probe top{&opt.observer, -1};
  const Shard sh{opt.comm, opt.dcp};
  KCHECK(sh.dcp == 1 || sh.dcp == sh.size(), "decode-context-parallel size {} must be 1 or the group's size {}", sh.dcp,
         sh.size());
  KCHECK(opt.tap_layers.empty() || opt.taps_out, "tap layers given without a taps buffer");

  // §3.1: e = embed_tokens[id]; the stream starts as P = e with no stored blocks. Split by vocabulary
  // rows over ranks: the owner copies the row, the others contribute zeros, and the all-reduce (one
  // non-zero term per element) reproduces the row exactly.
  AttnResStream rs(T, D, tc.num_attn_res_blocks());
  const uint16_t* embed = bf16_ptr(w.embed);
  const int64_t Vl = w.embed.shape[0], v0 = sh.rank() * Vl;  // this rank's rows [v0, v0 + Vl)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = tokens[size_t(t)] - v0;
    uint16_t* dst = rs.partial.data() + t * D;
    if (id >= 0 && id < Vl)
      std::memcpy(dst, embed + id * D, size_t(D) * 2);
    else
      std::fill(dst, dst + D, uint16_t(0));
  }
  if (sh.split()) sh.comm->all_reduce_sum(rs.partial.data(), size_t(T * D), DType::bf16);
  top("embed", rs.partial.data(), DType::bf16, {T, D});

  Bf16Vec hin(size_t(T * D)), normed(size_t(T * D)), y(size_t(T * D));  // bf16 [T, D] each
  for (int L = 0; L < tc.num_hidden_layers; ++L) {
    const LayerWeights& lw = w.layers[size_t(L)];
    const Probe probe{&opt.observer, L};
    // §3.2 step 1: x_attn_in = Mix([B_0..B_{n−1}, P]).
    attn_res_mix(rs, bf16_ptr(lw.attn_res_norm), bf16_ptr(lw.attn_res_proj), eps, hin.data());
    probe("attn_in", hin.data(), DType::bf16, {T, D});
    // Step 2: a write layer stores P as the next block and empties it.
    const bool write = tc.attn_res_writes(L);
    if (write) rs.write_block();
    // Step 3: a = Attn_L(RMSNorm_input_layernorm(x_attn_in)).
    cpu::rmsnorm_bf16(hin.data(), bf16_ptr(lw.input_norm), normed.data(), T, D, eps);
    if (lw.attn_kind == AttnKind::kda)
      kda_forward(lw.kda, tc, st.kda[size_t(L)], normed.data(), T, y.data(), opt.kda_form, sh);
    else
      mla_forward(lw.mla, tc, st.mla[size_t(L)], st.pos, normed.data(), T, y.data(), mla_form, probe, sh);
    probe("attn_out", y.data(), DType::bf16, {T, D});
    // Step 4: P := a on a write layer, else P := bf16(P + a).
    if (write)
      rs.partial = y;
    else
      rs.accumulate(y.data());
    // Step 5: x_mlp_in = Mix([B_0..B_{|B|−1}, P]).
    attn_res_mix(rs, bf16_ptr(lw.mlp_res_norm), bf16_ptr(lw.mlp_res_proj), eps, hin.data());
    probe("mlp_in", hin.data(), DType::bf16, {T, D});
    // Step 6: m = MLP_L(RMSNorm_post_attention_layernorm(x_mlp_in)); P := bf16(P + m).
    cpu::rmsnorm_bf16(hin.data(), bf16_ptr(lw.post_attn_norm), normed.data(), T, D, eps);
    if (lw.mlp_kind == MlpKind::dense && sh.split()) {  // gate/up rows, down columns: partial sums
      std::vector<float> part(size_t(T * D));          // f32 [T, D]
      mlp_forward_partial(lw.dense, tc, normed.data(), T, part.data());
      reduce_to_bf16(sh, part.data(), T * D, y.data());
    } else if (lw.mlp_kind == MlpKind::dense) {
      mlp_forward(lw.dense, tc, normed.data(), T, y.data());
    } else {
      moe_forward(lw.moe, tc, normed.data(), T, y.data(), probe, sh);
    }
    probe("mlp_out", y.data(), DType::bf16, {T, D});
    rs.accumulate(y.data());
    // §5 DSpark taps: P after this layer, into its column block of taps_out.
    const int64_t n_taps = int64_t(opt.tap_layers.size());
    for (int64_t k = 0; k < n_taps; ++k)
      if (opt.tap_layers[size_t(k)] == L)
        for (int64_t t = 0; t < T; ++t)
          std::memcpy(opt.taps_out + (t * n_taps + k) * D, rs.partial.data() + t * D, size_t(D) * 2);
  }

  // §3.2 final: h = Mix([B_0..B_{Nb−1}, P]; output_attn_res_*); §3.8: logits = lm_head(RMSNorm(h)).
  attn_res_mix(rs, bf16_ptr(w.out_res_norm), bf16_ptr(w.out_res_proj), eps, hin.data());
  top("final_hidden", hin.data(), DType::bf16, {T, D});
  if (!logits_out && !top.active()) return;
  const int64_t first = opt.last_logits_only ? T - 1 : 0, rows = T - first;
  cpu::rmsnorm_bf16(hin.data() + first * D, bf16_ptr(w.final_norm), normed.data(), rows, D, eps);
  const TensorView& head = w.lm_head.empty() ? w.embed : w.lm_head;  // tied embeddings share the table
  std::vector<float> local;
  float* logits = logits_out;
  if (!logits) {
    local.resize(size_t(rows * V));
    logits = local.data();
  }
  if (!sh.split()) {
    cpu::gemm_bf16_f32(normed.data(), D, bf16_ptr(head), logits, V, rows, D, V);
  } else {  // vocabulary rows per rank: logits [rows, V/N] each, gathered side by side
    const int64_t Vh = head.shape[0];
    std::vector<float> part(size_t(rows * Vh));  // f32 [rows, V/N]
    cpu::gemm_bf16_f32(normed.data(), D, bf16_ptr(head), part.data(), Vh, rows, D, Vh);
    gather_columns(sh, part.data(), rows, Vh, DType::f32, logits);
  }
  top("logits", logits, DType::f32, {rows, V});
}

void decode(const ModelWeights& w, const ModelConfig& c, State& state, int32_t token, float* logits_out,
            const ForwardOptions& options) {
  prefill(w, c, state, std::span<const int32_t>(&token, 1), logits_out, options);
}

}  // namespace kestrel::model
