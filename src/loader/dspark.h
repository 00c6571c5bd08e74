// The DSpark draft's own config.json and weights (MODEL.md §5, §0.5) as plain structs.
//
// A draft directory holds config.json (`model_type "k3_dspark"`) and model.safetensors (or shards with an
// index). Every draft field the engine uses is read from that file (§0.5): target_layer_ids, mask_token_id,
// hidden_act, rope_theta / rope_scaling, the block size (num_speculative_tokens), the Markov rank. The
// embedding and lm_head are the target's and are not stored in the draft.
//
// Tensor names (kestrel's layout, written by reference/make_draft.py; the preview release's names are not
// public, docs/speculative.md): context_proj.weight [D, n·Dt], context_norm.weight [D];
// layers.ℓ.{input_layernorm, post_attention_layernorm}.weight [D];
// layers.ℓ.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
// o_proj}.weight (§3.4 shapes, no g_proj); layers.ℓ.mlp.{gate_proj, up_proj, down_proj}.weight; norm.weight [D];
// markov_w1.weight [V, r] (an embedding), markov_w2.weight [V, r]; optional confidence_head.proj.{weight
// f32 [1, D+r], bias f32 [1]} (training/scheduling only; bound, never computed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/tensor.h"
#include "loader/config.h"

namespace kestrel {

class Checkpoint;

struct DraftRope {
  float theta = 50000.0f;
  bool yarn = false;
  float factor = 1.0f;
  int64_t original_max_position_embeddings = 0;
  float beta_fast = 32.0f, beta_slow = 1.0f;
  float mscale = 1.0f, mscale_all_dim = 0.0f;
};

struct DraftConfig {
  int hidden_size = 0;          // D (= the target's)
  int intermediate_size = 0;    // Fd
  int num_hidden_layers = 0;    // Ld
  int num_attention_heads = 0;  // Hm
  int q_lora_rank = 0;          // Q
  int kv_lora_rank = 0;         // C
  int qk_nope_head_dim = 0;     // N
  int qk_rope_head_dim = 0;     // R
  int v_head_dim = 0;           // Dv
  int vocab_size = 0;           // V (= the target's)
  float rms_norm_eps = 1e-5f;
  std::string hidden_act = "silu";
  DraftRope rope;
  std::vector<int> target_layer_ids;  // 0-indexed: tap = P after that target layer
  int target_hidden_size = 0;         // Dt
  int mask_token_id = -1;
  int markov_rank = 0;                // r
  int block_size = 7;                 // Nb = num_speculative_tokens of the config
  bool has_confidence_head = false;

  int num_taps() const { return int(target_layer_ids.size()); }
  int64_t tap_width() const { return int64_t(target_hidden_size) * num_taps(); }  // n·Dt
  int cache_width() const { return kv_lora_rank + qk_rope_head_dim; }            // C+R
  // A TextConfig carrying the draft's MLA shapes, for the shared MLA cache views and kernels.
  TextConfig mla_text_config() const;
};

// Reads <dir>/config.json (or a .json path); checks it against the target (hidden size, vocabulary, tap
// layers, mask id) and throws kestrel::Error naming the field.
DraftConfig load_draft_config(const std::string& path, const ModelConfig& target);
DraftConfig parse_draft_config(const nlohmann::json& j, const std::string& what, const ModelConfig& target);

struct DraftLayerWeights {
  TensorView input_norm, post_attn_norm;  // bf16 [D]
  TensorView q_a_proj;                    // bf16 [Q, D]
  TensorView q_a_norm;                    // bf16 [Q]
  TensorView q_b_proj;                    // bf16 [Hm*(N+R), Q]
  TensorView kv_a_proj;                   // bf16 [C+R, D]
  TensorView kv_a_norm;                   // bf16 [C]
  TensorView kv_b_proj;                   // bf16 [Hm*(N+Dv), C]
  TensorView o_proj;                      // bf16 [D, Hm*Dv]
  TensorView gate_proj, up_proj;          // bf16 [Fd, D]
  TensorView down_proj;                   // bf16 [D, Fd]
};

struct DraftWeights {
  TensorView context_proj;  // bf16 [D, n*Dt]
  TensorView context_norm;  // bf16 [D]
  std::vector<DraftLayerWeights> layers;
  TensorView final_norm;    // bf16 [D]
  TensorView markov_w1;     // bf16 [V, r]
  TensorView markov_w2;     // bf16 [V, r]
  TensorView confidence_w;  // f32 [1, D+r] (optional, unused)
  TensorView confidence_b;  // f32 [1]
};

// Binds every draft tensor; missing, extra, mis-shaped or mis-typed tensors give one Error listing them.
DraftWeights bind_draft_weights(const DraftConfig& c, const Checkpoint& ckpt);

}  // namespace kestrel
