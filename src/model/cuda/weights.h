// Weights of the GPU model: uploaded once from the mmapped checkpoint (loader/weights.h) into a
// DeviceArena, kept as plain structs of device pointers. The layer forwards read only these: no
// tensor names, no host views, no shapes beyond the config's.
//
// Packing done at upload: q|k|v (KDA) and gate|up (dense MLP, shared experts) are stacked row-wise so
// each is one GEMM, the three conv kernels likewise so the conv is one launch over q|k|v; routed
// experts stay MXFP4, each layer's X experts repacked by cuda::pack_experts_mxfp4 into the tensor-core
// fragment order moe_experts_mxfp4 reads (kernels/cuda/moe_layout.h: the same bytes, permuted).
// Tied embeddings: lm_head points at embed.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cuda/device_alloc.h"
#include "kernels/cuda/moe.h"
#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel::model::gpu {

using u16 = uint16_t;

struct KdaWeightsDev {
  const u16* qkv;      // bf16 [3·H·Dk, D]: q_proj | k_proj | v_proj
  const u16* g_proj;   // bf16 [H·Dk, D]
  const u16* f_a;      // bf16 [Dk, D]
  const u16* f_b;      // bf16 [H·Dk, Dk]
  const u16* b_proj;   // bf16 [H, D]
  const u16* o_proj;   // bf16 [D, H·Dk]
  const float* conv;   // f32 [3·H·Dk, W]: q_conv | k_conv | v_conv
  const float* a_log;  // f32 [≥ H]
  const float* dt_bias;  // f32 [H·Dk]
  const float* o_norm;   // f32 [Dk]
};

struct MlaWeightsDev {
  const u16* q_a;        // bf16 [Q, D]
  const u16* q_a_norm;   // bf16 [Q]
  const u16* q_b;        // bf16 [Hm·(N+R), Q]
  const u16* kv_a;       // bf16 [C+R, D]
  const u16* kv_a_norm;  // bf16 [C]
  const u16* kv_b;       // bf16 [Hm·(N+Dv), C]
  const u16* g_proj;     // bf16 [Hm·Dv, D], null without the output gate
  const u16* o_proj;     // bf16 [D, Hm·Dv]
  bool has_indexer;
  const u16* wq_b;          // bf16 [Hi·Di, Q]       (indexer; null without one)
  const u16* wk;            // bf16 [Di, D]
  const u16* k_norm;        // bf16 [Di]
  const u16* k_norm_bias;   // bf16 [Di] or null (bias 0)
  const u16* weights_proj;  // bf16 [Hi, D]
};

struct MlpWeightsDev {
  const u16* gate_up;  // bf16 [2F, D]: gate_proj | up_proj
  const u16* down;     // bf16 [D, F]
  int64_t F;
};

struct MoeWeightsDev {
  const u16* router;       // bf16 [X, D]
  const float* router_bias;  // f32 [X]
  const u16* latent_down;  // bf16 [Lt, D]
  const u16* latent_norm;  // bf16 [Lt]
  const u16* latent_up;    // bf16 [D, Lt]
  cuda::MoeExpertWeights experts;
  bool has_shared;
  MlpWeightsDev shared;  // F = Is
};

struct LayerWeightsDev {
  const u16* input_norm;      // bf16 [D]
  const u16* post_attn_norm;  // bf16 [D]
  const u16* attn_res_norm;   // bf16 [D]
  const u16* attn_res_proj;   // bf16 [D]
  const u16* mlp_res_norm;    // bf16 [D]
  const u16* mlp_res_proj;    // bf16 [D]
  AttnKind attn;
  MlpKind mlp;
  KdaWeightsDev kda;    // attn == kda
  MlaWeightsDev mla;    // attn == mla
  MlpWeightsDev dense;  // mlp == dense
  MoeWeightsDev moe;    // mlp == moe
};

struct WeightsDev {
  const u16* embed;         // bf16 [V, D]
  const u16* lm_head;       // bf16 [V, D] (= embed when tied)
  const u16* final_norm;    // bf16 [D]
  const u16* out_res_norm;  // bf16 [D]
  const u16* out_res_proj;  // bf16 [D]
  std::vector<LayerWeightsDev> layers;
};

// Copies every tensor of `w` into `arena` (synchronous; returns once the copies are done).
WeightsDev upload_weights(const ModelConfig& c, const ModelWeights& w, cuda::DeviceArena& arena);

}  // namespace kestrel::model::gpu
