// One row's RMSNorm and the DSA indexer's key LayerNorm as block-level device functions: the bodies of
// norm.cu's rmsnorm_kernel and indexer_key_norm_kernel, shared with paged.cu's fused MLA norm + cache-write
// launch (mla_norms_and_writes), so both give the same bits. Device code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_util.cuh"

namespace kestrel::cuda::rows_dev {

// yr = RMSNorm_w(xr) over n values (a multiple of 8), BF16 in and out, the rounding of cpu::rmsnorm_bf16.
// Thread i of the block owns the 8-vectors i, i + blockDim, ...; yr may alias xr (each thread reads its own
// vectors, through L2, before writing them). The result depends on blockDim (the order of Σx²): rmsnorm_kernel's
// 256. scratch: 32 floats.
__device__ __forceinline__ void rmsnorm_row(const uint16_t* xr, const uint16_t* __restrict__ w, uint16_t* yr, int n,
                                            float eps, float* scratch) {
  const int nv = n / 8;
  float ss = 0.0f;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[8];
    dev::unpack8(__ldcg(reinterpret_cast<const uint4*>(xr + 8 * v)), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
  }
  ss = dev::block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(ss / float(n) + eps);
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[8], g[8];
    dev::unpack8(__ldcg(reinterpret_cast<const uint4*>(xr + 8 * v)), f);
    dev::unpack8(dev::ld16(w + 8 * v), g);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = g[i] * dev::round_bf16(f[i] * r);
    *reinterpret_cast<uint4*>(yr + 8 * v) = dev::pack8(f);
  }
}

// out = LayerNorm_{w, bias}(k) over Di values (MODEL.md §3.5 step 2, eps 1e-6): mean and variance in double as
// the CPU twin (cpu::indexer_key_norm), the affine step with round-to-nearest FP32 operations, no FMA. The
// first kKeyNormThreads threads of the block stride over the row; the others (a larger block) add zeros, which
// leaves block_sum_d's butterfly, and so every bit, as with a block of exactly kKeyNormThreads.
constexpr int kKeyNormThreads = 128;
__device__ __forceinline__ void key_norm_row(const uint16_t* __restrict__ k, const uint16_t* __restrict__ w,
                                             const uint16_t* __restrict__ bias, int64_t Di, uint16_t* __restrict__ out,
                                             double* scratch) {
  const int64_t tid = threadIdx.x;
  const bool mine = tid < kKeyNormThreads;
  double s = 0.0;
  if (mine)
    for (int64_t i = tid; i < Di; i += kKeyNormThreads) s += double(dev::bf16_to_f32(k[i]));
  const double mean = dev::block_sum_d(s, scratch) / double(Di);
  double v = 0.0;
  if (mine)
    for (int64_t i = tid; i < Di; i += kKeyNormThreads) {
      const double dd = double(dev::bf16_to_f32(k[i])) - mean;
      v += dd * dd;
    }
  const double var = dev::block_sum_d(v, scratch);
  const float rstd = float(1.0 / sqrt(var / double(Di) + 1e-6));
  const float meanf = float(mean);
  if (mine)
    for (int64_t i = tid; i < Di; i += kKeyNormThreads) {
      const float b = bias ? dev::bf16_to_f32(bias[i]) : 0.0f;
      const float xn = __fmul_rn(__fsub_rn(dev::bf16_to_f32(k[i]), meanf), rstd);
      const float y = __fadd_rn(__fmul_rn(xn, dev::bf16_to_f32(w[i])), b);
      out[i] = dev::f32_to_bf16(y);
    }
}

}  // namespace kestrel::cuda::rows_dev
