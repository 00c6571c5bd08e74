// ORDER_K GEMM micro-kernels over packed panels (gemm_kernels.h), AVX2 and the portable twin
// (bit-identical), and the packing itself.
//
// Micro-kernel MR × NP: MR activation rows × NP panels (16 outputs each), 2·MR·NP accumulators;
// per k one 256-bit panel load and two ALU ops widen 16 bf16 weights, one broadcast per row, two
// FMAs per (row, panel). 6 × 1 for batches (12 accumulators, 7 loads per 12 FMAs: FMA-bound), and
// for a few rows 1 × 4, 2 × 2, 3 × 2 so that enough independent FMA chains hide the latency.
// Packing (row-major W) transposes 16 × 8 blocks in registers: pairs of rows j, j+8 interleave into
// dwords, then an 8 × 8 dword transpose gives the 8 dwords of each k.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/simd_avx2.h"

namespace kestrel::cpu::gemm_detail {
namespace {

inline uint16_t wat(const uint16_t* w, int64_t ldw, bool kmajor, int64_t N, int64_t K, int64_t n, int64_t k) {
  if (n >= N || k >= K) return 0;
  return kmajor ? w[k * ldw + n] : w[n * ldw + k];
}

void pack_scalar(const uint16_t* w, int64_t ldw, bool kmajor, int64_t N, int64_t K, PanelFormat f, uint32_t* out,
                 int64_t p) {
  const int64_t n0 = 16 * p;
  uint32_t* o = out + p * panel_dwords(f, K);
  if (f == PanelFormat::kAvx2) {
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < 8; ++j)
        o[8 * k + j] = uint32_t(wat(w, ldw, kmajor, N, K, n0 + j, k)) |
                       uint32_t(wat(w, ldw, kmajor, N, K, n0 + 8 + j, k)) << 16;
  } else {
    for (int64_t q = 0; q < (K + 1) / 2; ++q)
      for (int j = 0; j < 16; ++j)
        o[16 * q + j] = uint32_t(wat(w, ldw, kmajor, N, K, n0 + j, 2 * q)) |
                        uint32_t(wat(w, ldw, kmajor, N, K, n0 + j, 2 * q + 1)) << 16;
  }
}

// kAvx2 panel p of a row-major W, whole 8-k blocks in registers, the K mod 8 tail scalar.
KESTREL_AVX2 void pack_avx2(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint32_t* out, int64_t p) {
  const int64_t n0 = 16 * p;
  uint32_t* o = out + p * panel_dwords(PanelFormat::kAvx2, K);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 r[8];
    for (int j = 0; j < 8; ++j) {
      const __m128i a = n0 + j < N ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + j) * ldw + k))
                                   : _mm_setzero_si128();
      const __m128i b = n0 + 8 + j < N
                            ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + 8 + j) * ldw + k))
                            : _mm_setzero_si128();
      // dword i = (a[i], b[i]) for i = 0..7: row j's and row j+8's weight at k + i.
      r[j] = _mm256_castsi256_ps(_mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b)));
    }
    simd::transpose8x8(r);  // r[i] = the 8 dwords of k + i
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(o + 8 * (k + i)), r[i]);
  }
  for (; k < K; ++k)
    for (int j = 0; j < 8; ++j)
      o[8 * k + j] = uint32_t(wat(w, ldw, false, N, K, n0 + j, k)) | uint32_t(wat(w, ldw, false, N, K, n0 + 8 + j, k))
                                                                          << 16;
}

inline void store_one(const PanelBlock& b, int64_t m, int64_t n, float s) {
  if (b.yb)
    b.yb[m * b.ldy + n] = f32_to_bf16(s);
  else
    b.y[m * b.ldy + n] = s;
}

template <int MR, int NP>
KESTREL_AVX2 inline void micro(const PanelBlock& b, int64_t m0, int64_t p) {
  const int64_t K = b.w.K, ld = b.ldx;
  const uint32_t* w[NP];
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) w[q] = b.w.data + (b.p0 + p + q) * b.w.stride;
  const float* x = b.x + m0 * ld;
  __m256 acc[MR][NP][2];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) acc[m][q][0] = acc[m][q][1] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[q] + 8 * k));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), up = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ld + k);
        acc[m][q][0] = _mm256_fmadd_ps(xb, lo, acc[m][q][0]);
        acc[m][q][1] = _mm256_fmadd_ps(xb, up, acc[m][q][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) {
    const int64_t nloc = 16 * (p + q), nvalid = std::min<int64_t>(16, b.w.N - 16 * (b.p0 + p + q));
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      if (nvalid == 16 && !b.yb) {
        _mm256_storeu_ps(b.y + (m0 + m) * b.ldy + nloc, acc[m][q][0]);
        _mm256_storeu_ps(b.y + (m0 + m) * b.ldy + nloc + 8, acc[m][q][1]);
      } else if (nvalid == 16) {
        simd::store_bf16(b.yb + (m0 + m) * b.ldy + nloc, acc[m][q][0]);
        simd::store_bf16(b.yb + (m0 + m) * b.ldy + nloc + 8, acc[m][q][1]);
      } else {
        alignas(32) float v[16];
        _mm256_store_ps(v, acc[m][q][0]);
        _mm256_store_ps(v + 8, acc[m][q][1]);
        for (int64_t c = 0; c < nvalid; ++c) store_one(b, m0 + m, nloc + c, v[c]);
      }
    }
  }
}

template <int MR>
KESTREL_AVX2 void rows_one_panel(const PanelBlock& b, int64_t m0, int64_t p) {
  micro<MR, 1>(b, m0, p);
}

}  // namespace

int64_t panel_dwords(PanelFormat f, int64_t K) { return f == PanelFormat::kAvx2 ? 8 * K : 16 * ((K + 1) / 2); }

void pack(const uint16_t* w, int64_t ldw, bool kmajor, int64_t N, int64_t K, PanelFormat f, uint32_t* out) {
  KCHECK(N > 0 && K > 0 && ldw >= (kmajor ? N : K), "bad pack shape N={} K={} ldw={}", N, K, ldw);
  const int64_t panels = (N + 15) / 16;
  const bool fast = f == PanelFormat::kAvx2 && !kmajor && isa() >= Isa::avx2;
  for (int64_t p = 0; p < panels; ++p) {
    if (fast)
      pack_avx2(w, ldw, N, K, out, p);
    else
      pack_scalar(w, ldw, kmajor, N, K, f, out, p);
  }
}

void panels_portable(const PanelBlock& b) {
  KCHECK(b.w.format == PanelFormat::kAvx2, "portable GEMM needs kAvx2 panels");
  for (int64_t p = 0; p < b.np; ++p) {
    const uint32_t* w = b.w.data + (b.p0 + p) * b.w.stride;
    const int64_t nvalid = std::min<int64_t>(16, b.w.N - 16 * (b.p0 + p));
    for (int64_t m = 0; m < b.M; ++m)
      for (int64_t c = 0; c < nvalid; ++c) {
        float s = 0.0f;
        for (int64_t k = 0; k < b.w.K; ++k) {
          const uint32_t d = w[8 * k + (c & 7)];
          const float wk = bf16_to_f32(uint16_t(c < 8 ? d & 0xFFFF : d >> 16));
          s = std::fma(b.x[m * b.ldx + k], wk, s);
        }
        store_one(b, m, 16 * p + c, s);
      }
  }
}

KESTREL_AVX2 void panels_avx2(const PanelBlock& b) {
  KCHECK(b.w.format == PanelFormat::kAvx2, "AVX2 GEMM needs kAvx2 panels");
  if (b.M <= 3) {  // few rows (decode): several panels at once for independent FMA chains
    int64_t p = 0;
    switch (b.M) {
      case 1:
        for (; p + 4 <= b.np; p += 4) micro<1, 4>(b, 0, p);
        for (; p < b.np; ++p) micro<1, 1>(b, 0, p);
        break;
      case 2:
        for (; p + 2 <= b.np; p += 2) micro<2, 2>(b, 0, p);
        for (; p < b.np; ++p) micro<2, 1>(b, 0, p);
        break;
      case 3:
        for (; p + 2 <= b.np; p += 2) micro<3, 2>(b, 0, p);
        for (; p < b.np; ++p) micro<3, 1>(b, 0, p);
        break;
      default: break;
    }
    return;
  }
  for (int64_t p = 0; p < b.np; ++p) {
    int64_t m = 0;
    for (; m + 6 <= b.M; m += 6) micro<6, 1>(b, m, p);
    switch (b.M - m) {
      case 5: rows_one_panel<5>(b, m, p); break;
      case 4: rows_one_panel<4>(b, m, p); break;
      case 3: rows_one_panel<3>(b, m, p); break;
      case 2: rows_one_panel<2>(b, m, p); break;
      case 1: rows_one_panel<1>(b, m, p); break;
      default: break;
    }
  }
}

}  // namespace kestrel::cpu::gemm_detail
