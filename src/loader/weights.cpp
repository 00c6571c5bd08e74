// Tensor names of MODEL.md §2 and the binding of a checkpoint to ModelWeights.
#include "loader/weights.h"

#include <set>

#include "core/check.h"
#include "loader/safetensors.h"

namespace kestrel {

const char* module_name(Module m) {
  switch (m) {
    case Module::embedding: return "embedding";
    case Module::lm_head: return "lm_head";
    case Module::norms: return "norms+attn_res";
    case Module::kda: return "kda";
    case Module::mla: return "mla";
    case Module::indexer: return "indexer";
    case Module::dense_mlp: return "dense_mlp";
    case Module::router: return "router";
    case Module::latent_proj: return "latent_proj";
    case Module::routed_experts: return "routed_experts";
    case Module::shared_experts: return "shared_experts";
    case Module::vision: return "vision";
    case Module::projector: return "projector";
    case Module::count_: break;
  }
  return "?";
}

namespace {

struct Emitter {
  const std::function<void(TensorSpec&)>& fn;
  int layer = -1;
  void operator()(std::string name, DType dt, Shape shape, Module m, TensorView* dest, bool optional = false) const {
    TensorSpec s{std::move(name), dt, shape, m, optional, layer, dest};
    fn(s);
  }
};

void emit_mlp(const Emitter& e, const std::string& p, int64_t d, int64_t f, Module m, MlpWeights* w) {
  e(p + "gate_proj.weight", DType::bf16, {f, d}, m, &w->gate_proj);
  e(p + "up_proj.weight", DType::bf16, {f, d}, m, &w->up_proj);
  e(p + "down_proj.weight", DType::bf16, {d, f}, m, &w->down_proj);
}

void emit_mxfp4(const Emitter& e, const std::string& p, int64_t out, int64_t in, Mxfp4Weight* w) {
  e(p + ".weight_packed", DType::u8, {out, in / 2}, Module::routed_experts, &w->packed);
  e(p + ".weight_scale", DType::u8, {out, in / 32}, Module::routed_experts, &w->scale);
}

}  // namespace

void for_each_tensor(const ModelConfig& c, ModelWeights* w, const std::function<void(TensorSpec&)>& fn) {
  const TextConfig& t = c.text;
  const int64_t D = t.hidden_size, V = t.vocab_size;
  Emitter e{fn};
  const std::string lm = "language_model.";
  e(lm + "model.embed_tokens.weight", DType::bf16, {V, D}, Module::embedding, &w->embed);
  if (!t.tie_word_embeddings) e(lm + "lm_head.weight", DType::bf16, {V, D}, Module::lm_head, &w->lm_head);
  e(lm + "model.norm.weight", DType::bf16, {D}, Module::norms, &w->final_norm);
  e(lm + "model.output_attn_res_norm.weight", DType::bf16, {D}, Module::norms, &w->out_res_norm);
  e(lm + "model.output_attn_res_proj.weight", DType::bf16, {1, D}, Module::norms, &w->out_res_proj);

  w->layers.resize(size_t(t.num_hidden_layers));
  for (int L = 0; L < t.num_hidden_layers; ++L) {
    LayerWeights& lw = w->layers[size_t(L)];
    lw.attn_kind = t.attn_kind[size_t(L)];
    lw.mlp_kind = t.mlp_kind[size_t(L)];
    e.layer = L;
    const std::string P = fmt::format("{}model.layers.{}.", lm, L);
    e(P + "input_layernorm.weight", DType::bf16, {D}, Module::norms, &lw.input_norm);
    e(P + "post_attention_layernorm.weight", DType::bf16, {D}, Module::norms, &lw.post_attn_norm);
    e(P + "self_attention_res_norm.weight", DType::bf16, {D}, Module::norms, &lw.attn_res_norm);
    e(P + "self_attention_res_proj.weight", DType::bf16, {1, D}, Module::norms, &lw.attn_res_proj);
    e(P + "mlp_res_norm.weight", DType::bf16, {D}, Module::norms, &lw.mlp_res_norm);
    e(P + "mlp_res_proj.weight", DType::bf16, {1, D}, Module::norms, &lw.mlp_res_proj);

    const std::string A = P + "self_attn.";
    if (lw.attn_kind == AttnKind::kda) {
      const int64_t H = t.kda.num_heads, Dk = t.kda.head_dim, HD = H * Dk, W = t.kda.conv_size;
      KdaWeights& k = lw.kda;
      const Module m = Module::kda;
      e(A + "q_proj.weight", DType::bf16, {HD, D}, m, &k.q_proj);
      e(A + "k_proj.weight", DType::bf16, {HD, D}, m, &k.k_proj);
      e(A + "v_proj.weight", DType::bf16, {HD, D}, m, &k.v_proj);
      e(A + "g_proj.weight", DType::bf16, {HD, D}, m, &k.g_proj);
      e(A + "q_conv1d.weight", DType::f32, {HD, 1, W}, m, &k.q_conv);
      e(A + "k_conv1d.weight", DType::f32, {HD, 1, W}, m, &k.k_conv);
      e(A + "v_conv1d.weight", DType::f32, {HD, 1, W}, m, &k.v_conv);
      e(A + "f_a_proj.weight", DType::bf16, {Dk, D}, m, &k.f_a_proj);
      e(A + "f_b_proj.weight", DType::bf16, {HD, Dk}, m, &k.f_b_proj);
      e(A + "b_proj.weight", DType::bf16, {H, D}, m, &k.b_proj);
      e(A + "A_log", DType::f32, {t.kda.a_log_len()}, m, &k.a_log);
      e(A + "dt_bias", DType::f32, {HD}, m, &k.dt_bias);
      e(A + "o_norm.weight", DType::f32, {Dk}, m, &k.o_norm);
      e(A + "o_proj.weight", DType::bf16, {D, HD}, m, &k.o_proj);
    } else {
      const int64_t Hm = t.num_attention_heads, Q = t.q_lora_rank, C = t.kv_lora_rank;
      const int64_t N = t.qk_nope_head_dim, R = t.qk_rope_head_dim, Dv = t.v_head_dim;
      MlaWeights& a = lw.mla;
      const Module m = Module::mla;
      e(A + "q_a_proj.weight", DType::bf16, {Q, D}, m, &a.q_a_proj);
      e(A + "q_a_layernorm.weight", DType::bf16, {Q}, m, &a.q_a_norm);
      e(A + "q_b_proj.weight", DType::bf16, {Hm * (N + R), Q}, m, &a.q_b_proj);
      e(A + "kv_a_proj_with_mqa.weight", DType::bf16, {C + R, D}, m, &a.kv_a_proj);
      e(A + "kv_a_layernorm.weight", DType::bf16, {C}, m, &a.kv_a_norm);
      e(A + "kv_b_proj.weight", DType::bf16, {Hm * (N + Dv), C}, m, &a.kv_b_proj);
      if (t.mla_use_output_gate) e(A + "g_proj.weight", DType::bf16, {Hm * Dv, D}, m, &a.g_proj);
      e(A + "o_proj.weight", DType::bf16, {D, Hm * Dv}, m, &a.o_proj);
      a.has_indexer = t.has_indexer();
      if (a.has_indexer) {
        const int64_t Hi = t.index_n_heads, Di = t.index_head_dim;
        IndexerWeights& x = a.indexer;
        const std::string I = A + "indexer.";
        e(I + "wq_b.weight", DType::bf16, {Hi * Di, Q}, Module::indexer, &x.wq_b);
        e(I + "wk.weight", DType::bf16, {Di, D}, Module::indexer, &x.wk);
        e(I + "k_norm.weight", DType::bf16, {Di}, Module::indexer, &x.k_norm);
        e(I + "k_norm.bias", DType::bf16, {Di}, Module::indexer, &x.k_norm_bias, /*optional=*/true);
        e(I + "weights_proj.weight", DType::bf16, {Hi, D}, Module::indexer, &x.weights_proj);
      }
    }

    if (lw.mlp_kind == MlpKind::dense) {
      emit_mlp(e, P + "mlp.", D, t.intermediate_size, Module::dense_mlp, &lw.dense);
    } else {
      const int64_t X = t.num_experts, Lt = t.routed_expert_hidden_size, I = t.moe_intermediate_size;
      MoeWeights& m = lw.moe;
      const std::string M = P + "block_sparse_moe.";
      e(M + "gate.weight", DType::bf16, {X, D}, Module::router, &m.router);
      e(M + "gate.e_score_correction_bias", DType::f32, {X}, Module::router, &m.router_bias);
      e(M + "routed_expert_down_proj.weight", DType::bf16, {Lt, D}, Module::latent_proj, &m.latent_down);
      if (t.latent_moe_use_norm)
        e(M + "routed_expert_norm.weight", DType::bf16, {Lt}, Module::latent_proj, &m.latent_norm);
      e(M + "routed_expert_up_proj.weight", DType::bf16, {D, Lt}, Module::latent_proj, &m.latent_up);
      m.experts.resize(size_t(X));
      for (int64_t x = 0; x < X; ++x) {
        const std::string E = fmt::format("{}experts.{}.", M, x);
        ExpertWeights& ew = m.experts[size_t(x)];
        emit_mxfp4(e, E + "w1", I, Lt, &ew.w1);
        emit_mxfp4(e, E + "w2", Lt, I, &ew.w2);
        emit_mxfp4(e, E + "w3", I, Lt, &ew.w3);
      }
      m.has_shared = t.num_shared_experts > 0;
      if (m.has_shared) emit_mlp(e, M + "shared_experts.", D, t.shared_intermediate(), Module::shared_experts, &m.shared);
    }
  }
  e.layer = -1;

  w->has_vision = c.vision.present;
  if (c.vision.present) {
    const VisionConfig& v = c.vision;
    const int64_t Dv = v.hidden_size, p = v.patch_size, qkv = v.qkv_hidden_size, Fv = v.intermediate_size;
    const int64_t Mw = v.merged_width();
    VisionWeights& vw = w->vision;
    const Module m = Module::vision;
    e("vision_tower.patch_embed.proj.weight", DType::bf16, {Dv, 3, p, p}, m, &vw.patch_embed);
    e("vision_tower.patch_embed.pos_emb.weight", DType::bf16, {v.init_pos_emb_height, v.init_pos_emb_width, Dv}, m,
      &vw.pos_emb);
    vw.blocks.resize(size_t(v.num_layers));
    for (int b = 0; b < v.num_layers; ++b) {
      const std::string B = fmt::format("vision_tower.encoder.blocks.{}.", b);
      VisionBlockWeights& bw = vw.blocks[size_t(b)];
      e(B + "norm0.weight", DType::bf16, {Dv}, m, &bw.norm0);
      e(B + "norm1.weight", DType::bf16, {Dv}, m, &bw.norm1);
      e(B + "wqkv.weight", DType::bf16, {3 * qkv, Dv}, m, &bw.wqkv);
      e(B + "wo.weight", DType::bf16, {Dv, qkv}, m, &bw.wo);
      e(B + "mlp.fc0.weight", DType::bf16, {Fv, Dv}, m, &bw.fc0);
      e(B + "mlp.fc1.weight", DType::bf16, {Dv, Fv}, m, &bw.fc1);
    }
    e("vision_tower.encoder.final_layernorm.weight", DType::bf16, {Dv}, m, &vw.final_norm);
    e("mm_projector.proj.0.weight", DType::bf16, {Mw, Mw}, Module::projector, &vw.proj0);
    e("mm_projector.proj.2.weight", DType::bf16, {D, Mw}, Module::projector, &vw.proj2);
    e("mm_projector.post_norm.weight", DType::bf16, {D}, Module::projector, &vw.post_norm);
  }
}

std::vector<TensorSpec> expected_tensors(const ModelConfig& c) {
  ModelWeights scratch;
  std::vector<TensorSpec> out;
  for_each_tensor(c, &scratch, [&](TensorSpec& s) {
    s.dest = nullptr;
    out.push_back(s);
  });
  return out;
}

int64_t logical_params(const TensorSpec& t) {
  if (t.module == Module::routed_experts) {
    const std::string_view n = t.name;
    if (n.ends_with(".weight_scale")) return 0;
    return t.shape.numel() * 2;
  }
  return t.shape.numel();
}

ModelWeights bind_weights(const ModelConfig& c, const Checkpoint& ckpt) {
  ModelWeights w;
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for_each_tensor(c, &w, [&](TensorSpec& s) {
    expected.insert(s.name);
    const Checkpoint::Entry* e = ckpt.find(s.name);
    if (!e) {
      if (!s.optional) problems.push_back(fmt::format("missing tensor '{}' (expected {} {})", s.name,
                                                      dtype_safetensors_name(s.dtype), s.shape.str()));
      return;
    }
    const TensorInfo& info = *e->info;
    bool ok = true;
    if (info.dtype != s.dtype) {
      problems.push_back(fmt::format("tensor '{}' has dtype {}, expected {}", s.name,
                                     dtype_safetensors_name(info.dtype), dtype_safetensors_name(s.dtype)));
      ok = false;
    }
    if (!(info.shape == s.shape)) {
      problems.push_back(fmt::format("tensor '{}' has shape {}, expected {}", s.name, info.shape.str(), s.shape.str()));
      ok = false;
    }
    if (ok) *s.dest = ckpt.view(*e);
  });
  for (const auto& [name, entry] : ckpt.tensors())
    if (!expected.count(name))
      problems.push_back(fmt::format("unexpected tensor '{}' ({} {}) not implied by the config", name,
                                     dtype_safetensors_name(entry.info->dtype), entry.info->shape.str()));
  if (!problems.empty()) {
    std::string msg = fmt::format("{}: checkpoint does not match its config ({} problem{}):", ckpt.dir(),
                                  problems.size(), problems.size() == 1 ? "" : "s");
    const size_t shown = std::min<size_t>(problems.size(), 40);
    for (size_t i = 0; i < shown; ++i) msg += "\n  - " + problems[i];
    if (shown < problems.size()) msg += fmt::format("\n  ... and {} more", problems.size() - shown);
    throw Error(msg);
  }
  if (c.text.tie_word_embeddings) w.lm_head = w.embed;
  return w;
}

}  // namespace kestrel
