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
#include "kernels/cpu/simd_avx512.h"

namespace kestrel::cpu::gemm_detail {
namespace {

template <int MR, int NP>
KESTREL_AVX512BF16 inline void micro512(const PanelBlock& b, int64_t m0, int64_t p) {
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
    // One masked vector store per row (outputs past N untouched): at the model's K of 128–768 a scalar
    // store per output was a large share of the tile's time.
    const __mmask16 valid = __mmask16((1u << nvalid) - 1u);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      if (b.yb)
        _mm256_mask_storeu_epi16(b.yb + (m0 + m) * b.ldy + nloc, valid, simd512::to_bf16(acc[m][q]));
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
      for (int64_t m = 0; m < b.M; ++m) micro512<1, 4>(b, m, p);
  }
  for (; p + 2 <= b.np; p += 2) {
    int64_t m = 0;
    for (; m + 8 <= b.M; m += 8) micro512<8, 2>(b, m, p);
    for (; m < b.M; ++m) micro512<1, 2>(b, m, p);
  }
  for (; p < b.np; ++p) {
    int64_t m = 0;
    for (; m + 8 <= b.M; m += 8) micro512<8, 1>(b, m, p);
    for (; m < b.M; ++m) micro512<1, 1>(b, m, p);
  }
}

}  // namespace kestrel::cpu::gemm_detail
