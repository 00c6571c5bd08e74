// config.json reader. Field access goes through Reader, which knows the JSON path of the object it
// reads so every message can name the field ("text_config.linear_attn_config.kda_layers[3]").
#include "loader/config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"

namespace kestrel {
using nlohmann::json;

namespace {

struct Reader {
  const json& obj;
  std::string path;  // "text_config." etc.
  const std::string& what;

  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    fail("{}: field '{}{}' {}", what, path, key, why);
  }
  bool has(const char* key) const { return obj.contains(key) && !obj[key].is_null(); }

  int64_t get_int(const char* key) const {
    if (!has(key)) bad(key, "is missing");
    const json& v = obj[key];
    if (!v.is_number_integer()) bad(key, fmt::format("must be an integer, got {}", v.dump()));
    return v.get<int64_t>();
  }
  int get_i32(const char* key) const {
    const int64_t v = get_int(key);
    if (v < INT32_MIN || v > INT32_MAX) bad(key, fmt::format("= {} is out of range", v));
    return int(v);
  }
  int get_i32(const char* key, int dflt) const { return has(key) ? get_i32(key) : dflt; }
  int64_t get_i64(const char* key, int64_t dflt) const { return has(key) ? get_int(key) : dflt; }
  float get_f32(const char* key, float dflt) const {
    if (!has(key)) return dflt;
    const json& v = obj[key];
    if (!v.is_number()) bad(key, fmt::format("must be a number, got {}", v.dump()));
    return v.get<float>();
  }
  bool get_bool(const char* key, bool dflt) const {
    if (!has(key)) return dflt;
    const json& v = obj[key];
    if (!v.is_boolean()) bad(key, fmt::format("must be true or false, got {}", v.dump()));
    return v.get<bool>();
  }
  std::string get_str(const char* key, const std::string& dflt) const {
    if (!has(key)) return dflt;
    const json& v = obj[key];
    if (!v.is_string()) bad(key, fmt::format("must be a string, got {}", v.dump()));
    return v.get<std::string>();
  }
  std::vector<int> get_int_list(const char* key) const {
    if (!has(key)) bad(key, "is missing");
    const json& v = obj[key];
    if (!v.is_array()) bad(key, "must be a list of integers");
    std::vector<int> out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number_integer()) bad(fmt::format("{}[{}]", key, i), "must be an integer");
      const int64_t x = v[i].get<int64_t>();
      if (x < INT32_MIN || x > INT32_MAX) bad(fmt::format("{}[{}]", key, i), "is out of range");
      out.push_back(int(x));
    }
    return out;
  }
  Reader sub(const char* key) const {
    if (!has(key)) bad(key, "is missing");
    if (!obj[key].is_object()) bad(key, "must be an object");
    return Reader{obj[key], path + key + ".", what};
  }
};

TextConfig parse_text(const Reader& r) {
  TextConfig t;
  t.hidden_size = r.get_i32("hidden_size");
  t.num_hidden_layers = r.get_i32("num_hidden_layers");
  t.vocab_size = r.get_i32("vocab_size");
  t.max_position_embeddings = r.get_i64("max_position_embeddings", 1048576);
  t.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  t.rms_norm_eps = r.get_f32("rms_norm_eps", 1e-5f);
  t.hidden_act = r.get_str("hidden_act", "situ");
  t.situ_beta = r.get_f32("activation_situ_beta", 4.0f);
  t.situ_linear_beta = r.get_f32("activation_situ_linear_beta", 25.0f);
  t.intermediate_size = r.get_i32("intermediate_size");
  t.first_k_dense_replace = r.get_i32("first_k_dense_replace", 1);
  t.moe_layer_freq = r.get_i32("moe_layer_freq", 1);

  t.num_attention_heads = r.get_i32("num_attention_heads");
  t.num_key_value_heads = r.get_i32("num_key_value_heads", t.num_attention_heads);
  t.q_lora_rank = r.get_i32("q_lora_rank");
  t.kv_lora_rank = r.get_i32("kv_lora_rank");
  t.qk_nope_head_dim = r.get_i32("qk_nope_head_dim");
  t.qk_rope_head_dim = r.get_i32("qk_rope_head_dim");
  t.v_head_dim = r.get_i32("v_head_dim");
  t.mla_use_nope = r.get_bool("mla_use_nope", true);
  t.mla_use_output_gate = r.get_bool("mla_use_output_gate", true);
  if (r.has("qk_head_dim") && r.get_i32("qk_head_dim") != t.mla_qk_head_dim())
    r.bad("qk_head_dim", fmt::format("= {} but qk_nope_head_dim + qk_rope_head_dim = {}", r.get_i32("qk_head_dim"),
                                     t.mla_qk_head_dim()));

  t.index_n_heads = r.get_i32("index_n_heads", 0);
  t.index_head_dim = r.get_i32("index_head_dim", 0);
  t.index_topk = r.get_i32("index_topk", 0);
  t.index_rope_head_dim = r.get_i32("index_rope_head_dim", 0);
  if (r.get_bool("indexer_rope", false) && t.index_rope_head_dim == 0)
    r.bad("indexer_rope", "is true but index_rope_head_dim is not set");

  t.num_experts = r.get_i32("num_experts");
  t.num_experts_per_token = r.get_i32("num_experts_per_token");
  t.routed_expert_hidden_size = r.get_i32("routed_expert_hidden_size", t.hidden_size / 2);
  t.moe_intermediate_size = r.get_i32("moe_intermediate_size");
  t.num_shared_experts = r.get_i32("num_shared_experts", 0);
  t.shared_experts_intermediate_size = r.get_i32("shared_experts_intermediate_size", 0);
  t.latent_moe_use_norm = r.get_bool("latent_moe_use_norm", true);
  t.moe_router_activation_func = r.get_str("moe_router_activation_func", "sigmoid");
  t.moe_renormalize = r.get_bool("moe_renormalize", true);
  t.routed_scaling_factor = r.get_f32("routed_scaling_factor", 1.0f);
  t.num_expert_group = r.get_i32("num_expert_group", 1);
  t.topk_group = r.get_i32("topk_group", 1);

  t.attn_res_block_size = r.get_i32("attn_res_block_size");
  t.bos_token_id = r.get_i32("bos_token_id", -1);
  t.eos_token_id = r.get_i32("eos_token_id", -1);
  t.pad_token_id = r.get_i32("pad_token_id", -1);

  const Reader la = r.sub("linear_attn_config");
  t.kda.num_heads = la.get_i32("num_heads");
  t.kda.head_dim = la.get_i32("head_dim");
  t.kda.conv_size = la.get_i32("short_conv_kernel_size", 4);
  t.kda.use_full_rank_gate = la.get_bool("use_full_rank_gate", true);
  t.kda.gate_lower_bound = la.get_f32("gate_lower_bound", -5.0f);
  t.kda.kda_layers = la.get_int_list("kda_layers");
  t.kda.full_attn_layers = la.get_int_list("full_attn_layers");
  return t;
}

VisionConfig parse_vision(const Reader& r) {
  VisionConfig v;
  v.present = true;
  v.patch_size = r.get_i32("patch_size");
  v.init_pos_emb_height = r.get_i32("init_pos_emb_height");
  v.init_pos_emb_width = r.get_i32("init_pos_emb_width");
  v.init_pos_emb_time = r.get_i32("init_pos_emb_time", 4);
  v.num_heads = r.get_i32("vt_num_attention_heads");
  v.num_layers = r.get_i32("vt_num_hidden_layers");
  v.hidden_size = r.get_i32("vt_hidden_size");
  v.intermediate_size = r.get_i32("vt_intermediate_size");
  v.qkv_hidden_size = r.get_i32("qkv_hidden_size", v.hidden_size);
  v.text_hidden_size = r.get_i32("text_hidden_size");
  v.projector_ln_eps = r.get_f32("projector_ln_eps", 1e-5f);
  v.rms_norm_eps = r.get_f32("vt_rms_norm_eps", 1e-6f);  // §0.2
  const std::vector<int> mk = r.get_int_list("merge_kernel_size");
  if (mk.size() != 2) r.bad("merge_kernel_size", "must be a list of two integers [h, w]");
  v.merge_kernel_h = mk[0];
  v.merge_kernel_w = mk[1];
  return v;
}

QuantConfig parse_quant(const Reader& r) {
  QuantConfig q;
  q.present = true;
  q.quant_method = r.get_str("quant_method", "");
  q.format = r.get_str("format", "");
  if (r.has("config_groups")) {
    const Reader groups = r.sub("config_groups");
    for (const auto& [name, g] : groups.obj.items()) {
      if (!g.is_object()) groups.bad(name, "must be an object");
      const Reader gr{g, groups.path + name + ".", r.what};
      if (gr.has("weights")) {
        const Reader w = gr.sub("weights");
        q.num_bits = w.get_i32("num_bits", 0);
        q.group_size = w.get_i32("group_size", 0);
      }
    }
  }
  if (r.has("ignore")) {
    const json& ig = r.obj["ignore"];
    if (!ig.is_array()) r.bad("ignore", "must be a list of strings");
    for (size_t i = 0; i < ig.size(); ++i) {
      if (!ig[i].is_string()) r.bad(fmt::format("ignore[{}]", i), "must be a string");
      q.ignore.push_back(ig[i].get<std::string>());
    }
  }
  return q;
}

void finalize(TextConfig& t) {
  t.attn_kind.assign(size_t(std::max(t.num_hidden_layers, 0)), AttnKind::kda);
  t.mlp_kind.assign(size_t(std::max(t.num_hidden_layers, 0)), MlpKind::dense);
  for (int i = 0; i < t.num_hidden_layers; ++i) {
    // Lists are 1-indexed (MODEL.md §1.1): layer i is MLA iff i+1 is in full_attn_layers.
    for (int l : t.kda.full_attn_layers)
      if (l == i + 1) t.attn_kind[size_t(i)] = AttnKind::mla;
    const bool moe = i >= t.first_k_dense_replace && t.moe_layer_freq > 0 && i % t.moe_layer_freq == 0;
    t.mlp_kind[size_t(i)] = moe ? MlpKind::moe : MlpKind::dense;
  }
}

}  // namespace

int TextConfig::num_layers_of(AttnKind k) const {
  int n = 0;
  for (AttnKind a : attn_kind) n += a == k;
  return n;
}

int TextConfig::num_layers_of(MlpKind k) const {
  int n = 0;
  for (MlpKind m : mlp_kind) n += m == k;
  return n;
}

void validate(const ModelConfig& c, const std::string& what) {
  const TextConfig& t = c.text;
  auto bad = [&](const std::string& field, const std::string& why) {
    fail("{}: field 'text_config.{}' {}", what, field, why);
  };
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) bad(field, fmt::format("must be positive, got {}", v));
  };
  positive("hidden_size", t.hidden_size);
  positive("num_hidden_layers", t.num_hidden_layers);
  positive("vocab_size", t.vocab_size);
  positive("intermediate_size", t.intermediate_size);
  positive("num_attention_heads", t.num_attention_heads);
  positive("q_lora_rank", t.q_lora_rank);
  positive("kv_lora_rank", t.kv_lora_rank);
  positive("qk_nope_head_dim", t.qk_nope_head_dim);
  positive("v_head_dim", t.v_head_dim);
  if (t.qk_rope_head_dim < 0) bad("qk_rope_head_dim", "must not be negative");
  positive("num_experts", t.num_experts);
  positive("num_experts_per_token", t.num_experts_per_token);
  positive("moe_intermediate_size", t.moe_intermediate_size);
  positive("routed_expert_hidden_size", t.routed_expert_hidden_size);
  positive("attn_res_block_size", t.attn_res_block_size);
  positive("linear_attn_config.num_heads", t.kda.num_heads);
  positive("linear_attn_config.head_dim", t.kda.head_dim);
  positive("linear_attn_config.short_conv_kernel_size", t.kda.conv_size);
  if (!(t.rms_norm_eps > 0)) bad("rms_norm_eps", "must be positive");

  // Layer lists: 1-indexed, in range, every layer exactly once across the two lists.
  std::vector<int> count(size_t(t.num_hidden_layers) + 1, 0);
  auto cover = [&](const std::vector<int>& list, const char* name) {
    for (size_t i = 0; i < list.size(); ++i) {
      const int l = list[i];
      if (l < 1 || l > t.num_hidden_layers)
        bad(fmt::format("linear_attn_config.{}[{}]", name, i),
            fmt::format("= {} is outside 1..{} (the lists are 1-indexed)", l, t.num_hidden_layers));
      ++count[size_t(l)];
    }
  };
  cover(t.kda.kda_layers, "kda_layers");
  cover(t.kda.full_attn_layers, "full_attn_layers");
  for (int l = 1; l <= t.num_hidden_layers; ++l) {
    if (count[size_t(l)] == 0)
      bad("linear_attn_config", fmt::format("layer {} (1-indexed) is in neither kda_layers nor full_attn_layers", l));
    if (count[size_t(l)] > 1)
      bad("linear_attn_config", fmt::format("layer {} (1-indexed) is listed {} times across kda_layers and "
                                            "full_attn_layers; each layer must appear exactly once",
                                            l, count[size_t(l)]));
  }

  if (t.num_key_value_heads != t.num_attention_heads)
    bad("num_key_value_heads", fmt::format("= {} must equal num_attention_heads = {} for MLA", t.num_key_value_heads,
                                           t.num_attention_heads));
  if (!t.mla_use_nope) bad("mla_use_nope", "= false (rotary MLA) is not supported: K3 attention is NoPE");
  if (t.num_experts_per_token > t.num_experts)
    bad("num_experts_per_token", fmt::format("= {} exceeds num_experts = {}", t.num_experts_per_token, t.num_experts));
  if (t.num_expert_group < 1 || t.num_experts % t.num_expert_group != 0)
    bad("num_expert_group", fmt::format("= {} must divide num_experts = {}", t.num_expert_group, t.num_experts));
  if (t.topk_group < 1 || t.topk_group > t.num_expert_group)
    bad("topk_group", fmt::format("= {} must be in 1..num_expert_group = {}", t.topk_group, t.num_expert_group));
  if (t.num_expert_group != 1)
    bad("num_expert_group", "> 1 (grouped routing) is not supported; K3 uses a single group");
  if (t.routed_expert_hidden_size % 32 != 0)
    bad("routed_expert_hidden_size",
        fmt::format("= {} must be a multiple of 32 (MXFP4 blocks run along it)", t.routed_expert_hidden_size));
  if (t.moe_intermediate_size % 32 != 0)
    bad("moe_intermediate_size",
        fmt::format("= {} must be a multiple of 32 (MXFP4 blocks run along it)", t.moe_intermediate_size));
  if (t.num_shared_experts < 0) bad("num_shared_experts", "must not be negative");
  if (t.shared_experts_intermediate_size < 0 ||
      (t.shared_experts_intermediate_size > 0 && t.num_shared_experts == 0))
    bad("shared_experts_intermediate_size", "must be positive and needs num_shared_experts > 0");
  if (t.first_k_dense_replace < 0 || t.first_k_dense_replace > t.num_hidden_layers)
    bad("first_k_dense_replace", fmt::format("= {} must be in 0..num_hidden_layers", t.first_k_dense_replace));
  if (t.moe_layer_freq < 1) bad("moe_layer_freq", "must be at least 1");
  if (t.hidden_act != "situ" && t.hidden_act != "silu")
    bad("hidden_act", fmt::format("= '{}' is not supported (expected 'situ' or 'silu')", t.hidden_act));
  if (t.moe_router_activation_func != "sigmoid")
    bad("moe_router_activation_func",
        fmt::format("= '{}' is not supported (K3 routes with 'sigmoid')", t.moe_router_activation_func));
  if (!(t.kda.gate_lower_bound < 0))
    bad("linear_attn_config.gate_lower_bound", "must be negative (it bounds the log-decay)");
  if (t.has_indexer()) {
    positive("index_head_dim", t.index_head_dim);
    positive("index_topk", t.index_topk);
    if (t.index_head_dim % 32 != 0)
      bad("index_head_dim", fmt::format("= {} must be a multiple of 32 (MXFP4 index keys)", t.index_head_dim));
    if (t.index_rope_head_dim < 0 || t.index_rope_head_dim > t.index_head_dim || t.index_rope_head_dim % 2)
      bad("index_rope_head_dim", fmt::format("= {} must be even and in 0..index_head_dim", t.index_rope_head_dim));
  } else if (t.index_head_dim != 0 || t.index_topk != 0) {
    bad("index_n_heads", "is missing or 0 while index_head_dim/index_topk are set");
  }
  for (auto [name, id] : {std::pair{"bos_token_id", t.bos_token_id}, std::pair{"eos_token_id", t.eos_token_id},
                          std::pair{"pad_token_id", t.pad_token_id}}) {
    if (id >= t.vocab_size) bad(name, fmt::format("= {} is not below vocab_size = {}", id, t.vocab_size));
  }

  if (c.vision.present) {
    const VisionConfig& v = c.vision;
    auto vbad = [&](const std::string& field, const std::string& why) {
      fail("{}: field 'vision_config.{}' {}", what, field, why);
    };
    for (auto [name, val] : {std::pair{"patch_size", v.patch_size}, std::pair{"vt_num_attention_heads", v.num_heads},
                             std::pair{"vt_num_hidden_layers", v.num_layers}, std::pair{"vt_hidden_size", v.hidden_size},
                             std::pair{"vt_intermediate_size", v.intermediate_size},
                             std::pair{"qkv_hidden_size", v.qkv_hidden_size},
                             std::pair{"init_pos_emb_height", v.init_pos_emb_height},
                             std::pair{"init_pos_emb_width", v.init_pos_emb_width},
                             std::pair{"merge_kernel_size", std::min(v.merge_kernel_h, v.merge_kernel_w)}}) {
      if (val <= 0) vbad(name, fmt::format("must be positive, got {}", val));
    }
    if (v.qkv_hidden_size % v.num_heads != 0)
      vbad("qkv_hidden_size", fmt::format("= {} is not divisible by vt_num_attention_heads = {}", v.qkv_hidden_size,
                                          v.num_heads));
    if (v.text_hidden_size != t.hidden_size)
      vbad("text_hidden_size", fmt::format("= {} differs from text_config.hidden_size = {}", v.text_hidden_size,
                                           t.hidden_size));
  }
  if (c.quant.present && !c.quant.format.empty() && c.quant.format != "mxfp4-pack-quantized")
    fail("{}: field 'quantization_config.format' = '{}' is not supported (expected 'mxfp4-pack-quantized')", what,
         c.quant.format);
  if (c.quant.present && c.quant.group_size != 0 && c.quant.group_size != 32)
    fail("{}: field 'quantization_config.config_groups.*.weights.group_size' = {} is not supported (MXFP4 uses 32)",
         what, c.quant.group_size);
}

ModelConfig parse_config(const json& j, const std::string& what) {
  if (!j.is_object()) fail("{}: config is not a JSON object", what);
  ModelConfig c;
  const Reader top{j, "", what};
  c.model_type = top.get_str("model_type", "");
  c.media_placeholder_token_id = top.get_i32("media_placeholder_token_id", -1);
  if (top.has("text_config")) {
    c.text = parse_text(top.sub("text_config"));
  } else {
    c.text = parse_text(top);  // bare kimi_linear text config
  }
  if (top.has("vision_config")) c.vision = parse_vision(top.sub("vision_config"));
  if (top.has("quantization_config")) {
    c.quant = parse_quant(top.sub("quantization_config"));
  } else if (top.has("text_config") && top.sub("text_config").has("quantization_config")) {
    c.quant = parse_quant(top.sub("text_config").sub("quantization_config"));
  }
  finalize(c.text);
  validate(c, what);
  return c;
}

ModelConfig load_config(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  std::ifstream in(p);
  if (!in) fail("{}: cannot read config", p.string());
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", p.string(), e.what());
  }
  return parse_config(j, p.string());
}

}  // namespace kestrel
