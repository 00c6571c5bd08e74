// DSpark draft config.json reader and weight binding (see dspark.h).
#include "loader/dspark.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"
#include "loader/safetensors.h"

namespace kestrel {
using nlohmann::json;

namespace {

struct Field {
  const json& obj;
  std::string path;
  const std::string& what;

  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    fail("{}: field '{}{}' {}", what, path, key, why);
  }
  bool has(const char* k) const { return obj.contains(k) && !obj[k].is_null(); }
  int i32(const char* k) const {
    if (!has(k)) bad(k, "is missing");
    if (!obj[k].is_number_integer()) bad(k, fmt::format("must be an integer, got {}", obj[k].dump()));
    const int64_t v = obj[k].get<int64_t>();
    if (v < 0 || v > INT32_MAX) bad(k, fmt::format("= {} is out of range", v));
    return int(v);
  }
  int i32(const char* k, int d) const { return has(k) ? i32(k) : d; }
  float f32(const char* k, float d) const {
    if (!has(k)) return d;
    if (!obj[k].is_number()) bad(k, fmt::format("must be a number, got {}", obj[k].dump()));
    return obj[k].get<float>();
  }
  bool boolean(const char* k, bool d) const {
    if (!has(k)) return d;
    if (!obj[k].is_boolean()) bad(k, fmt::format("must be true or false, got {}", obj[k].dump()));
    return obj[k].get<bool>();
  }
  std::string str(const char* k, const std::string& d) const {
    if (!has(k)) return d;
    if (!obj[k].is_string()) bad(k, fmt::format("must be a string, got {}", obj[k].dump()));
    return obj[k].get<std::string>();
  }
};

}  // namespace

TextConfig DraftConfig::mla_text_config() const {
  TextConfig t;
  t.hidden_size = hidden_size;
  t.vocab_size = vocab_size;
  t.rms_norm_eps = rms_norm_eps;
  t.num_attention_heads = t.num_key_value_heads = num_attention_heads;
  t.q_lora_rank = q_lora_rank;
  t.kv_lora_rank = kv_lora_rank;
  t.qk_nope_head_dim = qk_nope_head_dim;
  t.qk_rope_head_dim = qk_rope_head_dim;
  t.v_head_dim = v_head_dim;
  t.mla_use_nope = false;
  t.mla_use_output_gate = false;
  return t;
}

DraftConfig parse_draft_config(const json& j, const std::string& what, const ModelConfig& target) {
  if (!j.is_object()) fail("{}: draft config must be a JSON object", what);
  const Field r{j, "", what};
  if (r.str("model_type", "") != "k3_dspark")
    r.bad("model_type", fmt::format("must be \"k3_dspark\", got {}", j.contains("model_type") ? j["model_type"].dump() : "nothing"));
  DraftConfig c;
  c.hidden_size = r.i32("hidden_size");
  c.intermediate_size = r.i32("intermediate_size");
  c.num_hidden_layers = r.i32("num_hidden_layers");
  c.num_attention_heads = r.i32("num_attention_heads");
  c.q_lora_rank = r.i32("q_lora_rank");
  c.kv_lora_rank = r.i32("kv_lora_rank");
  c.qk_nope_head_dim = r.i32("qk_nope_head_dim");
  c.qk_rope_head_dim = r.i32("qk_rope_head_dim");
  c.v_head_dim = r.i32("v_head_dim");
  c.vocab_size = r.i32("vocab_size");
  c.rms_norm_eps = r.f32("rms_norm_eps", 1e-5f);
  c.hidden_act = r.str("hidden_act", "silu");
  c.target_hidden_size = r.i32("target_hidden_size", c.hidden_size);
  c.mask_token_id = r.i32("mask_token_id");
  c.markov_rank = r.i32("markov_rank");
  c.block_size = r.i32("num_speculative_tokens", 7);
  c.has_confidence_head = r.boolean("enable_confidence_head", false);
  c.rope.theta = r.f32("rope_theta", 50000.0f);
  if (r.has("rope_scaling")) {
    if (!j["rope_scaling"].is_object()) r.bad("rope_scaling", "must be an object");
    const Field s{j["rope_scaling"], "rope_scaling.", what};
    const std::string type = s.has("type") ? s.str("type", "") : s.str("rope_type", "");
    if (type != "yarn") s.bad("type", fmt::format("'{}' is not supported (only \"yarn\", MODEL.md §5)", type));
    c.rope.yarn = true;
    c.rope.factor = s.f32("factor", 1.0f);
    c.rope.original_max_position_embeddings = s.i32("original_max_position_embeddings");
    c.rope.beta_fast = s.f32("beta_fast", 32.0f);
    c.rope.beta_slow = s.f32("beta_slow", 1.0f);
    c.rope.mscale = s.f32("mscale", 1.0f);
    c.rope.mscale_all_dim = s.f32("mscale_all_dim", 0.0f);
    if (!(c.rope.factor >= 1.0f)) s.bad("factor", "must be >= 1");
  }
  if (!r.has("target_layer_ids") || !j["target_layer_ids"].is_array()) r.bad("target_layer_ids", "must be a list of layer ids");
  for (size_t i = 0; i < j["target_layer_ids"].size(); ++i) {
    const json& v = j["target_layer_ids"][i];
    if (!v.is_number_integer()) r.bad(fmt::format("target_layer_ids[{}]", i), "must be an integer");
    const int64_t L = v.get<int64_t>();
    if (L < 0 || L >= target.text.num_hidden_layers)
      r.bad(fmt::format("target_layer_ids[{}]", i),
            fmt::format("= {} is not a layer of the target (0..{})", L, target.text.num_hidden_layers - 1));
    c.target_layer_ids.push_back(int(L));
  }
  if (c.target_layer_ids.empty()) r.bad("target_layer_ids", "is empty");
  if (r.has("num_target_layers") && r.i32("num_target_layers") != c.num_taps())
    r.bad("num_target_layers", fmt::format("= {} but target_layer_ids lists {}", r.i32("num_target_layers"), c.num_taps()));
  if (r.boolean("mla_use_output_gate", false)) r.bad("mla_use_output_gate", "must be false for a draft (MODEL.md §5)");
  if (r.boolean("mla_use_nope", false)) r.bad("mla_use_nope", "must be false for a draft (the draft uses RoPE)");
  if (c.hidden_act != "silu") r.bad("hidden_act", fmt::format("'{}' is not supported (drafts use silu, MODEL.md §5)", c.hidden_act));
  for (auto [name, v] : {std::pair{"hidden_size", c.hidden_size}, {"num_hidden_layers", c.num_hidden_layers},
                         {"num_attention_heads", c.num_attention_heads}, {"q_lora_rank", c.q_lora_rank},
                         {"kv_lora_rank", c.kv_lora_rank}, {"qk_rope_head_dim", c.qk_rope_head_dim},
                         {"v_head_dim", c.v_head_dim}, {"markov_rank", c.markov_rank},
                         {"intermediate_size", c.intermediate_size}})
    if (v <= 0) r.bad(name, "must be positive");
  if (c.qk_rope_head_dim % 2) r.bad("qk_rope_head_dim", "must be even (RoPE pairs)");
  if (c.block_size < 1 || c.block_size > 64) r.bad("num_speculative_tokens", "must be in 1..64");
  const TextConfig& t = target.text;
  if (c.hidden_size != t.hidden_size)
    r.bad("hidden_size", fmt::format("= {} differs from the target's {} (embedding and lm_head are shared)", c.hidden_size, t.hidden_size));
  if (c.vocab_size != t.vocab_size) r.bad("vocab_size", fmt::format("= {} differs from the target's {}", c.vocab_size, t.vocab_size));
  if (c.target_hidden_size != t.hidden_size)
    r.bad("target_hidden_size", fmt::format("= {} differs from the target's hidden_size {}", c.target_hidden_size, t.hidden_size));
  if (c.mask_token_id >= c.vocab_size) r.bad("mask_token_id", fmt::format("= {} is outside the vocabulary", c.mask_token_id));
  return c;
}

DraftConfig load_draft_config(const std::string& path, const ModelConfig& target) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  std::ifstream f(p);
  if (!f) fail("cannot open draft config {}", p.string());
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", p.string(), e.what());
  }
  return parse_draft_config(j, p.string(), target);
}

DraftWeights bind_draft_weights(const DraftConfig& c, const Checkpoint& ckpt) {
  DraftWeights w;
  struct Want {
    std::string name;
    DType dt;
    Shape shape;
    TensorView* dest;
    bool optional;
  };
  std::vector<Want> want;
  const int64_t D = c.hidden_size, F = c.intermediate_size, Hm = c.num_attention_heads, Q = c.q_lora_rank,
                C = c.kv_lora_rank, N = c.qk_nope_head_dim, R = c.qk_rope_head_dim, Dv = c.v_head_dim,
                V = c.vocab_size, r = c.markov_rank;
  auto add = [&](std::string n, DType dt, Shape s, TensorView* d, bool opt = false) {
    want.push_back({std::move(n), dt, s, d, opt});
  };
  add("context_proj.weight", DType::bf16, {D, c.tap_width()}, &w.context_proj);
  add("context_norm.weight", DType::bf16, {D}, &w.context_norm);
  w.layers.resize(size_t(c.num_hidden_layers));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    DraftLayerWeights& L = w.layers[size_t(l)];
    const std::string P = fmt::format("layers.{}.", l), A = P + "self_attn.";
    add(P + "input_layernorm.weight", DType::bf16, {D}, &L.input_norm);
    add(P + "post_attention_layernorm.weight", DType::bf16, {D}, &L.post_attn_norm);
    add(A + "q_a_proj.weight", DType::bf16, {Q, D}, &L.q_a_proj);
    add(A + "q_a_layernorm.weight", DType::bf16, {Q}, &L.q_a_norm);
    add(A + "q_b_proj.weight", DType::bf16, {Hm * (N + R), Q}, &L.q_b_proj);
    add(A + "kv_a_proj_with_mqa.weight", DType::bf16, {C + R, D}, &L.kv_a_proj);
    add(A + "kv_a_layernorm.weight", DType::bf16, {C}, &L.kv_a_norm);
    add(A + "kv_b_proj.weight", DType::bf16, {Hm * (N + Dv), C}, &L.kv_b_proj);
    add(A + "o_proj.weight", DType::bf16, {D, Hm * Dv}, &L.o_proj);
    add(P + "mlp.gate_proj.weight", DType::bf16, {F, D}, &L.gate_proj);
    add(P + "mlp.up_proj.weight", DType::bf16, {F, D}, &L.up_proj);
    add(P + "mlp.down_proj.weight", DType::bf16, {D, F}, &L.down_proj);
  }
  add("norm.weight", DType::bf16, {D}, &w.final_norm);
  add("markov_w1.weight", DType::bf16, {V, r}, &w.markov_w1);
  add("markov_w2.weight", DType::bf16, {V, r}, &w.markov_w2);
  add("confidence_head.proj.weight", DType::f32, {1, D + r}, &w.confidence_w, true);
  add("confidence_head.proj.bias", DType::f32, {1}, &w.confidence_b, true);

  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const Want& x : want) {
    expected.insert(x.name);
    const Checkpoint::Entry* e = ckpt.find(x.name);
    if (!e) {
      if (!x.optional) problems.push_back(fmt::format("missing tensor '{}' (expected {} {})", x.name,
                                                      dtype_safetensors_name(x.dt), x.shape.str()));
      continue;
    }
    if (e->info->dtype != x.dt || !(e->info->shape == x.shape)) {
      problems.push_back(fmt::format("tensor '{}' is {} {}, expected {} {}", x.name, dtype_safetensors_name(e->info->dtype),
                                     e->info->shape.str(), dtype_safetensors_name(x.dt), x.shape.str()));
      continue;
    }
    *x.dest = ckpt.view(*e);
  }
  for (const auto& [name, entry] : ckpt.tensors())
    if (!expected.count(name)) problems.push_back(fmt::format("unexpected tensor '{}' not implied by the draft config", name));
  if (!problems.empty()) {
    std::string msg = fmt::format("{}: draft checkpoint does not match its config ({} problem{}):", ckpt.dir(),
                                  problems.size(), problems.size() == 1 ? "" : "s");
    for (size_t i = 0; i < std::min<size_t>(problems.size(), 40); ++i) msg += "\n  - " + problems[i];
    throw Error(msg);
  }
  return w;
}

}  // namespace kestrel
