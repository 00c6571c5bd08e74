// Scalar number formats used by K3.1 checkpoints and kernels, with exact conversions.
//
// Every narrowing conversion is round-to-nearest, ties-to-even (RNE), computed on the bit pattern so
// the result never depends on the host FPU's rounding mode or on x87 excess precision. The CUDA kernels
// use the hardware conversions, which implement the same rules; the exhaustive tests in
// tests/unit/test_dtype.cpp pin the CPU twins down so they can serve as oracles.
//
// Format summary (see docs/GLOSSARY.md):
//   bf16    top 16 bits of an f32; NaN stays NaN (quiet bit forced), Inf stays Inf.
//   f16     IEEE binary16 with subnormals; overflow -> Inf.
//   f8e4m3  OCP E4M3 "fn": no Inf, 0x7F/0xFF are NaN, max 448. Overflow either saturates to +-448
//           (Fp8Overflow::saturate, what quantisers use after scaling) or becomes NaN
//           (Fp8Overflow::nan, PyTorch's `.to(float8_e4m3fn)` behaviour). "Overflow" means the RNE
//           result would exceed 448 in magnitude, i.e. |x| > 464 (464 itself ties to even = 448).
//   e8m0    unsigned power-of-two scale 2^(e-127); 255 = NaN; no zero.
//   e2m1    4-bit float, codes 0..7 = +{0,0.5,1,1.5,2,3,4,6}, bit 3 = sign; saturates at +-6.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kestrel {

enum class DType : uint8_t {
  f32,
  f16,
  bf16,
  f8e4m3,
  e8m0,
  u8,
  i8,
  i16,
  i32,
  i64,
  u16,
  u32,
  u64,
  f64,
  boolean,
  f8e5m2,
};

// Size of one element in bytes (all supported dtypes are whole bytes; MXFP4 is stored as u8).
size_t dtype_size(DType t);
std::string_view dtype_name(DType t);

// safetensors spells dtypes "BF16", "F8_E4M3", ...; returns false for names we do not know.
bool dtype_from_safetensors(std::string_view name, DType* out);
std::string_view dtype_safetensors_name(DType t);

// ---- bf16 ----------------------------------------------------------------------------------------
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_f32(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN: keep sign, quiet
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // RNE; carries into the exponent correctly, overflow lands on Inf
  return uint16_t(u >> 16);
}

// Round an f32 to the nearest bf16 value and return it as f32 (the "cast to BF16" of MODEL.md §3).
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// ---- f16 -----------------------------------------------------------------------------------------
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// ---- f8 e4m3 (fn) --------------------------------------------------------------------------------
enum class Fp8Overflow { saturate, nan };
inline constexpr float kFp8E4M3Max = 448.0f;
float f8e4m3_to_f32(uint8_t v);
uint8_t f32_to_f8e4m3(float f, Fp8Overflow mode = Fp8Overflow::saturate);

// ---- e8m0 ----------------------------------------------------------------------------------------
inline constexpr uint8_t kE8M0Nan = 255;
float e8m0_to_f32(uint8_t e);  // 2^(e-127), NaN for 255; 2^-127 is an f32 subnormal, exact
// The smallest power of two >= x, as an e8m0 code, clamped to [2^-127, 2^127]. x must be > 0 and
// finite; NaN/Inf give 255. Used by the MXFP4/FP8 quantisers (MODEL.md §0.9, §3.5).
uint8_t e8m0_ceil_pow2(float x);

// ---- e2m1 / mxfp4 ----------------------------------------------------------------------------------
inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
inline float e2m1_to_f32(uint8_t code) { return kE2M1Values[code & 0xF]; }
// RNE to the E2M1 grid, ties to the even code, saturating at +-6. NaN maps to +0: callers that can
// see NaN (the block quantiser) flag the block through its e8m0 scale instead.
uint8_t f32_to_e2m1(float f);

inline constexpr int kMxBlock = 32;  // elements per e8m0 scale
// Quantise one block of 32 floats per MODEL.md §0.9: scale = smallest power of two with
// max|x|/scale <= 6 (clamped to the e8m0 range), elements RNE to E2M1. Writes 16 packed bytes (low
// nibble = even element) and returns the e8m0 scale code. A NaN/Inf in the block gives scale 255.
uint8_t mxfp4_quantize_block(const float* x /* f32 [32] */, uint8_t* packed /* u8 [16] */);
// Dequantise n elements (n a multiple of 2) of one row: element c uses scales[c/32].
void mxfp4_dequantize_row(const uint8_t* packed /* u8 [n/2] */, const uint8_t* scales /* e8m0 [n/32] */,
                          float* out /* f32 [n] */, size_t n);

}  // namespace kestrel
