// MXFP4 expert product (MODEL.md §4) straight from the packed storage, in ORDER16 (gemm_kernels.h).
//
// A panel of up to 16 weight rows is decoded once per call into an f32 scratch in the permuted layout
// (per 16-group the 8 even elements, then the 8 odd ones: low nibbles of 8 packed bytes are the even
// elements of a group, high nibbles the odd ones), then applied to all T inputs with the GEMM's block
// kernel. So each block of an expert is decoded once per step for all tokens routed to it, and no
// dequantised expert ever exists. Decoding: e2m1 magnitude by an 8-entry permute (vpermps), the sign
// bit moved into place, times the block's 2^(e−127) (exact in FP32, subnormal 2^−127 included).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

constexpr int64_t kPanel = 16;  // weight rows decoded at once

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

// 8 e2m1 codes (the low 8 bytes of `codes8`, one code per byte) → 8 values × scale.
KESTREL_AVX2 inline __m256 e2m1x8(__m128i codes8, __m256 sc) {
  const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);  // codes 0..7
  const __m256i idx = _mm256_cvtepu8_epi32(codes8);
  const __m256 m = _mm256_permutevar8x32_ps(mag, idx);  // uses the low 3 bits: the magnitude
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(idx, 28), _mm256_set1_epi32(int32_t(0x80000000u)));
  return _mm256_mul_ps(_mm256_xor_ps(m, _mm256_castsi256_ps(sign)), sc);
}

KESTREL_AVX2 void decode_row_avx2(const uint8_t* p, const uint8_t* s, int64_t in, float* w) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < in / kMxBlock; ++b) {
    const __m256 sc = _mm256_set1_ps(e8m0_to_f32(s[b]));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * 16));
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    float* o = w + b * 32;
    _mm256_storeu_ps(o, e2m1x8(lo, sc));
    _mm256_storeu_ps(o + 8, e2m1x8(hi, sc));
    _mm256_storeu_ps(o + 16, e2m1x8(_mm_srli_si128(lo, 8), sc));
    _mm256_storeu_ps(o + 24, e2m1x8(_mm_srli_si128(hi, 8), sc));
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
