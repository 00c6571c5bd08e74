// RMSNorm and the AttnRes Mix + RMSNorm of the prefill / reference path (attn_res_mix_rmsnorm; the fused AttnRes
// point of the forward, attn_res_step, is in attn_res.cu), and the indexer's key LayerNorm at the end. One block
// per token; each thread owns 8-element vectors
// v = tid, tid + blockDim, ... of the row (16-byte loads, coalesced across the warp). The sources are
// re-read in each pass rather than held in registers (up to 16 sources × 7168 values do not fit); the
// re-reads hit L1/L2. The mixed row h is kept in shared memory (f32 [D]) for the final norm.
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/norm_rows.cuh"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;

// y may alias x (in place): each thread reads only its own vectors, through L2 (ld.cg), before writing them.
__global__ void __launch_bounds__(kThreads) rmsnorm_kernel(const uint16_t* x, int64_t ldx,
                                                           const uint16_t* __restrict__ w, uint16_t* y,
                                                           int64_t ldy, int n, float eps) {
  __shared__ float scratch[32];
  dev::pdl_trigger();
  dev::pdl_wait();
  rows_dev::rmsnorm_row(x + int64_t(blockIdx.x) * ldx, w, y + int64_t(blockIdx.x) * ldy, n, eps, scratch);
}

__global__ void __launch_bounds__(kThreads) attn_res_mix_rmsnorm_kernel(
    const uint16_t* __restrict__ blocks, int64_t block_stride, int nb, const uint16_t* __restrict__ partial, int64_t ld,
    const uint16_t* __restrict__ mix_norm_w, const uint16_t* __restrict__ mix_proj_w,
    const uint16_t* __restrict__ rms_w, float eps, uint16_t* __restrict__ h_out, uint16_t* __restrict__ y,
    int64_t ldy, int D) {
  extern __shared__ float h[];  // f32 [D], the BF16-rounded mix
  __shared__ float red[2 * kAttnResMaxSources][33];
  __shared__ float alpha[kAttnResMaxSources];
  const int64_t t = blockIdx.x;
  const int n = nb + 1, nv = D / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  auto src = [&](int i) -> const uint16_t* { return (i < nb ? blocks + i * block_stride : partial) + t * ld; };

  // Pass 1: per source, v·u and Σv².
  float dot[kAttnResMaxSources], ss[kAttnResMaxSources];
#pragma unroll
  for (int i = 0; i < kAttnResMaxSources; ++i) dot[i] = ss[i] = 0.0f;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float a[8], b[8], u[8];
    dev::unpack8(dev::ld16(mix_norm_w + 8 * v), a);
    dev::unpack8(dev::ld16(mix_proj_w + 8 * v), b);
#pragma unroll
    for (int j = 0; j < 8; ++j) u[j] = a[j] * b[j];  // exact: two bf16 significands fit in f32
#pragma unroll
    for (int i = 0; i < kAttnResMaxSources; ++i) {
      if (i < n) {
        float f[8];
        dev::unpack8(dev::ld16(src(i) + 8 * v), f);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          dot[i] = fmaf(f[j], u[j], dot[i]);
          ss[i] = fmaf(f[j], f[j], ss[i]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kAttnResMaxSources; ++i) {
    if (i < n) {
      const float d = dev::warp_sum(dot[i]), s = dev::warp_sum(ss[i]);
      if (lane == 0) {
        red[2 * i][warp] = d;
        red[2 * i + 1][warp] = s;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float logit[kAttnResMaxSources];
    float m = -INFINITY;
    for (int i = 0; i < n; ++i) {
      float d = 0.0f, s = 0.0f;
      for (int w = 0; w < nw; ++w) {
        d += red[2 * i][w];
        s += red[2 * i + 1][w];
      }
      logit[i] = d / sqrtf(s / float(D) + eps);
      m = fmaxf(m, logit[i]);
    }
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += (logit[i] = expf(logit[i] - m));
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; ++i) alpha[i] = logit[i] * inv;
  }
  __syncthreads();

  // Pass 2: h = bf16(Σ α_i v_i) over the raw sources, and Σh² for the norm.
  float hs = 0.0f;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kAttnResMaxSources; ++i) {
      if (i < n) {
        float f[8];
        dev::unpack8(dev::ld16(src(i) + 8 * v), f);
        const float a = alpha[i];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(a, f[j], acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j] = dev::round_bf16(acc[j]);
      h[8 * v + j] = acc[j];
      hs = fmaf(acc[j], acc[j], hs);
    }
    if (h_out) *reinterpret_cast<uint4*>(h_out + t * ldy + 8 * v) = dev::pack8(acc);
  }
  hs = dev::block_sum(hs, &red[0][0]);  // block_sum syncs before reusing the scratch row
  const float r = 1.0f / sqrtf(hs / float(D) + eps);

  // Pass 3: y = w ⊙ bf16(h · r). Each thread reads back only the h values it wrote itself.
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[8], g[8];
    dev::unpack8(dev::ld16(rms_w + 8 * v), g);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = g[j] * dev::round_bf16(h[8 * v + j] * r);
    *reinterpret_cast<uint4*>(y + t * ldy + 8 * v) = dev::pack8(f);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

void rmsnorm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t ldy, int64_t T, int64_t n,
                  float eps, cudaStream_t stream) {
  KCUDA_REQUIRE(x && w && y, std::string("rmsnorm: null pointer"));
  KCUDA_REQUIRE(T >= 0 && n > 0 && n % 8 == 0 && n < (int64_t(1) << 30),
                "rmsnorm: n = " + std::to_string(n) + " must be a positive multiple of 8");
  KCUDA_REQUIRE(ldx >= n && ldy >= n && ldx % 8 == 0 && ldy % 8 == 0, std::string("rmsnorm: bad row strides"));
  KCUDA_REQUIRE(aligned16(x) && aligned16(w) && aligned16(y), std::string("rmsnorm: pointers must be 16-byte aligned"));
  KCUDA_REQUIRE(T < (int64_t(1) << 31), std::string("rmsnorm: too many rows"));
  if (T == 0) return;
  launch_pdl(rmsnorm_kernel, dim3(unsigned(T)), dim3(kThreads), 0, stream, x, ldx, w, y, ldy, int(n), eps);
}

void attn_res_mix_rmsnorm(const uint16_t* blocks, int64_t block_stride, int nb, const uint16_t* partial, int64_t ld,
                          const uint16_t* mix_norm_w, const uint16_t* mix_proj_w, const uint16_t* rms_w, float eps,
                          uint16_t* h_out, uint16_t* y, int64_t ldy, int64_t T, int64_t D, cudaStream_t stream) {
  KCUDA_REQUIRE(partial && mix_norm_w && mix_proj_w && rms_w && y && (nb == 0 || blocks),
                std::string("attn_res_mix_rmsnorm: null pointer"));
  KCUDA_REQUIRE(nb >= 0 && nb + 1 <= kAttnResMaxSources,
                "attn_res_mix_rmsnorm: " + std::to_string(nb) + " stored blocks (at most " +
                    std::to_string(kAttnResMaxSources - 1) + ")");
  KCUDA_REQUIRE(D > 0 && D % 8 == 0 && D * 4 <= 96 * 1024,
                "attn_res_mix_rmsnorm: D = " + std::to_string(D) + " must be a multiple of 8 and <= 24576");
  KCUDA_REQUIRE(ld >= D && ldy >= D && ld % 8 == 0 && ldy % 8 == 0 && block_stride % 8 == 0,
                std::string("attn_res_mix_rmsnorm: bad strides"));
  KCUDA_REQUIRE((nb == 0 || aligned16(blocks)) && aligned16(partial) && aligned16(mix_norm_w) &&
                    aligned16(mix_proj_w) && aligned16(rms_w) && aligned16(y) && (!h_out || aligned16(h_out)),
                std::string("attn_res_mix_rmsnorm: pointers must be 16-byte aligned"));
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("attn_res_mix_rmsnorm: bad T"));
  if (T == 0) return;
  const size_t smem = size_t(D) * 4;
  if (smem > 48 * 1024)
    KCUDA_CHECK(cudaFuncSetAttribute(attn_res_mix_rmsnorm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(smem)));
  attn_res_mix_rmsnorm_kernel<<<unsigned(T), kThreads, smem, stream>>>(
      blocks, block_stride, nb, partial, ld, mix_norm_w, mix_proj_w, rms_w, eps, h_out, y, ldy, int(D));
  KCUDA_CHECK_LAUNCH();
}

// ---- the DSA indexer's key LayerNorm (MODEL.md §3.5 step 2) -----------------------------------------------
// One block of 128 threads per row, scalar loads; mean and variance in double as the CPU twin
// (cpu::indexer_key_norm), the affine step with round-to-nearest FP32 operations only, no fused multiply-add.
namespace {

__global__ void indexer_key_norm_kernel(const uint16_t* __restrict__ kraw, const uint16_t* __restrict__ w,
                                        const uint16_t* __restrict__ bias, int64_t Di, uint16_t* __restrict__ out) {
  __shared__ double scratch[32];
  const int64_t t = blockIdx.x;
  rows_dev::key_norm_row(kraw + t * Di, w, bias, Di, out + t * Di, scratch);
}

}  // namespace

void indexer_key_norm(const uint16_t* kraw, const uint16_t* w, const uint16_t* b, int64_t T, int64_t Di, uint16_t* out,
                      cudaStream_t stream) {
  if (T == 0) return;
  KCUDA_REQUIRE(Di <= 1024, std::string("indexer_key_norm: Di > 1024"));
  indexer_key_norm_kernel<<<unsigned(T), rows_dev::kKeyNormThreads, 0, stream>>>(kraw, w, b, Di, out);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
