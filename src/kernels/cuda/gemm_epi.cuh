// The decode GEMMs' output epilogues (gemm_skinny.h: GemmSegs), shared by the skinny kernel (gemm_skinny.cu)
// and the wide one (gemm_wide.cu). Both hold their results as mma.sync m16n8 accumulator fragments: lane
// (g = lane/4, q = lane%4) of a 16-row × 8-token tile holds d[0] (row g, token 2q), d[1] (g, 2q+1),
// d[2] (g+8, 2q), d[3] (g+8, 2q+1). store_frag writes one such fragment through its segment's epilogue.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemm_skinny.h"

namespace kestrel::cuda::epi {

__device__ __forceinline__ int seg_of(const GemmSegs& s, int r) {
  int i = 0;
  while (i + 1 < s.n && int64_t(r) >= s.seg[i + 1].n0) ++i;
  return i;
}

__device__ __forceinline__ float situ(float g, float u, float beta, float lbeta) {  // = elementwise.cu situ_kernel
  const float act = beta * tanhf(g / beta) * dev::sigmoid(g);
  return act * (lbeta * tanhf(u / lbeta));
}

__device__ __forceinline__ void emit(const GemmSegs& ss, int r, int tok, float v) {
  const GemmSeg& s = ss.seg[seg_of(ss, r)];
  const int64_t i = int64_t(tok) * s.ldy + (r - s.n0);
  switch (s.epi) {
    case GemmEpi::f32:
      static_cast<float*>(s.y)[i] = v;
      break;
    case GemmEpi::add_bf16: {
      const float a = dev::bf16_to_f32(s.add[int64_t(tok) * s.ld_add + (r - s.n0)]);
      static_cast<uint16_t*>(s.y)[i] = dev::f32_to_bf16(dev::round_bf16(v) + a);
      break;
    }
    default:
      static_cast<uint16_t*>(s.y)[i] = dev::f32_to_bf16(v);
  }
}

// One fragment of the 16-row tile starting at row rb (rb < N) and tokens 8·nt.. (see above). A situ_glu8
// segment holds whole 16-row tiles (checked on the host): rows g and g+8 are the gate and up rows of
// feature (rb − n0)/2 + g.
__device__ __forceinline__ void store_frag(const GemmSegs& ss, int N, int T, int rb, int nt, const float (&d)[4],
                                           int g, int q) {
  const GemmSeg& sg = ss.seg[seg_of(ss, rb)];
  const int r0 = rb + g, r1 = rb + g + 8, c0 = 8 * nt + 2 * q, c1 = c0 + 1;
  if (sg.epi == GemmEpi::situ_glu8) {
    const int f = (rb - int(sg.n0)) / 2 + g;
    uint16_t* y = static_cast<uint16_t*>(sg.y);
    const float b = ss.glu_beta, lb = ss.glu_linear_beta;
    if (c0 < T) y[int64_t(c0) * sg.ldy + f] = dev::f32_to_bf16(situ(dev::round_bf16(d[0]), dev::round_bf16(d[2]), b, lb));
    if (c1 < T) y[int64_t(c1) * sg.ldy + f] = dev::f32_to_bf16(situ(dev::round_bf16(d[1]), dev::round_bf16(d[3]), b, lb));
  } else {
    if (r0 < N) {
      if (c0 < T) emit(ss, r0, c0, d[0]);
      if (c1 < T) emit(ss, r0, c1, d[1]);
    }
    if (r1 < N) {
      if (c0 < T) emit(ss, r1, c0, d[2]);
      if (c1 < T) emit(ss, r1, c1, d[3]);
    }
  }
}

}  // namespace kestrel::cuda::epi
