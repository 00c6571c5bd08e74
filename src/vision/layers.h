// The layers of the vision tower (MODEL.md §6), one file each; used by vision.cpp only.
// Letters: Dvt vision width, Fvt its MLP width, Hv heads, dv head dim, p patch size, N patches of an
// image, ΣN of all the call's images, D text width.
#pragma once

#include <cstdint>
#include <span>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/common.h"

namespace kestrel::vision {

struct ImageRows {  // one image's patches inside the stacked rows
  int64_t row0 = 0;  // first row in [ΣN, ·]
  int grid_h = 0, grid_w = 0;
  int64_t n() const { return int64_t(grid_h) * grid_w; }
};

// patch_embed.cpp: x = bf16(Lin(W_patch)(bf16(patches)) + pos), pos the table or its bilinear resize.
void patch_embed(const VisionWeights& w, const VisionConfig& c, std::span<const ImageRows> imgs,
                 std::span<const float* const> patches /* per image f32 [N, 3·p·p] */,
                 uint16_t* x /* bf16 [ΣN, Dvt] */);
// The resized table (torch F.interpolate bilinear, align_corners=False), BF16-rounded: bf16 [h, w, Dvt].
void resize_pos_table(const uint16_t* table /* bf16 [h0, w0, Dvt] */, int h0, int w0, int64_t dim, int h, int w,
                      uint16_t* out /* bf16 [h, w, Dvt] */);

// block.cpp: one pre-norm encoder block, in place on the stream x.
void encoder_block(const VisionBlockWeights& b, const VisionConfig& c, std::span<const ImageRows> imgs,
                   uint16_t* x /* bf16 [ΣN, Dvt] */, int64_t total_rows);
// 2-D RoPE of one image's q or k rows, in FP32, rounded to BF16 (exposed for the unit test).
void rope_2d(uint16_t* x /* bf16 [N, Hv, dv], row stride ld */, int64_t ld, int grid_h, int grid_w, int heads,
             int head_dim);

// o = softmax(q kᵀ · dv^−½) v over one image's N rows, every head, FP32, rounded once (the GPU kernel's twin).
void attention(const uint16_t* qkv /* bf16 [N, 3, Hv, dv], row stride ld */, int64_t ld, int64_t N, int heads,
               int dv, uint16_t* o /* bf16 [N, Hv·dv] */);

// projector.cpp: final RMSNorm is the caller's; 2×2 merge + Lin → GELU(erf) → Lin → RMSNorm.
void merge_project(const VisionWeights& w, const VisionConfig& c, std::span<const ImageRows> imgs,
                   const uint16_t* y /* bf16 [ΣN, Dvt] */, uint16_t* out /* bf16 [Σ tokens, D] */);

}  // namespace kestrel::vision
