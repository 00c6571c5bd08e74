// The CPU vision tower (src/vision, MODEL.md §6) and image rows in the text model (§3.1), against the
// golden data of reference/make_golden_vision.py (tests/golden/nano-vision: numpy FP64 vision reference,
// torch FP64 text reference with the rows injected) on the nano seed-1 checkpoint of $KESTREL_NANO_DIR.
//
// Tolerances: the engine rounds to BF16 at the same points as the reference but accumulates in FP32, so
// a stage differs by BF16 rounding flips only: relative L2 ≤ 1e-2 at every captured stage of each image
// (measured ≤ 6.2e-3), logits of the prompt with images ≤ 2e-2 with the same greedy token on every row
// (MODEL.md §0.10), measured 4.2e-3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/dtype.h"
#include "loader/safetensors.h"
#include "model/model.h"
#include "nano_checkpoint.h"
#include "sha256.h"
#include "vision/layers.h"
#include "vision/vision.h"

namespace kestrel {
namespace {

struct GoldenVision {
  nlohmann::json meta;
  std::unique_ptr<SafetensorsFile> tensors;
  std::string error;  // the checkpoint is missing or not the one the data came from

  std::vector<float> f32(const std::string& name) const {
    const TensorInfo* t = tensors->find(name);
    if (!t) throw std::runtime_error("golden.safetensors has no tensor " + name);
    const TensorView v = tensors->view(*t);
    std::vector<float> out(size_t(v.numel()));
    for (int64_t i = 0; i < v.numel(); ++i)
      out[size_t(i)] = v.dtype == DType::bf16 ? bf16_to_f32(v.as<const uint16_t>()[i]) : v.as<const float>()[i];
    return out;
  }
};

const GoldenVision& golden() {
  static const GoldenVision g = [] {
    GoldenVision g;
    const std::string dir = std::string(KESTREL_SOURCE_DIR) + "/tests/golden/nano-vision";
    std::ifstream in(dir + "/golden.json");
    if (!in) throw std::runtime_error("cannot read " + dir + "/golden.json");
    g.meta = nlohmann::json::parse(in);
    g.tensors = std::make_unique<SafetensorsFile>(dir + "/golden.safetensors");
    const char* env = std::getenv("KESTREL_NANO_DIR");
    if (!env || !*env) {
      g.error = "KESTREL_NANO_DIR is not set";
      return g;
    }
    for (const auto& [file, want] : g.meta["checkpoint"]["sha256"].items())
      if (testing::sha256_file(std::string(env) + "/" + file) != want.get<std::string>())
        g.error += fmt::format("{}/{} differs from the checkpoint of the golden data; regenerate: {}\n", env, file,
                               g.meta["regenerate"].dump());
    return g;
  }();
  return g;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double n = 0, d = 0;
  for (size_t i = 0; i < a.size(); ++i) n += double(a[i] - b[i]) * (a[i] - b[i]), d += double(b[i]) * b[i];
  return std::sqrt(n / d);
}

std::vector<float> to_f32(const TensorView& v) {
  std::vector<float> out(size_t(v.numel()));
  for (int64_t i = 0; i < v.numel(); ++i) out[size_t(i)] = bf16_to_f32(v.as<const uint16_t>()[i]);
  return out;
}
std::vector<float> to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(v[i]);
  return out;
}

ImageInput golden_image(const GoldenVision& g, int i) {
  const auto& m = g.meta["images"][size_t(i)];
  ImageInput im;
  im.grid_h = m["grid_h"].get<int>();
  im.grid_w = m["grid_w"].get<int>();
  im.patches = g.f32(fmt::format("img{}.patches", i));
  im.content_hash = uint64_t(i + 1);
  return im;
}

// A deterministic image different from the golden ones (values in [-1, 1]).
ImageInput synthetic_image(int gh, int gw, int seed) {
  ImageInput im;
  im.grid_h = gh;
  im.grid_w = gw;
  im.patches.resize(size_t(gh) * gw * 588);
  for (size_t k = 0; k < im.patches.size(); ++k) im.patches[k] = float(std::sin(0.37 * double(k) + seed * 1.3));
  return im;
}

#define REQUIRE_GOLDEN(g)             \
  const GoldenVision& g = golden();   \
  ASSERT_TRUE(g.error.empty()) << g.error;

TEST(Vision, EveryStageOfEveryImageMatchesTheReference) {
  REQUIRE_GOLDEN(g);
  const auto& n = testing::nano_checkpoint();
  ASSERT_TRUE(n.w.has_vision);
  EXPECT_FLOAT_EQ(n.cfg.vision.rms_norm_eps, g.meta["reference"]["vision_rms_norm_eps"].get<float>());
  const int layers = n.cfg.vision.num_layers;
  double worst = 0;
  for (size_t i = 0; i < g.meta["images"].size(); ++i) {
    const ImageInput im = golden_image(g, int(i));
    std::map<std::string, std::vector<float>> cap;
    const model::Observer obs = [&](std::string_view name, const TensorView& t) { cap[std::string(name)] = to_f32(t); };
    const ImageInput* one[] = {&im};
    const std::vector<uint16_t> out = vision::encode(n.w.vision, n.cfg.vision, one, &obs);
    ASSERT_EQ(int64_t(out.size()), im.num_tokens() * n.cfg.text.hidden_size);
    std::vector<std::string> stages = {"embed", "final", "out"};
    for (int b = 0; b < layers; ++b) stages.push_back(fmt::format("B{}", b));
    for (const std::string& s : stages) {
      const std::vector<float> want = g.f32(fmt::format("img{}.{}", i, s));
      ASSERT_EQ(cap[s].size(), want.size()) << s;
      const double r = rel_l2(cap[s], want);
      worst = std::max(worst, r);
      EXPECT_LE(r, 1e-2) << "image " << i << " (" << im.grid_h << "x" << im.grid_w << ") stage " << s;
    }
    EXPECT_EQ(to_f32(out), cap["out"]);
  }
  fmt::print("vision vs reference: worst stage rel L2 {:.2e} over {} images\n", worst, g.meta["images"].size());
}

TEST(Vision, ImagesOfOneCallDoNotSeeEachOther) {
  REQUIRE_GOLDEN(g);
  const auto& n = testing::nano_checkpoint();
  std::vector<ImageInput> ims;
  for (size_t i = 0; i < g.meta["images"].size(); ++i) ims.push_back(golden_image(g, int(i)));
  std::vector<const ImageInput*> all;
  std::vector<uint16_t> alone;
  for (const ImageInput& im : ims) {
    all.push_back(&im);
    const ImageInput* one[] = {&im};
    const std::vector<uint16_t> r = vision::encode(n.w.vision, n.cfg.vision, one);
    alone.insert(alone.end(), r.begin(), r.end());
  }
  EXPECT_EQ(vision::encode(n.w.vision, n.cfg.vision, all), alone);  // row-invariant GEMMs: bit-identical
}

TEST(Vision, PositionTableResizeIsBilinearHalfPixel) {
  // torch F.interpolate(bilinear, align_corners=False) of [0, 1] (2 rows, 1 column) to 4 rows:
  // sources −0.25→0, 0.25, 0.75, 1.25→clamped: 0, 0.25, 0.75, 1.
  const uint16_t table[] = {f32_to_bf16(0.0f), f32_to_bf16(1.0f)};
  uint16_t out[4];
  vision::resize_pos_table(table, 2, 1, 1, 4, 1, out);
  EXPECT_EQ(bf16_to_f32(out[0]), 0.0f);
  EXPECT_EQ(bf16_to_f32(out[1]), 0.25f);
  EXPECT_EQ(bf16_to_f32(out[2]), 0.75f);
  EXPECT_EQ(bf16_to_f32(out[3]), 1.0f);
  // same size: the identity
  const uint16_t t2[] = {f32_to_bf16(1.5f), f32_to_bf16(-2.0f), f32_to_bf16(3.25f), f32_to_bf16(7.0f)};
  uint16_t o2[4];
  vision::resize_pos_table(t2, 2, 2, 1, 2, 2, o2);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(o2[k], t2[k]);
}

TEST(Vision, RopeTurnsEvenPairsByColumnAndOddPairsByRow) {
  // head_dim 8: pairs 0..3; f_0 = 1, f_1 = 10000^(−1/2) = 0.01. Patch (row 1, col 2) of a 2×3 grid.
  std::vector<uint16_t> x(6 * 8, f32_to_bf16(0.0f));
  for (int j = 0; j < 4; ++j) x[5 * 8 + 2 * j] = f32_to_bf16(1.0f);
  vision::rope_2d(x.data(), 8, 2, 3, 1, 8);
  const double ang[4] = {2.0, 1.0, 2.0 * 0.01, 1.0 * 0.01};  // col·f0, row·f0, col·f1, row·f1
  for (int j = 0; j < 4; ++j) {
    EXPECT_NEAR(bf16_to_f32(x[5 * 8 + 2 * j]), std::cos(ang[j]), 4e-3) << j;
    EXPECT_NEAR(bf16_to_f32(x[5 * 8 + 2 * j + 1]), std::sin(ang[j]), 4e-3) << j;
  }
}

TEST(Vision, BadImagesAreClearErrors) {
  const auto& n = testing::nano_checkpoint();
  ImageInput odd = synthetic_image(2, 2, 0);
  odd.grid_w = 3;
  odd.patches.resize(size_t(2 * 3 * 588));
  ImageInput short_ = synthetic_image(2, 2, 0);
  short_.patches.pop_back();
  ImageInput nan = synthetic_image(2, 2, 0);
  nan.patches[7] = std::nanf("");
  for (const ImageInput* im : {&odd, &short_, &nan}) {
    const ImageInput* one[] = {im};
    EXPECT_THROW(vision::encode(n.w.vision, n.cfg.vision, one), Error);
  }
  VisionConfig none;  // a --no-vision checkpoint
  const ImageInput ok = synthetic_image(2, 2, 0);
  const ImageInput* one[] = {&ok};
  EXPECT_THROW(vision::encode(VisionWeights{}, none, one), Error);
}

// The text model with the image rows at the <|media_pad|> positions (model::EmbedOverride).
std::vector<float> prompt_logits(const testing::NanoCheckpoint& n, const std::vector<int32_t>& toks,
                                 const std::vector<const ImageInput*>& ims) {
  const int32_t pad = n.cfg.media_placeholder_token_id;
  const std::vector<uint16_t> rows = vision::encode(n.w.vision, n.cfg.vision, ims);
  std::vector<model::EmbedOverride> ov;
  for (size_t j = 0; j < toks.size(); ++j)
    if (toks[j] == pad) ov.push_back({int64_t(j), rows.data() + int64_t(ov.size()) * n.cfg.text.hidden_size});
  KCHECK(int64_t(ov.size()) == vision::num_tokens(ims), "pads {} != image tokens", ov.size());
  model::State st(n.cfg);
  model::ForwardOptions opt;
  opt.embed_override = ov;
  std::vector<float> logits(toks.size() * size_t(n.cfg.text.vocab_size));
  model::prefill(n.w, n.cfg, st, toks, logits.data(), opt);
  return logits;
}

TEST(Vision, PromptWithImagesMatchesTheReferenceLogits) {
  REQUIRE_GOLDEN(g);
  const auto& n = testing::nano_checkpoint();
  const std::vector<int32_t> toks = g.meta["prompt"]["tokens"].get<std::vector<int32_t>>();
  ASSERT_EQ(g.meta["prompt"]["media_pad_id"].get<int32_t>(), n.cfg.media_placeholder_token_id);
  const ImageInput a = golden_image(g, 0), b = golden_image(g, 1);
  const std::vector<float> got = prompt_logits(n, toks, {&a, &b});
  const std::vector<float> want = g.f32("prompt.logits");
  ASSERT_EQ(got.size(), want.size());
  const double r = rel_l2(got, want);
  fmt::print("prompt with images vs reference: logits rel L2 {:.2e}\n", r);
  EXPECT_LE(r, 2e-2);
  const int64_t V = n.cfg.text.vocab_size;
  for (size_t r = 0; r < toks.size(); ++r) {
    auto argmax = [&](const std::vector<float>& l) {
      return std::max_element(l.begin() + int64_t(r) * V, l.begin() + int64_t(r + 1) * V) - (l.begin() + int64_t(r) * V);
    };
    EXPECT_EQ(argmax(got), argmax(want)) << "row " << r;
  }
}

TEST(Vision, LogitsDependOnTheImageAndOnlyOnIt) {
  const auto& n = testing::nano_checkpoint();
  const int32_t pad = n.cfg.media_placeholder_token_id;
  std::vector<int32_t> toks = {5, 77, 301};
  toks.insert(toks.end(), 6, pad);
  toks.insert(toks.end(), {12, 400, 9});
  const ImageInput a = synthetic_image(4, 6, 1), b = synthetic_image(4, 6, 2);
  ImageInput a2 = a;  // the same pixels, another object
  const std::vector<float> la = prompt_logits(n, toks, {&a}), la2 = prompt_logits(n, toks, {&a2}),
                           lb = prompt_logits(n, toks, {&b});
  EXPECT_EQ(la, la2);
  const int64_t V = n.cfg.text.vocab_size;
  // rows before the image are untouched (causal); the image rows and every later row move
  for (size_t r = 0; r < toks.size(); ++r) {
    const std::vector<float> ra(la.begin() + int64_t(r) * V, la.begin() + int64_t(r + 1) * V),
        rb(lb.begin() + int64_t(r) * V, lb.begin() + int64_t(r + 1) * V);
    if (r < 3)
      EXPECT_EQ(ra, rb) << r;
    else
      EXPECT_GT(rel_l2(ra, rb), 1e-3) << r;
  }
}

}  // namespace
}  // namespace kestrel
