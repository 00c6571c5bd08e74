// AVX-512 BF16 micro-kernels of the GEMM (gemm_kernels.h, ORDER_K2 over kPairs panels): per k-pair
// one zmm holds 16 outputs' weight pairs, each activation pair is broadcast as a dword, and vdpbf16ps
// multiplies and accumulates both products into 16 FP32 lanes — no widening at all. Tiles of 8 rows
// × 2 panels (16 of the 32 zmm registers); 1 row × 4 panels for one or few rows.
// Numerics: products of two bf16 are exact in FP32; vdpbf16ps flushes denormal inputs and outputs
// to zero (bf16 denormals never matter at the model's scales). Compiled for every x86-64 build, run
// only where the CPU reports AVX512_BF16 (isa.h); the tests check it against the scalar reference
// and for row invariance on such machines.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

// GCC 12's avx512fintrin.h initialises a register from itself (_mm256_undefined_pd) inside
// _mm512_castps512_ps256 / _mm512_extractf64x4_pd, a known false -Wuninitialized in that header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"

namespace kestrel::cpu::gemm_detail {
namespace {

// 16 f32 → 16 bf16, exactly f32_to_bf16 (core/dtype.h) per lane: RNE by the integer add, NaN kept
// quiet with its sign. Not vcvtneps2bf16: that flushes denormal inputs, which f32_to_bf16 rounds.
// Vector stores matter here: at the model's K of 128–768 a scalar store per output cost about as
// much as a fifth of the tile's dot products.
KESTREL_AVX512BF16 inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __m512i nanv = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 isnan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(isnan, r, nanv));
}

template <int MR, int NP>
KESTREL_AVX512BF16 inline void micro(const PanelBlock& b, int64_t m0, int64_t p) {
  const int64_t P = (b.w.K + 1) / 2, ld = b.ldx;  // k-pairs; x rows are zero-padded to 2P
  const uint32_t* w[NP];
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) w[q] = b.w.data + (b.p0 + p + q) * b.w.stride;
  const uint16_t* x = b.xb + m0 * ld;
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < P; ++k2) {
    __m512i wv[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) wv[q] = _mm512_loadu_si512(w[q] + 16 * k2);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * ld + 2 * k2, 4);
      const __m512i xv = _mm512_set1_epi32(int32_t(pair));
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_dpbf16_ps(acc[m][q], (__m512bh)xv, (__m512bh)wv[q]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) {
    const int64_t nloc = 16 * (p + q), nvalid = std::min<int64_t>(16, b.w.N - 16 * (b.p0 + p + q));
    const __mmask16 valid = __mmask16((1u << nvalid) - 1u);  // outputs past N are not stored
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      if (b.yb)
        _mm256_mask_storeu_epi16(b.yb + (m0 + m) * b.ldy + nloc, valid, to_bf16(acc[m][q]));
      else
        _mm512_mask_storeu_ps(b.y + (m0 + m) * b.ldy + nloc, valid, acc[m][q]);
    }
  }
}

}  // namespace

KESTREL_AVX512BF16 void panels_avx512bf16(const PanelBlock& b) {
  KCHECK(b.w.format == PanelFormat::kPairs && b.xb, "AVX-512 BF16 GEMM needs kPairs panels and bf16 activations");
  int64_t p = 0;
  if (b.M < 4) {  // few rows: four panels at once
    for (; p + 4 <= b.np; p += 4)
      for (int64_t m = 0; m < b.M; ++m) micro<1, 4>(b, m, p);
  }
  for (; p + 2 <= b.np; p += 2) {
    int64_t m = 0;
    for (; m + 8 <= b.M; m += 8) micro<8, 2>(b, m, p);
    for (; m < b.M; ++m) micro<1, 2>(b, m, p);
  }
  for (; p < b.np; ++p) {
    int64_t m = 0;
    for (; m + 8 <= b.M; m += 8) micro<8, 1>(b, m, p);
    for (; m < b.M; ++m) micro<1, 1>(b, m, p);
  }
}

}  // namespace kestrel::cpu::gemm_detail
