// Shard binding (loader/shard.h): for every tensor of two nano checkpoints, every rank of TP2, TP4, EP2
// and EP4 binds exactly the slice docs/parallel.md prescribes, as a view into the mapped file (no copy).
//
// The expected slice of each tensor is written here from the model's dimensions (heads x head width,
// vocabulary, widths, experts), by tensor kind, not from the stored shape: e.g. rank r of N holds
// KDA q_proj rows [r·(H/N)·Dk, (r+1)·(H/N)·Dk). Every element of the rank's view is compared with the
// element of the whole tensor (bind_weights) it must be, walking the view through its strides; a
// tensor whose kind the table does not know fails the test, so new tensors cannot slip through.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "core/check.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/shard.h"
#include "loader/weights.h"

namespace kestrel {
namespace {

// The fixture makes nano and nano_tp side by side; KESTREL_NANO_TP_DIR may point elsewhere.
std::string dir_of(const char* var) {
  if (const char* d = std::getenv(var)) return d;
  const char* nano = std::getenv("KESTREL_NANO_DIR");
  if (!nano) throw std::runtime_error(std::string(var) + " is not set (the ctest fixtures make the checkpoints)");
  if (std::string(var) == "KESTREL_NANO_TP_DIR") return (std::filesystem::path(nano).parent_path() / "nano_tp").string();
  throw std::runtime_error(std::string(var) + " is not set");
}

// Expected piece of one tensor on rank r of n: which dimension, [begin, end), or whole / absent.
struct Want {
  int dim = -1;
  int64_t begin = 0, end = 0;
  bool absent = false;
  std::string kind;  // for coverage
};

bool ends(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}
bool has(const std::string& s, const std::string& x) { return s.find(x) != std::string::npos; }

Want expected(const std::string& name, const TextConfig& t, int n, int r, bool ep) {
  auto rows = [&](int64_t unit, const char* kind) { return Want{0, unit * r, unit * (r + 1), false, kind}; };
  auto cols = [&](int64_t unit, const char* kind) { return Want{1, unit * r, unit * (r + 1), false, kind}; };
  auto whole = [&](const char* kind) { return Want{-1, 0, 0, false, kind}; };
  const int64_t Hk = t.kda.num_heads / n, Dk = t.kda.head_dim;        // KDA heads per rank
  const int64_t Hm = t.num_attention_heads / n;                          // MLA heads per rank
  const int64_t Hi = t.index_n_heads / n, Di = t.index_head_dim;         // indexer heads per rank
  const int64_t Xr = t.num_experts / n, Ir = t.moe_intermediate_size / n, Lr = t.routed_expert_hidden_size / n;
  if (has(name, "vision_tower.") || has(name, "mm_projector.")) return whole("vision");
  if (ends(name, "embed_tokens.weight") || ends(name, "lm_head.weight")) return rows(t.vocab_size / n, "vocab");
  if (ends(name, "layernorm.weight") && !has(name, "self_attn.")) return whole("norm");
  if (ends(name, "_res_norm.weight") || ends(name, "_res_proj.weight") || ends(name, "model.norm.weight"))
    return whole("norm");
  if (has(name, ".self_attn.indexer.")) {
    if (ends(name, "wq_b.weight")) return rows(Hi * Di, "indexer heads (rows)");
    if (ends(name, "weights_proj.weight")) return rows(Hi, "indexer head weights (rows)");
    return whole("indexer key (whole)");  // wk, k_norm
  }
  if (has(name, ".self_attn.")) {
    const int L = std::stoi(name.substr(name.find("layers.") + 7));
    if (t.attn_kind[size_t(L)] == AttnKind::mla) {
      if (has(name, "q_a_proj") || has(name, "q_a_layernorm") || has(name, "kv_a_")) return whole("MLA down-projections");
      if (ends(name, "q_b_proj.weight")) return rows(Hm * (t.qk_nope_head_dim + t.qk_rope_head_dim), "MLA heads (rows)");
      if (ends(name, "kv_b_proj.weight")) return rows(Hm * (t.qk_nope_head_dim + t.v_head_dim), "MLA heads (rows)");
      if (ends(name, "g_proj.weight")) return rows(Hm * t.v_head_dim, "MLA gate (rows)");
      if (ends(name, "o_proj.weight")) return cols(Hm * t.v_head_dim, "o_proj (cols)");
      return Want{-2, 0, 0, false, "UNKNOWN"};
    }
    if (ends(name, "A_log")) return rows(Hk, "KDA A_log (first H)");
    if (ends(name, "f_a_proj.weight") || ends(name, "o_norm.weight")) return whole("KDA shared");
    if (ends(name, ".b_proj.weight")) return rows(Hk, "KDA beta (rows)");
    if (ends(name, "o_proj.weight")) return cols(Hk * Dk, "o_proj (cols)");
    return rows(Hk * Dk, "KDA heads (rows)");  // q/k/v/g_proj, conv weights, f_b_proj, dt_bias
  }
  if (has(name, ".mlp.") || has(name, ".shared_experts.")) {
    const int64_t F = (has(name, ".mlp.") ? t.intermediate_size : t.shared_intermediate()) / n;
    return ends(name, "down_proj.weight") ? cols(F, "MLP down (cols)") : rows(F, "MLP gate/up (rows)");
  }
  if (ends(name, "gate.weight") || ends(name, "e_score_correction_bias")) return rows(Xr, "router (rows)");
  if (ends(name, "routed_expert_down_proj.weight") || ends(name, "routed_expert_norm.weight"))
    return rows(Lr, "latent down/norm (rows)");
  if (ends(name, "routed_expert_up_proj.weight")) return cols(Lr, "latent up (cols)");
  if (has(name, ".experts.")) {
    const size_t at = name.find(".experts.") + 9;
    const int64_t e = std::stoll(name.substr(at));
    if (ep) return e / Xr == r ? whole("expert (EP, own)") : Want{-1, 0, 0, true, "expert (EP, other)"};
    const bool packed = ends(name, "weight_packed");
    if (has(name, ".w2.")) return cols(packed ? Ir / 2 : Ir / 32, "expert w2 (cols)");
    return rows(Ir, "expert w1/w3 (rows)");
  }
  return Want{-2, 0, 0, false, "UNKNOWN"};
}

// Compares every element of `part` with the element of `full` it must hold (offset `begin` along `dim`),
// one innermost row at a time (views keep a unit stride in the last dimension).
::testing::AssertionResult same_elements(const TensorView& full, const TensorView& part, int dim, int64_t begin) {
  const size_t esz = dtype_size(full.dtype);
  const int rank = full.shape.rank;
  const int64_t run = part.shape[rank - 1];
  if (part.stride[size_t(rank - 1)] != 1) return ::testing::AssertionFailure() << "last dimension is not contiguous";
  const int64_t rows = run == 0 ? 0 : part.numel() / run;
  std::array<int64_t, kMaxDims> idx{};
  for (int64_t k = 0; k < rows; ++k) {
    int64_t rem = k, poff = 0, foff = 0;
    for (int d = rank - 2; d >= 0; --d) {
      idx[size_t(d)] = rem % part.shape[d];
      rem /= part.shape[d];
    }
    idx[size_t(rank - 1)] = 0;
    for (int d = 0; d < rank; ++d) {
      poff += idx[size_t(d)] * part.stride[size_t(d)];
      foff += (idx[size_t(d)] + (d == dim ? begin : 0)) * full.stride[size_t(d)];
    }
    if (std::memcmp(static_cast<const uint8_t*>(part.data) + poff * esz,
                    static_cast<const uint8_t*>(full.data) + foff * esz, size_t(run) * esz) != 0)
      return ::testing::AssertionFailure() << "row " << k << " differs";
  }
  return ::testing::AssertionSuccess();
}

// Pointers to the views of every tensor of w, by name.
std::map<std::string, TensorView*> views(const ModelConfig& c, ModelWeights* w) {
  std::map<std::string, TensorView*> out;
  for_each_tensor(c, w, [&](TensorSpec& s) { out[s.name] = s.dest; });
  return out;
}

void check_layout_binding(const std::string& dir, int n, bool ep, std::set<std::string>* kinds) {
  const ModelConfig c = load_config(dir);
  const Checkpoint ckpt(dir);
  ModelWeights full = bind_weights(c, ckpt);
  const auto fv = views(c, &full);
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE(fmt::format("{} rank {} of {}{}", dir, r, n, ep ? " (EP)" : ""));
    ModelWeights w = bind_shard(c, ckpt, ParallelLayout{n, r, ep, 1});
    const auto rv = views(c, &w);
    ASSERT_EQ(rv.size(), fv.size());
    for (const auto& [name, fp] : fv) {
      const TensorView& f = *fp;
      const TensorView& v = *rv.at(name);
      if (f.empty()) continue;  // an optional tensor this checkpoint does not carry
      const Want want = expected(name, c.text, n, r, ep);
      ASSERT_NE(want.dim, -2) << "no expectation for " << name;
      kinds->insert(want.kind);
      if (want.absent) {
        EXPECT_TRUE(v.empty()) << name << " is bound on a rank that does not own it";
        continue;
      }
      ASSERT_FALSE(v.empty()) << name;
      EXPECT_EQ(v.dtype, f.dtype) << name;
      Shape s = f.shape;
      if (want.dim >= 0) s.d[size_t(want.dim)] = want.end - want.begin;
      EXPECT_EQ(v.shape, s) << name << ": " << v.shape.str() << " vs expected " << s.str();
      // Zero copy: the view lies inside the whole tensor's bytes in the mapping.
      const auto* lo = static_cast<const uint8_t*>(f.data);
      const auto* p = static_cast<const uint8_t*>(v.data);
      EXPECT_TRUE(p >= lo && p < lo + f.nbytes()) << name << " is not a view into the mapped tensor";
      EXPECT_TRUE(same_elements(f, v, want.dim, want.begin)) << name;
    }
    if (c.text.tie_word_embeddings) {
      EXPECT_EQ(w.lm_head.data, w.embed.data);
    }
  }
}

TEST(ShardLoader, EveryRankBindsItsSliceOfEveryTensor) {
  std::set<std::string> kinds;
  check_layout_binding(dir_of("KESTREL_NANO_DIR"), 2, false, &kinds);
  check_layout_binding(dir_of("KESTREL_NANO_DIR"), 2, true, &kinds);
  check_layout_binding(dir_of("KESTREL_NANO_TP_DIR"), 2, false, &kinds);
  check_layout_binding(dir_of("KESTREL_NANO_TP_DIR"), 4, false, &kinds);
  check_layout_binding(dir_of("KESTREL_NANO_TP_DIR"), 4, true, &kinds);
  // Every kind of rule was exercised.
  for (const char* k : {"vision", "vocab", "norm", "indexer heads (rows)", "indexer head weights (rows)",
                        "indexer key (whole)", "o_proj (cols)", "MLA down-projections", "MLA heads (rows)",
                        "MLA gate (rows)", "KDA A_log (first H)", "KDA shared", "KDA beta (rows)", "KDA heads (rows)",
                        "MLP down (cols)", "MLP gate/up (rows)", "router (rows)", "latent down/norm (rows)",
                        "latent up (cols)", "expert (EP, own)", "expert (EP, other)", "expert w2 (cols)",
                        "expert w1/w3 (rows)"})
    EXPECT_TRUE(kinds.count(k)) << "no tensor of kind " << k;
}

TEST(ShardLoader, TrivialLayoutIsTheWholeCheckpoint) {
  const std::string dir = dir_of("KESTREL_NANO_DIR");
  const ModelConfig c = load_config(dir);
  const Checkpoint ckpt(dir);
  ModelWeights a = bind_weights(c, ckpt), b = bind_shard(c, ckpt, ParallelLayout{});
  const auto va = views(c, &a), vb = views(c, &b);
  for (const auto& [name, p] : va) {
    EXPECT_EQ(p->data, vb.at(name)->data) << name;
    EXPECT_EQ(p->shape, vb.at(name)->shape) << name;
  }
}

std::string layout_error(const std::string& dir, ParallelLayout p) {
  const ModelConfig c = load_config(dir);
  const Checkpoint ckpt(dir);
  try {
    bind_shard(c, ckpt, p);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ShardLoader, CountsThatDoNotDivideGiveOneErrorListingAll) {
  const std::string nano = dir_of("KESTREL_NANO_DIR");
  // nano: 2 indexer heads, expert intermediate 64 (16 columns per rank at TP4 cut an MXFP4 block).
  std::string e = layout_error(nano, {4, 0, false, 1});
  EXPECT_NE(e.find("cannot run this model as TP4 (2 problems)"), std::string::npos) << e;
  EXPECT_NE(e.find("index_n_heads = 2 (indexer heads)"), std::string::npos) << e;
  EXPECT_NE(e.find("moe_intermediate_size = 64 split 4 ways gives 16"), std::string::npos) << e;
  // Whole experts per rank lift the MXFP4 constraint, not the indexer one.
  e = layout_error(nano, {4, 1, true, 1});
  EXPECT_NE(e.find("TP4+EP4 (1 problem)"), std::string::npos) << e;
  // TP3: no count of nano divides by 3, and every one is listed in the one error.
  e = layout_error(nano, {3, 0, false, 1});
  for (const char* f : {"KDA heads", "MLA heads", "indexer heads", "vocabulary", "dense MLP width", "router rows",
                        "latent width", "shared-expert width", "expert intermediate width"})
    EXPECT_NE(e.find(f), std::string::npos) << f << " missing in: " << e;
  e = layout_error(nano, {2, 2, false, 1});
  EXPECT_NE(e.find("rank 2 is outside [0, 2)"), std::string::npos) << e;
  e = layout_error(nano, {4, 0, true, 3});
  EXPECT_NE(e.find("decode-context-parallel size 3 must divide"), std::string::npos) << e;
  EXPECT_EQ(layout_error(dir_of("KESTREL_NANO_TP_DIR"), {4, 3, false, 4}), "");
}

}  // namespace
}  // namespace kestrel
