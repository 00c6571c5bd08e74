// The accuracy of --quantization ptpc-fp8 (model/cuda/linear.h) against the BF16 GPU model: the golden
// prompts (tests/golden/nano/golden.json, the token lists of the reference's cases) through every checkpoint
// of KESTREL_GPU_CKPTS and through the trained k3-tiny (models/k3-tiny, the repository's), prefill with
// logits at every position, then 8 greedy steps teacher-forced with the BF16 model's tokens. Printed per
// checkpoint: logits rel L2 (all positions, and the worst position), and how often the FP8 argmax equals
// the BF16 one. Bounds (failing on a broken FP8 path, e.g. a wrong scale gives rel L2 ≈ 1): on the random
// checkpoints the rel L2 over all positions ≤ 0.1 and the worst position ≤ 0.25 (measured 4e-3..6e-3 and
// ≤ 1.2e-2); on the trained k3-tiny, whose outliers cost FP8 more (measured 0.108, worst position 4.1,
// 87.4 % greedy agreement), rel L2 ≤ 0.2 and agreement ≥ 80 %.
// Paths are relative to the repository root (bench/gpu/run.sh runs from there); KESTREL_SOURCE_DIR overrides.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "harness.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"

namespace kestrel::gputest {
namespace {

std::string source_dir() {
  const char* e = std::getenv("KESTREL_SOURCE_DIR");
  return e ? e : ".";
}

std::vector<std::vector<int32_t>> golden_prompts() {
  std::ifstream in(source_dir() + "/tests/golden/nano/golden.json");
  std::vector<std::vector<int32_t>> out;
  if (!in) return out;
  const nlohmann::json j = nlohmann::json::parse(in);
  for (const auto& c : j.at("cases"))  // the "batch" case carries several sequences, not one token list
    if (c.contains("tokens")) out.push_back(c.at("tokens").get<std::vector<int32_t>>());
  return out;
}

// Logits of the prompt (every position) and of `decode` teacher-forced tokens after it.
std::vector<float> run(model::CudaModel& m, const std::vector<int32_t>& prompt, const std::vector<int32_t>& decode,
                       int64_t V) {
  const int P = 16;
  const int64_t total = int64_t(prompt.size() + decode.size()) + 1;
  std::vector<int32_t> table(size_t((total + P - 1) / P));
  std::iota(table.begin(), table.end(), 0);
  auto cache = m.new_cache(int32_t(table.size()), 1,
                           CacheFormats{P, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
  std::vector<float> out(prompt.size() * size_t(V));
  const model::CudaSeq q{prompt, 0, 0, table, model::CudaSeq::Logits::all};
  m.forward_batch(*cache, std::span<const model::CudaSeq>(&q, 1));
  m.copy_logits(out.data());
  std::vector<float> row(static_cast<size_t>(V));
  for (size_t i = 0; i < decode.size(); ++i) {
    const model::CudaSeq d{std::span<const int32_t>(&decode[i], 1), int64_t(prompt.size() + i), 0, table,
                           model::CudaSeq::Logits::last};
    m.forward_batch(*cache, std::span<const model::CudaSeq>(&d, 1));
    m.copy_logits(row.data());
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

TEST(GpuFp8, LogitsVsBf16OnGoldenPrompts) {
  ASSERT_GT(cuda::device_count(), 0);
  const auto prompts = golden_prompts();
  ASSERT_FALSE(prompts.empty()) << "cannot read tests/golden/nano/golden.json under " << source_dir();
  std::vector<std::pair<std::string, bool>> dirs;  // (dir, trained)
  for (const std::string& d : gpu_ckpt_dirs()) dirs.push_back({d, false});
  const std::string tiny = source_dir() + "/models/k3-tiny";
  if (std::filesystem::exists(tiny + "/config.json")) dirs.push_back({tiny, true});
  ASSERT_FALSE(dirs.empty()) << "no checkpoint: set KESTREL_GPU_CKPTS or run from the repository root";
  const int G = 8;
  for (const auto& [dir, trained] : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;
    model::CudaModel bf(cfg, w);
    model::CudaModelOptions o;
    o.quant = model::WeightQuant::ptpc_fp8;
    model::CudaModel f8(cfg, w, o);
    double num = 0, den = 0, worst = 0;
    int64_t positions = 0, agree = 0;
    for (const auto& p0 : prompts) {
      std::vector<int32_t> prompt;
      for (int32_t t : p0) prompt.push_back(int32_t(t % V));
      // The BF16 model's greedy continuation, then both models teacher-forced with it.
      std::vector<int32_t> cont;
      {
        std::vector<float> lg = run(bf, prompt, {}, V);
        std::vector<int32_t> ctx = prompt;
        for (int g = 0; g < G; ++g) {
          const float* last = lg.data() + (lg.size() / size_t(V) - 1) * size_t(V);
          cont.push_back(int32_t(std::max_element(last, last + V) - last));
          lg = run(bf, prompt, cont, V);
        }
      }
      const auto a = run(bf, prompt, std::vector<int32_t>(cont.begin(), cont.end() - 1), V);
      const auto b = run(f8, prompt, std::vector<int32_t>(cont.begin(), cont.end() - 1), V);
      ASSERT_EQ(a.size(), b.size());
      const int64_t n = int64_t(a.size()) / V;
      for (int64_t r = 0; r < n; ++r) {
        double rn = 0, rd = 0;
        for (int64_t i = 0; i < V; ++i) {
          const double d = double(b[size_t(r * V + i)]) - a[size_t(r * V + i)];
          rn += d * d, rd += double(a[size_t(r * V + i)]) * a[size_t(r * V + i)];
        }
        num += rn, den += rd;
        worst = std::max(worst, std::sqrt(rn / std::max(rd, 1e-30)));
        const float* ra = a.data() + r * V;
        const float* rb = b.data() + r * V;
        agree += (std::max_element(ra, ra + V) - ra) == (std::max_element(rb, rb + V) - rb);
        ++positions;
      }
    }
    const double rel = std::sqrt(num / den);
    const std::string name = std::filesystem::path(dir).filename().string();
    note(fmt::format("{:<28} {:<34} logits rel L2 {:.3e} (worst position {:.3e}), argmax equal at {}/{} positions "
                     "({:.1f} %), {} golden prompts",
                     "ptpc-fp8 vs bf16 (GPU)", fmt::format("{} L={} V={}", name, cfg.text.num_hidden_layers, V), rel,
                     worst, agree, positions, 100.0 * double(agree) / double(positions), prompts.size()));
    std::cout << fmt::format("PERF fp8_logits_rel_l2_{} {:.4e}\nPERF fp8_greedy_agree_pct_{} {:.1f}\n", name, rel,
                             name, 100.0 * double(agree) / double(positions));
    if (!trained) {
      EXPECT_LE(rel, 0.1) << name;
      EXPECT_LE(worst, 0.25) << name;
    } else {
      // Measured on the H200 (2026-12-01): rel L2 0.108, worst position 4.1, argmax equal at 87.4 % — the
      // trained model's activation outliers cost PTPC FP8 real accuracy (why BF16 stays the default).
      // The bounds catch a broken path (a wrong scale gives rel L2 ≈ 1 and chance agreement), not that.
      EXPECT_LE(rel, 0.2) << name;
      EXPECT_GE(double(agree) / double(positions), 0.8) << name;
    }
  }
}

}  // namespace
}  // namespace kestrel::gputest
