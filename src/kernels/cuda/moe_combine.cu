// Step 4 of the routed experts (moe_experts.cu's launch 4; MODEL.md §3.6 steps 4–5): the combine
// ũ_t = bf16(Σ_k w_k·y_k) in top-k order, FP32, deterministic (no atomics on values), and optionally step 5's
// RMSNorm of ũ in the same launch (MoeExpertsOptions::norm_w). CPU twin: cpu::moe_experts followed by
// cpu::rmsnorm_bf16.
//
// All kernels are instantiated per top-k (1..8; larger K takes batches of 8): at batch 1 the launch's time is its
// warps' instruction chain (Nsight Compute, session 28: the generic batches cost the reduced mini's top-2 combine +
// norm ~1,200 instructions a warp, 8.3 µs a launch; per-K and with the row held in registers, 717 and 5.7 µs).
// Three kernels:
// - combine_kernel (no norm): a thread per 16-byte vector of ũ over the whole batch.
// - combine_norm_kernel: one CTA of 256 threads per token, each holding up to two vectors of the row in registers.
// - combine_norm_cluster_kernel (decode, T ≤ kCombineClusterMaxT = 64, Lt ≤ 16384): a token's row cut over a
//   thread-block cluster of C ≤ 8 CTAs, one vector a thread held in registers from its single load (Lt = 3584:
//   7 CTAs × 64 vectors; nano's Lt = 128: C = 1, one warp). Each warp publishes its Σx² in its CTA's shared memory;
//   after one cluster barrier each warp reads the cluster's warp partials from distributed shared memory, one a lane,
//   and sums them by its xor tree, so all CTAs compute the same norm factor. Why: at batch 1 the one-CTA kernel is
//   one SM's dependent chain (two vectors a thread, a block-wide sum); AttnRes's points went 10 → 6 µs the same way
//   (attn_res.cu attn_res_cluster_kernel). The second barrier, which keeps each CTA's shared memory alive until the
//   others have read it, is split: arrive after the reads, wait only before exiting, so the norm's arithmetic and
//   stores overlap it.
//   Numerics: ũ is bit-identical to the other kernels' (the same combine8 per vector). The normed row differs from
//   combine_norm_kernel's only by the order of the FP32 Σx² (at C = 1 — Lt ≤ 512, nano's 128 — the same partials in
//   the same order: bit-identical); the norm factor then moves by a few FP32 ulps, which can move
//   bf16(ũ·r) by one BF16 step and so w·bf16(ũ·r), rounded once, by at most 2: normed within 2 BF16 ulps of the
//   one-CTA kernel's per element (tests/emu and tests/gpu check that bound; both kernels are within it of
//   cpu::rmsnorm_bf16 on ũ, whose Σx² is in double).
//   Switch (unmeasured, so OFF by default): KESTREL_MOE_COMBINE_CLUSTER=1 takes it where it applies, 0 or unset the
//   one-CTA kernel; MoeExpertsOptions::combine_cluster (1 / 0) overrides the environment for tests and benchmarks.
//   A/B on the GPU machine: here `PACK_TARGETS="bench_moe bench_ops kestrel_kernel_trace kestrel_gpu_tests"
//   PACK_SKIP=kestrel bench/gpu/run.sh pack`, carried as run.sh's header says; there, one command:
//     bench/gpu/run.sh ab 2 "" -- bench_moe --topk 2 --batches 1,8,64 --variants auto-norm-cta,auto-norm-cluster --breakdown
//   (the reduced mini's top-2 at the real Lt = 3584, both kernels alternated in one process, twice: the breakdown's
//   combine column is this launch alone, PDL off; the graph / queued columns the whole experts call with PDL). The
//   exposed time in the reduced mini's decode step (the ~6–8 µs this kernel is for):
//     bench/gpu/run.sh timeline_ab 2 "KESTREL_MOE_COMBINE_CLUSTER=0" "KESTREL_MOE_COMBINE_CLUSTER=1"
//   and its tests: bench/gpu/run.sh test --gtest_filter='GpuMoe.Combine*'.
// Emulation: tests/emu (test_emu_moe.cpp) compiles this file unchanged for the CPU emulation of simt.h (moe_mma.cuh's
// inline PTX from the emulator, launch_combine over its emulated CUDA runtime, tests/emu/simt_runtime.h, which runs a
// cluster's CTAs together).
#include <algorithm>
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

// 4''. combine + the latent norm over a cluster (see the header): token blockIdx.y, CTA blockIdx.x = its rank in the
// cluster (grid.x = C = the cluster size), which owns vectors [rank·per, rank·per + per) of the row, one a thread.
// The dynamic shared memory holds the CTA's per-warp Σx², f32 [blockDim.x / 32]: dynamic, so that its offset is the
// same in every CTA (and the emulator's mapa finds it).
constexpr int kClusterMax = 8;        // portable cluster size
constexpr int kClusterVecs = 64;      // fewest 16-byte vectors a CTA worth another CTA in the cluster (attn_res.cu's)
constexpr int kClusterThreads = 256;  // most vectors a CTA: rows up to 8 · 256 vectors (Lt 16384)
template <int KT>
__global__ void __launch_bounds__(kClusterThreads) combine_norm_cluster_kernel(
    const uint16_t* __restrict__ y /* bf16 [T·K, Lt] */, const float* __restrict__ wts /* f32 [T, K] */,
    const int32_t* __restrict__ ids /* i32 [T, K] */, int K, int X, int Lt, const uint16_t* __restrict__ nw /* bf16 [Lt] */,
    float eps, uint16_t* __restrict__ ut /* bf16 [T, Lt] */, uint16_t* __restrict__ normed /* bf16 [T, ldn] */,
    int64_t ldn, int per) {
  float* const part = dev::dyn_smem<float>();
  const int C = int(gridDim.x), rank = int(blockIdx.x), nwarps = int(blockDim.x) >> 5;
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int64_t t = blockIdx.y;
  const int v = rank * per + int(threadIdx.x);
  const bool act = int(threadIdx.x) < per && v < Lt / 8;
  // Every thread runs to the end (no early exit): the cluster barriers count them all.
  const uint4 g8 = act ? dev::ld16(nw + 8 * v) : make_uint4(0, 0, 0, 0);  // never written by a kernel: before the wait
  griddep_wait();  // y comes from the w2 GEMM
  griddep_launch();
  uint4 u8 = make_uint4(0, 0, 0, 0);
  float ss = 0.0f;
  if (act) {
    u8 = combine8<KT>(y, wts, ids, t, K, X, Lt, 8 * v);
    *reinterpret_cast<uint4*>(ut + t * Lt + 8 * v) = u8;
    float f[8];
    dev::unpack8(u8, f);  // the BF16 ũ, as rmsnorm_kernel reads it
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
  }
  ss = dev::warp_sum(ss);
  if (lane == 0) part[warp] = ss;
  // C = 1 (a row of at most kClusterVecs vectors): the CTA's own warps only, a CTA barrier.
  if (C > 1)
    cluster_sync();
  else
    __syncthreads();
  // Σx² over the cluster: the partial of (rank, warp) in lane 8·warp + rank (past 4 warps a CTA, lane i also adds
  // that of lane i + 32; 0 where there is none: shifts, not divisions, after the barrier), summed by the warp's xor
  // tree — combine_norm_kernel's second level. Every warp of every CTA adds the same values in the same order, so
  // all compute the same factor; the loads are one or two a lane, issued together (one distributed-shared-memory
  // latency, not one a partial in a chain).
  auto partial = [&](int i) {
    const int q = i & (kClusterMax - 1), w = i / kClusterMax;
    if (q >= C || w >= nwarps) return 0.0f;
    return C > 1 ? ld_shared_cluster(part + w, unsigned(q)) : part[w];
  };
  float tot = partial(lane);
  if (nwarps > 32 / kClusterMax) tot += partial(lane + 32);
  tot = dev::warp_sum(tot);
  if (C > 1) cluster_arrive();  // this CTA has read the others' partials: they may exit once all have
  const float rn = 1.0f / sqrtf(tot / float(Lt) + eps);  // combine_norm_kernel's expression
  if (act) {
    float f[8], g[8];
    dev::unpack8(u8, f);
    dev::unpack8(g8, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = g[e] * dev::round_bf16(f[e] * rn);
    *reinterpret_cast<uint4*>(normed + t * ldn + 8 * v) = dev::pack8(f);
  }
  if (C > 1) cluster_wait();  // part[] stays until every CTA of the cluster has read it
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

// MoeExpertsOptions::combine_cluster: 1 / 0 as given, −1 KESTREL_MOE_COMBINE_CLUSTER (1 on; default off: unmeasured).
bool cluster_wanted(int cluster) {
  static const bool env_on = [] {
    const char* e = std::getenv("KESTREL_MOE_COMBINE_CLUSTER");
    return e && e[0] == '1';
  }();
  return cluster == 1 || (cluster < 0 && env_on);
}

}  // namespace

void launch_combine(const uint16_t* y, const float* wts, const int32_t* ids, int64_t T, int64_t K, int64_t X,
                    int64_t Lt, uint16_t* ut, const uint16_t* norm_w, float eps, uint16_t* normed, int64_t ldn, bool pdl,
                    cudaStream_t stream, int cluster) {
  KCUDA_REQUIRE(y && wts && ids && ut && T >= 0 && K >= 1 && Lt % 8 == 0 && T < (int64_t(1) << 31),
                "moe combine: bad arguments (T = " + std::to_string(T) + ", K = " + std::to_string(K) + ", Lt = " +
                    std::to_string(Lt) + ")");
  if (T == 0) return;
  const int64_t nv = Lt / 8;
  if (norm_w && cluster_wanted(cluster) && T <= kCombineClusterMaxT && nv <= int64_t(kClusterMax) * kClusterThreads) {
    // C CTAs of `per` vectors (enough for each to be worth a CTA), threads rounded up to whole warps.
    const int64_t C = std::clamp<int64_t>((nv + kClusterVecs - 1) / kClusterVecs, 1, kClusterMax);
    const int64_t per = (nv + C - 1) / C, threads = (per + 31) / 32 * 32;
    launch_cluster(pick_kt(K, combine_norm_cluster_kernel<0>, combine_norm_cluster_kernel<1>,
                           combine_norm_cluster_kernel<2>, combine_norm_cluster_kernel<3>,
                           combine_norm_cluster_kernel<4>, combine_norm_cluster_kernel<5>,
                           combine_norm_cluster_kernel<6>, combine_norm_cluster_kernel<7>,
                           combine_norm_cluster_kernel<8>),
                   dim3(unsigned(C), unsigned(T)), dim3(unsigned(threads)), size_t(threads / 32) * sizeof(float), stream,
                   pdl, unsigned(C), y, wts, ids, int(K), int(X), int(Lt), norm_w, eps, ut, normed, ldn, int(per));
    return;
  }
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
