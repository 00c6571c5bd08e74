// A random-weight nano K3.1 model (MODEL.md Appendix A) held in HostTensors, for model tests that
// must not depend on the checkpoint generator. Tensors come from the loader's own list
// (for_each_tensor), so the structs are filled exactly as bind_weights would fill them; values follow
// the generator's initialisation recipe (reference/make_checkpoint.py: linear N(0, 1/fan_in), layer output
// projections scaled by 0.03 (routed_expert_up_proj 0.01), AttnRes projections N(0, 0.03²/hidden), norms
// 1 + 0.02·N, ...), experts are quantised to MXFP4 from N(0, 1/fan_in) floats.
#pragma once

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/tensor.h"
#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel::testing {

inline nlohmann::json nano_config_json() {
  return nlohmann::json::parse(R"({
    "model_type": "kimi_k3",
    "text_config": {
      "model_type": "kimi_linear", "hidden_size": 256, "num_hidden_layers": 8, "vocab_size": 1024,
      "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
      "intermediate_size": 512, "first_k_dense_replace": 1, "moe_layer_freq": 1,
      "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
      "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": true,
      "mla_use_output_gate": true, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 64,
      "num_experts": 16, "num_experts_per_token": 4, "routed_expert_hidden_size": 128,
      "moe_intermediate_size": 64, "num_shared_experts": 2, "latent_moe_use_norm": true,
      "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "routed_scaling_factor": 1.0,
      "num_expert_group": 1, "topk_group": 1, "attn_res_block_size": 3,
      "bos_token_id": 768, "eos_token_id": 770, "pad_token_id": 1023,
      "linear_attn_config": {"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4,
        "use_full_rank_gate": true, "gate_lower_bound": -5.0,
        "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}
    }
  })");
}

struct RandomModel {
  ModelConfig cfg;
  ModelWeights w;
  std::vector<HostTensor> storage;
};

// `edit` may change text_config fields before parsing (e.g. index_topk).
template <typename Edit>
RandomModel make_random_model(uint64_t seed, Edit edit) {
  nlohmann::json j = nano_config_json();
  edit(j["text_config"]);
  RandomModel m;
  m.cfg = parse_config(j, "nano(test)");
  std::vector<TensorSpec> specs;
  for_each_tensor(m.cfg, &m.w, [&](TensorSpec& s) { specs.push_back(s); });
  m.storage.reserve(specs.size());
  for (const TensorSpec& s : specs) {
    std::mt19937_64 rng(seed ^ std::hash<std::string>{}(s.name));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    HostTensor& h = m.storage.emplace_back(s.dtype, s.shape);
    const std::string& n = s.name;
    const int64_t count = h.view.numel();
    auto ends = [&](const char* suf) { return n.size() >= std::string(suf).size() && n.ends_with(suf); };
    // Distribution per tensor kind, decided once per tensor: (mean, sd), or A_log's log-uniform.
    float mean = 0.0f, sd = 1.0f / std::sqrt(float(s.shape[s.shape.rank - 1]));
    const bool a_log = ends("A_log");
    if (ends("dt_bias")) sd = 0.1f;
    else if (ends("conv1d.weight")) sd = 0.5f;
    else if (ends("e_score_correction_bias")) sd = 0.01f;
    else if (ends("k_norm.bias")) sd = 0.02f;
    else if (ends("res_proj.weight")) sd = 0.03f / std::sqrt(float(s.shape[s.shape.rank - 1]));
    else if (n.find("norm") != std::string::npos) mean = 1.0f, sd = 0.02f;
    else if (ends("embed_tokens.weight")) sd = 1.0f;
    // Layer output projections (see "Conditioning" in reference/README.md).
    else if (ends("o_proj.weight") || ends("mlp.down_proj.weight") || ends("shared_experts.down_proj.weight"))
      sd *= 0.03f;
    else if (ends("routed_expert_up_proj.weight")) sd *= 0.01f;
    auto value = [&]() -> float {
      if (a_log) return std::log(0.5f + 1.5f * std::uniform_real_distribution<float>(0, 1)(rng));
      return mean + sd * nd(rng);
    };
    if (ends("weight_packed")) {
      // Quantise a row block at a time together with its scale tensor, filled right after.
      continue;
    }
    if (ends("weight_scale")) {
      const int64_t rows = s.shape[0], nblk = s.shape[1], in = nblk * 32;
      HostTensor& packed = m.storage[m.storage.size() - 2];
      float blk[32];
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nblk; ++b) {
          for (float& v : blk) v = nd(rng) / std::sqrt(float(in));
          h.as<uint8_t>()[r * nblk + b] = mxfp4_quantize_block(blk, packed.as<uint8_t>() + r * (in / 2) + b * 16);
        }
      *s.dest = h.view;
      continue;
    }
    for (int64_t i = 0; i < count; ++i) {
      const float v = value();
      if (s.dtype == DType::bf16) h.as<uint16_t>()[i] = f32_to_bf16(v);
      else h.as<float>()[i] = v;
    }
    *s.dest = h.view;
  }
  // Packed expert tensors were skipped above; bind them now (their storage was allocated in order).
  for (size_t i = 0; i < specs.size(); ++i)
    if (specs[i].name.ends_with("weight_packed")) *specs[i].dest = m.storage[i].view;
  return m;
}

inline RandomModel make_random_model(uint64_t seed) {
  return make_random_model(seed, [](nlohmann::json&) {});
}

}  // namespace kestrel::testing
