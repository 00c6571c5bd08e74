// MXFP4 expert product (MODEL.md §4) straight from the packed storage, in ORDER16 (gemm_kernels.h).
//
// A panel of up to 16 weight rows is decoded once per call into an f32 scratch in the permuted layout
// (per 16-group the 8 even elements, then the 8 odd ones: low nibbles of 8 packed bytes are the even
// elements of a group, high nibbles the odd ones), then applied to all T inputs with the ORDER16 block
// kernel; for T ≤ 3 (decode) each block is decoded in registers and applied at once. So each block of
// an expert is decoded once per step for all tokens routed to it, and no dequantised expert ever
// exists. Decoding: vpshufb maps codes to 2·value (int8), converted and scaled exactly (decode_block).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

constexpr int64_t kPanel = 16;  // weight rows decoded at once

// 2^(e−128) = half the e8m0 scale, for every e (NaN for 255): a table, not a call per block.
struct HalfScales {
  float v[256];
  HalfScales() {
    for (int e = 0; e < 256; ++e) v[e] = 0.5f * e8m0_to_f32(uint8_t(e));
  }
};
const HalfScales kHalfScale;

void decode_row_portable(const uint8_t* p /* u8 [in/2] */, const uint8_t* s /* e8m0 [in/32] */, int64_t in,
                         float* w /* f32 [in] permuted */) {
  for (int64_t b = 0; b < in / kMxBlock; ++b) {
    const float sc = e8m0_to_f32(s[b]);
    for (int h = 0; h < 2; ++h)  // the block's two 16-groups: bytes 0..7 and 8..15
      for (int j = 0; j < 8; ++j) {
        const uint8_t byte = p[b * 16 + h * 8 + j];
        w[b * 32 + h * 16 + j] = kE2M1Values[byte & 0xF] * sc;
        w[b * 32 + h * 16 + 8 + j] = kE2M1Values[byte >> 4] * sc;
      }
  }
}

// The 32 weights of one block (16 packed bytes) in the permuted layout: E0 (elements 0, 2, …, 14:
// low nibbles of bytes 0–7), O0 (1, 3, …, 15: their high nibbles), E1, O1 (bytes 8–15). vpshufb maps
// each code to 2·value as an int8 (0, 1, 2, 3, 4, 6, 8, 12 and negatives), converted exactly to f32
// and scaled by 2^(e−128): the same value as kE2M1Values[code] · 2^(e−127) (code 8, −0, comes out +0,
// which no sum that starts from +0 can tell apart).
struct Decoded {
  __m256 e0, o0, e1, o1;
};
KESTREL_AVX2 inline __m256 scaled8(__m128i v /* 8 int8 in the low half */, __m256 sc) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sc);
}
KESTREL_AVX2 inline Decoded decode_block(const uint8_t* p, uint8_t e) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4));
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
  const __m256 sc = _mm256_set1_ps(kHalfScale.v[e]);
  return {scaled8(lo, sc), scaled8(hi, sc), scaled8(_mm_srli_si128(lo, 8), sc), scaled8(_mm_srli_si128(hi, 8), sc)};
}

KESTREL_AVX2 void decode_row_avx2(const uint8_t* p, const uint8_t* s, int64_t in, float* w) {
  for (int64_t b = 0; b < in / kMxBlock; ++b) {
    const Decoded d = decode_block(p + b * 16, s[b]);
    float* o = w + b * 32;
    _mm256_storeu_ps(o, d.e0);
    _mm256_storeu_ps(o + 8, d.o0);
    _mm256_storeu_ps(o + 16, d.e1);
    _mm256_storeu_ps(o + 24, d.o1);
  }
}

// Few tokens (decode): each block decoded in registers and applied at once, four rows at a time;
// per 16-group the same two FMAs per lane as the block kernel, so the same ORDER16 result.
template <int NT>
KESTREL_AVX2 void direct_avx2(const uint8_t* packed, const uint8_t* scale, const float* xp, int64_t out, int64_t in,
                              float* y, uint16_t* yb, int64_t ldy) {
  const int64_t nblk = in / kMxBlock;
  constexpr int R = 4;
  for (int64_t r0 = 0; r0 < out; r0 += R) {
    const int nr = int(std::min<int64_t>(R, out - r0));
    __m256 acc[R][NT];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; ++b)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        if (r >= nr) break;
        const Decoded d = decode_block(packed + (r0 + r) * (in / 2) + b * 16, scale[(r0 + r) * nblk + b]);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          const float* x = xp + t * in + b * 32;
          acc[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(x), d.e0, acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), d.o0, acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), d.e1, acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), d.o1, acc[r][t]);
        }
      }
    for (int t = 0; t < NT; ++t) {
      alignas(16) float v[R];  // the four rows' sums at once, each in the ORDER16 tree (simd::reduce4)
      _mm_store_ps(v, simd::reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
      for (int r = 0; r < nr; ++r) {
        if (yb)
          yb[t * ldy + r0 + r] = f32_to_bf16(v[r]);
        else
          y[t * ldy + r0 + r] = v[r];
      }
    }
  }
}

}  // namespace

namespace gemm_detail {

void mxfp4_rows(const uint8_t* packed, const uint8_t* scale, const float* xp, int64_t T, int64_t out, int64_t in,
                float* y, uint16_t* yb, int64_t ldy) {
  KCHECK(in > 0 && in % kMxBlock == 0, "MXFP4 input width {} is not a positive multiple of {}", in, kMxBlock);
  KCHECK(out > 0 && T >= 0, "bad MXFP4 shape out={} T={}", out, T);
  if (T == 0) return;
  const bool avx2 = isa() >= Isa::avx2;
  if (avx2 && T <= 3) {  // decode: no scratch, each block decoded once per call in registers
    switch (T) {
      case 1: return direct_avx2<1>(packed, scale, xp, out, in, y, yb, ldy);
      case 2: return direct_avx2<2>(packed, scale, xp, out, in, y, yb, ldy);
      default: return direct_avx2<3>(packed, scale, xp, out, in, y, yb, ldy);
    }
  }
  const int64_t panels = (out + kPanel - 1) / kPanel;
  parallel_for(panels, T * out * in, [&](int64_t pb, int64_t pe) {
    thread_local std::vector<float> wbuf;
    wbuf.resize(size_t(kPanel * in));
    for (int64_t pn = pb; pn < pe; ++pn) {
      const int64_t r0 = pn * kPanel, nr = std::min(kPanel, out - r0);
      for (int64_t r = 0; r < nr; ++r) {
        const uint8_t* p = packed + (r0 + r) * (in / 2);
        const uint8_t* s = scale + (r0 + r) * (in / kMxBlock);
        if (avx2)
          decode_row_avx2(p, s, in, wbuf.data() + r * in);
        else
          decode_row_portable(p, s, in, wbuf.data() + r * in);
      }
      Block blk;
      blk.xp = xp, blk.ldx = in;
      blk.wp = wbuf.data(), blk.ldw = in;
      blk.M = T, blk.N = nr, blk.K = in;
      blk.ldy = ldy;
      if (yb)
        blk.yb = yb + r0;
      else
        blk.y = y + r0;
      if (avx2)
        block_avx2(blk);
      else
        block_portable(blk);
    }
  });
}

}  // namespace gemm_detail

void mxfp4_gemm(const uint8_t* packed, const uint8_t* scale, const float* x, float* y, int64_t T, int64_t out,
                int64_t in) {
  KCHECK(in > 0 && in % kMxBlock == 0, "MXFP4 input width {} is not a positive multiple of {}", in, kMxBlock);
  std::vector<float> xp(size_t(T * in));
  for (int64_t t = 0; t < T; ++t) gemm_detail::permute_row_f32(x + t * in, in, xp.data() + t * in);
  gemm_detail::mxfp4_rows(packed, scale, xp.data(), T, out, in, y, nullptr, out);
}

}  // namespace kestrel::cpu
