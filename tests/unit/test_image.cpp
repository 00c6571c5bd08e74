// Image input, front-end half (src/vision/image.h): decoding PNG/JPEG/WebP through Debian's libraries
// (test images are made here with the same libraries' encoders), refusals (bombs from the header,
// truncation, corruption, unsupported formats), the resize geometry (expected values worked out by
// hand from the rule in image.h / MODEL.md §6) and the patch values of tiny images.
#include <gtest/gtest.h>

#include <png.h>
#include <webp/decode.h>
#include <webp/encode.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <unistd.h>

#include <jpeglib.h>

#include "core/check.h"
#include "server/media.h"
#include "server/openai.h"
#include "tokenizer/chat.h"
#include "vision/image.h"

namespace kestrel::vision {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes encode_png(int w, int h, const Bytes& px, int channels) {
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  im.width = png_uint_32(w);
  im.height = png_uint_32(h);
  im.format = channels == 4 ? PNG_FORMAT_RGBA : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  png_alloc_size_t size = 0;
  EXPECT_TRUE(png_image_write_to_memory(&im, nullptr, &size, 0, px.data(), 0, nullptr));
  Bytes out(size);
  EXPECT_TRUE(png_image_write_to_memory(&im, out.data(), &size, 0, px.data(), 0, nullptr));
  out.resize(size);
  return out;
}

Bytes encode_jpeg(int w, int h, const Bytes& px, int channels, int quality = 95, bool progressive = false) {
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = JDIMENSION(w);
  c.image_height = JDIMENSION(h);
  c.input_components = channels;
  c.in_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  if (progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(px.data()) + size_t(c.next_scanline) * w * channels;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  Bytes out(buf, buf + size);
  free(buf);
  return out;
}

Bytes encode_webp_lossless(int w, int h, const Bytes& rgba) {
  uint8_t* out = nullptr;
  const size_t n = WebPEncodeLosslessRGBA(rgba.data(), w, h, w * 4, &out);
  Bytes b(out, out + n);
  WebPFree(out);
  return b;
}

Bytes encode_webp_lossy(int w, int h, const Bytes& rgb) {
  uint8_t* out = nullptr;
  const size_t n = WebPEncodeRGB(rgb.data(), w, h, w * 3, 90.0f, &out);
  Bytes b(out, out + n);
  WebPFree(out);
  return b;
}

Bytes noise(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  Bytes b(n);
  for (auto& x : b) x = uint8_t(g());
  return b;
}

// A smooth picture (JPEG keeps it close): r = x, g = y, b = 128.
Bytes gradient(int w, int h) {
  Bytes b(size_t(w) * h * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &b[(size_t(y) * w + x) * 3];
      p[0] = uint8_t(x * 255 / std::max(1, w - 1));
      p[1] = uint8_t(y * 255 / std::max(1, h - 1));
      p[2] = 128;
    }
  return b;
}

std::string error_of(const Bytes& b, DecodeLimits lim = {}) {
  try {
    decode_image(b, lim);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// CRC-32 of PNG chunks (ISO 3309), to forge headers.
uint32_t crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return c ^ 0xffffffffu;
}
void put_be32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 24), p[1] = uint8_t(v >> 16), p[2] = uint8_t(v >> 8), p[3] = uint8_t(v);
}

TEST(Image, PngRgbAndGreyRoundTripExactly) {
  const Bytes px = noise(5 * 3 * 3, 1);
  const RgbImage img = decode_image(encode_png(5, 3, px, 3), {});
  EXPECT_EQ(img.width, 5);
  EXPECT_EQ(img.height, 3);
  EXPECT_EQ(img.rgb, px);
  const Bytes grey = {0, 77, 255, 9};
  const RgbImage g = decode_image(encode_png(2, 2, grey, 1), {});
  ASSERT_EQ(g.rgb.size(), 12u);
  for (size_t i = 0; i < 4; ++i)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(g.rgb[i * 3 + c], grey[i]);
  const ImageHeader h = read_header(encode_png(5, 3, px, 3));
  EXPECT_EQ(h.format, ImageFormat::png);
  EXPECT_EQ(h.width, 5);
  EXPECT_EQ(h.height, 3);
}

TEST(Image, AlphaIsCompositedOntoWhite) {
  // (c·a + 255·(255 − a) + 127) / 255, worked by hand: a = 128 gives 227, 177, 127 for 200, 100, 0.
  const Bytes rgba = {200, 100, 0, 0, 200, 100, 0, 255, 200, 100, 0, 128};
  const Bytes want = {255, 255, 255, 200, 100, 0, 227, 177, 127};
  EXPECT_EQ(decode_image(encode_png(3, 1, rgba, 4), {}).rgb, want);
  EXPECT_EQ(decode_image(encode_webp_lossless(3, 1, rgba), {}).rgb, want);
}

TEST(Image, JpegAndWebpDecode) {
  const Bytes px = gradient(40, 24);
  for (bool progressive : {false, true}) {
    const RgbImage j = decode_image(encode_jpeg(40, 24, px, 3, 95, progressive), {});
    ASSERT_EQ(j.width, 40);
    ASSERT_EQ(j.height, 24);
    int worst = 0;
    for (size_t i = 0; i < px.size(); ++i) worst = std::max(worst, std::abs(int(j.rgb[i]) - int(px[i])));
    EXPECT_LE(worst, 12) << "progressive " << progressive;  // lossy, but a smooth picture stays close
  }
  const Bytes grey(16 * 8, 90);
  const RgbImage g = decode_image(encode_jpeg(16, 8, grey, 1), {});
  for (uint8_t v : g.rgb) EXPECT_NEAR(int(v), 90, 2);
  const RgbImage w = decode_image(encode_webp_lossy(40, 24, px), {});
  ASSERT_EQ(w.width, 40);
  ASSERT_EQ(w.height, 24);
  int worst = 0;
  for (size_t i = 0; i < px.size(); ++i) worst = std::max(worst, std::abs(int(w.rgb[i]) - int(px[i])));
  EXPECT_LE(worst, 24);
  EXPECT_EQ(read_header(encode_jpeg(40, 24, px, 3)).format, ImageFormat::jpeg);
  EXPECT_EQ(read_header(encode_webp_lossy(40, 24, px)).format, ImageFormat::webp);
}

TEST(Image, BombsAreRefusedFromTheHeader) {
  // A real 1x1 PNG whose IHDR claims 100000 x 100000 (CRC fixed): the pixel data is one pixel, so a
  // decoder that went on would fail differently; the message shows the header refused it.
  Bytes png = encode_png(1, 1, {7, 7, 7}, 3);
  put_be32(&png[16], 100000);
  put_be32(&png[20], 100000);
  put_be32(&png[29], crc32(&png[12], 17));
  EXPECT_NE(error_of(png).find("100000x100000 = 10000000000 pixels exceeds the limit"), std::string::npos) << error_of(png);
  // JPEG: the baseline SOF0 frame header's height and width.
  Bytes jpg = encode_jpeg(8, 8, Bytes(8 * 8 * 3, 50), 3);
  size_t sof = 2;
  while (sof + 9 < jpg.size() && !(jpg[sof] == 0xff && jpg[sof + 1] == 0xc0)) ++sof;
  ASSERT_LT(sof + 9, jpg.size());
  jpg[sof + 5] = 0xfd, jpg[sof + 6] = 0xe8;  // height 65000
  jpg[sof + 7] = 0xfd, jpg[sof + 8] = 0xe8;  // width 65000
  EXPECT_NE(error_of(jpg).find("65000x65000"), std::string::npos) << error_of(jpg);
  EXPECT_NE(error_of(jpg).find("refused before decoding"), std::string::npos);
  // Any format against a small limit.
  const Bytes px = gradient(20, 20);
  for (const Bytes& b : {encode_png(20, 20, px, 3), encode_jpeg(20, 20, px, 3), encode_webp_lossy(20, 20, px)})
    EXPECT_NE(error_of(b, {399}).find("20x20 = 400 pixels exceeds the limit of 399"), std::string::npos) << error_of(b, {399});
  EXPECT_EQ(error_of(encode_png(20, 20, px, 3), {400}), "");
}

TEST(Image, TruncatedAndCorruptInputIsAnError) {
  const Bytes px = noise(64 * 64 * 3, 2);
  Bytes rgba(64 * 64 * 4);
  for (size_t i = 0; i < rgba.size(); ++i) rgba[i] = px[i % px.size()];
  for (const Bytes& b : {encode_png(64, 64, px, 3), encode_jpeg(64, 64, px, 3), encode_webp_lossless(64, 64, rgba),
                         encode_webp_lossy(64, 64, px)}) {
    ASSERT_EQ(error_of(b), "");
    for (size_t cut : {size_t(4), size_t(20), b.size() / 2, b.size() * 9 / 10}) {
      const Bytes t(b.begin(), b.begin() + long(cut));
      EXPECT_NE(error_of(t), "") << "cut at " << cut << " of " << b.size();
    }
  }
  // A flipped byte inside PNG image data breaks its CRC.
  Bytes png = encode_png(64, 64, px, 3);
  png[png.size() / 2] ^= 0x5a;
  EXPECT_NE(error_of(png).find("PNG"), std::string::npos) << error_of(png);
  EXPECT_EQ(error_of({}), "the image is empty (0 bytes)");
  EXPECT_EQ(error_of({'h', 'e', 'l', 'l', 'o'}), "not a PNG, JPEG or WebP image (unrecognised leading bytes)");
  EXPECT_EQ(error_of({'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0}), "unsupported image format GIF; supported: PNG, JPEG, WebP");
}

TEST(Image, ResizeGeometry) {
  const PreprocessConfig cfg;  // 14-px patches, merge 2, in_patch_limit 16384, 512 patches a side
  struct Case { int w, h, rw, rh, gw, gh; int64_t tokens; };
  // Worked from the rule: e.g. 4000x3000: floor patches 285·214 = 60990, scale = sqrt(16384/60990) =
  // 0.51830, sides ⌊2073.2⌋ = 2073 and ⌊1554.9⌋ = 1554, padded to 2100 and 1568 (multiples of 28).
  for (const Case& c : {Case{28, 28, 28, 28, 2, 2, 1}, Case{100, 50, 100, 50, 8, 4, 8}, Case{1, 1, 1, 1, 2, 2, 1},
                        Case{4000, 3000, 2073, 1554, 150, 112, 4200}, Case{3000, 4000, 1554, 2073, 112, 150, 4200},
                        Case{20000, 100, 7168, 35, 512, 4, 512}, Case{100, 20000, 35, 7168, 4, 512, 512},
                        Case{1024, 1024, 1024, 1024, 74, 74, 1369},
                        // 128·128 floor patches = the limit, so no resize, and padding makes 130·130.
                        Case{1800, 1800, 1800, 1800, 130, 130, 4225}}) {
    const ResizePlan p = plan_resize(c.w, c.h, cfg);
    EXPECT_EQ(p.resized_w, c.rw) << c.w << "x" << c.h;
    EXPECT_EQ(p.resized_h, c.rh) << c.w << "x" << c.h;
    EXPECT_EQ(p.grid_w, c.gw) << c.w << "x" << c.h;
    EXPECT_EQ(p.grid_h, c.gh) << c.w << "x" << c.h;
    EXPECT_EQ(p.num_tokens(), c.tokens) << c.w << "x" << c.h;
  }
  PreprocessConfig small;
  small.in_patch_limit = 4096;
  small.patch_limit_on_one_side = 64;
  const ResizePlan s = plan_resize(1800, 1800, small);  // side limit 64·14 = 896 binds
  EXPECT_EQ(s.resized_w, 896);
  EXPECT_EQ(s.grid_w, 64);
  // Invariants over many sizes: never enlarged, aspect kept to rounding, even grids within the side
  // limit, the area within the rule's bound.
  std::mt19937 g(3);
  for (int i = 0; i < 2000; ++i) {
    const int w = 1 + int(g() % 12000), h = 1 + int(g() % 12000);
    const ResizePlan p = plan_resize(w, h, cfg);
    EXPECT_LE(p.resized_w, w);
    EXPECT_LE(p.resized_h, h);
    EXPECT_EQ(p.grid_w % 2, 0);
    EXPECT_EQ(p.grid_h % 2, 0);
    EXPECT_LE(p.grid_w, 512);
    EXPECT_LE(p.grid_h, 512);
    EXPECT_GE(p.grid_w * 14, p.resized_w);
    EXPECT_LT(p.grid_w * 14 - p.resized_w, 28);
    // The rule's bound (not "patches <= in_patch_limit": the floors in the scale and the padding let the
    // patch count pass it a little, as in the reference): W'·H' <= W·H · in_patch_limit / (⌊W/14⌋·⌊H/14⌋).
    const double floors = std::max(1.0, double(w / 14)) * std::max(1.0, double(h / 14));
    EXPECT_LE(double(p.resized_w) * p.resized_h, double(w) * h * double(cfg.in_patch_limit) / floors * (1 + 1e-12)) << w << "x" << h;
    if (p.resized_w > 1 && p.resized_h > 1) {  // both sides scaled by one factor (truncation: < 1 px each)
      EXPECT_NEAR(double(p.resized_w) / w, double(p.resized_h) / h, 1.0 / p.resized_w + 1.0 / p.resized_h) << w << "x" << h;
    }
  }
}

TEST(Image, PatchValuesOfATinyImage) {
  // 15 x 2 pixels: no resize; padded to 28 x 28, a 2 x 2 grid. Values (v/255 − 0.5)/0.5; padding −1.
  RgbImage img;
  img.width = 15;
  img.height = 2;
  img.rgb.assign(15 * 2 * 3, 0);
  auto set = [&](int x, int y, uint8_t r, uint8_t g, uint8_t b) {
    uint8_t* p = &img.rgb[(size_t(y) * 15 + x) * 3];
    p[0] = r, p[1] = g, p[2] = b;
  };
  set(0, 0, 255, 0, 51);    // +1, −1, −0.6
  set(1, 1, 10, 128, 250);  // row 1, column 1
  set(14, 0, 255, 255, 255);  // first column of the second patch
  const ImageInput in = preprocess(img, PreprocessConfig{});
  ASSERT_EQ(in.grid_h, 2);
  ASSERT_EQ(in.grid_w, 2);
  EXPECT_EQ(in.num_tokens(), 1);
  ASSERT_EQ(in.patches.size(), 4u * 588);
  auto at = [&](int patch, int c, int y, int x) { return in.patches[size_t(patch) * 588 + c * 196 + y * 14 + x]; };
  EXPECT_FLOAT_EQ(at(0, 0, 0, 0), 1.0f);
  EXPECT_FLOAT_EQ(at(0, 1, 0, 0), -1.0f);
  EXPECT_NEAR(at(0, 2, 0, 0), -0.6f, 1e-6);
  EXPECT_NEAR(at(0, 0, 1, 1), 10 / 127.5 - 1, 1e-6);
  EXPECT_NEAR(at(0, 1, 1, 1), 128 / 127.5 - 1, 1e-6);
  EXPECT_NEAR(at(0, 2, 1, 1), 250 / 127.5 - 1, 1e-6);
  EXPECT_FLOAT_EQ(at(0, 0, 0, 13), -1.0f);  // a black pixel of the image
  EXPECT_FLOAT_EQ(at(1, 0, 0, 0), 1.0f);    // pixel (14, 0): patch (0, 1)
  EXPECT_FLOAT_EQ(at(1, 2, 0, 0), 1.0f);
  EXPECT_FLOAT_EQ(at(1, 0, 0, 1), -1.0f);   // padding right of the image
  for (int patch : {2, 3})                  // the bottom row of patches is all padding
    for (int i = 0; i < 588; ++i) ASSERT_FLOAT_EQ(in.patches[size_t(patch) * 588 + i], -1.0f);
}

TEST(Image, ResizeKeepsFlatColourAndOrder) {
  // 100 x 60 flat colour, shrunk (in_patch_limit 4: scale sqrt(4/(7·4)) = 0.378 -> 37 x 22): a
  // normalised filter keeps a flat colour exactly; a left-to-right ramp stays non-decreasing.
  PreprocessConfig cfg;
  cfg.in_patch_limit = 4;
  RgbImage flat;
  flat.width = 100;
  flat.height = 60;
  flat.rgb.assign(100 * 60 * 3, 0);
  for (size_t i = 0; i < flat.rgb.size(); i += 3) flat.rgb[i] = 204, flat.rgb[i + 1] = 51, flat.rgb[i + 2] = 102;
  const ResizePlan p = plan_resize(100, 60, cfg);
  EXPECT_EQ(p.resized_w, 37);
  EXPECT_EQ(p.resized_h, 22);
  const ImageInput in = preprocess(flat, cfg);
  ASSERT_EQ(in.grid_w, 4);
  ASSERT_EQ(in.grid_h, 2);
  for (int y = 0; y < 14; ++y)
    for (int x = 0; x < 14; ++x) {
      ASSERT_NEAR(in.patches[size_t(y) * 14 + x], 0.6f, 1e-6);            // 204 -> +0.6
      ASSERT_NEAR(in.patches[196 + size_t(y) * 14 + x], -0.6f, 1e-6);     // 51 -> −0.6
      ASSERT_NEAR(in.patches[392 + size_t(y) * 14 + x], -0.2f, 1e-6);     // 102 -> −0.2
    }
  RgbImage ramp;
  ramp.width = 100;
  ramp.height = 60;
  ramp.rgb = gradient(100, 60);
  const ImageInput r = preprocess(ramp, cfg);
  float last = -2;
  for (int x = 0; x < 37; ++x) {  // red channel along row 0 (x < 37 is image, not padding)
    const float v = r.patches[size_t(x / 14) * 588 + (x % 14)];
    EXPECT_GE(v, last - 1e-6f) << x;
    last = v;
  }
}

TEST(Image, ContentHashAndLoad) {
  const Bytes a = encode_png(30, 20, gradient(30, 20), 3);
  Bytes b = encode_png(30, 20, noise(30 * 20 * 3, 4), 3);
  EXPECT_EQ(content_hash(a), content_hash(Bytes(a)));
  EXPECT_NE(content_hash(a), content_hash(b));
  const LoadedImage la = load_image(a, {}, {});
  EXPECT_EQ(la.width, 30);
  EXPECT_EQ(la.height, 20);
  EXPECT_EQ(la.input->content_hash, content_hash(a));
  EXPECT_EQ(la.input->grid_w, 4);
  EXPECT_EQ(la.input->grid_h, 2);
  EXPECT_EQ(la.input->patches.size(), size_t(4 * 2 * 588));
}

TEST(Image, PreprocessorConfigFile) {
  const auto dir = std::filesystem::temp_directory_path() / ("kestrel_image_cfg_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  EXPECT_EQ(load_preprocess_config(dir.string()).in_patch_limit, 16384);  // no file: defaults
  std::ofstream(dir / "preprocessor_config.json")
      << R"({"media_proc_cfg": {"in_patch_limit": 4096, "patch_limit_on_one_side": 64, "merge_kernel_size": [2, 2]}})";
  const PreprocessConfig c = load_preprocess_config(dir.string());
  EXPECT_EQ(c.in_patch_limit, 4096);
  EXPECT_EQ(c.patch_limit_on_one_side, 64);
  EXPECT_EQ(c.merge, 2);
  std::ofstream(dir / "preprocessor_config.json") << R"({"in_patch_limit": "many"})";
  EXPECT_THROW(load_preprocess_config(dir.string()), Error);
  std::filesystem::remove_all(dir);
}

TEST(Image, PlaceImagesOnPadPositions) {
  auto image = [](int gh, int gw, uint64_t hash) {
    auto im = std::make_shared<ImageInput>();
    im->grid_h = gh, im->grid_w = gw, im->content_hash = hash;
    return std::shared_ptr<const ImageInput>(im);
  };
  const int32_t P = 99;
  const std::vector<int32_t> prompt = {1, P, P, 2, P, P, P, P, 3};
  const auto m = place_images(prompt, P, {image(2, 4, 11), image(4, 4, 22)});  // 2 tokens, then 4
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].start, 1);
  EXPECT_EQ(m[0].end, 3);
  EXPECT_EQ(m[0].content_hash, 11u);
  EXPECT_EQ(m[1].start, 4);
  EXPECT_EQ(m[1].end, 8);
  EXPECT_EQ(m[1].content_hash, 22u);
  EXPECT_THROW(place_images(prompt, P, {image(2, 4, 11)}), Error);                   // 6 pads, 2 needed
  EXPECT_THROW(place_images(prompt, P, {image(4, 4, 1), image(2, 4, 2)}), Error);    // 4 then 2: not consecutive
  EXPECT_TRUE(place_images(std::vector<int32_t>{1, 2}, P, {}).empty());
}

}  // namespace
}  // namespace kestrel::vision

namespace kestrel::server {
namespace {

std::string png_url(int w, int h, uint32_t seed) {
  const std::vector<uint8_t> b = vision::encode_png(w, h, vision::noise(size_t(w) * h * 3, seed), 3);
  static const char* A = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string s = "data:image/png;base64,";
  for (size_t i = 0; i < b.size(); i += 3) {
    const uint32_t v = uint32_t(b[i]) << 16 | (i + 1 < b.size() ? uint32_t(b[i + 1]) << 8 : 0) | (i + 2 < b.size() ? b[i + 2] : 0);
    s += A[v >> 18], s += A[(v >> 12) & 63];
    s += i + 1 < b.size() ? A[(v >> 6) & 63] : '=';
    s += i + 2 < b.size() ? A[v & 63] : '=';
  }
  return s;
}

TEST(Media, Base64) {
  auto str = [](std::string_view s) { auto v = base64_decode(s); return std::string(v.begin(), v.end()); };
  EXPECT_EQ(str(""), "");
  EXPECT_EQ(str("Zg=="), "f");
  EXPECT_EQ(str("Zm8="), "fo");
  EXPECT_EQ(str("Zm9v"), "foo");
  EXPECT_EQ(str("Zm9v\nYmFy"), "foobar");
  EXPECT_EQ(str("Zm8"), "fo");  // padding optional
  for (const char* bad : {"Z", "Zh==", "Zm9v!", "Zg==Zg", "Zm9v-_"}) EXPECT_THROW(base64_decode(bad), Error) << bad;
}

TEST(Media, LimitMmPerPrompt) {
  EXPECT_EQ(parse_limit_mm_per_prompt(R"({"image": 4})"), 4);
  EXPECT_EQ(parse_limit_mm_per_prompt(R"({"image": 2, "video": 0})"), 2);
  EXPECT_EQ(parse_limit_mm_per_prompt("image=3"), 3);
  EXPECT_EQ(parse_limit_mm_per_prompt(R"({"image": 0})"), 0);
  for (const char* bad : {R"({"video": 1})", R"({"image": -1})", R"({"image": "2"})", "[1]", "image=x", "image=", "3"})
    EXPECT_THROW(parse_limit_mm_per_prompt(bad), Error) << bad;
}

const tok::Tokenizer& golden() {
  static const tok::Tokenizer t = tok::Tokenizer::load(std::string(KESTREL_SOURCE_DIR) + "/tests/data/tok_golden");
  return t;
}

ojson chat_with(const std::vector<std::string>& urls) {
  ojson parts = ojson::array({{{"type", "text"}, {"text", "look"}}});
  for (const auto& u : urls) parts.push_back({{"type", "image_url"}, {"image_url", {{"url", u}}}});
  return {{"messages", ojson::array({{{"role", "user"}, {"content", parts}}})}};
}

int status_of(const MediaOptions& o, const ojson& req, std::string* msg = nullptr) {
  RequestImages im(o);
  try {
    tok::ChatEncoder(golden()).encode_request(req, im.resolver());
  } catch (const ApiError& e) {
    if (msg) *msg = e.what();
    return e.status;
  }
  return 200;
}

TEST(Media, RequestImagesFillMediaAndImages) {
  MediaOptions o;
  o.vision = true;
  const std::string a = png_url(100, 50, 1), b = png_url(28, 28, 2);
  RequestImages im(o);
  const tok::ChatPrompt cp = tok::ChatEncoder(golden()).encode_request(chat_with({a, b, a}), im.resolver());
  Request r;
  r.prompt.assign(cp.ids.begin(), cp.ids.end());
  im.attach(cp, r);
  ASSERT_EQ(r.media.size(), 3u);
  ASSERT_EQ(r.images.size(), 3u);
  const int32_t pad = int32_t(golden().require_special("<|media_pad|>"));
  const int64_t want[3] = {8, 1, 8};  // 100 x 50 -> 4 x 2 merged tokens; 28 x 28 -> 1
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r.media[i].end - r.media[i].start, want[i]);
    EXPECT_EQ(r.images[i]->num_tokens(), want[i]);
    EXPECT_EQ(r.media[i].content_hash, r.images[i]->content_hash);
    for (int64_t p = r.media[i].start; p < r.media[i].end; ++p) EXPECT_EQ(r.prompt[size_t(p)], pad);
  }
  EXPECT_EQ(r.media[0].content_hash, r.media[2].content_hash);  // the same bytes
  EXPECT_NE(r.media[0].content_hash, r.media[1].content_hash);
  EXPECT_NE(cp.text.find("image 100x50<|media_content|>"), std::string::npos);
  const RequestLimits lim{int64_t(golden().vocab_size()), 4096, ""};
  EXPECT_NO_THROW(validate(r, lim));
  // validate() holds images to their spans: one per span, each with the span's token count.
  auto field = [&](Request x) {
    try {
      validate(x, lim);
    } catch (const RequestError& e) {
      return e.field;
    }
    return std::string();
  };
  Request fewer = r;
  fewer.images.pop_back();
  EXPECT_EQ(field(fewer), "images");
  Request swapped = r;
  std::swap(swapped.images[0], swapped.images[1]);  // 8 tokens into a 1-token span
  EXPECT_EQ(field(swapped), "images");
}

TEST(Media, Refusals) {
  MediaOptions o;
  std::string msg;
  EXPECT_EQ(status_of(o, chat_with({png_url(28, 28, 1)}), &msg), 400);
  EXPECT_NE(msg.find("no vision tower"), std::string::npos) << msg;
  o.vision = true;
  o.max_images = 1;
  EXPECT_EQ(status_of(o, chat_with({png_url(28, 28, 1)})), 200);
  EXPECT_EQ(status_of(o, chat_with({png_url(28, 28, 1), png_url(28, 28, 1)}), &msg), 400);
  EXPECT_NE(msg.find("more than 1 images"), std::string::npos) << msg;
  o.max_images = 4;
  o.decode.max_pixels = 100;
  EXPECT_EQ(status_of(o, chat_with({png_url(11, 10, 1)}), &msg), 400);
  EXPECT_NE(msg.find("exceeds the limit of 100 pixels"), std::string::npos) << msg;
  o.decode.max_pixels = 1 << 20;
  for (const char* url : {"http://x/a.png", "https://x/a.png", "ftp://x", "/etc/passwd", "file:///etc/passwd",
                          "data:image/png,abc", "data:image/png;base64,@@@", "data:image/png;base64"}) {
    EXPECT_EQ(status_of(o, chat_with({url}), &msg), 400) << url;
  }
  o.max_image_bytes = 50;
  EXPECT_EQ(status_of(o, chat_with({png_url(28, 28, 1)}), &msg), 400);
  EXPECT_NE(msg.find("exceed 50 bytes"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kestrel::server
