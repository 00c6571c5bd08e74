// The model configuration: config.json of `kimi_k3` (MODEL.md §1) as plain structs.
//
// parse_config() reads the released layout (top level + text_config + vision_config +
// quantization_config); a bare `kimi_linear` text config (no text_config wrapper) is accepted too.
// Every field the engine depends on is read, never assumed; fields the release always carries but
// older or scaled configs may omit take the release's value (MODEL.md §1.1). validate() rejects
// inconsistent configs with a message that names the offending field. Derived quantities (layer
// kinds, stored-block count, padded A_log length) are computed once here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace kestrel {

enum class AttnKind : uint8_t { kda, mla };
enum class MlpKind : uint8_t { dense, moe };

struct KdaConfig {
  int num_heads = 0;   // H
  int head_dim = 0;    // Dk
  int conv_size = 4;   // W
  bool use_full_rank_gate = true;
  float gate_lower_bound = -5.0f;
  std::vector<int> kda_layers;        // 1-indexed, as in the file
  std::vector<int> full_attn_layers;  // 1-indexed

  int width() const { return num_heads * head_dim; }
  // A_log is stored padded to a multiple of 128 heads (MODEL.md §2).
  int a_log_len() const { return (num_heads + 127) / 128 * 128; }
};

struct TextConfig {
  int hidden_size = 0;         // D
  int num_hidden_layers = 0;
  int vocab_size = 0;          // V
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  float rms_norm_eps = 1e-5f;
  std::string hidden_act = "situ";
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;
  int intermediate_size = 0;   // F, dense layers
  int first_k_dense_replace = 1;
  int moe_layer_freq = 1;

  // MLA
  int num_attention_heads = 0;  // Hm
  int num_key_value_heads = 0;
  int q_lora_rank = 0;          // Q
  int kv_lora_rank = 0;         // C
  int qk_nope_head_dim = 0;     // N
  int qk_rope_head_dim = 0;     // R
  int v_head_dim = 0;           // Dv
  bool mla_use_nope = true;
  bool mla_use_output_gate = true;

  // DSA indexer (K3.1); index_n_heads == 0 means the checkpoint has no indexer (plain K3).
  int index_n_heads = 0;        // Hi
  int index_head_dim = 0;       // Di
  int index_topk = 0;           // Ki
  int index_rope_head_dim = 0;

  // MoE
  int num_experts = 0;          // X
  int num_experts_per_token = 0;  // K
  int routed_expert_hidden_size = 0;  // Lt
  int moe_intermediate_size = 0;      // I
  int num_shared_experts = 0;
  // kestrel extension for per-rank test configs (mini): the fused shared-expert width when it is
  // not moe_intermediate_size * num_shared_experts (TP-sharded). 0 = the release's rule.
  int shared_experts_intermediate_size = 0;
  bool latent_moe_use_norm = true;
  std::string moe_router_activation_func = "sigmoid";
  bool moe_renormalize = true;
  float routed_scaling_factor = 1.0f;
  int num_expert_group = 1;
  int topk_group = 1;

  int attn_res_block_size = 12;
  int bos_token_id = -1;
  int eos_token_id = -1;
  int pad_token_id = -1;

  KdaConfig kda;

  // Derived by finalize().
  std::vector<AttnKind> attn_kind;  // per 0-indexed layer
  std::vector<MlpKind> mlp_kind;

  bool has_indexer() const { return index_n_heads > 0; }
  int mla_qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int mla_cache_width() const { return kv_lora_rank + qk_rope_head_dim; }  // 576 in the release
  int shared_intermediate() const {  // Is
    return shared_experts_intermediate_size > 0 ? shared_experts_intermediate_size
                                                : moe_intermediate_size * num_shared_experts;
  }
  // Blocks stored by AttnRes at the end of the stack: writes happen at layers 0, bs, 2bs, ...
  int num_attn_res_blocks() const { return (num_hidden_layers + attn_res_block_size - 1) / attn_res_block_size; }
  bool attn_res_writes(int layer) const { return layer % attn_res_block_size == 0; }
  int num_layers_of(AttnKind k) const;
  int num_layers_of(MlpKind k) const;
};

struct VisionConfig {
  bool present = false;
  int patch_size = 14;
  int init_pos_emb_height = 64;
  int init_pos_emb_width = 64;
  int init_pos_emb_time = 4;
  int num_heads = 0;         // vt_num_attention_heads
  int num_layers = 0;        // vt_num_hidden_layers
  int hidden_size = 0;       // vt_hidden_size
  int intermediate_size = 0; // vt_intermediate_size
  int qkv_hidden_size = 0;
  int merge_kernel_h = 2;
  int merge_kernel_w = 2;
  int text_hidden_size = 0;
  float projector_ln_eps = 1e-5f;
  float rms_norm_eps = 1e-6f;  // vt_rms_norm_eps; absent: 1e-6 (MODEL.md §0.2)

  int merged_width() const { return hidden_size * merge_kernel_h * merge_kernel_w; }
};

struct QuantConfig {
  bool present = false;
  std::string quant_method;
  std::string format;
  int num_bits = 0;
  int group_size = 0;
  std::vector<std::string> ignore;
};

struct ModelConfig {
  std::string model_type;
  int media_placeholder_token_id = -1;
  TextConfig text;
  VisionConfig vision;
  QuantConfig quant;
};

// Reads and validates <dir>/config.json (or a path to a .json file).
ModelConfig load_config(const std::string& path);
// Parses an already-loaded JSON document; `what` names the source in messages.
ModelConfig parse_config(const nlohmann::json& j, const std::string& what);
// Throws kestrel::Error naming the first inconsistent field.
void validate(const ModelConfig& c, const std::string& what);

}  // namespace kestrel
