// MoonViT-V2 vision tower and projector on the CPU (MODEL.md §6): preprocessed images → the rows that
// replace the prompt's <|media_pad|> embeddings (§3.1).
//
//   std::vector<uint16_t> rows = vision::encode(w.vision, c.vision, images);   // bf16 [Σ tokens, D]
//
// Layout: every image's patches are stacked (image order, grid row-major), so each linear layer is one
// GEMM over all of them; attention alone runs per image (full, non-causal: varlen). Output rows come
// image by image, each in merged-grid row-major order ((grid_h/2)·(grid_w/2) rows; image i's rows
// start at Σ_{j<i} tokens_j).
//
// Precision follows §3's conventions as the text model does (BF16 activations, FP32 accumulation, one
// BF16 rounding where a BF16 model holds a BF16 tensor); the points where it rounds are listed in
// reference/k3ref/vision.py, the reference it is tested against (tests/unit/test_vision.cpp, golden data
// tests/golden/nano-vision). Interpretations of §6 (eps, resize, RoPE for head_dim ≠ 128): the same file
// and docs/ARCHITECTURE.md "Vision".
//
// Observer captures (bf16, stacked over images): embed [ΣN, Dvt], B{b} [ΣN, Dvt] (after block b),
// final [ΣN, Dvt] (after the final RMSNorm), out [Σ tokens, D].
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/common.h"
#include "request/request.h"

namespace kestrel::vision {

// Throws kestrel::Error unless the image fits the tower: even positive grid, patches of the right size,
// finite values.
void check_image(const VisionConfig& c, const ImageInput& im);

// A request's images against the model (MODEL.md §6), as RequestError (field "images"): a vision tower, one
// image per media span, each image one the tower takes (check_image), and in each span exactly as many
// <|media_pad|> tokens (config.json's media_placeholder_token_id) as the image has rows.
void check_request_images(const Request& r, const ModelConfig& c);

// Σ num_tokens() over the images.
int64_t num_tokens(std::span<const ImageInput* const> images);

// The projector rows of every image, in order: bf16 [Σ tokens, c.text_hidden_size].
std::vector<uint16_t> encode(const VisionWeights& w, const VisionConfig& c, std::span<const ImageInput* const> images,
                             const model::Observer* observer = nullptr);

}  // namespace kestrel::vision
