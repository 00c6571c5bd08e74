// The 2×2 merge (`sd2_tpool`) and the `patchmergerv2` projector (MODEL.md §6):
//   m  = [TL | TR | BL | BR] of each 2×2 group of the (final-normed) patches, merged grid row-major
//        (t = 1 for images, so the temporal mean is the identity)       bf16 [h/2·w/2, 4·Dvt]
//   out = RMSNorm_post(Lin(proj.2)(gelu_erf(Lin(proj.0)(m))), eps = projector_ln_eps)   bf16 [·, D]
// Every image's merged rows are stacked first, so both GEMMs run once for the call.
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "vision/layers.h"

namespace kestrel::vision {

void merge_project(const VisionWeights& w, const VisionConfig& c, std::span<const ImageRows> imgs, const uint16_t* y,
                   uint16_t* out) {
  const int64_t Dvt = c.hidden_size, M = c.merged_width(), D = c.text_hidden_size;
  KCHECK(c.merge_kernel_h == 2 && c.merge_kernel_w == 2, "merge kernel {}x{}: only 2x2 (sd2_tpool) is implemented",
         c.merge_kernel_h, c.merge_kernel_w);
  int64_t tokens = 0;
  for (const ImageRows& im : imgs) tokens += int64_t(im.grid_h / 2) * (im.grid_w / 2);
  std::vector<uint16_t> m(static_cast<size_t>(tokens * M));  // bf16 [Σ tokens, 4·Dvt]
  int64_t r = 0;
  for (const ImageRows& im : imgs)
    for (int gy = 0; gy < im.grid_h / 2; ++gy)
      for (int gx = 0; gx < im.grid_w / 2; ++gx, ++r)
        for (int k = 0; k < 4; ++k) {  // (kh, kw) row-major: TL, TR, BL, BR
          const int64_t src = im.row0 + int64_t(2 * gy + k / 2) * im.grid_w + (2 * gx + k % 2);
          std::memcpy(m.data() + (r * 4 + k) * Dvt, y + src * Dvt, size_t(Dvt) * 2);
        }
  std::vector<uint16_t> a(static_cast<size_t>(tokens * M)), b(static_cast<size_t>(tokens * D));  // bf16 [Σ tokens, 4·Dvt], [Σ tokens, D]
  cpu::gemm_bf16(m.data(), M, model::bf16_ptr(w.proj0), a.data(), M, tokens, M, M);
  cpu::parallel_for(tokens, tokens * M * 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * M; i < hi * M; ++i) {  // exact (erf) GELU
      const float v = bf16_to_f32(a[size_t(i)]);
      a[size_t(i)] = f32_to_bf16(0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f)));
    }
  });
  cpu::gemm_bf16(a.data(), M, model::bf16_ptr(w.proj2), b.data(), D, tokens, M, D);
  cpu::rmsnorm_bf16(b.data(), model::bf16_ptr(w.post_norm), out, tokens, D, c.projector_ln_eps);
}

}  // namespace kestrel::vision
