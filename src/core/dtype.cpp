// Bit-exact conversions for the small float formats. See dtype.h for the rules.
//
// The one trick: every "float to small float" conversion goes through encode_small(), which counts
// quanta of the target grid on the f32 mantissa with integer arithmetic. For a target with `mbits`
// mantissa bits and minimum normal exponent `emin`, the code of a magnitude is
//     ((max(e, emin) - emin) << mbits) + n
// where n is the RNE count of quanta 2^(max(e,emin) - mbits). A mantissa that rounds up to the next
// power of two carries into the exponent field by plain addition, and subnormals fall out for free.
#include "core/dtype.h"

#include <algorithm>
#include <cmath>

namespace kestrel {
namespace {

// abs_bits: f32 bits with the sign cleared, finite. Returns the unsigned magnitude code.
uint32_t encode_small(uint32_t abs_bits, int mbits, int emin) {
  uint32_t exp_field = abs_bits >> 23;
  uint32_t mant = abs_bits & 0x7fffffu;
  int e;
  if (exp_field == 0) {
    e = -126;  // f32 subnormal: no implicit bit
  } else {
    e = int(exp_field) - 127;
    mant |= 0x800000u;
  }
  const int eq = std::max(e, emin);
  const int shift = 23 + (eq - mbits) - e;  // >= 23 - mbits > 0
  if (shift >= 26) return 0;  // value < quarter quantum: rounds to zero
  uint32_t n = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (n & 1u))) ++n;
  return (uint32_t(eq - emin) << mbits) + n;
}

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64:
    case DType::u64:
      return 8;
    case DType::f32:
    case DType::i32:
    case DType::u32:
      return 4;
    case DType::f16:
    case DType::bf16:
    case DType::i16:
    case DType::u16:
      return 2;
    case DType::f8e4m3:
    case DType::f8e5m2:
    case DType::e8m0:
    case DType::u8:
    case DType::i8:
    case DType::boolean:
      return 1;
  }
  return 0;
}

namespace {
struct DTypeNames {
  DType t;
  std::string_view ours;
  std::string_view safetensors;
};
constexpr DTypeNames kNames[] = {
    {DType::f32, "f32", "F32"},         {DType::f16, "f16", "F16"},
    {DType::bf16, "bf16", "BF16"},      {DType::f8e4m3, "f8e4m3", "F8_E4M3"},
    {DType::e8m0, "e8m0", "F8_E8M0"},   {DType::u8, "u8", "U8"},
    {DType::i8, "i8", "I8"},            {DType::i16, "i16", "I16"},
    {DType::i32, "i32", "I32"},         {DType::i64, "i64", "I64"},
    {DType::u16, "u16", "U16"},         {DType::u32, "u32", "U32"},
    {DType::u64, "u64", "U64"},         {DType::f64, "f64", "F64"},
    {DType::boolean, "bool", "BOOL"},   {DType::f8e5m2, "f8e5m2", "F8_E5M2"},
};
}  // namespace

std::string_view dtype_name(DType t) {
  for (const auto& n : kNames)
    if (n.t == t) return n.ours;
  return "?";
}

std::string_view dtype_safetensors_name(DType t) {
  for (const auto& n : kNames)
    if (n.t == t) return n.safetensors;
  return "?";
}

bool dtype_from_safetensors(std::string_view name, DType* out) {
  for (const auto& n : kNames) {
    if (n.safetensors == name) {
      *out = n.t;
      return true;
    }
  }
  return false;
}

// ---- f16 -----------------------------------------------------------------------------------------
float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // Inf / NaN
  if (exp == 0) {
    const float v = std::ldexp(float(mant), -24);  // subnormal or zero: exact
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a == 0x7f800000u) return uint16_t(sign | 0x7c00u);
  const uint32_t code = encode_small(a, 10, -14);
  if (code >= 0x7c00u) return uint16_t(sign | 0x7c00u);  // overflow to Inf
  return uint16_t(sign | code);
}

// ---- f8 e4m3 -------------------------------------------------------------------------------------
float f8e4m3_to_f32(uint8_t v) {
  const bool neg = v & 0x80u;
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 0x7;
  float r;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0)
    r = std::ldexp(float(mant), -9);
  else
    r = std::ldexp(float(8 + mant), exp - 10);
  return neg ? -r : r;
}

uint8_t f32_to_f8e4m3(float f, Fp8Overflow mode) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7f);
  const uint8_t overflow = mode == Fp8Overflow::saturate ? uint8_t(sign | 0x7e) : uint8_t(sign | 0x7f);
  if (a == 0x7f800000u) return overflow;
  const uint32_t code = encode_small(a, 3, -6);
  if (code > 0x7eu) return overflow;
  return uint8_t(sign | code);
}

// ---- e8m0 ----------------------------------------------------------------------------------------
float e8m0_to_f32(uint8_t e) {
  if (e == kE8M0Nan) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, int(e) - 127);
}

uint8_t e8m0_ceil_pow2(float x) {
  if (std::isnan(x) || std::isinf(x)) return kE8M0Nan;
  if (!(x > 0.0f)) return 0;
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t exp_field = u >> 23;
  const uint32_t mant = u & 0x7fffffu;
  int k;
  if (exp_field == 0) {
    k = (u <= 0x00400000u) ? -127 : -126;  // 0x00400000 = 2^-127 exactly
  } else {
    k = int(exp_field) - 127 + (mant != 0 ? 1 : 0);
  }
  k = std::clamp(k, -127, 127);
  return uint8_t(k + 127);
}

// ---- e2m1 / mxfp4 ----------------------------------------------------------------------------------
uint8_t f32_to_e2m1(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint8_t sign = uint8_t((u >> 28) & 0x8u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0;
  if (a == 0x7f800000u) return uint8_t(sign | 0x7);
  const uint32_t code = encode_small(a, 1, 0);
  return uint8_t(sign | std::min<uint32_t>(code, 7u));
}

uint8_t mxfp4_quantize_block(const float* x, uint8_t* packed) {
  float amax = 0.0f;
  bool bad = false;
  for (int i = 0; i < kMxBlock; ++i) {
    if (!std::isfinite(x[i])) bad = true;
    amax = std::max(amax, std::fabs(x[i]));
  }
  if (bad) {
    std::fill(packed, packed + kMxBlock / 2, uint8_t(0));
    return kE8M0Nan;
  }
  // Smallest k with amax <= 6 * 2^k. amax/6 is inexact in f32, so take its ceil-log2 as a first
  // guess and correct it against the exact products 6 * 2^k.
  int k = amax > 0.0f ? int(e8m0_ceil_pow2(amax / 6.0f)) - 127 : -127;
  while (k < 127 && amax > std::ldexp(6.0f, k)) ++k;
  while (k > -127 && amax <= std::ldexp(6.0f, k - 1)) --k;
  for (int i = 0; i < kMxBlock; i += 2) {
    const uint8_t lo = f32_to_e2m1(std::ldexp(x[i], -k));
    const uint8_t hi = f32_to_e2m1(std::ldexp(x[i + 1], -k));
    packed[i / 2] = uint8_t(lo | (hi << 4));
  }
  return uint8_t(k + 127);
}

void mxfp4_dequantize_row(const uint8_t* packed, const uint8_t* scales, float* out, size_t n) {
  for (size_t c = 0; c < n; c += 2) {
    const float s = e8m0_to_f32(scales[c / kMxBlock]);
    const uint8_t b = packed[c / 2];
    out[c] = kE2M1Values[b & 0xF] * s;
    out[c + 1] = kE2M1Values[b >> 4] * s;
  }
}

}  // namespace kestrel
