// Step 4 of the routed experts (moe_experts.cu's launch 4; MODEL.md §3.6 steps 4–5): the combine
// ũ_t = bf16(Σ_k w_k·y_k) in top-k order, FP32, deterministic (no atomics on values), and optionally step 5's
// RMSNorm of ũ in the same launch (MoeExpertsOptions::norm_w; one CTA per token). CPU twin: cpu::moe_experts
// followed by cpu::rmsnorm_bf16.
//
// Both kernels are instantiated per top-k (1..8; larger K takes batches of 8): at batch 1 the launch is one CTA
// whose time is its warps' instruction chain (Nsight Compute, session 28: the generic batches cost the reduced
// mini's top-2 combine + norm ~1,200 instructions a warp, 8.3 µs a launch; per-K and with the row held in
// registers, 717 and 5.7 µs).
// Emulation: tests/emu (test_emu_moe.cpp) compiles this file unchanged for the CPU emulation of simt.h (moe_mma.cuh's
// inline PTX from the emulator, launch_combine over its emulated CUDA runtime, tests/emu/simt_runtime.h).
#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_mma.cuh"

namespace kestrel::cuda::moe_detail {
namespace {

using namespace moe_dev;

constexpr int kCombineThreads = 256;

// ũ[t, j..j+7] = bf16(Σ_k w[t,k]·y[t·K+k, j..j+7]), FP32 in top-k order; out-of-range ids add nothing.
// The K rows are loaded 8 at a time before any is summed (one memory latency per 8 slots, not per slot), and
// independently of the ids: a slot's y row exists whatever its id (y is [T·K, Lt] in slot order on every path),
// so the loads of y, ids and weights issue together and an out-of-range slot is skipped only when summing — the
// same bits as predicating the y load on the id, one dependent L2 round trip (ids → y) fewer at batch 1.
// KT > 0: K == KT ≤ 8 known at compile time (the launcher's switch), so the batch is exactly the K slots. Why:
// at batch 1 these kernels are one CTA whose time is its warps' instruction chain, and the generic batch of 8
// (clamped slots, predicates) cost the reduced mini's top-2 combine + norm ~1,200 instructions a warp (Nsight
// Compute, session 28: 8.3 µs a launch at 7.3 cycles an instruction).
template <int KT>
__device__ __forceinline__ uint4 combine8(const uint16_t* __restrict__ y, const float* __restrict__ wts,
                                          const int32_t* __restrict__ ids, int64_t t, int K_, int X, int Lt, int j) {
  constexpr int U = KT > 0 ? KT : 8;
  const int K = KT > 0 ? KT : K_;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k0 = 0; k0 < K; k0 += U) {
    uint4 v[U];
    float w[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t slot = t * K + min(k0 + u, K - 1);  // clamped: always a row of y
      v[u] = ld_act16(y + slot * Lt + j);
      w[u] = __ldg(wts + slot);
      ok[u] = k0 + u < K && unsigned(__ldg(ids + slot)) < unsigned(X);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!ok[u]) continue;
      float f[8];
      dev::unpack8(v[u], f);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(w[u], f[q]));  // no FMA: as the CPU twin
    }
  }
  return dev::pack8(acc);
}

template <int KT>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const uint16_t* __restrict__ y,
                                                                  const float* __restrict__ wts,
                                                                  const int32_t* __restrict__ ids, int64_t T, int K,
                                                                  int X, int Lt, uint16_t* __restrict__ ut) {
  griddep_wait();  // y comes from the w2 GEMM
  griddep_launch();
  const int per = Lt / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * per) return;
  const int64_t t = i / per;
  const int j = int(i - t * per) * 8;
  *reinterpret_cast<uint4*>(ut + t * Lt + j) = combine8<KT>(y, wts, ids, t, K, X, Lt, j);
}

// 4'. combine + the latent norm (MoeExpertsOptions::norm_w): one CTA of kNormThreads per token. Thread i owns
// the 8-vectors i, i + kNormThreads, ... — rmsnorm_kernel's (norm.cu) ownership and order — so Σx² and the
// normalised row are bit-identical to combine_kernel followed by rmsnorm_bf16, one launch fewer.
constexpr int kNormThreads = 256;  // = norm.cu kThreads
// Rows of at most kNormHeld vectors a thread (Lt ≤ 4096: the real latent 3584 is 448 vectors) keep their ũ vectors
// in registers between the two passes and read their norm weights (never written by a kernel) before the PDL
// wait; the passes' loops are unrolled, so a thread's loads are in flight together. Longer rows loop as before.
constexpr int kNormHeld = 2;
template <int KT>
__global__ void __launch_bounds__(kNormThreads) combine_norm_kernel(const uint16_t* __restrict__ y,
                                                                    const float* __restrict__ wts,
                                                                    const int32_t* __restrict__ ids, int K, int X,
                                                                    int Lt, const uint16_t* __restrict__ nw,
                                                                    float eps, uint16_t* __restrict__ ut,
                                                                    uint16_t* __restrict__ normed, int64_t ldn) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const int nv = Lt / 8;
  if (nv <= kNormHeld * kNormThreads) {
    uint4 g8[kNormHeld], u8[kNormHeld];
#pragma unroll
    for (int i = 0; i < kNormHeld; ++i) {
      const int v = int(threadIdx.x) + i * kNormThreads;
      g8[i] = v < nv ? dev::ld16(nw + 8 * v) : make_uint4(0, 0, 0, 0);
    }
    griddep_wait();  // y comes from the w2 GEMM
    griddep_launch();
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kNormHeld; ++i) {
      const int v = int(threadIdx.x) + i * kNormThreads;
      if (v < nv) {
        u8[i] = combine8<KT>(y, wts, ids, t, K, X, Lt, 8 * v);
        *reinterpret_cast<uint4*>(ut + t * Lt + 8 * v) = u8[i];
        float f[8];
        dev::unpack8(u8[i], f);  // the BF16 ũ, as rmsnorm_kernel reads it
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
      }
    }
    ss = dev::block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / float(Lt) + eps);
#pragma unroll
    for (int i = 0; i < kNormHeld; ++i) {
      const int v = int(threadIdx.x) + i * kNormThreads;
      if (v < nv) {
        float f[8], g[8];
        dev::unpack8(u8[i], f);
        dev::unpack8(g8[i], g);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = g[e] * dev::round_bf16(f[e] * r);
        *reinterpret_cast<uint4*>(normed + t * ldn + 8 * v) = dev::pack8(f);
      }
    }
    return;
  }
  griddep_wait();
  griddep_launch();
  float ss = 0.0f;
  for (int v = threadIdx.x; v < nv; v += kNormThreads) {
    const int j = 8 * v;
    const uint4 packed = combine8<KT>(y, wts, ids, t, K, X, Lt, j);
    *reinterpret_cast<uint4*>(ut + t * Lt + j) = packed;
    float f[8];
    dev::unpack8(packed, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
  }
  ss = dev::block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(ss / float(Lt) + eps);
  for (int v = threadIdx.x; v < nv; v += kNormThreads) {  // this thread's own ũ vectors, written above
    float f[8], g[8];
    dev::unpack8(*reinterpret_cast<const uint4*>(ut + t * Lt + 8 * v), f);
    dev::unpack8(dev::ld16(nw + 8 * v), g);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = g[i] * dev::round_bf16(f[i] * r);
    *reinterpret_cast<uint4*>(normed + t * ldn + 8 * v) = dev::pack8(f);
  }
}

// The combine instantiation for K slots a token: k[K] for K ≤ 8 (exact batches), else k[0] (batches of 8);
// KESTREL_MOE_COMBINE_KT=0 takes k[0] always (A/B).
template <typename F, typename... Fs>
F pick_kt(int64_t K, F generic, Fs... exact) {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_MOE_COMBINE_KT");
    return !(e && e[0] == '0');
  }();
  const F k[] = {generic, exact...};
  return on && K >= 1 && K < int64_t(sizeof...(Fs)) + 1 ? k[K] : generic;
}

}  // namespace

void launch_combine(const uint16_t* y, const float* wts, const int32_t* ids, int64_t T, int64_t K, int64_t X,
                    int64_t Lt, uint16_t* ut, const uint16_t* norm_w, float eps, uint16_t* normed, int64_t ldn, bool pdl,
                    cudaStream_t stream) {
  KCUDA_REQUIRE(y && wts && ids && ut && T >= 0 && K >= 1 && Lt % 8 == 0 && T < (int64_t(1) << 31),
                "moe combine: bad arguments (T = " + std::to_string(T) + ", K = " + std::to_string(K) + ", Lt = " +
                    std::to_string(Lt) + ")");
  if (T == 0) return;
  if (norm_w) {  // the caller checked normed's alignment and ldn
    launch(pick_kt(K, combine_norm_kernel<0>, combine_norm_kernel<1>, combine_norm_kernel<2>, combine_norm_kernel<3>,
                   combine_norm_kernel<4>, combine_norm_kernel<5>, combine_norm_kernel<6>, combine_norm_kernel<7>,
                   combine_norm_kernel<8>),
           dim3(unsigned(T)), dim3(kNormThreads), 0, stream, pdl, y, wts, ids, int(K), int(X), int(Lt), norm_w, eps, ut,
           normed, ldn);
    return;
  }
  const int64_t outs = T * (Lt / 8);
  KCUDA_REQUIRE((outs + kCombineThreads - 1) / kCombineThreads < (int64_t(1) << 31),
                std::string("moe combine: too many outputs"));
  launch(pick_kt(K, combine_kernel<0>, combine_kernel<1>, combine_kernel<2>, combine_kernel<3>, combine_kernel<4>,
                 combine_kernel<5>, combine_kernel<6>, combine_kernel<7>, combine_kernel<8>),
         dim3(unsigned((outs + kCombineThreads - 1) / kCombineThreads)), dim3(kCombineThreads), 0, stream, pdl, y, wts,
         ids, T, int(K), int(X), int(Lt), ut);
}

}  // namespace kestrel::cuda::moe_detail
