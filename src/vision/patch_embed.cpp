// MoonViT-V2 patch embedding (MODEL.md §6 "Patch embed"): Conv2d(3 → Dvt, kernel p, stride p, no bias)
// as one GEMM over the 3·p·p values of each patch (the contract's patch layout (c, y, x) is the conv
// weight's [Dvt, 3, p, p]), plus the learned position table [h0, w0, Dvt], bilinearly resized to the
// image's grid when it differs (torch F.interpolate, align_corners=False, no antialias).
//
// Numerics: pixels are rounded to BF16 (they enter a BF16 conv); the GEMM rounds once; the resized
// table is interpolated in FP64 and rounded once (the table is BF16); the sum is rounded once.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "vision/layers.h"

namespace kestrel::vision {
namespace {

struct Axis {  // source taps of one output index along one axis
  int i0 = 0, i1 = 0;
  double lam = 0.0;  // weight of i1
};

// torch's area_pixel_compute_source_index for align_corners=False: s = (o + ½)·(in/out) − ½, s ≥ 0.
std::vector<Axis> axis_taps(int n_in, int n_out) {
  std::vector<Axis> a(static_cast<size_t>(n_out));
  const double scale = double(n_in) / double(n_out);
  for (int o = 0; o < n_out; ++o) {
    const double s = std::max((o + 0.5) * scale - 0.5, 0.0);
    const int i0 = std::min(int(std::floor(s)), n_in - 1);
    a[size_t(o)] = {i0, std::min(i0 + 1, n_in - 1), s - i0};
  }
  return a;
}

}  // namespace

void resize_pos_table(const uint16_t* table, int h0, int w0, int64_t dim, int h, int w, uint16_t* out) {
  KCHECK(h0 > 0 && w0 > 0 && h > 0 && w > 0 && dim > 0, "bad position-table resize {}x{} -> {}x{}", h0, w0, h, w);
  const std::vector<Axis> ry = axis_taps(h0, h), rx = axis_taps(w0, w);
  auto at = [&](int y, int x, int64_t d) { return double(bf16_to_f32(table[(int64_t(y) * w0 + x) * dim + d])); };
  cpu::parallel_for(h, int64_t(h) * w * dim * 8, [&](int64_t b, int64_t e) {
    for (int64_t y = b; y < e; ++y) {
      const Axis& ay = ry[size_t(y)];
      for (int x = 0; x < w; ++x) {
        const Axis& ax = rx[size_t(x)];
        uint16_t* o = out + (y * w + x) * dim;
        for (int64_t d = 0; d < dim; ++d) {  // separable: along x on both rows, then along y
          const double top = at(ay.i0, ax.i0, d) * (1 - ax.lam) + at(ay.i0, ax.i1, d) * ax.lam;
          const double bot = at(ay.i1, ax.i0, d) * (1 - ax.lam) + at(ay.i1, ax.i1, d) * ax.lam;
          o[d] = f32_to_bf16(float(top * (1 - ay.lam) + bot * ay.lam));
        }
      }
    }
  });
}

void patch_embed(const VisionWeights& w, const VisionConfig& c, std::span<const ImageRows> imgs,
                 std::span<const float* const> patches, uint16_t* x) {
  const int64_t Dvt = c.hidden_size, P = int64_t(3) * c.patch_size * c.patch_size;
  const int h0 = c.init_pos_emb_height, w0 = c.init_pos_emb_width;
  const uint16_t* W = model::bf16_ptr(w.patch_embed);  // bf16 [Dvt, 3·p·p]
  const uint16_t* table = model::bf16_ptr(w.pos_emb);  // bf16 [h0, w0, Dvt]
  std::vector<uint16_t> px, pos;
  for (size_t i = 0; i < imgs.size(); ++i) {
    const ImageRows& im = imgs[i];
    const int64_t N = im.n();
    px.resize(size_t(N * P));  // bf16 [N, 3·p·p]
    cpu::f32_to_bf16_n(patches[i], px.data(), N * P);
    uint16_t* xi = x + im.row0 * Dvt;
    cpu::gemm_bf16(px.data(), P, W, xi, Dvt, N, P, Dvt);
    const uint16_t* p = table;
    if (im.grid_h != h0 || im.grid_w != w0) {
      pos.resize(size_t(N * Dvt));  // bf16 [grid_h, grid_w, Dvt]
      resize_pos_table(table, h0, w0, Dvt, im.grid_h, im.grid_w, pos.data());
      p = pos.data();
    }
    cpu::add_bf16(xi, p, xi, N * Dvt);
  }
}

}  // namespace kestrel::vision
