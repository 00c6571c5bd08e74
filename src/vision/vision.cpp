// MoonViT-V2 forward (MODEL.md §6) over a call's images: patch embed → blocks → final RMSNorm →
// merge + projector. See vision.h.
#include "vision/vision.h"

#include <cmath>

#include <fmt/format.h>

#include "kernels/cpu/cpu_ops.h"
#include "vision/layers.h"

namespace kestrel::vision {

void check_image(const VisionConfig& c, const ImageInput& im) {
  if (im.grid_h <= 0 || im.grid_w <= 0 || im.grid_h % 2 != 0 || im.grid_w % 2 != 0)
    fail("image grid {}x{} patches: both sides must be positive and even (2x2 merge)", im.grid_h, im.grid_w);
  const int64_t want = int64_t(im.grid_h) * im.grid_w * 3 * c.patch_size * c.patch_size;
  if (int64_t(im.patches.size()) != want)
    fail("image grid {}x{}: {} patch values, expected {} (3x{}x{} per patch)", im.grid_h, im.grid_w,
         im.patches.size(), want, c.patch_size, c.patch_size);
  for (float v : im.patches)
    if (!std::isfinite(v)) fail("image grid {}x{}: a patch value is not finite", im.grid_h, im.grid_w);
}

void check_request_images(const Request& r, const ModelConfig& c) {
  if (r.images.empty()) return;
  if (!c.vision.present)
    throw RequestError("images", "this model has no vision tower (the checkpoint has no vision_config); "
                                 "requests with images are not supported");
  if (r.images.size() != r.media.size())
    throw RequestError("images", fmt::format("{} images for {} media spans", r.images.size(), r.media.size()));
  for (size_t i = 0; i < r.images.size(); ++i) {
    if (!r.images[i]) throw RequestError("images", fmt::format("image {} is missing", i));
    try {
      check_image(c.vision, *r.images[i]);
    } catch (const RequestError&) {
      throw;
    } catch (const Error& e) {
      throw RequestError("images", fmt::format("image {}: {}", i, e.what()));
    }
    int64_t pads = 0;
    for (int64_t p = r.media[i].start; p < r.media[i].end; ++p) pads += r.prompt[size_t(p)] == c.media_placeholder_token_id;
    if (pads != r.images[i]->num_tokens())
      throw RequestError("images", fmt::format("image {} has {} tokens ({}x{} patches) but its media span holds {} "
                                               "<|media_pad|> tokens (id {})", i, r.images[i]->num_tokens(),
                                               r.images[i]->grid_h, r.images[i]->grid_w, pads,
                                               c.media_placeholder_token_id));
  }
}

int64_t num_tokens(std::span<const ImageInput* const> images) {
  int64_t n = 0;
  for (const ImageInput* im : images) n += im->num_tokens();
  return n;
}

std::vector<uint16_t> encode(const VisionWeights& w, const VisionConfig& c, std::span<const ImageInput* const> images,
                             const model::Observer* observer) {
  KCHECK(c.present, "the checkpoint has no vision tower");
  KCHECK(int64_t(w.blocks.size()) == c.num_layers, "vision weights have {} blocks, config {}", w.blocks.size(),
         c.num_layers);
  const int64_t Dvt = c.hidden_size;
  std::vector<ImageRows> imgs;
  std::vector<const float*> patches;
  int64_t T = 0;
  for (const ImageInput* im : images) {
    check_image(c, *im);
    imgs.push_back({T, im->grid_h, im->grid_w});
    patches.push_back(im->patches.data());
    T += imgs.back().n();
  }
  const int64_t tokens = num_tokens(images);
  std::vector<uint16_t> out(static_cast<size_t>(tokens * c.text_hidden_size));  // bf16 [Σ tokens, D]
  if (imgs.empty()) return out;
  const model::Probe probe{observer, -1};
  std::vector<uint16_t> x(static_cast<size_t>(T * Dvt));  // bf16 [ΣN, Dvt], the stream
  patch_embed(w, c, imgs, patches, x.data());
  probe("embed", x.data(), DType::bf16, {T, Dvt});
  for (int b = 0; b < c.num_layers; ++b) {
    encoder_block(w.blocks[size_t(b)], c, imgs, x.data(), T);
    if (probe.active()) probe(fmt::format("B{}", b), x.data(), DType::bf16, {T, Dvt});
  }
  std::vector<uint16_t> y(static_cast<size_t>(T * Dvt));  // bf16 [ΣN, Dvt]
  cpu::rmsnorm_bf16(x.data(), model::bf16_ptr(w.final_norm), y.data(), T, Dvt, c.rms_norm_eps);
  probe("final", y.data(), DType::bf16, {T, Dvt});
  merge_project(w, c, imgs, y.data(), out.data());
  probe("out", out.data(), DType::bf16, {tokens, int64_t(c.text_hidden_size)});
  return out;
}

}  // namespace kestrel::vision
