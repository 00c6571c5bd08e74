// The whole GPU forward pass (model/cuda/cuda_model.h) against the CPU engine (model/model.h) on real
// checkpoints: KESTREL_GPU_CKPTS = colon-separated checkpoint directories (the nano checkpoint and the
// reduced mini one; bench/gpu/run.sh generates them on the GPU machine). Required.
//
// Per checkpoint: a prompt of P tokens (prefill, logits at every position), then G greedy decode steps.
// The GPU is teacher-forced with the CPU's tokens so logits stay comparable at every position.
// Discrete choices make the forward discontinuous: the MoE router's top-k and the indexer's top-k can
// pick differently when BF16 noise (cuBLASLt vs OpenBLAS summation order) moves a near-tied score. So
// both engines' router ids and index selections are captured at every position and layer; at
// positions before the first differing choice (a choice at position t only affects positions ≥ t) the
// logits must agree within MODEL.md §0.10's rel L2 ≤ 2e-2, max |Δ| ≤ 5% of max |logit|, and the argmax
// must be equal except at near ties, reported: positions where the CPU's top two logits are within 4% of
// max |logit| AND within twice that position's measured GPU−CPU max |Δ| (the observed error could flip
// them), at most one position per 16 compared (at least one). The seed-2 nano_tp_gpu checkpoint
// (2026-12-02) has two such ties in 62 positions, gaps 0.12 % and 0.08 % of max |logit| with max |Δ| 0.34 %;
// the old rule (one tie in all) failed it on those. From the first differing choice on, positions are
// reported, not failed. Measured on the H200 (2026-11-29) with the well-conditioned nano checkpoint
// (reference/README.md "Conditioning"): nano rel L2 2.5e-3, greedy equal at 78/78 positions, no
// differing choice; reduced mini 1.4e-3, 24/24. The first runs on the earlier, chaotic checkpoint had
// measured 4.6e-2 / 0.11 with router flips — the checkpoint, not the kernels (per-layer captures
// showed a smooth ~2-3x growth per layer from the first layer's 1.7e-5). The first-layer bound catches
// a wrong op before any amplification: L0.attn_out rel L2 ≤ 5e-3 (measured 4.4e-6 nano, 1.3e-3 mini).
// KESTREL_GPU_CKPTS must be set (bench/gpu/run.sh does it); an unset variable is a failure, not a skip.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <numeric>
#include <string_view>
#include <sstream>

#include "core/dtype.h"
#include "harness.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/model.h"
#include "model/cuda/cuda_model.h"

namespace kestrel::gputest {
namespace {

int32_t argmax(const float* x, int64_t n) { return int32_t(std::max_element(x, x + n) - x); }
float top2_gap(const float* x, int64_t n) {
  std::vector<float> v(x, x + n);
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
  return v[0] - v[1];
}

TEST(GpuModel, MatchesCpuEngine) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  ASSERT_GT(cuda::device_count(), 0);
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;
    // Nano: 70 prompt tokens cross index_topk = 64, so the sparse (indexer-selected) path runs.
    const int64_t P = cfg.text.index_topk > 0 && cfg.text.index_topk < 100 ? 70 : 16, G = 8;
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < P; ++i) prompt.push_back(int32_t((i * 7919 + 13) % std::min<int64_t>(V, 1000)));

    // CPU reference: prefill logits at every position, then greedy decode.
    model::State cst(cfg);
    model::ForwardOptions opt;
    std::map<std::string, std::vector<int32_t>> cpu_caps;
    std::map<std::string, std::vector<float>> cpu_act;
    opt.observer = [&](std::string_view n, const TensorView& t) {
      const std::string name(n);
      if (name.find("attn_out") != std::string::npos || name.find("mlp_out") != std::string::npos) {
        auto& v = cpu_act[name];
        for (int64_t i = 0; i < t.numel(); ++i) v.push_back(bf16_to_f32(t.as<const uint16_t>()[i]));
        return;
      }
      if (name.find("router_ids") == std::string::npos && name.find("index_topk") == std::string::npos) return;
      auto& v = cpu_caps[name];
      v.insert(v.end(), t.as<const int32_t>(), t.as<const int32_t>() + t.numel());
    };
    std::vector<float> cpu_logits(size_t(P * V));
    model::prefill(w, cfg, cst, prompt, cpu_logits.data(), opt);
    std::vector<int32_t> toks{argmax(cpu_logits.data() + (P - 1) * V, V)};
    std::vector<float> lg(static_cast<size_t>(V));
    for (int64_t s = 0; s < G; ++s) {
      model::decode(w, cfg, cst, toks.back(), lg.data(), opt);
      cpu_logits.insert(cpu_logits.end(), lg.begin(), lg.end());
      toks.push_back(argmax(lg.data(), V));
    }

    // GPU, teacher-forced with the CPU's tokens: one sequence (slot 0, pages 0, 1, ... of 64 tokens,
    // BF16 caches) through the batched forward, prefill then one decode step at a time.
    model::CudaModel gm(cfg, w);
    gm.enable_captures(true);
    std::vector<float> gpu_logits(size_t(P * V));
    {
      const int page = 64;
      std::vector<int32_t> table(size_t((P + G + 1 + page - 1) / page));
      std::iota(table.begin(), table.end(), 0);
      auto cache = gm.new_cache(int32_t(table.size()), 1,
                                CacheFormats{page, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
      auto step = [&](std::span<const int32_t> tokens, int64_t pos0, model::CudaSeq::Logits which, float* out) {
        const model::CudaSeq q{tokens, pos0, 0, table, which};
        gm.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
        gm.copy_logits(out);
      };
      step(prompt, 0, model::CudaSeq::Logits::all, gpu_logits.data());
      for (int64_t s = 0; s < G; ++s) {
        step(std::span<const int32_t>(&toks[size_t(s)], 1), P + s, model::CudaSeq::Logits::last, lg.data());
        gpu_logits.insert(gpu_logits.end(), lg.begin(), lg.end());
      }
    }
    const std::string name = fmt::format("{} L={} V={} K={}", cfg.text.hidden_size == 256 ? "nano" : "mini(reduced)",
                                          cfg.text.num_hidden_layers, V, cfg.text.num_experts_per_token);
    // First position where any layer's router set or index selection differs.
    const int64_t positions = P + G;
    int64_t first_diff = positions;
    std::string first_what = "none";
    for (const auto& [n, cv] : cpu_caps) {
      const auto it = gm.captures().find(n);
      ASSERT_TRUE(it != gm.captures().end()) << "GPU did not capture " << n;
      const auto& gv = it->second;
      ASSERT_EQ(cv.size(), gv.size()) << n;
      const int64_t width = int64_t(cv.size()) / positions;
      for (int64_t p = 0; p < std::min(first_diff, positions); ++p) {
        std::vector<int32_t> a(cv.begin() + p * width, cv.begin() + (p + 1) * width),
            b(gv.begin() + p * width, gv.begin() + (p + 1) * width);
        if (n.find("router_ids") != std::string::npos) std::sort(a.begin(), a.end()), std::sort(b.begin(), b.end());
        if (a != b) {
          first_diff = p, first_what = n;
          break;
        }
      }
    }
    note(fmt::format("  {}: first differing discrete choice at position {} of {} ({})", name, first_diff, positions,
                     first_what));
    double l0_err = 0;
    // Where the difference enters: each layer's attention and MLP output, rel L2 over the prefill rows at
    // position 0 (no context) and over positions < min(P, first_diff).
    {
      const int64_t D = cfg.text.hidden_size, rows = std::min(P, first_diff);
      std::string line;
      for (int L = 0; L < cfg.text.num_hidden_layers; ++L) {
        for (const char* what : {"attn_out", "mlp_out"}) {
          const std::string n = fmt::format("L{}.{}", L, what);
          const auto& cv = cpu_act[n];
          const auto it = gm.activation_captures().find(n);
          if (it == gm.activation_captures().end() || cv.size() < size_t(rows * D) || rows == 0) continue;
          auto rel = [&](int64_t r0, int64_t r1) {
            double num = 0, den = 0;
            for (int64_t i = r0 * D; i < r1 * D; ++i) {
              const double d = double(it->second[size_t(i)]) - cv[size_t(i)];
              num += d * d, den += double(cv[size_t(i)]) * cv[size_t(i)];
            }
            return std::sqrt(num / std::max(den, 1e-30));
          };
          line += fmt::format(" {}={:.1e}/{:.1e}", n, rel(0, 1), rel(0, rows));
          if (L == 0 && std::string(what) == "attn_out") {
            l0_err = rel(0, rows);
          }
        }
      }
      note(fmt::format("  {}: per-layer rel L2 (position 0 / positions < {}):{}", name, rows, line));
    }
    int mismatched = 0, near_ties = 0, after = 0;
    double worst_l2 = 0, worst_rel_abs = 0;
    for (int64_t p = 0; p < positions; ++p) {
      const float* c = cpu_logits.data() + p * V;
      const float* g = gpu_logits.data() + p * V;
      double num = 0, den = 0, mx = 0, scale = 0;
      for (int64_t i = 0; i < V; ++i) {
        const double d = double(g[i]) - c[i];
        num += d * d, den += double(c[i]) * c[i];
        mx = std::max(mx, std::fabs(d)), scale = std::max(scale, double(std::fabs(c[i])));
        if (!std::isfinite(g[i])) mx = INFINITY;
      }
      const double l2 = std::sqrt(num / den), rel_abs = mx / scale;
      const int32_t ac = argmax(c, V), ag = argmax(g, V);
      if (p >= first_diff) {
        if (ac != ag) ++after;
        continue;
      }
      worst_l2 = std::max(worst_l2, l2), worst_rel_abs = std::max(worst_rel_abs, rel_abs);
      if (ac != ag) {
        const float gap = top2_gap(c, V);
        const bool tie = gap <= 0.04 * scale && gap <= 2.0 * mx;  // within the error measured here
        note(fmt::format("  {} position {}: CPU argmax {} GPU {}; CPU top-2 gap {:.4g} (logit scale {:.3g}) -> {}",
                         name, p, ac, ag, gap, scale, tie ? "near tie" : "REAL MISMATCH"));
        (tie ? near_ties : mismatched)++;
      }
    }
    const bool ok = mismatched == 0 && near_ties <= std::max<int64_t>(1, first_diff / 16) && worst_l2 <= 2e-2 &&
                    worst_rel_abs <= 5e-2 && l0_err <= 5e-3;
    note(fmt::format("{:<28} {:<34} {:<11.3e} {:<11.3e} {:<38} {}", "model logits (GPU vs CPU)",
                     fmt::format("{} P={} G={} pos<{}", name, P, G, first_diff), worst_rel_abs, worst_l2,
                     "max|d|/max 5e-2, L2 2e-2, L0 5e-3", ok ? "PASS" : "FAIL"));
    note(fmt::format("  {}: greedy argmax equal at {}/{} compared positions ({} near ties); {} argmax differences "
                     "at the {} positions after the first differing choice; CPU greedy tokens {}",
                     name, first_diff - mismatched - near_ties, first_diff, near_ties, after, positions - first_diff,
                     fmt::join(toks, ",")));
    EXPECT_TRUE(ok) << name << ": worst rel L2 " << worst_l2 << ", worst max|d|/scale " << worst_rel_abs << ", "
                    << mismatched << " argmax mismatches that are not near ties, L0.attn_out rel L2 " << l0_err;
  }
}

}  // namespace
}  // namespace kestrel::gputest
