// MXFP4 expert product (MODEL.md §4) on AVX-512 BF16: the routed experts' path where the CPU has
// vdpbf16ps (isa.h: avx512bf16), in ORDER_B32 (gemm_kernels.h).
//
// Why not the ORDER16 f32 kernel (mxfp4_gemm.cpp): on Zen 4 a 512-bit f32 FMA is two 256-bit ones, so
// only vdpbf16ps (32 products per instruction) doubles the multiply rate, and the expert inputs are
// BF16 anyway (z, and the SiTU-GLU output a). A decoded MXFP4 weight is exactly a BF16 value (an E2M1
// value has at most two significant bits; the e8m0 scale is a power of two), so the products are the
// same as the f32 kernel's; only the summation order differs.
// Layout: one 32-element block (16 packed bytes) decodes into one zmm of weight pairs, lane i = bytes
// i's (low nibble, high nibble) = elements (2i, 2i+1), which is also the activation's natural layout
// in memory: lanes run over k, no transpose. A 16-row panel is decoded once per call into a scratch of
// such zmm, then applied to all T inputs 4 rows × 4 tokens at a time; the 16 lane sums of each output
// fold in one fixed tree (reduce16), four outputs per instruction.
#include <immintrin.h>

#include <algorithm>
#include <vector>

// GCC 12's avx512fintrin.h: a false -Wuninitialized inside its own casts (as in gemm_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/simd_avx512.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu::gemm_detail {
namespace {

constexpr int64_t kPanel = 16;  // weight rows decoded at once
constexpr int kR = 4, kT = 4;   // outputs per tile: 4 rows × 4 tokens = the 16 sums reduce16 folds

struct Scales {  // e8m0 code → 2^(e−127) (NaN for 255), once
  float v[256];
  Scales() {
    for (int e = 0; e < 256; ++e) v[e] = e8m0_to_f32(uint8_t(e));
  }
};
const Scales kScale;

// One block: bf16 pairs (W[2i] | W[2i+1] << 16) in lane i. value·scale is exact in f32 and has at most
// two significant bits, so its upper 16 bits are its BF16 value (a subnormal result, scales below
// 2^−126, would lose bits here; vdpbf16ps flushes such inputs anyway).
KESTREL_AVX512BF16 inline __m512i decode_pairs(const uint8_t* p /* u8 [16] */, uint8_t e) {
  const __m512 lut = _mm512_loadu_ps(kE2M1Values);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 sc = _mm512_set1_ps(kScale.v[e]);
  const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), lut), sc);
  const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), sc);
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                         _mm512_and_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// Sixteen accumulators → one vector of their lane sums. Every output gets the same tree:
// s = ((p_i + p_{i+8}) folded i → i+4 → i+2 → i+1), i.e. lane i plus lane i+8 first, whichever slot it
// is in. Output a (accumulator index) lands in element 4·(a mod 4) + a / 4.
KESTREL_AVX512BF16 inline __m512 reduce16(const __m512* a) {
  __m512 p[8], q[4], r[2];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k)  // 512 → 256: a[2k] in the low half, a[2k+1] in the high half
    p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k)  // 256 → 128: 128-bit lane L holds output 4k + L
    q[k] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(p[2 * k], p[2 * k + 1], 0xDD));
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k)  // 4 → 2 inside each 128-bit lane
    r[k] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * k], q[2 * k + 1], 0x44), _mm512_shuffle_ps(q[2 * k], q[2 * k + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));  // 2 → 1
}

// Rows r0.. (nr ≤ 4) of the decoded panel wd (u32 [rows][nblk][16]) × tokens t0.. (nt ≤ 4): y[t, r].
KESTREL_AVX512BF16 void tile(const uint32_t* wd, int64_t nblk, int64_t r0, int nr, const uint16_t* x, int64_t ldx,
                             int64_t t0, int nt, float* y, uint16_t* yb, int64_t ldy, int64_t col0) {
  __m512 acc[kR * kT];
#pragma GCC unroll 16
  for (int a = 0; a < kR * kT; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    __m512i xv[kT];
#pragma GCC unroll 4
    for (int t = 0; t < kT; ++t)
      xv[t] = t < nt ? _mm512_loadu_si512(x + (t0 + t) * ldx + 32 * b) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int r = 0; r < kR; ++r) {
      if (r >= nr) break;
      const __m512i w = _mm512_loadu_si512(wd + 16 * ((r0 + r) * nblk + b));
#pragma GCC unroll 4
      for (int t = 0; t < kT; ++t) acc[r * kT + t] = _mm512_dpbf16_ps(acc[r * kT + t], (__m512bh)xv[t], (__m512bh)w);
    }
  }
  // Element 4t + r of the folded sums is output (r, t): each token's nr outputs are adjacent.
  const __m512 sum = reduce16(acc);
  const __mmask8 rows = __mmask8((1u << nr) - 1u);
  alignas(64) float s[16];
  alignas(32) uint16_t sb[16];
  if (yb)
    _mm256_store_si256(reinterpret_cast<__m256i*>(sb), simd512::to_bf16(sum));
  else
    _mm512_store_ps(s, sum);
  for (int t = 0; t < nt; ++t) {
    const int64_t at = (t0 + t) * ldy + col0 + r0;
    if (yb)
      _mm_mask_storeu_epi16(yb + at, rows, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 4 * t)));
    else
      _mm_mask_storeu_ps(y + at, rows, _mm_load_ps(s + 4 * t));
  }
}

// Panel rows [c0, c0 + nr): decoded once into wd (u32 [nr][nblk][16]), then every token.
KESTREL_AVX512BF16 void panel(const uint8_t* packed, const uint8_t* scale, int64_t in, int64_t c0, int64_t nr,
                              uint32_t* wd, const uint16_t* x, int64_t ldx, int64_t T, float* y, uint16_t* yb,
                              int64_t ldy) {
  const int64_t nblk = in / kMxBlock;
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t b = 0; b < nblk; ++b)
      _mm512_storeu_si512(wd + 16 * (r * nblk + b),
                          decode_pairs(packed + (c0 + r) * (in / 2) + 16 * b, scale[(c0 + r) * nblk + b]));
  for (int64_t t0 = 0; t0 < T; t0 += kT)
    for (int64_t r0 = 0; r0 < nr; r0 += kR)
      tile(wd, nblk, r0, int(std::min<int64_t>(kR, nr - r0)), x, ldx, t0, int(std::min<int64_t>(kT, T - t0)), y, yb,
           ldy, c0);
}

}  // namespace

void mxfp4_rows_bf16(const uint8_t* packed, const uint8_t* scale, const uint16_t* x, int64_t ldx, int64_t T,
                     int64_t out, int64_t in, float* y, uint16_t* yb, int64_t ldy) {
  KCHECK(isa() >= Isa::avx512bf16, "mxfp4_rows_bf16 needs AVX-512 BF16");
  KCHECK(in > 0 && in % kMxBlock == 0, "MXFP4 input width {} is not a positive multiple of {}", in, kMxBlock);
  KCHECK(out > 0 && T >= 0 && ldx >= in, "bad MXFP4 shape out={} T={} ldx={}", out, T, ldx);
  if (T == 0) return;
  const int64_t panels = (out + kPanel - 1) / kPanel;
  parallel_for(panels, T * out * in, [&](int64_t pb, int64_t pe) {
    thread_local std::vector<uint32_t> wd;  // one panel decoded: u32 [kPanel][in/32][16]
    wd.resize(size_t(kPanel * in / 2));
    for (int64_t pn = pb; pn < pe; ++pn)
      panel(packed, scale, in, pn * kPanel, std::min(kPanel, out - pn * kPanel), wd.data(), x, ldx, T, y, yb, ldy);
  });
}

}  // namespace kestrel::cpu::gemm_detail
