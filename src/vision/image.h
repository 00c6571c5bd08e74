// Image input, front-end half (MODEL.md §6 "Preprocess"): encoded bytes (PNG, JPEG, WebP) -> pixels ->
// the patches of one request::ImageInput. The engine's vision tower (src/vision, other files) consumes
// the ImageInput; nothing here knows of tensors or devices.
//
// Decoding is Debian's libraries (libpng's simplified API, libjpeg-turbo, libwebp), never our own
// codec. Every decoder reads the header first: a size over DecodeLimits::max_pixels is refused before
// one pixel is decoded (a decompression bomb costs its header). Corrupt, truncated, animated or
// otherwise unsupported input raises kestrel::Error with a message fit for a 400 answer; a decoder
// warning (libjpeg's "premature end of data") is an error too, never a half-grey picture.
//
// Preprocess (the Kimi processor's NaViT rule, MODEL.md §6): scale = min(1, sqrt(in_patch_limit /
// (max(1, W//14)·max(1, H//14))), side·14/W, side·14/H) — never enlarged —, new side = min(max(1,
// ⌊side·scale⌋), side_limit·14); resized with a separable bicubic (Keys a = −0.5, PIL's BICUBIC: the
// filter widens by the downscale factor, so it averages when shrinking) rounded to 8 bits per pass as
// PIL does; padded right and bottom with black up to multiples of 28 (merge 2 × patch 14); scaled to
// [−1, 1] (mean = std = 0.5); cut into 14 × 14 patches, row-major over the grid, (c, y, x) inside a
// patch. Alpha is composited onto white first. The rule bounds the area, W'·H' <= W·H·in_patch_limit /
// (⌊W/14⌋·⌊H/14⌋), not the patch count: the floors and the padding let it pass in_patch_limit a little
// (1800 x 1800 is 130 x 130 patches), as in the reference; each side is at most patch_limit_on_one_side
// patches.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "request/request.h"

namespace kestrel::vision {

enum class ImageFormat : uint8_t { png, jpeg, webp };
const char* format_name(ImageFormat f);  // "PNG", "JPEG", "WebP"

struct DecodeLimits {
  int64_t max_pixels = 50'000'000;  // width × height, checked from the header before decoding
};

// What the header says.
struct ImageHeader {
  ImageFormat format = ImageFormat::png;
  int width = 0;
  int height = 0;
};

// Decoded pixels, alpha composited onto white.
struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  // u8 [height, width, 3]
};

// The format from the magic bytes and the size from the header; throws kestrel::Error for anything
// else (unknown or unsupported format, header corrupt or truncated).
ImageHeader read_header(std::span<const uint8_t> bytes);
// read_header, the size checked against `limits`, then the pixels.
RgbImage decode_image(std::span<const uint8_t> bytes, const DecodeLimits& limits);

// 64-bit content hash of the encoded bytes: XXH3-64 (Debian's libxxhash) seeded with a random value
// drawn once per process, so a collision cannot be prepared offline to poison the prefix cache; equal
// bytes hash equal within one process, which is all the prefix cache needs.
uint64_t content_hash(std::span<const uint8_t> bytes);

// The resize rule's knobs (the checkpoint's preprocessor_config.json media_proc_cfg; defaults: the
// released Kimi K2.5/K2.6 media_proc_cfg, in_patch_limit 16384 and patch_limit_on_one_side 512).
struct PreprocessConfig {
  int patch_size = 14;
  int merge = 2;                       // merge kernel (2 × 2); sides are padded to merge·patch_size
  int64_t in_patch_limit = 16384;
  int patch_limit_on_one_side = 512;
};

// Reads media_proc_cfg (or top-level) in_patch_limit / patch_limit_on_one_side / patch_size /
// merge_kernel_size from <model_dir>/preprocessor_config.json when that file exists; the defaults
// otherwise. Throws kestrel::Error for a file that is there but malformed.
PreprocessConfig load_preprocess_config(const std::string& model_dir);

// The geometry preprocess() will produce for a W × H image.
struct ResizePlan {
  int resized_w = 0, resized_h = 0;  // after the resize, before padding
  int grid_w = 0, grid_h = 0;        // patches after padding (even)
  int64_t num_tokens() const { return int64_t(grid_h / 2) * (grid_w / 2); }
};
ResizePlan plan_resize(int width, int height, const PreprocessConfig& cfg);

// Resize + pad + normalize + patchify; content_hash is left 0 (the caller hashes the bytes).
ImageInput preprocess(const RgbImage& img, const PreprocessConfig& cfg);

// One image of a request, ready: its original size (the prompt's "image {W}x{H}") and its ImageInput.
struct LoadedImage {
  int width = 0, height = 0;
  std::shared_ptr<const ImageInput> input;
};
// decode_image + preprocess + content_hash.
LoadedImage load_image(std::span<const uint8_t> bytes, const DecodeLimits& limits, const PreprocessConfig& cfg);

// A token-id prompt's image positions (`kestrel generate --image` with --prompt-tokens): the
// <|media_pad|> positions, in order, receive the images in order, image i taking the next
// num_tokens() of them, which must be consecutive. Returns Request::media (with each image's
// content_hash); throws kestrel::Error naming the counts when they do not match.
std::vector<MediaSpan> place_images(std::span<const int32_t> prompt, int32_t pad_id,
                                    const std::vector<std::shared_ptr<const ImageInput>>& images);

}  // namespace kestrel::vision
