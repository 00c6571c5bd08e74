// Weights of the GPU model: uploaded once from the mmapped checkpoint (loader/weights.h) into a
// DeviceArena, kept as plain structs of device pointers. The layer forwards read only these: no
// tensor names, no host views, no shapes beyond the config's.
//
// Packing done at upload: projections that read the same input are stacked row-wise into one matrix
// (linear.h), so a decode step reads each layer's input-side weights in one launch: KDA q|k|v|g|f_a|b,
// MLA q_a|kv_a|wk|g_proj|weights_proj and q_b|wq_b, MoE shared gate|up|latent_down|router; gate|up pairs are
// interleaved by 8 rows so the SiTU-GLU runs in the GEMM's epilogue. The MoE's two output-side matrices (latent
// up, shared down: same output rows, different inputs) sit side by side along K instead (MoeWeightsDev::out_proj). The three conv kernels are stacked so
// the conv is one launch over q|k|v; routed experts stay MXFP4, each layer's X experts repacked by cuda::pack_experts_mxfp4 into the tensor-core
// fragment order moe_experts_mxfp4 reads (kernels/cuda/moe_layout.h: the same bytes, permuted).
// Tied embeddings: lm_head points at embed.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cuda/device_alloc.h"
#include "kernels/cuda/moe.h"
#include "loader/config.h"
#include "loader/weights.h"
#include "model/cuda/linear.h"

namespace kestrel::model::gpu {

using u16 = uint16_t;

struct KdaWeightsDev {
  LinearDev in_proj;   // [q_proj | k_proj | v_proj (3·H·Dk) | g_proj (H·Dk) | f_a (Dk) | b_proj (H)] × D, one GEMM
  LinearDev f_b;       // [H·Dk, Dk]
  LinearDev o_proj;    // [D, H·Dk]
  const u16* f_b_bf16;  // bf16 [H·Dk, Dk] (the fused decode kernel reads it; = f_b.w, or kept beside f_b.w8)
  const float* conv;   // f32 [3·H·Dk, W]: q_conv | k_conv | v_conv
  const float* a_log;  // f32 [≥ H]
  const float* dt_bias;  // f32 [H·Dk]
  const float* o_norm;   // f32 [Dk]
};

struct MlaWeightsDev {
  // [q_a (Q) | kv_a (C+R) | wk (Di, indexer) | g_proj (Hm·Dv, output gate) | weights_proj (Hi, FP32 out; BF16 mode)]
  LinearDev in_proj;
  int64_t off_kv = 0, off_wk = -1, off_g = -1, off_hw = -1;  // first rows in in_proj (−1: absent)
  LinearDev head_w;      // weights_proj [Hi, D] on its own (ptpc-fp8: FP32 outputs stay BF16); N = 0 otherwise
  LinearDev q_proj;      // [q_b (Hm·(N+R)) | wq_b (Hi·Di, indexer)] × Q
  LinearDev o_proj;      // [D, Hm·Dv]
  const u16* q_a_norm;   // bf16 [Q]
  const u16* kv_a_norm;  // bf16 [C]
  const u16* kv_b;       // bf16 [Hm·(N+Dv), C]
  bool has_indexer, has_gate;
  const u16* k_norm;        // bf16 [Di]   (indexer)
  const u16* k_norm_bias;   // bf16 [Di] or null (bias 0)
};

struct MlpWeightsDev {
  LinearDev gate_up;  // [2F, D], gate and up rows interleaved by 8 (GemmEpi::situ_glu8)
  LinearDev down;     // [D, F]
  int64_t F;
};

struct MoeWeightsDev {
  // [shared gate|up interleaved (2·Is, with shared experts) | latent_down (Lt) | router (X, FP32 out; BF16 mode)]
  LinearDev in_proj;
  int64_t off_down = 0, off_router = -1;
  LinearDev router;        // [X, D] on its own (ptpc-fp8); N = 0 otherwise
  const float* router_bias;  // f32 [X] (under TP: gathered over the ranks at attach, cuda_model.cpp)
  const u16* latent_norm;  // bf16 [Lt] (likewise)
  LinearDev latent_up;     // [D, Lt] (under TP: [D, Lt/N], the rank's columns); N = 0 when out_proj holds it
  int64_t I = 0;           // the experts' intermediate width on this rank (I, or I/N under TP; I under EP)
  int64_t Xl = 0, Ll = 0;  // router rows and latent-down rows on this rank (X and Lt on one rank)
  // The experts `experts` holds: global ids [x_lo, x_lo + Xe) — all X (x_lo = 0) on one rank and under the
  // I split, the rank's X/N whole experts under --enable-expert-parallel (moe.cpp maps ids to local ones).
  int64_t x_lo = 0, Xe = 0;
  cuda::MoeExpertWeights experts;
  bool has_shared;
  LinearDev shared_down;   // [D, Is]; N = 0 when out_proj holds it
  int64_t Is = 0;
  // BF16 with shared experts: [latent_up | shared_down] side by side, [D, Ll + Is] — steps 5's up-projection,
  // 6's down-projection and 7's sum in one GEMM over [RMSNorm(ũ) | a_sh] (moe.cpp). N = 0 otherwise.
  LinearDev out_proj;
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
  LinearDev lm_head;        // bf16 [V, D] (= embed when tied), FP32 logits
  const u16* final_norm;    // bf16 [D]
  const u16* out_res_norm;  // bf16 [D]
  const u16* out_res_proj;  // bf16 [D]
  std::vector<LayerWeightsDev> layers;
};

// Copies every tensor of `w` into `arena` (synchronous; returns once the copies are done). fp8: the dense
// projections are re-quantised at load to PTPC FP8 (e4m3 + per-output-channel scales, quantize_fp8_rows on
// the device; the BF16 copies are not kept), except the FP32-output ones (router, indexer head weights,
// lm_head) and the MLA kv_b the attention kernels read.
// embed_zero_row: one zero row is appended to the embedding table (tensor parallelism: a rank's ids outside
// its vocabulary rows look it up, cuda_model.cpp). Under TP `c` is the rank's config (model::rank_config)
// and `w` its shard (loader/shard.h, strided column slices packed contiguous by model::pack_strided): every
// width below is then the rank's, read from the tensors' shapes.
WeightsDev upload_weights(const ModelConfig& c, const ModelWeights& w, cuda::DeviceArena& arena, bool fp8,
                          bool embed_zero_row = false);

}  // namespace kestrel::model::gpu
