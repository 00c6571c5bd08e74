// GpuVision.*: the MoonViT-V2 GPU kernels (kernels/cuda/vision.h) and the whole GPU encoder
// (vision/cuda/vision_cuda.h) against their CPU twins in src/vision, over shape tables at the nano
// head_dim (16) and the real one (128), random inputs, NaN-poisoned outputs.
//
// Tolerances: RoPE is the same arithmetic up to the angle's precision (FP32 sincos of an FP64 angle vs FP64
// cos/sin): 1 BF16 ulp. Attention: the GPU feeds the probabilities to P·V in BF16 (the CPU twin keeps FP32)
// and sums in another order: |Δ| ≤ 2e-2 + 2e-2·|ref|, rel L2 ≤ 1e-2. The encoder (2 blocks, random weights,
// each stage re-rounded to BF16): rel L2 ≤ 3e-2 at the output rows.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "harness.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/vision.h"
#include "vision/cuda/vision_cuda.h"
#include "vision/layers.h"
#include "vision/vision.h"

namespace kestrel {
namespace {

using gputest::Rng;

TEST(GpuVision, AttentionMatchesCpuTwin) {
  struct Case {
    int head_dim, heads;
    std::vector<int> rows;  // per image
  };
  // Row counts around the 64-key tile (the two-stage pipeline's last prefetch: N = 64, 128 exactly), and one
  // long image (16 tiles: the stages swap 16 times).
  const std::vector<Case> cases = {{16, 2, {4, 64, 1}},    {16, 2, {130}},           {32, 3, {65, 7}},
                                   {128, 2, {63, 64, 65}}, {128, 12, {200, 2, 129}}, {128, 1, {1}},
                                   {128, 2, {128, 192}},   {128, 2, {1000, 3}},      {32, 2, {1024}}};
  Rng rng(11);
  for (const Case& c : cases) {
    const int64_t Wq = int64_t(c.heads) * c.head_dim, ld = 3 * Wq;
    std::vector<int32_t> row0{0};
    int64_t max_rows = 0;
    for (int n : c.rows) row0.push_back(row0.back() + n), max_rows = std::max<int64_t>(max_rows, n);
    const int64_t T = row0.back();
    const std::vector<uint16_t> qkv = gputest::rand_bf16(size_t(T * ld), rng, -2.0f, 2.0f);
    std::vector<uint16_t> ref(size_t(T * Wq));
    for (size_t i = 0; i < c.rows.size(); ++i)
      vision::attention(qkv.data() + row0[i] * ld, ld, c.rows[i], c.heads, c.head_dim, ref.data() + row0[i] * Wq);
    auto d_qkv = gputest::upload(qkv);
    auto d_row0 = gputest::upload(row0);
    auto d_o = gputest::poisoned<uint16_t>(size_t(T * Wq));
    cuda::vision_attention(d_qkv.p(), ld, Wq, d_row0.p(), int(c.rows.size()), max_rows, c.heads, c.head_dim, d_o.p(),
                           Wq, nullptr);
    gputest::sync();
    std::string shape = fmt::format("dv={} H={} N=", c.head_dim, c.heads);
    for (int n : c.rows) shape += fmt::format("{},", n);
    gputest::check_bf16("vision_attention", shape, d_o.get(), ref, {2e-2, 2e-2, 1e-2});
  }
}

TEST(GpuVision, RopeMatchesCpuTwin) {
  struct Case {
    int gh, gw, heads, head_dim;
  };
  Rng rng(12);
  for (const Case& c : std::vector<Case>{{2, 2, 2, 16}, {6, 4, 2, 16}, {74, 74, 12, 128}, {10, 12, 3, 32}}) {
    const int64_t T = int64_t(c.gh) * c.gw, Wq = int64_t(c.heads) * c.head_dim, ld = 3 * Wq;
    const std::vector<uint16_t> qkv = gputest::rand_bf16(size_t(T * ld), rng, -2.0f, 2.0f);
    std::vector<uint16_t> ref = qkv;
    vision::rope_2d(ref.data(), ld, c.gh, c.gw, c.heads, c.head_dim);
    vision::rope_2d(ref.data() + Wq, ld, c.gh, c.gw, c.heads, c.head_dim);
    std::vector<int32_t> rc;
    for (int64_t t = 0; t < T; ++t) rc.push_back(int32_t(t / c.gw)), rc.push_back(int32_t(t % c.gw));
    auto d = gputest::upload(qkv);
    auto d_rc = gputest::upload(rc);
    cuda::vision_rope_qk(d.p(), ld, Wq, d_rc.p(), T, c.heads, c.head_dim, nullptr);
    gputest::sync();
    // one BF16 ulp at |x| ≤ 2√2 is 2^-6; v (untouched) must stay bit-identical
    gputest::check_bf16("vision_rope_qk", fmt::format("{}x{} H={} dv={}", c.gh, c.gw, c.heads, c.head_dim), d.get(),
                        ref, {1.6e-2, 8e-3, 4e-3});
    const std::vector<uint16_t> got = d.get();
    for (int64_t t = 0; t < T; ++t)
      ASSERT_EQ(0, std::memcmp(got.data() + t * ld + 2 * Wq, qkv.data() + t * ld + 2 * Wq, size_t(Wq) * 2)) << t;
  }
}

// Random host weights of a vision config (nn.Linear-like scales; norm weights near 1).
struct HostVision {
  VisionConfig c;
  std::vector<std::vector<uint16_t>> store;
  VisionWeights w;
  TensorView make(Shape s, Rng& r, float lo, float hi) {
    int64_t n = 1;
    for (int i = 0; i < s.rank; ++i) n *= s[i];
    store.push_back(gputest::rand_bf16(size_t(n), r, lo, hi));
    return TensorView(store.back().data(), DType::bf16, s);
  }
  HostVision(int Dvt, int heads, int qkv, int Fvt, int layers, int D, int h0, int w0, uint64_t seed) {
    c.present = true;
    c.hidden_size = Dvt, c.num_heads = heads, c.qkv_hidden_size = qkv, c.intermediate_size = Fvt;
    c.num_layers = layers, c.text_hidden_size = D, c.init_pos_emb_height = h0, c.init_pos_emb_width = w0;
    Rng r(seed);
    store.reserve(size_t(16 + 6 * layers));  // TensorViews point into it: no reallocation
    auto lin = [&](int64_t out, int64_t in) {
      const float a = std::sqrt(3.0f / float(in));
      return make(Shape{out, in}, r, -a, a);
    };
    auto norm = [&](int64_t n) { return make(Shape{n}, r, 0.9f, 1.1f); };
    const float pa = std::sqrt(3.0f / 588.0f);
    w.patch_embed = make(Shape{Dvt, 3, 14, 14}, r, -pa, pa);
    w.pos_emb = make(Shape{h0, w0, Dvt}, r, -0.05f, 0.05f);
    for (int b = 0; b < layers; ++b)
      w.blocks.push_back({norm(Dvt), norm(Dvt), lin(3 * qkv, Dvt), lin(Dvt, qkv), lin(Fvt, Dvt), lin(Dvt, Fvt)});
    w.final_norm = norm(Dvt);
    w.proj0 = lin(4 * Dvt, 4 * Dvt);
    w.proj2 = lin(D, 4 * Dvt);
    w.post_norm = norm(D);
  }
};

std::shared_ptr<ImageInput> rand_image(int gh, int gw, Rng& r) {
  auto im = std::make_shared<ImageInput>();
  im->grid_h = gh, im->grid_w = gw;
  im->patches = gputest::rand_f32(size_t(gh) * gw * 588, r, -1.0f, 1.0f);
  return im;
}

TEST(GpuVision, EncoderMatchesCpuEncoder) {
  struct Case {
    const char* name;
    int Dvt, heads, qkv, Fvt, layers, D, h0, w0;
    std::vector<std::pair<int, int>> grids;
  };
  const std::vector<Case> cases = {
      {"nano dims (dv 16)", 32, 2, 32, 64, 2, 256, 8, 8, {{2, 2}, {4, 6}, {8, 8}, {12, 10}}},
      {"dv 128", 256, 2, 256, 512, 2, 512, 8, 8, {{10, 12}, {8, 8}, {2, 2}, {16, 14}}},
  };
  Rng rng(13);
  for (const Case& k : cases) {
    HostVision hv(k.Dvt, k.heads, k.qkv, k.Fvt, k.layers, k.D, k.h0, k.w0, 100);
    std::vector<std::shared_ptr<ImageInput>> ims;
    std::vector<const ImageInput*> ptrs;
    for (auto [gh, gw] : k.grids) ims.push_back(rand_image(gh, gw, rng)), ptrs.push_back(ims.back().get());
    const std::vector<uint16_t> ref = vision::encode(hv.w, hv.c, ptrs);
    std::vector<cuda::DeviceBuffer> keep;
    vision::VisionCuda enc(hv.c, vision::VisionCuda::upload(hv.w, keep));
    auto out = gputest::poisoned<uint16_t>(ref.size());
    enc.encode(ptrs, out.p(), nullptr);
    gputest::sync();
    gputest::check_bf16("vision encoder", k.name, out.get(), ref, {6e-2, 6e-2, 3e-2});
    // a second call reuses the scratch and the resized tables: the same rows, bit for bit
    auto again = gputest::poisoned<uint16_t>(ref.size());
    enc.encode(ptrs, again.p(), nullptr);
    gputest::sync();
    gputest::check_exact("vision encoder (again)", k.name, again.get().data(), out.get().data(), ref.size() * 2);
  }
}

}  // namespace
}  // namespace kestrel
