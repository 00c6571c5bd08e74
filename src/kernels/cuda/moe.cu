// MoE router and MXFP4 experts; see moe.h.
//
// Expert product, correct-first (CUDA cores, no tensor cores yet):
//   1. group: one block counts slots per expert, scans, and scatters slot ids into expert order.
//   2. w13: grid (row tiles of I, experts). One warp per output row r of W1 and W3. Lane l takes the
//      32-element blocks l, l+32, …: one 16-byte load holds a whole block's 32 nibbles, one byte its
//      scale. The decoded block (×2, w1 and w3) stays in registers and is applied to up to kTok
//      tokens of that expert at once; then the warp reduces and lane 0 writes a = SiTU-GLU(bf16 g, bf16 u).
//   3. w2: the same over W2 rows with a as input; y = bf16(sum).
//   4. combine: ũ = bf16(Σ_k w_k y_k) per token in top-k order.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe.h"

namespace kestrel::cuda {
namespace {

constexpr int kRouteThreads = 256;
constexpr int kMaxExperts = 8192;
constexpr int kMaxTopK = 64;
constexpr int kWarps = 8;  // rows per block in the expert kernels
constexpr int kTok = 4;    // tokens sharing one decoded weight block

// ---- router ------------------------------------------------------------------------------------------
struct Cand {
  float key;
  int idx;
};
__device__ __forceinline__ bool better(const Cand& a, const Cand& b) {
  return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}

__global__ void __launch_bounds__(kRouteThreads) route_kernel(const float* __restrict__ logits,
                                                              const float* __restrict__ bias, int X, int K,
                                                              bool renorm, float scaling, int32_t* __restrict__ ids,
                                                              float* __restrict__ wts) {
  extern __shared__ float sm[];  // s [X], sel [X]
  float* s = sm;
  float* sel = sm + X;
  __shared__ Cand warp_best[32];
  __shared__ int chosen[kMaxTopK];
  const int64_t t = blockIdx.x;
  for (int e = threadIdx.x; e < X; e += blockDim.x) {
    const float sv = dev::sigmoid(logits[t * X + e]);
    s[e] = sv;
    const float k = sv + bias[e];
    sel[e] = isnan(k) ? -INFINITY : k;  // NaN ranks below every number
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int r = 0; r < K; ++r) {
    Cand best{-INFINITY, 0x7fffffff};
    for (int e = threadIdx.x; e < X; e += blockDim.x) {
      bool taken = false;
      for (int q = 0; q < r; ++q) taken |= chosen[q] == e;
      const Cand c{sel[e], e};
      if (!taken && better(c, best)) best = c;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const Cand other{__shfl_xor_sync(0xffffffffu, best.key, o), __shfl_xor_sync(0xffffffffu, best.idx, o)};
      if (better(other, best)) best = other;
    }
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      Cand b = warp_best[0];
      for (int w = 1; w < nw; ++w)
        if (better(warp_best[w], b)) b = warp_best[w];
      chosen[r] = b.idx;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    float w[kMaxTopK];
    for (int r = 0; r < K; ++r) sum += (w[r] = s[chosen[r]]);
    for (int r = 0; r < K; ++r) {
      float v = w[r];
      if (renorm) v /= (sum + 1e-20f);
      ids[t * K + r] = chosen[r];
      wts[t * K + r] = v * scaling;
    }
  }
}

// ---- grouping ------------------------------------------------------------------------------------------
// offsets i32 [X+1]; order i32 [T*K] = flat slots (t*K + k) grouped by expert. Single block.
__global__ void group_kernel(const int32_t* __restrict__ ids, int64_t n, int X, int32_t* __restrict__ offsets,
                             int32_t* __restrict__ cursor, int32_t* __restrict__ order) {
  for (int e = threadIdx.x; e < X; e += blockDim.x) cursor[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&cursor[ids[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int e = 0; e < X; ++e) {
      offsets[e] = acc;
      acc += cursor[e];
      cursor[e] = offsets[e];
    }
    offsets[X] = acc;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) order[atomicAdd(&cursor[ids[i]], 1)] = int32_t(i);
}

// ---- MXFP4 block decode ----------------------------------------------------------------------------------
__device__ __forceinline__ void decode_block(const uint8_t* packed /* 16 bytes */, uint8_t scale, float* f /* [32] */) {
  constexpr float kLut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const uint4 p = dev::ld16(packed);
  const float sc = scale == 255 ? __uint_as_float(0x7fc00000u) : __uint_as_float(scale ? uint32_t(scale) << 23 : 0x00400000u);
  const uint32_t w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int b = 0; b < 8; ++b) f[8 * i + b] = kLut[(w[i] >> (4 * b)) & 0xFu] * sc;
}

__device__ __forceinline__ float dot32_bf16(const float* wf /* [32] */, const uint16_t* x /* bf16 [32], 16B aligned */) {
  float acc = 0.0f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float xf[8];
    dev::unpack8(dev::ld16(x + 8 * q), xf);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(wf[8 * q + j], xf[j], acc);
  }
  return acc;
}

__device__ __forceinline__ float situ_glu(float g, float u, float beta, float lbeta) {
  return beta * tanhf(g / beta) * dev::sigmoid(g) * (lbeta * tanhf(u / lbeta));
}

// a[slot, r] for rows r of W1/W3 of expert blockIdx.y.
__global__ void __launch_bounds__(kWarps * 32) w13_kernel(const uint16_t* __restrict__ z, const int32_t* __restrict__ offsets,
                                                          const int32_t* __restrict__ order, MoeExpertWeights w, int K,
                                                          int Lt, int I, float beta, float lbeta,
                                                          uint16_t* __restrict__ act /* bf16 [T*K, I] */) {
  const int e = blockIdx.y;
  const int begin = offsets[e], end = offsets[e + 1];
  if (begin == end) return;
  const int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (r >= I) return;
  const int lane = threadIdx.x & 31;
  const int nblk = Lt / 32;
  const uint8_t* p1 = w.w1_packed + e * w.w13_packed_stride + int64_t(r) * (Lt / 2);
  const uint8_t* s1 = w.w1_scale + e * w.w13_scale_stride + int64_t(r) * nblk;
  const uint8_t* p3 = w.w3_packed + e * w.w13_packed_stride + int64_t(r) * (Lt / 2);
  const uint8_t* s3 = w.w3_scale + e * w.w13_scale_stride + int64_t(r) * nblk;
  for (int i0 = begin; i0 < end; i0 += kTok) {
    const int nt = min(kTok, end - i0);
    int slot[kTok];
#pragma unroll
    for (int q = 0; q < kTok; ++q) slot[q] = q < nt ? order[i0 + q] : order[i0];
    float g[kTok] = {}, u[kTok] = {};
    for (int b = lane; b < nblk; b += 32) {
      float f1[32], f3[32];
      decode_block(p1 + 16 * b, s1[b], f1);
      decode_block(p3 + 16 * b, s3[b], f3);
#pragma unroll
      for (int q = 0; q < kTok; ++q) {
        if (q < nt) {
          const uint16_t* zr = z + int64_t(slot[q] / K) * Lt + 32 * b;
          g[q] += dot32_bf16(f1, zr);
          u[q] += dot32_bf16(f3, zr);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kTok; ++q) {
      if (q < nt) {
        const float gs = dev::warp_sum(g[q]), us = dev::warp_sum(u[q]);
        if (lane == 0)
          act[int64_t(slot[q]) * I + r] =
              dev::f32_to_bf16(situ_glu(dev::round_bf16(gs), dev::round_bf16(us), beta, lbeta));
      }
    }
  }
}

// y[slot, r] = bf16(a[slot]·W2[r]) for rows r of W2 of expert blockIdx.y.
__global__ void __launch_bounds__(kWarps * 32) w2_kernel(const uint16_t* __restrict__ act, const int32_t* __restrict__ offsets,
                                                         const int32_t* __restrict__ order, MoeExpertWeights w, int Lt,
                                                         int I, uint16_t* __restrict__ y /* bf16 [T*K, Lt] */) {
  const int e = blockIdx.y;
  const int begin = offsets[e], end = offsets[e + 1];
  if (begin == end) return;
  const int r = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (r >= Lt) return;
  const int lane = threadIdx.x & 31;
  const int nblk = I / 32;
  const uint8_t* p2 = w.w2_packed + e * w.w2_packed_stride + int64_t(r) * (I / 2);
  const uint8_t* s2 = w.w2_scale + e * w.w2_scale_stride + int64_t(r) * nblk;
  for (int i0 = begin; i0 < end; i0 += kTok) {
    const int nt = min(kTok, end - i0);
    int slot[kTok];
#pragma unroll
    for (int q = 0; q < kTok; ++q) slot[q] = q < nt ? order[i0 + q] : order[i0];
    float acc[kTok] = {};
    for (int b = lane; b < nblk; b += 32) {
      float f2[32];
      decode_block(p2 + 16 * b, s2[b], f2);
#pragma unroll
      for (int q = 0; q < kTok; ++q)
        if (q < nt) acc[q] += dot32_bf16(f2, act + int64_t(slot[q]) * I + 32 * b);
    }
#pragma unroll
    for (int q = 0; q < kTok; ++q) {
      if (q < nt) {
        const float s = dev::warp_sum(acc[q]);
        if (lane == 0) y[int64_t(slot[q]) * Lt + r] = dev::f32_to_bf16(s);
      }
    }
  }
}

__global__ void combine_kernel(const uint16_t* __restrict__ y, const float* __restrict__ wts, int64_t T, int K, int Lt,
                               uint16_t* __restrict__ ut) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * Lt) return;
  const int64_t t = i / Lt, j = i % Lt;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) acc += wts[t * K + k] * dev::bf16_to_f32(y[(t * K + k) * Lt + j]);
  ut[i] = dev::f32_to_bf16(acc);
}

size_t round256(size_t n) { return (n + 255) & ~size_t(255); }

}  // namespace

void moe_route(const float* logits, const float* bias, int64_t T, int64_t X, int64_t K, bool renormalize,
               float scaling, int32_t* ids, float* weights, cudaStream_t stream) {
  KCUDA_REQUIRE(logits && bias && ids && weights, std::string("moe_route: null pointer"));
  KCUDA_REQUIRE(X > 0 && X <= kMaxExperts && K > 0 && K <= kMaxTopK && K <= X,
                "moe_route: X = " + std::to_string(X) + ", K = " + std::to_string(K));
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("moe_route: bad T"));
  if (T == 0) return;
  const size_t smem = size_t(2 * X) * 4;
  if (smem > 48 * 1024)
    KCUDA_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  route_kernel<<<unsigned(T), kRouteThreads, smem, stream>>>(logits, bias, int(X), int(K), renormalize, scaling, ids,
                                                              weights);
  KCUDA_CHECK_LAUNCH();
}

size_t moe_experts_workspace_bytes(int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I) {
  return round256(size_t(X + 1) * 4) + round256(size_t(X) * 4) + round256(size_t(T * K) * 4) +
         round256(size_t(T * K * I) * 2) + round256(size_t(T * K * Lt) * 2);
}

void moe_experts_mxfp4(const uint16_t* z, const int32_t* ids, const float* weights, const MoeExpertWeights& w,
                       int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                       void* workspace, uint16_t* ut, cudaStream_t stream) {
  KCUDA_REQUIRE(z && ids && weights && workspace && ut && w.w1_packed && w.w1_scale && w.w3_packed && w.w3_scale &&
                    w.w2_packed && w.w2_scale,
                std::string("moe_experts_mxfp4: null pointer"));
  KCUDA_REQUIRE(Lt > 0 && I > 0 && Lt % 32 == 0 && I % 32 == 0 && Lt < (1 << 24) && I < (1 << 24),
                "moe_experts_mxfp4: Lt = " + std::to_string(Lt) + ", I = " + std::to_string(I) +
                    " must be positive multiples of 32");
  KCUDA_REQUIRE(X > 0 && X <= 65535 && K > 0 && K <= X, std::string("moe_experts_mxfp4: bad X or K"));
  KCUDA_REQUIRE(T >= 0 && T * K < (int64_t(1) << 31), std::string("moe_experts_mxfp4: bad T"));
  KCUDA_REQUIRE(w.w13_packed_stride >= I * Lt / 2 && w.w13_scale_stride >= I * Lt / 32 &&
                    w.w2_packed_stride >= Lt * I / 2 && w.w2_scale_stride >= Lt * I / 32,
                std::string("moe_experts_mxfp4: expert strides too small"));
  KCUDA_REQUIRE((((reinterpret_cast<uintptr_t>(z) | reinterpret_cast<uintptr_t>(w.w1_packed) |
                   reinterpret_cast<uintptr_t>(w.w3_packed) | reinterpret_cast<uintptr_t>(w.w2_packed) |
                   uintptr_t(w.w13_packed_stride) | uintptr_t(w.w2_packed_stride)) & 15u) == 0),
                std::string("moe_experts_mxfp4: z and packed weights must be 16-byte aligned"));
  if (T == 0) return;
  char* p = static_cast<char*>(workspace);
  int32_t* offsets = reinterpret_cast<int32_t*>(p);
  p += round256(size_t(X + 1) * 4);
  int32_t* cursor = reinterpret_cast<int32_t*>(p);
  p += round256(size_t(X) * 4);
  int32_t* order = reinterpret_cast<int32_t*>(p);
  p += round256(size_t(T * K) * 4);
  uint16_t* act = reinterpret_cast<uint16_t*>(p);
  p += round256(size_t(T * K * I) * 2);
  uint16_t* y = reinterpret_cast<uint16_t*>(p);

  group_kernel<<<1, 1024, 0, stream>>>(ids, T * K, int(X), offsets, cursor, order);
  KCUDA_CHECK_LAUNCH();
  w13_kernel<<<dim3(unsigned((I + kWarps - 1) / kWarps), unsigned(X)), kWarps * 32, 0, stream>>>(
      z, offsets, order, w, int(K), int(Lt), int(I), situ_beta, situ_linear_beta, act);
  KCUDA_CHECK_LAUNCH();
  w2_kernel<<<dim3(unsigned((Lt + kWarps - 1) / kWarps), unsigned(X)), kWarps * 32, 0, stream>>>(act, offsets, order, w,
                                                                                                 int(Lt), int(I), y);
  KCUDA_CHECK_LAUNCH();
  const int64_t n = T * Lt;
  KCUDA_REQUIRE((n + 255) / 256 < (int64_t(1) << 31), std::string("moe_experts_mxfp4: too many outputs"));
  combine_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(y, weights, T, int(K), int(Lt), ut);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
