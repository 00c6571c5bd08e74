// Image decoding and preprocessing: see image.h.
//
// libjpeg reports errors by calling error_exit, which must not return: the standard way out is
// longjmp back to a setjmp in the caller. longjmp over C++ frames with destructors is undefined, so
// the JPEG code keeps every setjmp in a small function whose only state lives in a JpegCtx owned by
// the caller (a RAII holder that destroys the decompressor on every path); nothing between setjmp and
// the libjpeg calls allocates or throws. libpng is used through its simplified API (png_image_*),
// which reports errors by return value, and libwebp has plain return codes.
#include "vision/image.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <png.h>
#include <webp/decode.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <type_traits>

// jpeglib.h needs FILE and size_t declared first.
#include <jerror.h>
#include <jpeglib.h>

namespace kestrel::vision {
namespace {

// A progressive JPEG re-reads the whole coefficient buffer per scan; real files have a dozen scans,
// a hostile one thousands (a CPU bomb within the pixel limit). libjpeg-turbo's own tools stop at 500.
constexpr int kMaxJpegScans = 100;

bool starts_with(std::span<const uint8_t> b, std::initializer_list<uint8_t> magic, size_t at = 0) {
  if (b.size() < at + magic.size()) return false;
  size_t i = at;
  for (uint8_t m : magic)
    if (b[i++] != m) return false;
  return true;
}

ImageFormat sniff(std::span<const uint8_t> b) {
  if (b.empty()) fail("the image is empty (0 bytes)");
  if (starts_with(b, {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'})) return ImageFormat::png;
  if (starts_with(b, {0xff, 0xd8, 0xff})) return ImageFormat::jpeg;
  if (starts_with(b, {'R', 'I', 'F', 'F'}) && starts_with(b, {'W', 'E', 'B', 'P'}, 8)) return ImageFormat::webp;
  const char* known = starts_with(b, {'G', 'I', 'F', '8'})                                         ? "GIF"
                      : starts_with(b, {'B', 'M'})                                                  ? "BMP"
                      : starts_with(b, {'I', 'I', '*', 0}) || starts_with(b, {'M', 'M', 0, '*'})    ? "TIFF"
                      : starts_with(b, {0, 0, 0}) && starts_with(b, {'f', 't', 'y', 'p'}, 4)        ? "HEIF/AVIF"
                                                                                                   : nullptr;
  if (known) fail("unsupported image format {}; supported: PNG, JPEG, WebP", known);
  fail("not a PNG, JPEG or WebP image (unrecognised leading bytes)");
}

void check_size(const ImageHeader& h, const DecodeLimits& limits) {
  if (h.width <= 0 || h.height <= 0) fail("{} image has an empty size {}x{}", format_name(h.format), h.width, h.height);
  const int64_t px = int64_t(h.width) * h.height;
  if (px > limits.max_pixels)
    fail("{} image of {}x{} = {} pixels exceeds the limit of {} pixels per image (refused before decoding)",
         format_name(h.format), h.width, h.height, px, limits.max_pixels);
}

// ---- PNG (libpng simplified API) ----

struct PngImage {
  png_image im;
  PngImage() {
    std::memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
  }
  ~PngImage() { png_image_free(&im); }  // safe after finish_read (which frees) and on failure
  PngImage(const PngImage&) = delete;
  PngImage& operator=(const PngImage&) = delete;
};

std::string png_message(const png_image& im) {
  return im.message[0] ? std::string(im.message, strnlen(im.message, sizeof im.message)) : "unknown error";
}

void png_begin(PngImage& p, std::span<const uint8_t> b) {
  if (!png_image_begin_read_from_memory(&p.im, b.data(), b.size()))
    fail("corrupt or truncated PNG header (libpng: {})", png_message(p.im));
}

RgbImage png_decode(std::span<const uint8_t> b, const DecodeLimits& limits, std::vector<uint8_t>& rgba) {
  PngImage p;
  png_begin(p, b);
  check_size({ImageFormat::png, int(p.im.width), int(p.im.height)}, limits);
  p.im.format = PNG_FORMAT_RGBA;
  RgbImage out;
  out.width = int(p.im.width);
  out.height = int(p.im.height);
  rgba.resize(size_t(out.width) * out.height * 4);
  if (!png_image_finish_read(&p.im, nullptr, rgba.data(), 0, nullptr))
    fail("corrupt or truncated PNG data (libpng: {})", png_message(p.im));
  return out;
}

// ---- JPEG (libjpeg-turbo, classic API) ----

struct JpegCtx {
  jpeg_decompress_struct cinfo;
  jpeg_error_mgr err;
  jpeg_progress_mgr progress;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX + 64];
  bool created = false;
};

[[noreturn]] void jpeg_bail(j_common_ptr c) {
  auto* ctx = static_cast<JpegCtx*>(c->client_data);
  (*c->err->format_message)(c, ctx->message);
  std::longjmp(ctx->jump, 1);
}
// Warnings (level −1: corrupt data, premature end of file) are errors: a truncated JPEG would
// otherwise decode to a picture with grey rows. Trace messages (level ≥ 0) are ignored.
void jpeg_emit(j_common_ptr c, int level) {
  if (level < 0) jpeg_bail(c);
}
void jpeg_progress(j_common_ptr c) {
  auto* d = reinterpret_cast<j_decompress_ptr>(c);
  if (d->input_scan_number > kMaxJpegScans) {
    auto* ctx = static_cast<JpegCtx*>(c->client_data);
    std::snprintf(ctx->message, sizeof ctx->message, "progressive JPEG with more than %d scans", kMaxJpegScans);
    std::longjmp(ctx->jump, 1);
  }
}

// Holds the decompressor: destroyed on every path out.
struct JpegHolder {
  JpegCtx ctx{};
  ~JpegHolder() {
    if (ctx.created) jpeg_destroy_decompress(&ctx.cinfo);
  }
};

// Header: false (with ctx.message) on a libjpeg error.
bool jpeg_header(JpegCtx& ctx, const uint8_t* data, size_t size) {
  ctx.cinfo.err = jpeg_std_error(&ctx.err);
  ctx.err.error_exit = jpeg_bail;
  ctx.err.emit_message = jpeg_emit;
  ctx.cinfo.client_data = &ctx;
  if (setjmp(ctx.jump)) return false;
  jpeg_create_decompress(&ctx.cinfo);
  ctx.cinfo.client_data = &ctx;  // jpeg_create_decompress clears the struct (keeping err)
  ctx.created = true;
  ctx.progress.progress_monitor = jpeg_progress;
  ctx.cinfo.progress = &ctx.progress;
  jpeg_mem_src(&ctx.cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&ctx.cinfo, TRUE);
  return true;
}

// Pixels into `out` (u8 [H, W, C], C = output_components after start): false on a libjpeg error.
bool jpeg_pixels(JpegCtx& ctx, uint8_t* out, size_t out_size) {
  if (setjmp(ctx.jump)) return false;
  jpeg_start_decompress(&ctx.cinfo);
  const size_t stride = size_t(ctx.cinfo.output_width) * ctx.cinfo.output_components;
  if (stride * ctx.cinfo.output_height > out_size) {
    std::snprintf(ctx.message, sizeof ctx.message, "unexpected JPEG output geometry");
    return false;
  }
  while (ctx.cinfo.output_scanline < ctx.cinfo.output_height) {
    JSAMPROW row = out + size_t(ctx.cinfo.output_scanline) * stride;
    jpeg_read_scanlines(&ctx.cinfo, &row, 1);
  }
  jpeg_finish_decompress(&ctx.cinfo);
  return true;
}

ImageHeader jpeg_read_size(JpegHolder& h, std::span<const uint8_t> b) {
  if (!jpeg_header(h.ctx, b.data(), b.size())) fail("corrupt or truncated JPEG header (libjpeg: {})", h.ctx.message);
  return {ImageFormat::jpeg, int(h.ctx.cinfo.image_width), int(h.ctx.cinfo.image_height)};
}

RgbImage jpeg_decode(std::span<const uint8_t> b, const DecodeLimits& limits) {
  JpegHolder h;
  const ImageHeader hdr = jpeg_read_size(h, b);
  check_size(hdr, limits);
  j_decompress_ptr ci = &h.ctx.cinfo;
  // Grey, YCbCr and RGB come out as RGB; CMYK and YCCK as CMYK, converted below.
  const bool cmyk = ci->jpeg_color_space == JCS_CMYK || ci->jpeg_color_space == JCS_YCCK;
  ci->out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  const int comps = cmyk ? 4 : 3;
  std::vector<uint8_t> buf(size_t(hdr.width) * hdr.height * comps);
  if (!jpeg_pixels(h.ctx, buf.data(), buf.size())) fail("corrupt or truncated JPEG data (libjpeg: {})", h.ctx.message);
  if (int(ci->output_width) != hdr.width || int(ci->output_height) != hdr.height || ci->output_components != comps)
    fail("unexpected JPEG output geometry");
  RgbImage out;
  out.width = hdr.width;
  out.height = hdr.height;
  if (!cmyk) {
    out.rgb = std::move(buf);
    return out;
  }
  // Adobe writes CMYK inverted (as nearly every CMYK JPEG does, and PIL assumes): stored = 255 − ink,
  // so the light left is stored_c · stored_k / 255.
  const bool inverted = ci->saw_Adobe_marker;
  out.rgb.resize(size_t(hdr.width) * hdr.height * 3);
  for (size_t i = 0, n = size_t(hdr.width) * hdr.height; i < n; ++i) {
    auto v = [&](int c) { return inverted ? int(buf[i * 4 + c]) : 255 - int(buf[i * 4 + c]); };
    const int k = v(3);
    for (int c = 0; c < 3; ++c) out.rgb[i * 3 + c] = uint8_t((v(c) * k + 127) / 255);
  }
  return out;
}

// ---- WebP ----

ImageHeader webp_read_size(std::span<const uint8_t> b, WebPBitstreamFeatures& f) {
  const VP8StatusCode st = WebPGetFeatures(b.data(), b.size(), &f);
  if (st == VP8_STATUS_NOT_ENOUGH_DATA) fail("truncated WebP header");
  if (st == VP8_STATUS_UNSUPPORTED_FEATURE) fail("unsupported WebP feature");
  if (st != VP8_STATUS_OK) fail("corrupt WebP header (libwebp status {})", int(st));
  if (f.has_animation) fail("animated WebP is not supported (send one frame as a still image)");
  return {ImageFormat::webp, f.width, f.height};
}

RgbImage webp_decode(std::span<const uint8_t> b, const DecodeLimits& limits, std::vector<uint8_t>& rgba) {
  WebPBitstreamFeatures f;
  const ImageHeader hdr = webp_read_size(b, f);
  check_size(hdr, limits);
  RgbImage out;
  out.width = hdr.width;
  out.height = hdr.height;
  rgba.resize(size_t(hdr.width) * hdr.height * 4);
  if (!WebPDecodeRGBAInto(b.data(), b.size(), rgba.data(), rgba.size(), hdr.width * 4))
    fail("corrupt or truncated WebP data");
  return out;
}

// RGBA -> RGB over white: c' = (c·a + 255·(255 − a)) / 255, rounded.
void composite_on_white(const std::vector<uint8_t>& rgba, RgbImage& img) {
  const size_t n = size_t(img.width) * img.height;
  img.rgb.resize(n * 3);
  for (size_t i = 0; i < n; ++i) {
    const int a = rgba[i * 4 + 3];
    for (int c = 0; c < 3; ++c) img.rgb[i * 3 + c] = uint8_t((rgba[i * 4 + c] * a + 255 * (255 - a) + 127) / 255);
  }
}

// ---- resize (PIL-style separable bicubic) ----

// Keys' cubic convolution kernel with a = −0.5 (Catmull-Rom), support [−2, 2].
double cubic(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

// The taps of output sample i along one axis (in -> out samples): the first input index, and the
// normalised weights in `w`. When shrinking, the kernel is stretched by the scale (an area-weighted
// low-pass, as PIL does); near the edges the taps that fall outside are dropped and the rest
// renormalised. Computed per output sample, never tabled for the whole axis: a table would hold
// about 4 weights per input sample (800 MB for a 1 x 50M-pixel strip).
struct Axis {
  int in = 0, out = 0;
  double scale = 1, fscale = 1, support = 2;
  Axis(int in_, int out_) : in(in_), out(out_), scale(double(in_) / out_), fscale(std::max(1.0, scale)), support(2.0 * fscale) {}
  int taps(int i, std::vector<float>& w) const {
    const double center = (i + 0.5) * scale;
    const int lo = std::max(int(center - support + 0.5), 0);
    const int hi = std::min(int(center + support + 0.5), in);
    w.clear();
    double sum = 0.0;
    for (int j = lo; j < hi; ++j) {
      const double k = cubic((j - center + 0.5) / fscale);
      w.push_back(float(k));
      sum += k;
    }
    if (sum != 0.0)
      for (float& x : w) x = float(x / sum);
    return lo;
  }
};

uint8_t clamp8(float v) { return uint8_t(std::clamp(std::lround(v), 0L, 255L)); }

// u8 [h, w, 3] -> u8 [h, ow, 3]; output column by output column, so each column's taps are made once.
std::vector<uint8_t> resize_rows(const std::vector<uint8_t>& src, int w, int h, int ow) {
  const Axis ax(w, ow);
  std::vector<uint8_t> dst(size_t(h) * ow * 3);
  std::vector<float> wt;
  for (int x = 0; x < ow; ++x) {
    const int first = ax.taps(x, wt);
    for (int y = 0; y < h; ++y) {
      const uint8_t* s = src.data() + (size_t(y) * w + first) * 3;
      float acc[3] = {0, 0, 0};
      for (size_t j = 0; j < wt.size(); ++j)
        for (int c = 0; c < 3; ++c) acc[c] += wt[j] * s[j * 3 + c];
      uint8_t* d = dst.data() + (size_t(y) * ow + x) * 3;
      for (int c = 0; c < 3; ++c) d[c] = clamp8(acc[c]);
    }
  }
  return dst;
}

// u8 [h, w, 3] -> u8 [oh, w, 3]
std::vector<uint8_t> resize_cols(const std::vector<uint8_t>& src, int w, int h, int oh) {
  const Axis ax(h, oh);
  std::vector<uint8_t> dst(size_t(oh) * w * 3);
  std::vector<float> acc(size_t(w) * 3), wt;
  for (int y = 0; y < oh; ++y) {
    const int first = ax.taps(y, wt);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (size_t j = 0; j < wt.size(); ++j) {
      const uint8_t* s = src.data() + (size_t(first) + j) * w * 3;
      for (size_t i = 0; i < acc.size(); ++i) acc[i] += wt[j] * s[i];
    }
    uint8_t* d = dst.data() + size_t(y) * w * 3;
    for (size_t i = 0; i < acc.size(); ++i) d[i] = clamp8(acc[i]);
  }
  return dst;
}

}  // namespace

const char* format_name(ImageFormat f) {
  switch (f) {
    case ImageFormat::png: return "PNG";
    case ImageFormat::jpeg: return "JPEG";
    case ImageFormat::webp: return "WebP";
  }
  return "?";
}

ImageHeader read_header(std::span<const uint8_t> bytes) {
  switch (sniff(bytes)) {
    case ImageFormat::png: {
      PngImage p;
      png_begin(p, bytes);
      return {ImageFormat::png, int(std::min<png_uint_32>(p.im.width, INT32_MAX)),
              int(std::min<png_uint_32>(p.im.height, INT32_MAX))};
    }
    case ImageFormat::jpeg: {
      JpegHolder h;
      return jpeg_read_size(h, bytes);
    }
    case ImageFormat::webp: {
      WebPBitstreamFeatures f;
      return webp_read_size(bytes, f);
    }
  }
  fail("unreachable");
}

RgbImage decode_image(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  std::vector<uint8_t> rgba;
  switch (sniff(bytes)) {
    case ImageFormat::png: {
      RgbImage img = png_decode(bytes, limits, rgba);
      composite_on_white(rgba, img);
      return img;
    }
    case ImageFormat::jpeg: return jpeg_decode(bytes, limits);
    case ImageFormat::webp: {
      RgbImage img = webp_decode(bytes, limits, rgba);
      composite_on_white(rgba, img);
      return img;
    }
  }
  fail("unreachable");
}

uint64_t content_hash(std::span<const uint8_t> bytes) {
  static const uint64_t seed = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ uint64_t(rd());
  }();
  return XXH3_64bits_withSeed(bytes.data(), bytes.size(), seed);
}

PreprocessConfig load_preprocess_config(const std::string& model_dir) {
  PreprocessConfig c;
  const std::filesystem::path path = std::filesystem::path(model_dir) / "preprocessor_config.json";
  std::error_code ec;
  if (model_dir.empty() || !std::filesystem::is_regular_file(path, ec)) return c;
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) fail("{}: not a JSON object", path.string());
  const nlohmann::json& m = j.contains("media_proc_cfg") && j["media_proc_cfg"].is_object() ? j["media_proc_cfg"] : j;
  auto num = [&](const char* key, int64_t lo, int64_t hi, auto& dst) {
    if (!m.contains(key) || m[key].is_null()) return;
    const nlohmann::json& v = m[key].is_array() && !m[key].empty() ? m[key][0] : m[key];
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      fail("{}: '{}' must be an integer in [{}, {}]", path.string(), key, lo, hi);
    dst = static_cast<std::remove_reference_t<decltype(dst)>>(v.get<int64_t>());
  };
  num("patch_size", 1, 64, c.patch_size);
  num("merge_kernel_size", 1, 8, c.merge);
  num("in_patch_limit", 1, int64_t(1) << 24, c.in_patch_limit);
  num("patch_limit_on_one_side", 1, 1 << 12, c.patch_limit_on_one_side);
  return c;
}

ResizePlan plan_resize(int width, int height, const PreprocessConfig& cfg) {
  KCHECK(width > 0 && height > 0, "plan_resize: empty image");
  KCHECK(cfg.patch_size > 0 && cfg.merge > 0 && cfg.in_patch_limit > 0 && cfg.patch_limit_on_one_side > 0,
                "plan_resize: bad preprocess config");
  const int p = cfg.patch_size;
  const int side_limit = cfg.patch_limit_on_one_side * p;
  const double s1 = std::sqrt(double(cfg.in_patch_limit) / (std::max(1.0, double(width / p)) * std::max(1.0, double(height / p))));
  const double s2 = double(side_limit) / width;
  const double s3 = double(side_limit) / height;
  const double scale = std::min({1.0, s1, s2, s3});
  ResizePlan r;
  r.resized_w = std::min(std::max(1, int(width * scale)), side_limit);
  r.resized_h = std::min(std::max(1, int(height * scale)), side_limit);
  const int factor = cfg.merge * p;
  r.grid_w = (r.resized_w + factor - 1) / factor * cfg.merge;
  r.grid_h = (r.resized_h + factor - 1) / factor * cfg.merge;
  return r;
}

ImageInput preprocess(const RgbImage& img, const PreprocessConfig& cfg) {
  KCHECK(img.rgb.size() == size_t(img.width) * img.height * 3, "preprocess: pixel buffer does not match the size");
  const ResizePlan plan = plan_resize(img.width, img.height, cfg);
  // Horizontal pass first, then vertical (PIL's order); an axis whose size is kept is not resampled.
  const std::vector<uint8_t>* px = &img.rgb;
  std::vector<uint8_t> tmp1, tmp2;
  if (plan.resized_w != img.width) {
    tmp1 = resize_rows(*px, img.width, img.height, plan.resized_w);
    px = &tmp1;
  }
  if (plan.resized_h != img.height) {
    tmp2 = resize_cols(*px, plan.resized_w, img.height, plan.resized_h);
    px = &tmp2;
  }
  const int p = cfg.patch_size, W = plan.resized_w, H = plan.resized_h;
  ImageInput in;
  in.grid_h = plan.grid_h;
  in.grid_w = plan.grid_w;
  const size_t patch = size_t(3) * p * p;
  in.patches.assign(size_t(plan.grid_h) * plan.grid_w * patch, -1.0f);  // padding: black, (0 − 0.5)/0.5
  for (int gy = 0; gy < plan.grid_h; ++gy)
    for (int gx = 0; gx < plan.grid_w; ++gx) {
      float* dst = in.patches.data() + (size_t(gy) * plan.grid_w + gx) * patch;
      for (int y = 0; y < p; ++y) {
        const int sy = gy * p + y;
        if (sy >= H) break;
        for (int x = 0; x < p; ++x) {
          const int sx = gx * p + x;
          if (sx >= W) break;
          const uint8_t* s = px->data() + (size_t(sy) * W + sx) * 3;
          for (int c = 0; c < 3; ++c) dst[size_t(c) * p * p + size_t(y) * p + x] = (float(s[c]) / 255.0f - 0.5f) / 0.5f;
        }
      }
    }
  return in;
}

LoadedImage load_image(std::span<const uint8_t> bytes, const DecodeLimits& limits, const PreprocessConfig& cfg) {
  const RgbImage img = decode_image(bytes, limits);
  auto in = std::make_shared<ImageInput>(preprocess(img, cfg));
  in->content_hash = content_hash(bytes);
  return {img.width, img.height, std::move(in)};
}

std::vector<MediaSpan> place_images(std::span<const int32_t> prompt, int32_t pad_id,
                                    const std::vector<std::shared_ptr<const ImageInput>>& images) {
  std::vector<int64_t> pads;
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] == pad_id) pads.push_back(int64_t(i));
  int64_t want = 0;
  std::string each;
  for (const auto& im : images) {
    want += im->num_tokens();
    each += fmt::format("{}{}", each.empty() ? "" : " + ", im->num_tokens());
  }
  if (int64_t(pads.size()) != want)
    fail("the prompt has {} <|media_pad|> tokens (id {}) but the {} image(s) need {} ({})", pads.size(), pad_id,
         images.size(), want, images.empty() ? "none" : each);
  std::vector<MediaSpan> out;
  size_t next = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    const int64_t n = images[i]->num_tokens();
    const int64_t start = pads[next], end = pads[next + size_t(n) - 1] + 1;
    if (end - start != n)
      fail("image {}'s {} <|media_pad|> positions are not consecutive (from position {} to {})", i, n, start, end - 1);
    out.push_back({start, end, images[i]->content_hash});
    next += size_t(n);
  }
  return out;
}

}  // namespace kestrel::vision
