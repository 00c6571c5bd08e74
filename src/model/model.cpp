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
  const Logits want = !logits_out && !opt.observer ? Logits::none : opt.last_logits_only ? Logits::last : Logits::all;
  const SeqInput one{st, tokens, want, opt.embed_override};
  ForwardOptions o = opt;
  o.mla_form_prefill = tokens.size() == 1 ? opt.mla_form_decode : opt.mla_form_prefill;
  forward_batch(w, c, std::span<const SeqInput>(&one, 1), logits_out, o);
}

void forward_batch(const ModelWeights& w, const ModelConfig& c, std::span<const SeqInput> seqs, float* logits_out,
                   const ForwardOptions& opt) {
  const TextConfig& tc = c.text;
  const int64_t D = tc.hidden_size, V = tc.vocab_size, n = int64_t(seqs.size());
  KCHECK(n > 0, "empty batch");
  KCHECK(int64_t(w.layers.size()) == tc.num_hidden_layers, "weights have {} layers, config {}", w.layers.size(),
         tc.num_hidden_layers);
  // The step's rows: every sequence's tokens, stacked in order.
  std::vector<int64_t> row0(size_t(n + 1), 0);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    const SeqInput& s = seqs[size_t(i)];
    KCHECK(!s.tokens.empty(), "empty token list");
    for (size_t j = 0; j < s.tokens.size(); ++j)
      if (s.tokens[j] < 0 || s.tokens[j] >= V) fail("token id {} at position {} is outside [0, {})", s.tokens[j], j, V);
    ids.insert(ids.end(), s.tokens.begin(), s.tokens.end());
    row0[size_t(i + 1)] = row0[size_t(i)] + int64_t(s.tokens.size());
  }
  const int64_t T = row0[size_t(n)];
  const float eps = tc.rms_norm_eps;
  const Probe top{&opt.observer, -1};
  std::vector<KdaSeq> kseqs(static_cast<size_t>(n));
  std::vector<MlaSeq> mseqs(static_cast<size_t>(n));
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
    const int64_t id = ids[size_t(t)] - v0;
    uint16_t* dst = rs.partial.data() + t * D;
    if (id >= 0 && id < Vl)
      std::memcpy(dst, embed + id * D, size_t(D) * 2);
    else
      std::fill(dst, dst + D, uint16_t(0));
  }
  if (sh.split()) sh.comm->all_reduce_sum(rs.partial.data(), size_t(T * D), DType::bf16);
  // §3.1/§6: image positions start from the projector's rows instead (every rank holds the whole rows).
  for (int64_t i = 0; i < n; ++i) {
    const int64_t Ti = row0[size_t(i + 1)] - row0[size_t(i)];
    for (const EmbedOverride& e : seqs[size_t(i)].embed_override) {
      KCHECK(e.row && e.pos >= 0 && e.pos < Ti, "embedding override at position {} outside the call's {} tokens",
             e.pos, Ti);
      std::memcpy(rs.partial.data() + (row0[size_t(i)] + e.pos) * D, e.row, size_t(D) * 2);
    }
  }
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
    // Step 3: a = Attn_L(RMSNorm_input_layernorm(x_attn_in)), each sequence through its own caches.
    cpu::rmsnorm_bf16(hin.data(), bf16_ptr(lw.input_norm), normed.data(), T, D, eps);
    if (lw.attn_kind == AttnKind::kda) {
      for (int64_t i = 0; i < n; ++i)
        kseqs[size_t(i)] = {row0[size_t(i)], row0[size_t(i + 1)] - row0[size_t(i)], seqs[size_t(i)].view.kda[size_t(L)]};
      kda_forward(lw.kda, tc, kseqs, normed.data(), T, y.data(), opt.kda_form, sh);
    } else {
      for (int64_t i = 0; i < n; ++i)
        mseqs[size_t(i)] = {row0[size_t(i)], row0[size_t(i + 1)] - row0[size_t(i)], seqs[size_t(i)].view.pos,
                            seqs[size_t(i)].view.mla[size_t(L)]};
      mla_forward(lw.mla, tc, mseqs, normed.data(), T, y.data(), opt.mla_form_prefill, probe, sh);
    }
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

  // §3.2 final: h = Mix([B_0..B_{Nb−1}, P]; output_attn_res_*); §3.8: logits = lm_head(RMSNorm(h)),
  // for the rows that want them only.
  attn_res_mix(rs, bf16_ptr(w.out_res_norm), bf16_ptr(w.out_res_proj), eps, hin.data());
  top("final_hidden", hin.data(), DType::bf16, {T, D});
  std::vector<int64_t> want;  // rows whose logits are written, in order
  for (int64_t i = 0; i < n; ++i) {
    const Logits l = seqs[size_t(i)].logits;
    if (l == Logits::last) want.push_back(row0[size_t(i + 1)] - 1);
    if (l == Logits::all)
      for (int64_t r = row0[size_t(i)]; r < row0[size_t(i + 1)]; ++r) want.push_back(r);
  }
  if (want.empty()) return;
  const int64_t rows = int64_t(want.size());
  Bf16Vec h(size_t(rows * D));  // bf16 [rows, D]
  for (int64_t r = 0; r < rows; ++r) std::memcpy(h.data() + r * D, hin.data() + want[size_t(r)] * D, size_t(D) * 2);
  cpu::rmsnorm_bf16(h.data(), bf16_ptr(w.final_norm), normed.data(), rows, D, eps);
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
