// Image input's parsing path (src/vision/image.h): arbitrary bytes through the header reader, the
// PNG/JPEG/WebP decoders (Debian's libpng, libjpeg-turbo, libwebp behind our error handling) and the
// preprocess (resize, pad, normalise, patchify). Anything but a kestrel::Error is a finding, as is a
// result that breaks the ImageInput contract. Limits are small so each input stays cheap: at most
// 4 Mpx decoded, at most 256 patches after the resize.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "core/check.h"
#include "vision/image.h"

using namespace kestrel;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  try {
    (void)vision::read_header(bytes);
  } catch (const Error&) {
  }
  vision::PreprocessConfig cfg;
  cfg.in_patch_limit = 256;
  cfg.patch_limit_on_one_side = 32;
  try {
    const vision::LoadedImage li = vision::load_image(bytes, {int64_t(1) << 22}, cfg);
    const ImageInput& in = *li.input;
    if (li.width <= 0 || li.height <= 0 || int64_t(li.width) * li.height > (int64_t(1) << 22)) std::abort();
    if (in.grid_h <= 0 || in.grid_w <= 0 || in.grid_h % 2 || in.grid_w % 2 || in.grid_h > 32 || in.grid_w > 32) std::abort();
    if (in.patches.size() != size_t(in.grid_h) * in.grid_w * 588) std::abort();
    for (float v : in.patches)
      if (!(v >= -1.0f && v <= 1.0f)) std::abort();
    if (in.content_hash != vision::content_hash(bytes)) std::abort();
  } catch (const Error&) {
  }
  return 0;
}
