// FP8 latent cache and FP8 / MXFP4 index-key caches against the BF16 caches, per MLA layer,
// teacher-forced, on the golden prompts (tests/golden/nano/golden.json) plus one 512-token prompt.
//
// Why teacher-forced: the random nano checkpoint is chaotic (test_golden_nano.cpp explains), so an
// end-to-end comparison would measure the chaos, not the cache format. Instead the BF16 model runs
// each prompt once and records every MLA layer's input (L{L}.attn_in); each layer then runs on that
// same input with a BF16 cache and with the quantised cache, through the same paged code path the
// engine uses (absorbed form, as the engine runs it), and we compare
//  - attention output a (bf16 [T, D]): relative L2 over the prompt and the worst row;
//  - the indexer's top-k selections: |S_q ∩ S_bf16| / Ki over queries with more than Ki visible keys.
// The bounds below are the measured values with headroom; the measured numbers are printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/cache_format.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/mla.h"
#include "model/model.h"
#include "nano_checkpoint.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {
namespace {


using Nano = testing::NanoCheckpoint;
const Nano& nano_ckpt() { return testing::nano_checkpoint(); }

std::vector<std::pair<std::string, std::vector<int32_t>>> golden_prompts() {
  std::ifstream in(std::string(KESTREL_SOURCE_DIR) + "/tests/golden/nano/golden.json");
  const nlohmann::json g = nlohmann::json::parse(in);
  std::vector<std::pair<std::string, std::vector<int32_t>>> out;
  for (const auto& c : g["cases"]) {
    const std::string name = c["name"];
    if (c.contains("tokens")) out.push_back({name, c["tokens"].get<std::vector<int32_t>>()});
    if (c.contains("requests"))
      for (size_t i = 0; i < c["requests"].size(); ++i)
        out.push_back({fmt::format("{}[{}]", name, i), c["requests"][i].get<std::vector<int32_t>>()});
  }
  std::mt19937 rng(42);
  std::vector<int32_t> longp(512);
  for (int32_t& t : longp) t = int32_t(rng() % 768);  // ordinary (non-special) ids
  out.push_back({"synthetic512", longp});
  return out;
}

struct LayerRun {
  std::vector<uint16_t> out;  // bf16 [T, D]
  std::vector<int32_t> sel;   // i32 [T, Ki]
};

LayerRun run_layer(const ModelConfig& cfg, const ModelWeights& w, int L, const std::vector<uint16_t>& normed, int64_t T,
                   LatentFormat lf, IndexKeyFormat kf) {
  const TextConfig& tc = cfg.text;
  LayerRun r;
  r.out.resize(size_t(T * tc.hidden_size));
  model::MlaCache cache;
  cache.latent_format = lf, cache.key_format = kf;
  model::Observer obs = [&](std::string_view name, const TensorView& t) {
    if (name.ends_with("index_topk")) r.sel.assign(t.as<const int32_t>(), t.as<const int32_t>() + t.numel());
  };
  model::mla_forward(w.layers[size_t(L)].mla, tc, cache, normed.data(), T, r.out.data(), model::MlaForm::absorbed,
                     model::Probe{&obs, L});
  return r;
}

// Runs the whole BF16 model over `tokens` and returns every MLA layer's input (L{L}.attn_in, bf16 [T, D])
// RMS-normed with that layer's input norm: exactly what the MLA layer receives.
std::map<int, std::vector<uint16_t>> normed_mla_inputs(const ModelConfig& cfg, const ModelWeights& w,
                                                       const std::vector<int32_t>& tokens) {
  const TextConfig& tc = cfg.text;
  std::map<int, std::vector<uint16_t>> attn_in;
  model::ForwardOptions opt;
  opt.observer = [&](std::string_view name, const TensorView& t) {
    if (!name.ends_with(".attn_in")) return;
    const int L = std::stoi(std::string(name.substr(1, name.find('.') - 1)));
    if (tc.attn_kind[size_t(L)] == AttnKind::kda) return;
    attn_in[L].assign(t.as<const uint16_t>(), t.as<const uint16_t>() + t.numel());
  };
  model::State st(cfg);
  model::prefill(w, cfg, st, tokens, nullptr, opt);
  for (auto& [L, x] : attn_in) {
    std::vector<uint16_t> normed(x.size());
    cpu::rmsnorm_bf16(x.data(), model::bf16_ptr(w.layers[size_t(L)].input_norm), normed.data(),
                      int64_t(tokens.size()), tc.hidden_size, tc.rms_norm_eps);
    x = std::move(normed);
  }
  return attn_in;
}

struct Acc {
  double err2 = 0, ref2 = 0, worst_row = 0;
  int64_t agree = 0, total = 0;
  double worst_row_agree = 1.0;
  double rel() const { return std::sqrt(err2 / ref2); }
  double agreement() const { return total ? double(agree) / double(total) : 1.0; }
};

TEST(EngineCacheFormats, QuantisedCachesAgainstBf16OnGoldenPrompts) {
  const Nano& n = nano_ckpt();
  const TextConfig& tc = n.cfg.text;
  const int64_t D = tc.hidden_size, Ki = tc.index_topk;
  struct Combo {
    const char* name;
    LatentFormat lf;
    IndexKeyFormat kf;
  };
  const Combo combos[] = {{"latent fp8", LatentFormat::fp8, IndexKeyFormat::bf16},
                          {"keys fp8", LatentFormat::bf16, IndexKeyFormat::fp8},
                          {"keys mxfp4", LatentFormat::bf16, IndexKeyFormat::mxfp4},
                          {"fp8 + fp8", LatentFormat::fp8, IndexKeyFormat::fp8},
                          {"fp8 + mxfp4", LatentFormat::fp8, IndexKeyFormat::mxfp4}};
  std::map<std::string, Acc> total;  // per combo, over every prompt and layer
  std::map<std::string, Acc> longctx;  // per combo, the 512-token prompt only
  for (const auto& [pname, tokens] : golden_prompts()) {
    const int64_t T = int64_t(tokens.size());
    const std::map<int, std::vector<uint16_t>> inputs = normed_mla_inputs(n.cfg, n.w, tokens);
    ASSERT_FALSE(inputs.empty());
    for (const auto& [L, normed] : inputs) {
      const LayerRun ref = run_layer(n.cfg, n.w, L, normed, T, LatentFormat::bf16, IndexKeyFormat::bf16);
      for (const Combo& c : combos) {
        const LayerRun q = run_layer(n.cfg, n.w, L, normed, T, c.lf, c.kf);
        for (Acc* a : {&total[c.name], pname == "synthetic512" ? &longctx[c.name] : nullptr}) {
          if (!a) continue;
          for (int64_t t = 0; t < T; ++t) {
            double e = 0, r = 0;
            for (int64_t d = 0; d < D; ++d) {
              const double rv = bf16_to_f32(ref.out[size_t(t * D + d)]), qv = bf16_to_f32(q.out[size_t(t * D + d)]);
              e += (qv - rv) * (qv - rv), r += rv * rv;
            }
            a->err2 += e, a->ref2 += r;
            a->worst_row = std::max(a->worst_row, std::sqrt(e / std::max(r, 1e-30)));
            if (t + 1 <= Ki) continue;  // every key selected: nothing to agree on
            std::set<int32_t> want(ref.sel.begin() + t * Ki, ref.sel.begin() + (t + 1) * Ki);
            int64_t same = 0;
            for (int64_t i = 0; i < Ki; ++i) same += want.count(q.sel[size_t(t * Ki + i)]);
            a->agree += same, a->total += Ki;
            a->worst_row_agree = std::min(a->worst_row_agree, double(same) / double(Ki));
          }
        }
      }
    }
  }
  for (const Combo& c : combos) {
    const Acc& a = total[c.name];
    const Acc& l = longctx[c.name];
    fmt::print("{:12s} attn_out rel_l2 {:.3e} worst_row {:.3e} | top-k agreement {:.4f} (worst row {:.3f}) | "
               "512-token prompt: agreement {:.4f}, rel_l2 {:.3e}\n",
               c.name, a.rel(), a.worst_row, a.agreement(), a.worst_row_agree, l.agreement(), l.rel());
  }
  // Bounds: measured value (2025-11-29, nano seed 1) with headroom.
  //  latent fp8   rel 2.89e-2 (worst row 6.4e-2), agreement 1 (the indexer never reads the latent)
  //  keys fp8     rel 8.61e-2 (worst row 0.75), agreement 0.9847 overall, 0.9835 on the 512-token prompt
  //  keys mxfp4   rel 0.170 (worst row 1.05), agreement 0.9407, 0.9357 on the 512-token prompt
  //  fp8 + fp8    rel 9.08e-2; fp8 + mxfp4 rel 0.172
  // The output error of the key formats is dominated by rows where a swapped key at the top-k
  // boundary carries real attention weight; the random checkpoint's index scores are close together,
  // so FP8 keys miss the 99 % agreement target here (no margin filtering is applied).
  EXPECT_LT(total["latent fp8"].rel(), 4e-2);
  EXPECT_LT(total["latent fp8"].worst_row, 1e-1);
  EXPECT_EQ(total["latent fp8"].agreement(), 1.0);
  EXPECT_LT(total["keys fp8"].rel(), 0.12);
  EXPECT_GE(total["keys fp8"].agreement(), 0.975);
  EXPECT_GE(longctx["keys fp8"].agreement(), 0.975);
  EXPECT_LT(total["keys mxfp4"].rel(), 0.22);
  EXPECT_GE(total["keys mxfp4"].agreement(), 0.92);
  EXPECT_GE(longctx["keys mxfp4"].agreement(), 0.92);
  EXPECT_LT(total["fp8 + fp8"].rel(), 0.12);
  EXPECT_LT(total["fp8 + mxfp4"].rel(), 0.22);
}

// The same measurement on the trained model (models/k3-tiny, issue #8) at long context: a 4,096-token
// passkey prompt from its evaluation set (twice its training context, 16x its index_topk of 256), encoded by
// the chat encoder as the server would. A trained indexer separates the keys that matter from the rest, which
// the random nano checkpoint's cannot; this is the measurement issue #5's ">= 99 % at long context" is about.
// Measured (2026-11-29, 4,084 tokens, both MLA layers): FP8 keys 0.9683 (worst row 0.898), MXFP4 0.8712
// (worst row 0.547) — short of 99 %. reference/index_agreement.py shows why: every key whose BF16 score is
// farther from the row's top-k threshold than the row's largest FP8 score error stays selected
// (1,455,536 of 1,455,537 such keys over the two layers); the swaps are all among keys whose order the
// format's own rounding decides. Longer contexts lower it further (FP8 0.946 / 0.932 at 32K, 0.925 / 0.914 at
// 64K; bench/RESULTS.md), yet the GPU engine's passkey responses from 1K to 128K are identical with BF16, FP8
// and MXFP4 keys. Bounds: the measured values with headroom.
TEST(EngineCacheFormats, TrainedModelIndexAgreementAtLongContext) {
  const std::string dir = std::string(KESTREL_SOURCE_DIR) + "/models/k3-tiny";
  const ModelConfig cfg = load_config(dir);
  const Checkpoint ck(dir);
  const ModelWeights w = bind_weights(cfg, ck);
  const tok::Tokenizer tk = tok::Tokenizer::load(dir);
  const TextConfig& tc = cfg.text;
  const int64_t Ki = tc.index_topk;

  std::vector<int32_t> tokens;
  {
    std::ifstream in(dir + "/eval/passkey.jsonl");
    ASSERT_TRUE(in) << dir << "/eval/passkey.jsonl";
    std::string line;
    while (std::getline(in, line)) {
      const auto item = nlohmann::ordered_json::parse(line);
      if (item["meta"]["context_tokens"].get<int>() < 4096) continue;
      const tok::ChatPrompt cp = tok::ChatEncoder(tk).encode_request(item["request"]);
      tokens.assign(cp.ids.begin(), cp.ids.end());
      break;
    }
  }
  ASSERT_GT(int64_t(tokens.size()), 8 * Ki) << "want a context far beyond index_topk";
  const int64_t T = int64_t(tokens.size());

  const std::map<int, std::vector<uint16_t>> inputs = normed_mla_inputs(cfg, w, tokens);
  ASSERT_FALSE(inputs.empty());

  std::map<std::string, Acc> acc;
  for (const auto& [L, normed] : inputs) {
    const LayerRun ref = run_layer(cfg, w, L, normed, T, LatentFormat::bf16, IndexKeyFormat::bf16);
    for (auto [name, kf] : {std::pair{"keys fp8", IndexKeyFormat::fp8}, std::pair{"keys mxfp4", IndexKeyFormat::mxfp4}}) {
      const LayerRun q = run_layer(cfg, w, L, normed, T, LatentFormat::bf16, kf);
      Acc& a = acc[name];
      for (int64_t t = Ki; t < T; ++t) {  // rows with more than Ki visible keys
        std::set<int32_t> want(ref.sel.begin() + t * Ki, ref.sel.begin() + (t + 1) * Ki);
        int64_t same = 0;
        for (int64_t i = 0; i < Ki; ++i) same += want.count(q.sel[size_t(t * Ki + i)]);
        a.agree += same, a.total += Ki;
        a.worst_row_agree = std::min(a.worst_row_agree, double(same) / double(Ki));
      }
    }
  }
  for (const auto& [name, a] : acc)
    fmt::print("k3-tiny, {}-token prompt, Ki {}: {:10s} top-k agreement with bf16 keys {:.4f} (worst row {:.3f})\n", T,
               Ki, name, a.agreement(), a.worst_row_agree);
  EXPECT_GE(acc["keys fp8"].agreement(), 0.955);
  EXPECT_GE(acc["keys mxfp4"].agreement(), 0.84);
}

// Round trip of one row through each format: exact for BF16, within the format's step otherwise.
TEST(EngineCacheFormats, RoundTripThroughPages) {
  const Nano& n = nano_ckpt();
  const TextConfig& tc = n.cfg.text;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t CW = tc.kv_lora_rank + tc.qk_rope_head_dim, Di = tc.index_head_dim, S = 200;
  std::vector<uint16_t> lat(size_t(S * CW)), keys(size_t(S * Di));
  for (auto& v : lat) v = f32_to_bf16(nd(rng));
  for (auto& v : keys) v = f32_to_bf16(nd(rng));
  for (auto lf : {LatentFormat::bf16, LatentFormat::fp8})
    for (auto kf : {IndexKeyFormat::bf16, IndexKeyFormat::fp8, IndexKeyFormat::mxfp4}) {
      model::MlaCache c;
      c.latent_format = lf, c.key_format = kf, c.block_size = 16;  // many pages, keys not 64-aligned
      const model::MlaCacheView v = c.view(tc, S);
      // Write in a scrambled order: positions are addressed through the block table only.
      for (int64_t p = S - 1; p >= 0; --p) v.write_latent(p, lat.data() + p * CW), v.write_key(p, keys.data() + p * Di);
      std::vector<uint16_t> lat2(lat.size()), keys2(keys.size());
      v.read_latent(S, lat2.data());
      v.read_keys(S, keys2.data());
      auto rel = [](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
        double e = 0, r = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          const double x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);
          e += (x - y) * (x - y), r += x * x;
        }
        return std::sqrt(e / r);
      };
      if (lf == LatentFormat::bf16) EXPECT_EQ(lat, lat2);
      else EXPECT_LT(rel(lat, lat2), 0.04);  // e4m3: 3 mantissa bits, rel RMS ≈ 2^-4/√3 · ...
      if (kf == IndexKeyFormat::bf16) EXPECT_EQ(keys, keys2);
      else if (kf == IndexKeyFormat::fp8) EXPECT_LT(rel(keys, keys2), 0.04);
      else EXPECT_LT(rel(keys, keys2), 0.2);  // e2m1: 1 mantissa bit
      // The k_pe half of an FP8 latent row stays bf16: exact.
      for (int64_t p = 0; p < S; ++p)
        for (int64_t d = tc.kv_lora_rank; d < CW; ++d) ASSERT_EQ(lat[size_t(p * CW + d)], lat2[size_t(p * CW + d)]);
    }
}

}  // namespace
}  // namespace kestrel
