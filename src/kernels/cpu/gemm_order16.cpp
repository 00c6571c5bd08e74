// ORDER16 blocks (gemm_kernels.h) of the MXFP4 expert product: AVX2/FMA, and the portable twin that
// repeats the same order one element at a time (bit-identical results; the tests compare them).
//
// Register tiles: MR rows × NR outputs, one 8-lane accumulator each (3×3 for batches, rows outer; 1×4
// when few rows are left, as in decode). Weight rows are decoded f32 in the permuted layout, so a 16-group
// is two loads per row and two FMAs per (row, output) pair. The batch tile keeps its rows' activations
// in registers per group (XR) and takes the weights as FMA memory operands; holding the weights and
// loading the activations (4×3) ran the expert products at ~44 GFLOP/s per core, 3×3 this way at ~53
// (issue #22: they were 12 % of a 2K prefill on an AVX2-only CPU). Same FMAs per accumulator, same bits.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/simd_avx2.h"

namespace kestrel::cpu::gemm_detail {
namespace {

inline void store(const Block& b, int64_t m, int64_t n, float s) {
  if (b.yb)
    b.yb[m * b.ldy + n] = f32_to_bf16(s);
  else
    b.y[m * b.ldy + n] = s;
}

// ---- portable twin ----------------------------------------------------------------------------

float dot_portable(const float* xp, const Block& b, int64_t n) {
  const int64_t G = b.K / 16;
  float l[8] = {};
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) {
      l[j] = std::fma(xp[16 * g + j], b.wp[n * b.ldw + 16 * g + j], l[j]);            // element 16g + 2j
      l[j] = std::fma(xp[16 * g + 8 + j], b.wp[n * b.ldw + 16 * g + 8 + j], l[j]);    // element 16g + 2j + 1
    }
  float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (int64_t k = 16 * G; k < b.K; ++k) s = std::fma(xp[k], b.wp[n * b.ldw + k], s);
  return s;
}

// ---- AVX2 -------------------------------------------------------------------------------------

template <int MR, int NR, bool XR = false>
KESTREL_AVX2 inline void tile(const Block& b, int64_t m0, int64_t n0) {
  const int64_t G = b.K / 16;
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  const float* xr = b.xp + m0 * b.ldx;
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (XR) {  // a row's even / odd halves in registers, the weights from memory
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m256 xe = _mm256_loadu_ps(xr + m * b.ldx + 16 * g), xo = _mm256_loadu_ps(xr + m * b.ldx + 16 * g + 8);
#pragma GCC unroll 4
        for (int n = 0; n < NR; ++n) {
          const float* wr = b.wp + (n0 + n) * b.ldw + 16 * g;
          acc[m][n] = _mm256_fmadd_ps(xe, _mm256_loadu_ps(wr), acc[m][n]);
          acc[m][n] = _mm256_fmadd_ps(xo, _mm256_loadu_ps(wr + 8), acc[m][n]);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) {
        const float* wr = b.wp + (n0 + n) * b.ldw + 16 * g;
        const __m256 we = _mm256_loadu_ps(wr), wo = _mm256_loadu_ps(wr + 8);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + m * b.ldx + 16 * g), we, acc[m][n]);
          acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + m * b.ldx + 16 * g + 8), wo, acc[m][n]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    // Up to four accumulators reduced at once: hadd pairs neighbours, so lane j of reduce4 is exactly
    // the ORDER16 tree of accumulator j (as reduce8 per accumulator, at a third of the shuffles; with
    // K = 128 the reduction was a quarter of the tile's work).
    alignas(16) float s[4];
    _mm_store_ps(s, simd::reduce4(acc[m][0], NR > 1 ? acc[m][NR > 1 ? 1 : 0] : _mm256_setzero_ps(),
                                  NR > 2 ? acc[m][NR > 2 ? 2 : 0] : _mm256_setzero_ps(),
                                  NR > 3 ? acc[m][NR > 3 ? 3 : 0] : _mm256_setzero_ps()));
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) {
      float v = s[n];
      for (int64_t k = 16 * G; k < b.K; ++k) v = __builtin_fmaf(xr[m * b.ldx + k], b.wp[(n0 + n) * b.ldw + k], v);
      store(b, m0 + m, n0 + n, v);
    }
  }
}

template <int NR>
KESTREL_AVX2 void rows(const Block& b, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= b.M; m += 4) tile<4, NR>(b, m, n0);
  switch (b.M - m) {
    case 3: tile<3, NR>(b, m, n0); break;
    case 2: tile<2, NR>(b, m, n0); break;
    case 1: tile<1, NR>(b, m, n0); break;
    default: break;
  }
}

// MR rows × all N outputs, three at a time (the N mod 3 tail narrower).
template <int MR>
KESTREL_AVX2 void cols(const Block& b, int64_t m0) {
  int64_t n = 0;
  for (; n + 3 <= b.N; n += 3) tile<MR, 3, true>(b, m0, n);
  switch (b.N - n) {
    case 2: tile<MR, 2>(b, m0, n); break;
    case 1: tile<MR, 1>(b, m0, n); break;
    default: break;
  }
}

}  // namespace

void block_portable(const Block& b) {
  for (int64_t m = 0; m < b.M; ++m)
    for (int64_t n = 0; n < b.N; ++n) store(b, m, n, dot_portable(b.xp + m * b.ldx, b, n));
}

KESTREL_AVX2 void block_avx2(const Block& b) {
  if (b.M < 4) {  // few rows (decode): four outputs share each activation load
    int64_t n = 0;
    for (; n + 4 <= b.N; n += 4)
      for (int64_t m = 0; m < b.M; ++m) tile<1, 4>(b, m, n);
    for (; n + 3 <= b.N; n += 3) rows<3>(b, n);
    for (; n < b.N; ++n) rows<1>(b, n);
    return;
  }
  // Batches: rows outer in blocks of 3, the panel's outputs inner (3 × 3 tiles), so a block of
  // activation rows (3 × K f32) stays in L1 across the panel's tiles; outputs outer streamed every
  // activation row from L2 once per 3 outputs. Every element is summed by the same FMAs whatever the
  // tile's shape or register use: results unchanged.
  int64_t m = 0;
  for (; m + 3 <= b.M; m += 3) cols<3>(b, m);
  switch (b.M - m) {
    case 2: cols<2>(b, m); break;
    case 1: cols<1>(b, m); break;
    default: break;
  }
}

KESTREL_AVX2 void permute_row_bf16_avx2(const uint16_t* x, int64_t K, float* xp) {
  const int64_t G = K / 16;
  const __m256i hi = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t g = 0; g < G; ++g) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * g));
    _mm256_storeu_ps(xp + 16 * g, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    _mm256_storeu_ps(xp + 16 * g + 8, _mm256_castsi256_ps(_mm256_and_si256(v, hi)));
  }
  for (int64_t k = 16 * G; k < K; ++k) xp[k] = bf16_to_f32(x[k]);
}

void permute_row_bf16(const uint16_t* x, int64_t K, float* xp) {
  const int64_t G = K / 16;
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) {
      xp[16 * g + j] = bf16_to_f32(x[16 * g + 2 * j]);
      xp[16 * g + 8 + j] = bf16_to_f32(x[16 * g + 2 * j + 1]);
    }
  for (int64_t k = 16 * G; k < K; ++k) xp[k] = bf16_to_f32(x[k]);
}

void permute_row_f32(const float* x, int64_t K, float* xp) {
  const int64_t G = K / 16;
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) {
      xp[16 * g + j] = x[16 * g + 2 * j];
      xp[16 * g + 8 + j] = x[16 * g + 2 * j + 1];
    }
  for (int64_t k = 16 * G; k < K; ++k) xp[k] = x[k];
}

}  // namespace kestrel::cpu::gemm_detail
