// Model weights as plain structs, bound to checkpoint tensors by name (MODEL.md §2).
//
// Compute code only ever sees these structs; tensor names live in weights.cpp alone. One function,
// for_each_tensor(), walks the structs in checkpoint order and yields (name, dtype, shape, module,
// destination) for every tensor the config implies. Binding, parameter counting (`kestrel inspect
// --config-only`) and checkpoint generation checks all use that one list, so they cannot disagree.
//
// Routed experts stay MXFP4: `packed` u8 [out, in/2] (low nibble = even element) and `scale` e8m0
// [out, in/32] (MODEL.md §4). They are never dequantised up front.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "loader/config.h"

namespace kestrel {

class Checkpoint;

// What a tensor belongs to, for parameter accounting and sharding rules.
enum class Module : uint8_t {
  embedding,
  lm_head,
  norms,          // RMSNorm weights and AttnRes vectors
  kda,
  mla,
  indexer,
  dense_mlp,
  router,
  latent_proj,    // routed_expert_down/up projections and norm
  routed_experts,
  shared_experts,
  vision,
  projector,
  count_
};
const char* module_name(Module m);

struct Mxfp4Weight {
  TensorView packed;  // u8 [out, in/2]
  TensorView scale;   // e8m0 (stored as u8) [out, in/32]
  int64_t rows() const { return packed.shape[0]; }
  int64_t cols() const { return packed.shape[1] * 2; }
};

struct KdaWeights {
  TensorView q_proj, k_proj, v_proj;  // bf16 [H*Dk, D]
  TensorView g_proj;                  // bf16 [H*Dk, D] full-rank output gate
  TensorView q_conv, k_conv, v_conv;  // f32 [H*Dk, 1, W]
  TensorView f_a_proj;                // bf16 [Dk, D]
  TensorView f_b_proj;                // bf16 [H*Dk, Dk]
  TensorView b_proj;                  // bf16 [H, D]
  TensorView a_log;                   // f32 [ceil(H/128)*128], first H used
  TensorView dt_bias;                 // f32 [H*Dk]
  TensorView o_norm;                  // f32 [Dk], shared by heads
  TensorView o_proj;                  // bf16 [D, H*Dk]
};

struct IndexerWeights {
  TensorView wq_b;          // bf16 [Hi*Di, Q]
  TensorView wk;            // bf16 [Di, D]
  TensorView k_norm;        // bf16 [Di] LayerNorm weight
  TensorView k_norm_bias;   // bf16 [Di], empty view when absent (bias = 0)
  TensorView weights_proj;  // bf16 [Hi, D]
};

struct MlaWeights {
  TensorView q_a_proj;       // bf16 [Q, D]
  TensorView q_a_norm;       // bf16 [Q]
  TensorView q_b_proj;       // bf16 [Hm*(N+R), Q]
  TensorView kv_a_proj;      // bf16 [C+R, D]
  TensorView kv_a_norm;      // bf16 [C]
  TensorView kv_b_proj;      // bf16 [Hm*(N+Dv), C]
  TensorView g_proj;         // bf16 [Hm*Dv, D], empty when mla_use_output_gate is false
  TensorView o_proj;         // bf16 [D, Hm*Dv]
  bool has_indexer = false;
  IndexerWeights indexer;
};

struct MlpWeights {  // dense layer-0 MLP and the fused shared experts
  TensorView gate_proj, up_proj;  // bf16 [F, D]
  TensorView down_proj;           // bf16 [D, F]
};

struct ExpertWeights {
  Mxfp4Weight w1;  // gate: logical [I, Lt]
  Mxfp4Weight w3;  // up:   logical [I, Lt]
  Mxfp4Weight w2;  // down: logical [Lt, I]
};

struct MoeWeights {
  TensorView router;        // bf16 [X, D]
  TensorView router_bias;   // f32 [X] e_score_correction_bias (selection only)
  TensorView latent_down;   // bf16 [Lt, D]
  TensorView latent_norm;   // bf16 [Lt]
  TensorView latent_up;     // bf16 [D, Lt]
  std::vector<ExpertWeights> experts;  // X
  bool has_shared = false;
  MlpWeights shared;        // bf16, F = Is
};

struct LayerWeights {
  AttnKind attn_kind = AttnKind::kda;
  MlpKind mlp_kind = MlpKind::dense;
  TensorView input_norm;      // bf16 [D]
  TensorView post_attn_norm;  // bf16 [D]
  TensorView attn_res_norm;   // bf16 [D]
  TensorView attn_res_proj;   // bf16 [1, D]
  TensorView mlp_res_norm;    // bf16 [D]
  TensorView mlp_res_proj;    // bf16 [1, D]
  KdaWeights kda;
  MlaWeights mla;
  MlpWeights dense;
  MoeWeights moe;
};

struct VisionBlockWeights {
  TensorView norm0, norm1;  // bf16 [Dvt]
  TensorView wqkv;          // bf16 [3*qkv, Dvt]
  TensorView wo;            // bf16 [Dvt, qkv]
  TensorView fc0;           // bf16 [Fvt, Dvt]
  TensorView fc1;           // bf16 [Dvt, Fvt]
};

struct VisionWeights {
  TensorView patch_embed;   // bf16 [Dvt, 3, p, p]
  TensorView pos_emb;       // bf16 [h0, w0, Dvt]
  std::vector<VisionBlockWeights> blocks;
  TensorView final_norm;    // bf16 [Dvt]
  TensorView proj0;         // bf16 [4*Dvt, 4*Dvt]
  TensorView proj2;         // bf16 [D, 4*Dvt]
  TensorView post_norm;     // bf16 [D]
};

struct ModelWeights {
  TensorView embed;         // bf16 [V, D]
  TensorView lm_head;       // bf16 [V, D] (= embed when tie_word_embeddings)
  TensorView final_norm;    // bf16 [D]
  TensorView out_res_norm;  // bf16 [D]
  TensorView out_res_proj;  // bf16 [1, D]
  std::vector<LayerWeights> layers;
  bool has_vision = false;
  VisionWeights vision;
};

struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
  Module module;
  bool optional = false;  // may be absent (k_norm.bias)
  int layer = -1;         // -1 for tensors outside the layer stack
  TensorView* dest = nullptr;
};

// Visits every tensor the config implies, in a stable order. `w` is resized to the config and its
// fields are the destinations; pass a scratch ModelWeights when only the list is wanted.
void for_each_tensor(const ModelConfig& c, ModelWeights* w, const std::function<void(TensorSpec&)>& fn);
std::vector<TensorSpec> expected_tensors(const ModelConfig& c);

// Binds every expected tensor of the checkpoint. Missing, extra, mis-shaped or mis-typed tensors
// produce one kestrel::Error that lists all of them.
ModelWeights bind_weights(const ModelConfig& c, const Checkpoint& ckpt);

// Logical parameters of one tensor: an MXFP4 `weight_packed` byte holds two parameters, its
// `weight_scale` holds none (it is storage overhead).
int64_t logical_params(const TensorSpec& t);

}  // namespace kestrel
