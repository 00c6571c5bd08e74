// Exhaustive tests of the scalar formats in core/dtype.h.
//
// The oracles are written independently of the bit-twiddling under test: candidates are enumerated
// from the decoded value tables and the nearest one is chosen with exact double arithmetic (every
// value involved is exactly representable in a double), ties going to the even code.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"

namespace kestrel {
namespace {

// ---- bf16 -------------------------------------------------------------------------------------
TEST(DTypeBf16, AllPatternsRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_f32(uint16_t(b));
    const uint16_t back = f32_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(back))) << b;
      EXPECT_EQ(back & 0x8000, b & 0x8000) << "NaN sign kept " << b;
    } else {
      EXPECT_EQ(back, b) << "pattern " << b;
    }
  }
}

// For every pair of adjacent finite bf16 values, probe the midpoint and one f32 ulp either side.
TEST(DTypeBf16, RoundsToNearestEvenBetweenEveryAdjacentPair) {
  for (uint32_t b = 0; b < 0x7f80; ++b) {  // positive finite, next one also finite or Inf
    for (uint32_t sign : {0u, 0x8000u}) {
      const uint16_t lo = uint16_t(b | sign), hi = uint16_t((b + 1) | sign);
      const double vlo = bf16_to_f32(lo);
      // Past the largest finite value the next grid point is 2^128 (which rounds to Inf).
      const double vhi = (b + 1 == 0x7f80) ? std::copysign(std::ldexp(1.0, 128), vlo) : bf16_to_f32(hi);
      const double mid = (vlo + vhi) / 2;  // exact in double
      const float fmid = float(mid);       // also exact: needs only 9 significant bits
      ASSERT_EQ(double(fmid), mid);
      const uint16_t even = (lo & 1) ? hi : lo;
      EXPECT_EQ(f32_to_bf16(fmid), even) << "tie at " << mid;
      EXPECT_EQ(f32_to_bf16(std::nextafter(fmid, float(vlo))), lo) << mid;
      if (b + 1 < 0x7f80) {
        EXPECT_EQ(f32_to_bf16(std::nextafter(fmid, float(vhi))), hi) << mid;
      }
    }
  }
}

TEST(DTypeBf16, SpecialValues) {
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload lives only in the low 16 bits must not become Inf.
  const float snan = std::bit_cast<float>(0x7f800001u);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(snan))));
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80) << "FLT_MAX rounds up to Inf";
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
}

// ---- f16 --------------------------------------------------------------------------------------
// Oracle: the value table built from the IEEE formula in double, and a nearest-value search with
// ties to the even code; no bit tricks shared with the code under test.
double f16_reference_value(uint32_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return s ? -mag : mag;
}

uint16_t f16_oracle(float f) {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (uint32_t h = 0; h < 0x7c00; ++h) t.push_back(f16_reference_value(h));
    return t;
  }();
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (a >= 65520.0) return uint16_t(sign | 0x7c00);  // halfway to 2^16 and beyond: Inf
  const auto it = std::lower_bound(table.begin(), table.end(), a);
  const uint32_t hi = uint32_t(it - table.begin());
  if (hi == 0) return sign;
  if (hi == table.size()) return uint16_t(sign | 0x7bff);  // (65504, 65520): nearest is the max
  const uint32_t lo = hi - 1;
  const double dlo = a - table[lo], dhi = table[hi] - a;
  const uint32_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return uint16_t(sign | pick);
}

TEST(DTypeF16, AllPatternsDecodeExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = f16_to_f32(uint16_t(h));
    if (((h >> 10) & 31) == 31) {
      EXPECT_EQ(std::isnan(got), (h & 1023) != 0) << h;
      EXPECT_EQ(std::isinf(got), (h & 1023) == 0) << h;
      continue;
    }
    EXPECT_EQ(double(got), f16_reference_value(h)) << h;
    EXPECT_EQ(std::signbit(got), (h >> 15) != 0) << h;
    EXPECT_EQ(f32_to_f16(got), uint16_t(h)) << "round trip " << h;
  }
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypeF16, EncodeMatchesOracleOnMidpointsAndRandom) {
  auto check = [](float f) { EXPECT_EQ(f32_to_f16(f), f16_oracle(f)) << "f=" << f; };
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double a = f16_reference_value(h), b = f16_reference_value(h + 1);
    const float mid = float((a + b) / 2);
    ASSERT_EQ(double(mid), (a + b) / 2);
    for (float s : {1.0f, -1.0f}) {
      check(s * mid);
      check(s * std::nextafter(mid, 0.0f));
      check(s * std::nextafter(mid, 1e9f));
    }
  }
  check(65504.0f);
  check(65519.99f);
  check(65520.0f);
  check(std::ldexp(1.0f, -25));                       // ties to zero
  check(std::nextafter(std::ldexp(1.0f, -25), 1.0f));  // rounds up to the smallest subnormal
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e30f), 0xfc00);
  std::mt19937 rng(7);
  for (int i = 0; i < 300000; ++i) {
    const float f = std::bit_cast<float>(uint32_t(rng()));
    if (std::isnan(f)) continue;
    check(f);
  }
}

// ---- f8 e4m3 ------------------------------------------------------------------------------------
double e4m3_reference_value(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

TEST(DTypeFp8, AllCodesDecode) {
  for (int c = 0; c < 256; ++c) {
    const float v = f8e4m3_to_f32(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(double(v), e4m3_reference_value(c)) << c;
    EXPECT_EQ(f32_to_f8e4m3(v), uint8_t(c)) << "round trip " << c;
  }
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
}

uint8_t e4m3_oracle(double x, Fp8Overflow mode) {
  if (std::isnan(x)) return 0x7f;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a > 464.0) return uint8_t(sign | (mode == Fp8Overflow::saturate ? 0x7e : 0x7f));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double err = std::fabs(e4m3_reference_value(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return uint8_t(sign | best);
}

TEST(DTypeFp8, EncodeMidpointsSaturationAndNan) {
  for (int c = 0; c < 0x7e; ++c) {
    const double a = e4m3_reference_value(c), b = e4m3_reference_value(c + 1);
    const float mid = float((a + b) / 2);
    ASSERT_EQ(double(mid), (a + b) / 2);
    for (float s : {1.0f, -1.0f}) {
      for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
        for (auto mode : {Fp8Overflow::saturate, Fp8Overflow::nan})
          EXPECT_EQ(f32_to_f8e4m3(s * v, mode), e4m3_oracle(double(s * v), mode)) << s * v;
      }
    }
  }
  EXPECT_EQ(f32_to_f8e4m3(464.0f), 0x7e) << "464 ties to even (448)";
  EXPECT_EQ(f32_to_f8e4m3(464.01f, Fp8Overflow::saturate), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(464.01f, Fp8Overflow::nan), 0x7f);
  EXPECT_EQ(f32_to_f8e4m3(1e30f), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(-1e30f), 0xfe);
  EXPECT_EQ(f32_to_f8e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(std::numeric_limits<float>::infinity(), Fp8Overflow::nan), 0x7f);
  EXPECT_EQ(f32_to_f8e4m3(-std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.0f, -10)), 0x00) << "2^-10 ties to zero";
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.0f, -30)), 0x00);
  EXPECT_EQ(f32_to_f8e4m3(-std::ldexp(1.0f, -30)), 0x80);
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::ldexp(float(rng()) / 4294967296.0f, int(rng() % 40) - 20) * ((rng() & 1) ? 1 : -1);
    EXPECT_EQ(f32_to_f8e4m3(f), e4m3_oracle(f, Fp8Overflow::saturate)) << f;
  }
}

// ---- e8m0 --------------------------------------------------------------------------------------
TEST(DTypeE8M0, AllCodes) {
  for (int e = 0; e < 255; ++e) {
    EXPECT_EQ(double(e8m0_to_f32(uint8_t(e))), std::ldexp(1.0, e - 127)) << e;
    EXPECT_EQ(e8m0_ceil_pow2(e8m0_to_f32(uint8_t(e))), e) << "exact powers map to themselves " << e;
    if (e > 0 && e < 254) {
      const float just_above = std::nextafter(e8m0_to_f32(uint8_t(e)), 1e38f);
      EXPECT_EQ(e8m0_ceil_pow2(just_above), e + 1) << e;
    }
  }
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
  EXPECT_EQ(e8m0_ceil_pow2(std::numeric_limits<float>::quiet_NaN()), 255);
  EXPECT_EQ(e8m0_ceil_pow2(std::numeric_limits<float>::infinity()), 255);
  EXPECT_EQ(e8m0_ceil_pow2(0.0f), 0) << "clamped to 2^-127";
  EXPECT_EQ(e8m0_ceil_pow2(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(e8m0_ceil_pow2(std::numeric_limits<float>::max()), 254) << "clamped to 2^127";
  EXPECT_EQ(e8m0_ceil_pow2(3.0f), 127 + 2);
}

// ---- e2m1 --------------------------------------------------------------------------------------
TEST(DTypeE2M1, AllCodesAndTies) {
  const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const double want = (c & 8 ? -1 : 1) * grid[c & 7];
    EXPECT_EQ(double(e2m1_to_f32(uint8_t(c))), want) << c;
    EXPECT_EQ(f32_to_e2m1(e2m1_to_f32(uint8_t(c))), c) << c;
  }
  // Every midpoint: ties go to the even code.
  for (int c = 0; c < 7; ++c) {
    const float mid = float((grid[c] + grid[c + 1]) / 2);
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(f32_to_e2m1(mid), even) << mid;
    EXPECT_EQ(f32_to_e2m1(-mid), even | 8) << -mid;
    EXPECT_EQ(f32_to_e2m1(std::nextafter(mid, 0.0f)), c) << mid;
    EXPECT_EQ(f32_to_e2m1(std::nextafter(mid, 10.0f)), c + 1) << mid;
  }
  EXPECT_EQ(f32_to_e2m1(7.0f), 7);
  EXPECT_EQ(f32_to_e2m1(1e30f), 7);
  EXPECT_EQ(f32_to_e2m1(-std::numeric_limits<float>::infinity()), 15);
  EXPECT_EQ(f32_to_e2m1(std::ldexp(1.0f, -140)), 0);
}

TEST(DTypeMxfp4, BlockScaleIsSmallestPowerOfTwo) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    float x[32];
    const int e = int(rng() % 200) - 100;
    for (float& v : x) v = std::ldexp(u(rng), e);
    if (trial % 7 == 0) x[rng() % 32] = std::ldexp(6.0f, e - 3);  // exactly 6 * 2^k
    uint8_t packed[16];
    const uint8_t s = mxfp4_quantize_block(x, packed);
    double amax = 0;
    for (float v : x) amax = std::max(amax, double(std::fabs(v)));
    const double scale = std::ldexp(1.0, int(s) - 127);
    EXPECT_LE(amax / scale, 6.0);
    if (s > 0) {
      EXPECT_GT(amax / (scale / 2), 6.0) << "a smaller scale would also fit";
    }
    float back[32];
    mxfp4_dequantize_row(packed, &s, back, 32);
    for (int i = 0; i < 32; ++i) {
      const uint8_t code = i % 2 ? packed[i / 2] >> 4 : packed[i / 2] & 15;
      EXPECT_EQ(code, f32_to_e2m1(float(double(x[i]) / scale))) << "element " << i;
      EXPECT_EQ(double(back[i]), double(e2m1_to_f32(code)) * scale);
    }
  }
}

TEST(DTypeMxfp4, ZeroNanAndNibbleOrder) {
  float x[32] = {};
  uint8_t packed[16];
  EXPECT_EQ(mxfp4_quantize_block(x, packed), 0);
  for (uint8_t b : packed) EXPECT_EQ(b, 0);
  x[0] = 1.0f;   // even element -> low nibble
  x[1] = -6.0f;  // odd element -> high nibble
  const uint8_t s = mxfp4_quantize_block(x, packed);
  EXPECT_EQ(s, 127);
  EXPECT_EQ(packed[0], uint8_t(0x2 | (0xF << 4)));
  x[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(mxfp4_quantize_block(x, packed), kE8M0Nan);
}

TEST(DTypeNames, SafetensorsRoundTrip) {
  for (const char* n : {"F32", "F16", "BF16", "F8_E4M3", "U8", "I32", "I64", "F64", "BOOL"}) {
    DType t;
    ASSERT_TRUE(dtype_from_safetensors(n, &t)) << n;
    EXPECT_EQ(dtype_safetensors_name(t), n);
  }
  DType t;
  EXPECT_FALSE(dtype_from_safetensors("F4", &t));
  EXPECT_FALSE(dtype_from_safetensors("bf16", &t));
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f8e4m3), 1u);
}

}  // namespace
}  // namespace kestrel
