// config.json parsing, validation and parameter accounting.
//
// The full K3.1 Pro config (tests/data/k31_pro_config.json, transcribed by hand from MODEL.md §1)
// is checked against a parameter count written out here from the tensor table of MODEL.md §2,
// independently of the loader's tensor list.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "loader/config.h"
#include "loader/inventory.h"
#include "loader/weights.h"

namespace kestrel {
namespace {
using nlohmann::json;

json full_config_json() {
  std::ifstream in(std::string(KESTREL_SOURCE_DIR) + "/tests/data/k31_pro_config.json");
  return json::parse(in);
}

// Expects parse_config to throw an Error whose message contains every fragment.
void expect_rejected(const json& j, std::initializer_list<const char*> fragments) {
  try {
    parse_config(j, "cfg.json");
    FAIL() << "config was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const char* f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg << "\nwant: " << f;
    EXPECT_EQ(msg.rfind("cfg.json", 0), 0u) << "message names the file: " << msg;
  }
}

TEST(Config, FullK31ProLayerPattern) {
  const ModelConfig c = parse_config(full_config_json(), "full");
  const TextConfig& t = c.text;
  EXPECT_EQ(t.num_hidden_layers, 93);
  EXPECT_EQ(t.num_layers_of(AttnKind::mla), 24);
  EXPECT_EQ(t.num_layers_of(AttnKind::kda), 69);
  for (int i = 0; i < 93; ++i) {
    const bool mla = (i % 4 == 3) || i == 92;  // 0-indexed MLA = {3,7,...,91} U {92}
    EXPECT_EQ(t.attn_kind[size_t(i)] == AttnKind::mla, mla) << "layer " << i;
    EXPECT_EQ(t.mlp_kind[size_t(i)] == MlpKind::moe, i >= 1) << "layer " << i;
  }
  EXPECT_EQ(t.num_attn_res_blocks(), 8);
  EXPECT_EQ(t.kda.a_log_len(), 128);
  EXPECT_EQ(t.mla_cache_width(), 576);
  EXPECT_TRUE(t.has_indexer());
  EXPECT_TRUE(c.vision.present);
  EXPECT_EQ(c.quant.group_size, 32);
}

TEST(Config, FullK31ProParameterCountMatchesIndependentFormula) {
  const ModelConfig c = parse_config(full_config_json(), "full");
  const Inventory inv = take_inventory(c);
  // MODEL.md §2, written out by hand.
  const int64_t D = 7168, V = 163840;
  const int64_t kda = 4 * 12288 * D + 3 * 12288 * 4 + 128 * D + 12288 * 128 + 96 * D + 128 + 12288 + 128 + D * 12288;
  const int64_t mla = 1536 * D + 1536 + 18432 * 1536 + 576 * D + 512 + 24576 * 512 + 12288 * D + D * 12288;
  const int64_t indexer = 4096 * 1536 + 128 * D + 128 + 128 + 32 * D;
  const int64_t norms_per_layer = 4 * D + 2 * D;
  const int64_t dense = 3 * 33792 * D;
  const int64_t expert = 2 * 3072 * 3584 + 3584 * 3072;
  const int64_t moe_fixed = 896 * D + 896 + 3584 * D + 3584 + D * 3584 + 3 * 6144 * D;
  const int64_t vision = 1024 * 3 * 14 * 14 + 64 * 64 * 1024 +
                         27 * (2 * 1024 + 4608 * 1024 + 1024 * 1536 + 4096 * 1024 + 1024 * 4096) + 1024;
  const int64_t projector = 4096 * 4096 + 7168 * 4096 + 7168;
  const int64_t text_total = 2 * V * D + 3 * D + 93 * norms_per_layer + 69 * kda + 24 * (mla + indexer) + dense +
                             92 * (moe_fixed + 896 * expert);
  EXPECT_EQ(inv.total_params, text_total + vision + projector);
  const int64_t active = text_total - V * D - 92 * 880 * expert;  // minus embedding, 880 idle experts
  EXPECT_EQ(inv.active_params, active);
  // The launch's headline numbers: ~2.8T total, ~104B active.
  EXPECT_NEAR(double(inv.total_params) / 1e12, 2.8, 0.05);
  EXPECT_NEAR(double(inv.active_params) / 1e9, 104.0, 1.0);
  // K3 ships 497,220 tensors; K3.1 adds 5 indexer tensors on each of 24 MLA layers.
  EXPECT_EQ(inv.num_tensors, 497220 + 24 * 5);
  EXPECT_EQ(inv.bytes_by_dtype.at("MXFP4"), 92 * 896 * int64_t(17547264));  // MODEL.md §2: one expert = 17,547,264 B
  EXPECT_EQ(kda_state_bytes_per_request(c.text), 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2));
}

TEST(Config, BareTextConfigIsAccepted) {
  const json j = full_config_json()["text_config"];
  const ModelConfig c = parse_config(j, "text.json");
  EXPECT_EQ(c.text.hidden_size, 7168);
  EXPECT_FALSE(c.vision.present);
}

TEST(Config, K3WithoutIndexerHasNoIndexerTensors) {
  json j = full_config_json();
  for (const char* k : {"index_n_heads", "index_head_dim", "index_topk"}) j["text_config"].erase(k);
  const ModelConfig c = parse_config(j, "k3.json");
  EXPECT_FALSE(c.text.has_indexer());
  EXPECT_EQ(take_inventory(c).num_tensors, 497220);
}

TEST(ConfigRejects, LayerListsMustCoverEveryLayerOnce) {
  json j = full_config_json();
  auto& la = j["text_config"]["linear_attn_config"];
  la["kda_layers"].erase(la["kda_layers"].begin());  // layer 1 now in neither list
  expect_rejected(j, {"text_config.linear_attn_config", "layer 1 (1-indexed) is in neither"});

  j = full_config_json();
  j["text_config"]["linear_attn_config"]["kda_layers"].push_back(4);  // also in full_attn_layers
  expect_rejected(j, {"layer 4 (1-indexed) is listed 2 times"});

  j = full_config_json();
  j["text_config"]["linear_attn_config"]["full_attn_layers"].push_back(94);
  expect_rejected(j, {"full_attn_layers[", "= 94 is outside 1..93"});

  j = full_config_json();
  j["text_config"]["linear_attn_config"]["kda_layers"][0] = 0;  // 0-indexed by mistake
  expect_rejected(j, {"kda_layers[0]", "1-indexed"});
}

TEST(ConfigRejects, TopKLargerThanExperts) {
  json j = full_config_json();
  j["text_config"]["num_experts_per_token"] = 1000;
  expect_rejected(j, {"text_config.num_experts_per_token", "exceeds num_experts = 896"});
}

TEST(ConfigRejects, MlaWidths) {
  json j = full_config_json();
  j["text_config"]["qk_head_dim"] = 128;  // nope 128 + rope 64 = 192
  expect_rejected(j, {"text_config.qk_head_dim", "qk_nope_head_dim + qk_rope_head_dim = 192"});
  j = full_config_json();
  j["text_config"]["num_key_value_heads"] = 8;
  expect_rejected(j, {"text_config.num_key_value_heads", "must equal num_attention_heads"});
  j = full_config_json();
  j["text_config"]["mla_use_nope"] = false;
  expect_rejected(j, {"text_config.mla_use_nope"});
}

TEST(ConfigRejects, FieldTypesAndPresence) {
  json j = full_config_json();
  j["text_config"].erase("hidden_size");
  expect_rejected(j, {"text_config.hidden_size", "is missing"});
  j = full_config_json();
  j["text_config"]["hidden_size"] = "7168";
  expect_rejected(j, {"text_config.hidden_size", "must be an integer"});
  j = full_config_json();
  j["text_config"]["vocab_size"] = -5;
  expect_rejected(j, {"text_config.vocab_size", "must be positive"});
  j = full_config_json();
  j["text_config"]["linear_attn_config"] = 3;
  expect_rejected(j, {"text_config.linear_attn_config", "must be an object"});
  j = full_config_json();
  j["text_config"]["linear_attn_config"]["kda_layers"] = {1, "two"};
  expect_rejected(j, {"text_config.linear_attn_config.kda_layers[1]", "must be an integer"});
  j = full_config_json();
  j["text_config"]["hidden_size"] = 1e20;
  expect_rejected(j, {"text_config.hidden_size"});
}

TEST(ConfigRejects, MoeAndIndexerShapes) {
  json j = full_config_json();
  j["text_config"]["moe_intermediate_size"] = 3000;
  expect_rejected(j, {"text_config.moe_intermediate_size", "multiple of 32"});
  j = full_config_json();
  j["text_config"]["index_head_dim"] = 100;
  expect_rejected(j, {"text_config.index_head_dim", "multiple of 32"});
  j = full_config_json();
  j["text_config"]["moe_router_activation_func"] = "softmax";
  expect_rejected(j, {"moe_router_activation_func", "sigmoid"});
  j = full_config_json();
  j["text_config"]["eos_token_id"] = 200000;
  expect_rejected(j, {"text_config.eos_token_id", "vocab_size"});
  j = full_config_json();
  j["vision_config"]["text_hidden_size"] = 4096;
  expect_rejected(j, {"vision_config.text_hidden_size"});
  j = full_config_json();
  j["quantization_config"]["format"] = "nvfp4-pack-quantized";
  expect_rejected(j, {"quantization_config.format"});
}

TEST(ConfigRejects, NotAnObject) {
  expect_rejected(json::array({1, 2}), {"not a JSON object"});
}

TEST(Weights, ExpectedTensorNamesFollowModelMd) {
  const ModelConfig c = parse_config(full_config_json(), "full");
  const std::vector<TensorSpec> specs = expected_tensors(c);
  auto find = [&](const std::string& n) -> const TensorSpec* {
    for (const auto& s : specs)
      if (s.name == n) return &s;
    return nullptr;
  };
  const TensorSpec* s = find("language_model.model.layers.0.self_attn.A_log");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dtype, DType::f32);
  EXPECT_EQ(s->shape, (Shape{128}));
  s = find("language_model.model.layers.5.block_sparse_moe.experts.895.w2.weight_scale");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->shape, (Shape{3584, 96}));
  s = find("language_model.model.layers.3.self_attn.indexer.wq_b.weight");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->shape, (Shape{4096, 1536}));
  s = find("language_model.model.layers.92.self_attn.kv_b_proj.weight");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->shape, (Shape{24576, 512}));
  EXPECT_EQ(find("language_model.model.layers.0.block_sparse_moe.gate.weight"), nullptr) << "layer 0 is dense";
  EXPECT_NE(find("language_model.model.layers.0.mlp.down_proj.weight"), nullptr);
  EXPECT_NE(find("mm_projector.proj.2.weight"), nullptr);
}

}  // namespace
}  // namespace kestrel
