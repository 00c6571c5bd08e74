// The CPU engine against the committed golden data of the independent PyTorch reference
// (tests/golden/nano, produced by reference/make_golden.py on the nano seed-1 checkpoint; FP64 compute
// with the spec's BF16 rounding points, see reference/README.md "Golden data").
//
// What is compared:
//  - the checkpoint in $KESTREL_NANO_DIR against golden.json's sha256 list (any mismatch fails every
//    test: comparing against other weights would be meaningless);
//  - per layer, teacher-forced: the golden input of each block (attn_in / mlp_in) goes through the
//    engine's RMSNorm and KDA / MLA / dense MLP / MoE with fresh state, and the output is compared
//    with the golden output; MLA indexer selections and MoE routing are compared on rows whose
//    golden margin is above the engine's noise; AttnRes Mix is recomputed from the golden stream;
//    the final norm + lm_head from golden final_hidden;
//  - end to end: model::prefill / decode logits and greedy tokens for every case.
//
// Conditioning: the nano checkpoint's initialisation (reference/make_checkpoint.py, reference/README.md
// "Conditioning") keeps every layer a small correction to the embedding, so a BF16 flip is not amplified
// through the 8 layers: the reference's own FP32 run stays within 1.0–1.5e-3 of FP64 at the logits on
// every case (golden.json `fp32_compute_sensitivity`), and the end-to-end test below holds MODEL.md
// §0.10's bound (logits rel L2 ≤ 2e-2 at every position, same greedy token). The per-layer,
// teacher-forced checks stay: fed the golden input, a layer's own arithmetic is compared at BF16-level
// bounds, and a routing/indexer decision is compared wherever its golden margin is above the noise.
//
// Relative L2 = ||engine − golden|| / ||golden|| over the compared rows. Every bound below states the
// value measured when it was chosen.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/attn_res.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/mlp.h"
#include "model/model.h"
#include "model/moe.h"
#include "sha256.h"

namespace kestrel {
namespace {

// ---- SHA-256 (FIPS 180-4), dependency-free: sha256.h (its known-answer test is below) -----------------
using testing::sha256_file;
using testing::sha256_hex;

TEST(GoldenSha256, KnownAnswers) {
  // FIPS 180-4 examples, plus lengths around the 55/56/64-byte padding edges.
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(sha256_hex(std::string(64, 'a')), "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

// ---- golden data ---------------------------------------------------------------------------------

struct Golden {
  nlohmann::json meta;
  std::unique_ptr<SafetensorsFile> tensors;
  std::string ckpt_dir;
  std::string error;  // non-empty: the checkpoint is missing or is not the one the data came from
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  ModelWeights w;

  const nlohmann::json& case_(const std::string& name) const {
    for (const auto& c : meta["cases"])
      if (c["name"] == name) return c;
    throw std::runtime_error("golden.json has no case " + name);
  }
  TensorView view(const std::string& name) const {
    const TensorInfo* t = tensors->find(name);
    if (!t) throw std::runtime_error("golden.safetensors has no tensor " + name);
    return tensors->view(*t);
  }
  bool has(const std::string& name) const { return tensors->find(name) != nullptr; }
  // Rows [r0, r0+n) of a 2-D (or 1-D) tensor, as float.
  std::vector<float> rows_f32(const std::string& name, int64_t r0 = 0, int64_t n = -1) const {
    const TensorView v = view(name);
    const int64_t w = v.shape.rank > 1 ? v.shape[1] : 1;
    if (n < 0) n = v.shape[0] - r0;
    std::vector<float> out(size_t(n * w));
    for (int64_t i = 0; i < n * w; ++i) {
      const int64_t j = r0 * w + i;
      out[size_t(i)] = v.dtype == DType::bf16 ? bf16_to_f32(v.as<const uint16_t>()[j]) : v.as<const float>()[j];
    }
    return out;
  }
  model::Bf16Vec rows_bf16(const std::string& name, int64_t r0 = 0, int64_t n = -1) const {
    const TensorView v = view(name);
    EXPECT_EQ(v.dtype, DType::bf16) << name;
    const int64_t w = v.shape[1];
    if (n < 0) n = v.shape[0] - r0;
    const uint16_t* p = v.as<const uint16_t>() + r0 * w;
    return model::Bf16Vec(p, p + n * w);
  }
  std::vector<int32_t> rows_i32(const std::string& name, int64_t r0, int64_t n) const {
    const TensorView v = view(name);
    const int64_t w = v.shape[1];
    const int32_t* p = v.as<const int32_t>() + r0 * w;
    return std::vector<int32_t>(p, p + n * w);
  }
};

Golden load_golden() {
  Golden g;
  const std::string dir = std::string(KESTREL_SOURCE_DIR) + "/tests/golden/nano";
  std::ifstream in(dir + "/golden.json");
  if (!in) throw std::runtime_error("cannot read " + dir + "/golden.json");
  g.meta = nlohmann::json::parse(in);
  g.tensors = std::make_unique<SafetensorsFile>(dir + "/golden.safetensors");
  const char* env = std::getenv("KESTREL_NANO_DIR");
  const std::string regen = g.meta["regenerate"][0].get<std::string>();
  if (!env || !*env) {
    g.error = "KESTREL_NANO_DIR is not set; generate the checkpoint with `" + regen + "` (DIR = any directory)";
    return g;
  }
  g.ckpt_dir = env;
  for (const auto& [file, want] : g.meta["checkpoint"]["sha256"].items()) {
    const std::string got = sha256_file(g.ckpt_dir + "/" + file);
    if (got != want.get<std::string>())
      g.error += fmt::format("{}/{}: sha256 {} but golden.json expects {}\n", g.ckpt_dir, file,
                             got.empty() ? "(unreadable)" : got, want.get<std::string>());
  }
  if (!g.error.empty()) {
    g.error += "The checkpoint is not the one the golden data were made from. Regenerate it with `" + regen +
               "` (DIR = $KESTREL_NANO_DIR), or regenerate the golden data: " +
               g.meta["regenerate"].dump();
    return g;
  }
  g.cfg = load_config(g.ckpt_dir);
  g.ckpt = std::make_unique<Checkpoint>(g.ckpt_dir);
  g.w = bind_weights(g.cfg, *g.ckpt);
  return g;
}

const Golden& golden() {
  static const Golden g = load_golden();
  return g;
}

#define REQUIRE_GOLDEN(g)                         \
  const Golden& g = golden();                     \
  ASSERT_TRUE(g.error.empty()) << g.error;


std::vector<float> to_f32(const model::Bf16Vec& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(v[i]);
  return f;
}

// Accumulates ||Δ||² and ||ref||² over several row ranges, and the worst single row.
struct RelL2 {
  double num = 0, den = 0, worst_row = 0;
  void add(const float* a, const float* b, int64_t rows, int64_t w) {
    for (int64_t r = 0; r < rows; ++r) {
      double n = 0, d = 0;
      for (int64_t k = 0; k < w; ++k) {
        const double x = a[r * w + k], y = b[r * w + k];
        n += (x - y) * (x - y), d += y * y;
      }
      num += n, den += d;
      worst_row = std::max(worst_row, std::sqrt(n / d));
    }
  }
  double value() const { return std::sqrt(num / den); }
};

// One independent sequence of a case: its rows in the golden tensors and how it is fed to the engine
// (one prefill call, or prefill + single-token decode calls for prefill_decode).
struct Seq {
  std::string case_name, label;
  int64_t row0 = 0;
  std::vector<int32_t> tokens;
  std::vector<int64_t> calls;  // tokens per call, summing to tokens.size()
};

std::vector<Seq> sequences(const Golden& g) {
  std::vector<Seq> out;
  for (const auto& c : g.meta["cases"]) {
    const std::string name = c["name"], kind = c["kind"];
    if (kind == "batch") {
      int64_t r0 = 0;
      for (size_t i = 0; i < c["requests"].size(); ++i) {
        Seq s{name, fmt::format("{}[{}]", name, i), r0, c["requests"][i].get<std::vector<int32_t>>(), {}};
        s.calls = {int64_t(s.tokens.size())};
        r0 += int64_t(s.tokens.size());
        out.push_back(s);
      }
    } else {
      Seq s{name, name, 0, c["tokens"].get<std::vector<int32_t>>(), {}};
      if (kind == "prefill_decode") {
        const int64_t n = c["prefill_len"];
        s.calls = {n};
        for (size_t i = size_t(n); i < s.tokens.size(); ++i) s.calls.push_back(1);
      } else {
        s.calls = {int64_t(s.tokens.size())};
      }
      out.push_back(s);
    }
  }
  return out;
}

// Captures named observer tensors of one layer, rows appended call after call.
struct Capture {
  std::map<std::string, std::vector<int32_t>> i32;
  std::map<std::string, std::vector<float>> f32;
  model::Observer observer() {
    return [this](std::string_view name, const TensorView& t) {
      const std::string key(name.substr(name.find('.') + 1));
      if (t.dtype == DType::i32) {
        auto& v = i32[key];
        v.insert(v.end(), t.as<const int32_t>(), t.as<const int32_t>() + t.numel());
      } else if (t.dtype == DType::f32) {
        auto& v = f32[key];
        v.insert(v.end(), t.as<const float>(), t.as<const float>() + t.numel());
      }
    };
  }
};

// ---- noise thresholds and bounds (measured values in the comments) --------------------------------

// A golden routing decision is compared only where its margin exceeds what the engine's FP32 arithmetic
// can move. Router: scores are σ(x·Wᵀ) from the BF16 normed x; FP32 accumulation alone moves them by
// ~1e-7, and a 1-ulp BF16 flip of one element of the normed x (FP32 vs FP64 RMSNorm) by ≲ 2^-8 · |w|
// · σ' ≈ 6e-5 (|w| ~ 1/√D). 39 of 1890 golden rows have margin ≤ 1e-3, 8 ≤ 2e-4, min 2.0e-5; the
// engine flips none of them (measured).
constexpr double kRouterMarginNoise = 2e-4;
// Indexer: same argument for Σ_h w_h ReLU(q_I·k_I)-scores (median margin 4.5e-3 on `long`; 9 rows in
// (0, 1e-3], min 1.5e-5). Exact-zero margins (ties among ReLU-clipped zero scores, 53 rows) are left
// out too although the tie rule is deterministic; the engine matches them all anyway (measured).
constexpr double kIndexMarginNoise = 1e-4;

// Per-layer bounds (relative L2 of one case's rows for one layer / worst single row). Teacher-forced
// layers see bit-identical BF16 inputs, so differences are FP32-vs-FP64 arithmetic flipping single
// BF16 roundings (2^-9 relative each) inside the layer.
//   attention: measured max 6.2e-4 (KDA) and 1.5e-3 (MLA, batch; prefill_decode 1.2e-3: decode uses the
//   absorbed form, golden the naive one; reference/README.md measures 3.5e-3 between the two); worst
//   row 5.9e-3.
constexpr double kAttnTensorBound = 5e-3, kAttnRowBound = 2e-2;
//   dense MLP / MoE (rows with the golden expert set): measured max 6.7e-4, worst row 3.8e-3.
constexpr double kMlpTensorBound = 5e-3, kMlpRowBound = 2e-2;
//   router weights, same expert set: max |Δw| measured 1.8e-5 (an input BF16 flip), else ≤ 6e-8.
constexpr double kRouterWeightBound = 2e-4;
//   AttnRes Mix from the golden stream: identical inputs, FP32 softmax/sum vs FP64; measured max
//   2.8e-5 per tensor, worst row 9.5e-4 (most Mix results are bit-identical).
constexpr double kMixTensorBound = 1e-3, kMixRowBound = 5e-3;
//   model.norm + lm_head from golden final_hidden: FP32 vs FP64 accumulation of identical BF16
//   products, logits not rounded; measured 1.1e-7 (worst row 1.4e-7).
constexpr double kFinalLogitsBound = 1e-6;

// ---- tests ---------------------------------------------------------------------------------------

TEST(GoldenNano, CheckpointMatchesGoldenHashes) {
  REQUIRE_GOLDEN(g);
  EXPECT_EQ(g.meta["format"], "kestrel-golden-v1");
  EXPECT_EQ(g.cfg.text.num_hidden_layers, g.meta["model"]["num_hidden_layers"].get<int>());
  EXPECT_EQ(g.cfg.text.hidden_size, g.meta["model"]["hidden_size"].get<int>());
  // The layer kinds the golden data were made with are the ones the engine derives from config.json.
  std::vector<int> kda, mla, moe;
  for (int L = 0; L < g.cfg.text.num_hidden_layers; ++L) {
    (g.cfg.text.attn_kind[size_t(L)] == AttnKind::kda ? kda : mla).push_back(L);
    if (g.cfg.text.mlp_kind[size_t(L)] == MlpKind::moe) moe.push_back(L);
  }
  EXPECT_EQ(kda, g.meta["model"]["kda_layers_0idx"].get<std::vector<int>>());
  EXPECT_EQ(mla, g.meta["model"]["mla_layers_0idx"].get<std::vector<int>>());
  EXPECT_EQ(moe, g.meta["model"]["moe_layers_0idx"].get<std::vector<int>>());
}

TEST(GoldenNano, AttentionPerLayerTeacherForced) {
  REQUIRE_GOLDEN(g);
  const TextConfig& tc = g.cfg.text;
  const int64_t D = tc.hidden_size;
  const model::ForwardOptions defaults;
  for (int L = 0; L < tc.num_hidden_layers; ++L) {
    const LayerWeights& lw = g.w.layers[size_t(L)];
    const bool mla = lw.attn_kind == AttnKind::mla;
    for (const std::string case_name : {"short", "medium", "long", "batch", "prefill_decode"}) {
      RelL2 err;
      int idx_rows = 0, idx_checked = 0, idx_mismatch = 0, idx_small_margin_diff = 0;
      double idx_min_margin_mismatch = std::numeric_limits<double>::infinity();
      for (const Seq& s : sequences(g)) {
        if (s.case_name != case_name) continue;
        const int64_t T = int64_t(s.tokens.size());
        const std::string pre = fmt::format("{}.L{}.", s.case_name, L);
        const model::Bf16Vec in = g.rows_bf16(pre + "attn_in", s.row0, T);
        model::Bf16Vec normed(in.size()), out(in.size());
        cpu::rmsnorm_bf16(in.data(), model::bf16_ptr(lw.input_norm), normed.data(), T, D, tc.rms_norm_eps);
        Capture cap;
        const model::Observer obs = cap.observer();
        const model::Probe probe{&obs, L};
        model::KdaState kst;
        model::MlaCache cache;
        if (!mla) kst.reset(tc);
        int64_t off = 0;
        for (int64_t n : s.calls) {  // fresh state, fed call by call like the reference
          if (mla)
            model::mla_forward(lw.mla, tc, cache, normed.data() + off * D, n, out.data() + off * D,
                               n == 1 ? defaults.mla_form_decode : defaults.mla_form_prefill, probe);
          else
            model::kda_forward(lw.kda, tc, kst, normed.data() + off * D, n, out.data() + off * D);
          off += n;
        }
        const std::vector<float> got = to_f32(out), want = g.rows_f32(pre + "attn_out", s.row0, T);
        err.add(got.data(), want.data(), T, D);
        if (mla && lw.mla.has_indexer) {
          const int64_t Ki = tc.index_topk;
          const std::vector<int32_t>& sel = cap.i32["index_topk"];
          ASSERT_EQ(int64_t(sel.size()), T * Ki);
          const std::vector<int32_t> gsel = g.rows_i32(pre + "index_topk", s.row0, T);
          const std::vector<float> margin = g.rows_f32(pre + "index_margin", s.row0, T);
          for (int64_t t = 0; t < T; ++t) {
            ++idx_rows;
            const bool same = std::equal(sel.begin() + t * Ki, sel.begin() + (t + 1) * Ki, gsel.begin() + t * Ki);
            if (margin[size_t(t)] > kIndexMarginNoise) {
              ++idx_checked;
              if (!same) {
                ++idx_mismatch;
                idx_min_margin_mismatch = std::min(idx_min_margin_mismatch, double(margin[size_t(t)]));
              }
            } else if (!same) {
              ++idx_small_margin_diff;
            }
          }
        }
      }
      EXPECT_LE(err.value(), kAttnTensorBound) << case_name << " L" << L;
      EXPECT_LE(err.worst_row, kAttnRowBound) << case_name << " L" << L;
      if (mla) {
        EXPECT_GT(idx_checked, 0) << case_name << " L" << L;
      }
      EXPECT_EQ(idx_mismatch, 0) << case_name << " L" << L << ": indexer selections differ on rows with margin > "
                                 << kIndexMarginNoise << " (smallest such margin " << idx_min_margin_mismatch << ")";
      std::printf("attn  L%d %-3s %-15s rel_l2 %.3e worst_row %.3e", L, mla ? "MLA" : "KDA", case_name.c_str(),
                  err.value(), err.worst_row);
      if (mla)
        std::printf("  index rows %d checked %d mismatched %d (min margin %.3g) small-margin differing %d",
                    idx_rows, idx_checked, idx_mismatch, idx_min_margin_mismatch, idx_small_margin_diff);
      std::printf("\n");
    }
  }
}


TEST(GoldenNano, MlpPerLayerTeacherForced) {
  REQUIRE_GOLDEN(g);
  const TextConfig& tc = g.cfg.text;
  const int64_t D = tc.hidden_size, K = tc.num_experts_per_token;
  for (int L = 0; L < tc.num_hidden_layers; ++L) {
    const LayerWeights& lw = g.w.layers[size_t(L)];
    const bool moe = lw.mlp_kind == MlpKind::moe;
    for (const std::string case_name : {"short", "medium", "long", "batch", "prefill_decode"}) {
      // The MLP is token-local, so a case's rows run in one call.
      const std::string pre = fmt::format("{}.L{}.", case_name, L);
      const model::Bf16Vec in = g.rows_bf16(pre + "mlp_in");
      const int64_t T = int64_t(in.size()) / D;
      model::Bf16Vec normed(in.size()), out(in.size());
      cpu::rmsnorm_bf16(in.data(), model::bf16_ptr(lw.post_attn_norm), normed.data(), T, D, tc.rms_norm_eps);
      Capture cap;
      const model::Observer obs = cap.observer();
      if (moe)
        model::moe_forward(lw.moe, tc, normed.data(), T, out.data(), model::Probe{&obs, L});
      else
        model::mlp_forward(lw.dense, tc, normed.data(), T, out.data());
      const std::vector<float> got = to_f32(out), want = g.rows_f32(pre + "mlp_out");
      RelL2 err;
      int flipped = 0, small_margin = 0;
      double max_w_err = 0, min_flip_margin = std::numeric_limits<double>::infinity();
      if (!moe) {
        err.add(got.data(), want.data(), T, D);
      } else {
        // Routing compared as sets: the reference stores selection order, but two chosen experts with
        // near-equal scores may swap order without changing the set (the combine is a sum).
        const std::vector<int32_t>& ids = cap.i32["router_ids"];
        const std::vector<float>& wts = cap.f32["router_weights"];
        ASSERT_EQ(int64_t(ids.size()), T * K);
        const std::vector<int32_t> gids = g.rows_i32(pre + "router_ids", 0, T);
        const std::vector<float> gw = g.rows_f32(pre + "router_weights");
        const std::vector<float> margin = g.rows_f32(pre + "router_margin");
        for (int64_t t = 0; t < T; ++t) {
          const bool small = margin[size_t(t)] <= kRouterMarginNoise;
          small_margin += small;
          std::map<int32_t, float> mine, ref;
          for (int64_t k = 0; k < K; ++k) {
            mine[ids[size_t(t * K + k)]] = wts[size_t(t * K + k)];
            ref[gids[size_t(t * K + k)]] = gw[size_t(t * K + k)];
          }
          bool same = mine.size() == ref.size();
          for (const auto& [e, w] : ref) same = same && mine.count(e);
          if (!same) {
            // A flip is legitimate only where the golden margin is within the engine's noise.
            ++flipped;
            min_flip_margin = std::min(min_flip_margin, double(margin[size_t(t)]));
            EXPECT_TRUE(small) << pre << " row " << t << ": expert set differs with router margin "
                               << margin[size_t(t)] << " > noise " << kRouterMarginNoise;
            continue;  // a different expert set gives a different output: excluded, counted
          }
          for (const auto& [e, w] : ref) max_w_err = std::max(max_w_err, std::fabs(double(mine[e]) - w));
          err.add(got.data() + t * D, want.data() + t * D, 1, D);
        }
        EXPECT_LE(flipped, small_margin) << pre;
      }
      EXPECT_LE(err.value(), kMlpTensorBound) << pre;
      EXPECT_LE(err.worst_row, kMlpRowBound) << pre;
      EXPECT_LE(max_w_err, kRouterWeightBound) << pre;
      std::printf("mlp   L%d %-5s %-15s rel_l2 %.3e worst_row %.3e", L, moe ? "MoE" : "dense", case_name.c_str(),
                  err.value(), err.worst_row);
      if (moe)
        std::printf("  rows %lld small-margin %d flipped %d (min margin %.3g) max|dw| %.2e", (long long)T,
                    small_margin, flipped, min_flip_margin, max_w_err);
      std::printf("\n");
    }
  }
}

TEST(GoldenNano, AttnResMixFromGoldenStream) {
  // Rebuild the AttnRes stream (§3.2) from the golden layer outputs with the engine's bookkeeping and
  // Mix, and compare every Mix result. Mix is token-local, so all rows of a case form one stream.
  REQUIRE_GOLDEN(g);
  const TextConfig& tc = g.cfg.text;
  const int64_t D = tc.hidden_size;
  const float eps = tc.rms_norm_eps;
  for (const auto& c : g.meta["cases"]) {
    const std::string name = c["name"];
    std::vector<int32_t> toks;
    if (c["kind"] == "batch")
      for (const auto& r : c["requests"]) for (int32_t t : r) toks.push_back(t);
    else
      toks = c["tokens"].get<std::vector<int32_t>>();
    const int64_t T = int64_t(toks.size());
    model::AttnResStream rs(T, D, tc.num_attn_res_blocks());
    const uint16_t* embed = model::bf16_ptr(g.w.embed);
    for (int64_t t = 0; t < T; ++t) std::memcpy(rs.partial.data() + t * D, embed + int64_t(toks[size_t(t)]) * D, size_t(D) * 2);
    model::Bf16Vec h(size_t(T * D));
    RelL2 err;
    auto check = [&](const std::string& tensor) {
      const std::vector<float> got = to_f32(h), want = g.rows_f32(tensor);
      RelL2 one;
      one.add(got.data(), want.data(), T, D);
      err.add(got.data(), want.data(), T, D);
      return one.value();
    };
    std::string line;
    for (int L = 0; L < tc.num_hidden_layers; ++L) {
      const LayerWeights& lw = g.w.layers[size_t(L)];
      const std::string pre = fmt::format("{}.L{}.", name, L);
      model::attn_res_mix(rs, model::bf16_ptr(lw.attn_res_norm), model::bf16_ptr(lw.attn_res_proj), eps, h.data());
      line += fmt::format(" L{} {:.1e}/", L, check(pre + "attn_in"));
      const model::Bf16Vec a = g.rows_bf16(pre + "attn_out");
      if (tc.attn_res_writes(L)) {
        rs.write_block();
        rs.partial = a;
      } else {
        rs.accumulate(a.data());
      }
      model::attn_res_mix(rs, model::bf16_ptr(lw.mlp_res_norm), model::bf16_ptr(lw.mlp_res_proj), eps, h.data());
      line += fmt::format("{:.1e}", check(pre + "mlp_in"));
      rs.accumulate(g.rows_bf16(pre + "mlp_out").data());
    }
    model::attn_res_mix(rs, model::bf16_ptr(g.w.out_res_norm), model::bf16_ptr(g.w.out_res_proj), eps, h.data());
    line += fmt::format(" final {:.1e}", check(name + ".final_hidden"));
    EXPECT_LE(err.value(), kMixTensorBound) << name << line;
    EXPECT_LE(err.worst_row, kMixRowBound) << name << line;
    std::printf("mix %-15s all %.3e worst_row %.3e  (attn_in/mlp_in per layer:%s)\n", name.c_str(), err.value(),
                err.worst_row, line.c_str());
  }
}

TEST(GoldenNano, FinalNormAndLmHeadFromGoldenHidden) {
  REQUIRE_GOLDEN(g);
  const TextConfig& tc = g.cfg.text;
  const int64_t D = tc.hidden_size, V = tc.vocab_size;
  const TensorView& head = g.w.lm_head.empty() ? g.w.embed : g.w.lm_head;
  for (const auto& c : g.meta["cases"]) {
    const std::string name = c["name"];
    const model::Bf16Vec h = g.rows_bf16(name + ".final_hidden");
    const int64_t T = int64_t(h.size()) / D;
    model::Bf16Vec normed(h.size());
    cpu::rmsnorm_bf16(h.data(), model::bf16_ptr(g.w.final_norm), normed.data(), T, D, tc.rms_norm_eps);
    std::vector<float> logits(size_t(T * V));
    cpu::gemm_bf16_f32(normed.data(), D, model::bf16_ptr(head), logits.data(), V, T, D, V);
    const std::vector<float> want = g.rows_f32(name + ".logits");
    RelL2 err;
    err.add(logits.data(), want.data(), T, V);
    EXPECT_LE(err.value(), kFinalLogitsBound) << name;
    std::printf("final %-15s logits rel_l2 %.3e worst_row %.3e\n", name.c_str(), err.value(), err.worst_row);
  }
}

// End to end, MODEL.md §0.10: logits relative L2 ≤ 2e-2 at every position (worst row) and the same
// greedy token at every position. Measured (engine vs golden): whole case 1.1e-7 (short, bit-identical
// activations) to 1.6e-3 (long), worst row 7.6e-3 (long; an indexer/router near-tie decided the other
// way, worth ≤ 1 % at that row by construction of the checkpoint); the reference's own FP32 run is at
// 1.0–1.5e-3. On top of §0.10, the whole case must stay within kE2eCaseBound: the conditioned
// checkpoint's layers are small corrections to the embedding, so a wiring bug moves the logits by less
// than 2e-2 per row, but on many rows. Measured in the FP64 reference on `long`: one layer's output
// zeroed moves the whole case by 5.9e-3 (L3 or L7 MLA) to 1.9e-2 (L5 MoE), worst row 1.7–2.7e-2; decode
// steps without the carried state (prefill_decode) 4.8e-2. The case bound catches all of them.
constexpr double kE2eRowBound = 2e-2;   // MODEL.md §0.10
constexpr double kE2eCaseBound = 3e-3;  // measured max 1.6e-3 (long)
// Greedy: the same token at every position, except where the golden top-1/top-2 logit gap is a numerical
// tie at BF16 level, gap < kGreedyTieGap · RMS(row logits): there either of the two tied tokens is
// accepted. One golden row is such a tie: batch row 29 (request 2, position 12), gap 2.1e-4 · RMS, tokens
// 185/488; even a 1-ulp change of one element of one layer's normed input flips it in the FP64
// reference (reference/conditioning.py), and the engine (per-row error ~1e-3) picks 488. All 269 other
// rows have gap ≥ 3.1e-3 · RMS (p1 4.3e-3) and must match exactly. With V = 1024 roughly Gaussian
// logits, a row has gap < 1e-3 · RMS with probability ≈ 0.4 %, so about one such row in 270 is expected
// for any random checkpoint: this is a property of random logits, not of the conditioning.
constexpr double kGreedyTieGap = 1e-3;

TEST(GoldenNano, EndToEndLogits) {
  REQUIRE_GOLDEN(g);
  const int64_t V = g.cfg.text.vocab_size;
  for (const auto& c : g.meta["cases"]) {
    const std::string name = c["name"];
    const std::vector<float> want = g.rows_f32(name + ".logits");
    std::vector<float> got(want.size());
    // Layer 0 of the chained run sees only the embedding, before any BF16 flip can have entered the
    // stream: there the chained activations must meet the per-layer bounds.
    const int64_t D = g.cfg.text.hidden_size;
    std::map<std::string, std::vector<float>> l0;
    model::ForwardOptions opt;
    opt.observer = [&](std::string_view n, const TensorView& t) {
      if (!n.starts_with("L0.") || t.dtype != DType::bf16) return;
      auto& v = l0[std::string(n)];
      for (int64_t i = 0; i < t.numel(); ++i) v.push_back(bf16_to_f32(t.as<const uint16_t>()[i]));
    };
    for (const Seq& s : sequences(g)) {
      if (s.case_name != name) continue;
      model::State st(g.cfg);
      int64_t off = 0;
      for (int64_t n : s.calls) {
        float* dst = got.data() + (s.row0 + off) * V;
        if (n == 1)
          model::decode(g.w, g.cfg, st, s.tokens[size_t(off)], dst, opt);
        else
          model::prefill(g.w, g.cfg, st, std::span(s.tokens.data() + off, size_t(n)), dst, opt);
        off += n;
      }
    }
    const int64_t T = int64_t(want.size()) / V;
    for (const char* what : {"L0.attn_in", "L0.attn_out", "L0.mlp_in", "L0.mlp_out"}) {
      const std::vector<float> ref = g.rows_f32(name + "." + what);
      ASSERT_EQ(l0[what].size(), ref.size()) << name << " " << what;
      RelL2 e0;
      e0.add(l0[what].data(), ref.data(), T, D);
      EXPECT_LE(e0.value(), kAttnTensorBound) << name << " chained " << what;  // measured ≤ 2.9e-4
      EXPECT_LE(e0.worst_row, kAttnRowBound) << name << " chained " << what;
    }
    RelL2 err;
    err.add(got.data(), want.data(), T, V);
    int greedy_same = 0, ties = 0;
    for (int64_t t = 0; t < T; ++t) {
      const float* g_row = got.data() + t * V;
      const float* w_row = want.data() + t * V;
      const int64_t a = std::max_element(g_row, g_row + V) - g_row;
      // golden top-1 / top-2 and the row's logit RMS
      int64_t b = 0, b2 = -1;
      double ms = 0;
      for (int64_t v = 0; v < V; ++v) {
        ms += double(w_row[v]) * w_row[v];
        if (v == 0) continue;
        if (w_row[v] > w_row[b]) b2 = b, b = v;
        else if (b2 < 0 || w_row[v] > w_row[b2]) b2 = v;
      }
      const double gap = (double(w_row[b]) - w_row[b2]) / std::sqrt(ms / double(V));
      greedy_same += a == b;
      if (gap < kGreedyTieGap) {
        ++ties;
        EXPECT_TRUE(a == b || a == b2) << name << " row " << t << ": greedy " << a << " is neither of the tied golden "
                                       << b << "/" << b2 << " (gap " << gap << " RMS)";
        if (a != b) std::printf("e2e %-15s row %lld: tie (gap %.2e RMS), golden %lld/%lld, engine %lld\n", name.c_str(),
                                (long long)t, gap, (long long)b, (long long)b2, (long long)a);
      } else {
        EXPECT_EQ(a, b) << name << " row " << t << ": greedy token differs (golden gap " << gap << " RMS)";
      }
    }
    EXPECT_LE(err.worst_row, kE2eRowBound) << name;
    EXPECT_LE(err.value(), kE2eCaseBound) << name;
    EXPECT_LE(ties, 1) << name << ": more golden near-ties than the one documented above";
    const double sens = c["fp32_compute_sensitivity"]["logits_rel_l2"];
    std::printf("e2e %-15s logits rel_l2 %.3e worst_row %.3e greedy %d/%lld (ties %d)  (ref fp32 sensitivity %.3e, "
                "greedy %.3f)\n",
                name.c_str(), err.value(), err.worst_row, greedy_same, (long long)T, ties, sens,
                c["fp32_compute_sensitivity"]["greedy_match"].get<double>());
  }
}


}  // namespace
}  // namespace kestrel
