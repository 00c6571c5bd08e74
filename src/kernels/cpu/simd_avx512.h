// AVX-512 helpers shared by the avx512bf16 kernels (isa.h), header-inline like simd_avx2.h: each
// carries its target attribute, so including this file changes nothing for the rest of the binary.
#pragma once

#include <immintrin.h>

#include "kernels/cpu/isa.h"

namespace kestrel::cpu::simd512 {

// 16 f32 → 16 bf16, exactly f32_to_bf16 (core/dtype.h) per lane: RNE by the integer add, NaN kept
// quiet with its sign. Not vcvtneps2bf16: that flushes denormal inputs, which f32_to_bf16 rounds.
KESTREL_AVX512BF16 inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __m512i nanv = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 isnan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(isnan, r, nanv));
}

}  // namespace kestrel::cpu::simd512
