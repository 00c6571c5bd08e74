// Device twins of core/dtype.cpp's small-float conversions (bit-identical: the same integer RNE on the f32
// mantissa), used by the paged cache writers and readers. Device code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::dev {

// Unsigned magnitude code of a finite f32 (sign cleared) on a grid with `mbits` mantissa bits and minimum
// normal exponent `emin`, rounded to nearest even (kestrel's encode_small).
__device__ __forceinline__ uint32_t encode_small(uint32_t abs_bits, int mbits, int emin) {
  const uint32_t exp_field = abs_bits >> 23;
  uint32_t mant = abs_bits & 0x7fffffu;
  int e;
  if (exp_field == 0) {
    e = -126;
  } else {
    e = int(exp_field) - 127;
    mant |= 0x800000u;
  }
  const int eq = max(e, emin);
  const int shift = 23 + (eq - mbits) - e;
  if (shift >= 26) return 0;
  uint32_t n = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (n & 1u))) ++n;
  return (uint32_t(eq - emin) << mbits) + n;
}

// OCP E4M3 "fn", overflow saturates to ±448, NaN → 0x7F|sign.
__device__ __forceinline__ uint8_t f32_to_e4m3_sat(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7f);
  if (a == 0x7f800000u) return uint8_t(sign | 0x7e);
  const uint32_t code = encode_small(a, 3, -6);
  if (code > 0x7eu) return uint8_t(sign | 0x7e);
  return uint8_t(sign | code);
}

__device__ __forceinline__ float e4m3_to_f32(uint8_t v) {
  const uint32_t e = (v >> 3) & 0xFu, m = v & 7u;
  float f;
  if (e == 0xF && m == 7) {
    f = __uint_as_float(0x7fc00000u);
  } else if (e == 0) {
    f = float(m) * 0.001953125f;  // m · 2^-9
  } else {
    f = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) · 2^(e−7)
  }
  return (v & 0x80u) ? -f : f;
}

// E2M1 code (sign bit 3) of x, RNE, saturating at ±6, NaN → 0.
__device__ __forceinline__ uint8_t f32_to_e2m1(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint8_t sign = uint8_t((u >> 28) & 0x8u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0;
  if (a == 0x7f800000u) return uint8_t(sign | 0x7);
  return uint8_t(sign | min(encode_small(a, 1, 0), 7u));
}

__device__ __forceinline__ float e2m1_to_f32(uint32_t code) {
  constexpr float kVals[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kVals[code & 7u];
  return (code & 8u) ? -m : m;
}

// Smallest power of two ≥ x as an e8m0 code, clamped to [2^-127, 2^127]; NaN/Inf → 255, x ≤ 0 → 0.
__device__ __forceinline__ uint8_t e8m0_ceil_pow2(float x) {
  if (isnan(x) || isinf(x)) return 255;
  if (!(x > 0.0f)) return 0;
  const uint32_t u = __float_as_uint(x), exp_field = u >> 23, mant = u & 0x7fffffu;
  int k;
  if (exp_field == 0) {
    k = (u <= 0x00400000u) ? -127 : -126;
  } else {
    k = int(exp_field) - 127 + (mant != 0 ? 1 : 0);
  }
  k = min(max(k, -127), 127);
  return uint8_t(k + 127);
}

__device__ __forceinline__ float e8m0_to_f32(uint8_t e) {
  if (e == 255) return __uint_as_float(0x7fc00000u);
  return ldexpf(1.0f, int(e) - 127);
}

}  // namespace kestrel::cuda::dev
