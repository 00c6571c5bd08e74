// AttnRes points on the GPU (MODEL.md §3.2; the API in kernels/cuda/norm.h): the pending update of the
// partial sum P, the optional stored block, the Mix over the stored blocks and P, the RMSNorm after it and
// optionally the next GEMM's FP8 codes — one kernel per point. Twin: model::attn_res_mix + cpu::rmsnorm_bf16.
//
// Two kernels, chosen by the launcher, each instantiated per stored-block count (0..15, a table indexed by nb;
// the run-time form for A/B) — at decode a point's time is its warps' instruction chain, see the cluster kernel:
// - attn_res_step_kernel (more tokens than attn_res_cluster_max_t(), default 64: prefill): one CTA
//   per token looping over the row. The sources are re-read in each pass (up to 16 sources × D values do not
//   fit in registers); h, the mixed row, waits in shared memory (f32 [D]) for the norm.
// - attn_res_cluster_kernel (decode batches, T ≤ 64): a token's row is cut over a cluster of C ≤ 8 CTAs
//   (D = 7168: 8 CTAs × 112 vectors), one 16-byte vector of every source per thread, held in registers from
//   its single load to the end. The per-source dot products and sums of squares, Σh² and the FP8 amax are
//   summed over the warps, then over the cluster through distributed shared memory (each CTA publishes its
//   partials, cluster barrier, every CTA adds the C partials in rank order — so all CTAs compute the same α
//   and the same norm factor). Why: at batch 1 the one-CTA kernel is a chain of dependent passes on one SM
//   (≈ 10 µs per point, 9 points per reduced-mini step, Nsight Compute); the cluster form makes one L2 round
//   trip for the data and three cluster barriers. Where a row fits one warp (nano's D = 256: one CTA of 32
//   threads) both kernels do the same operations in the same order, so their bits agree.
// Both: the three weight vectors are never written by a kernel, so they are read (or prefetched) before the
// PDL wait.
#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kClusterMaxT = 64;      // the most tokens the cluster kernel may take (decode buckets)
// Every decode bucket (T ≤ 64) on the cluster kernel: with both kernels instantiated per stored-block count
// (session 28, bench_ops --only attnres, 4 blocks) cluster 6.0 / 8.4 / 11.3 µs a point at T = 1 / 32 / 64, one-CTA
// 11.5–12.0; before, cluster 8.1 / 9.7 / 16.7 against one-CTA 14.5, so the bound was 32.
constexpr int kClusterDefaultMaxT = 64;
constexpr int kClusterMax = 8;        // portable cluster size
constexpr int kClusterVecs = 64;      // fewest 16-byte vectors per CTA worth another CTA in the cluster
constexpr int kClusterThreads = 256;  // most vectors per CTA (102 registers a thread: 15 sources held)

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

std::atomic<int>& cluster_max_t() {
  static std::atomic<int> v{[] {
    const char* e = std::getenv("KESTREL_ATTNRES_CLUSTER_MAX_T");
    return e ? std::clamp(std::atoi(e), 0, kClusterMaxT) : kClusterDefaultMaxT;
  }()};
  return v;
}


__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = lane < nw ? scratch[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// NB ≥ 0: the stored-block count at compile time, as for the cluster kernel below (−1: nb_rt at run time).
template <int NB>
__global__ void __launch_bounds__(1024) attn_res_step_kernel(
    const uint16_t* __restrict__ blocks, int64_t block_stride, int nb_rt, uint16_t* __restrict__ partial,
    const uint16_t* __restrict__ a, AttnResAdd mode, uint16_t* __restrict__ store_block,
    const uint16_t* __restrict__ mix_norm_w, const uint16_t* __restrict__ mix_proj_w,
    const uint16_t* __restrict__ rms_w, float eps, uint16_t* __restrict__ y, uint8_t* __restrict__ q8,
    float* __restrict__ q_scale, int D, const int32_t* __restrict__ a_ids) {
  static_assert(NB < kAttnResMaxSources, "NB stored blocks and P");
  const int nb = NB >= 0 ? NB : nb_rt;
  extern __shared__ float h[];  // f32 [D], the BF16-rounded mix
  __shared__ float red[2 * kAttnResMaxSources][33];
  __shared__ float alpha[kAttnResMaxSources];
  dev::pdl_trigger();
  // The three weight vectors are never written by a kernel: ask L2 for this thread's share before the PDL wait,
  // so that at batch 1 (one CTA, a chain of dependent passes) their DRAM latency overlaps the previous kernel.
  if (blockIdx.x == 0) {
    for (int v = threadIdx.x; v < D / 8; v += blockDim.x) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(mix_norm_w + 8 * v));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(mix_proj_w + 8 * v));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(rms_w + 8 * v));
    }
  }
  dev::pdl_wait();
  const int64_t t = blockIdx.x;
  const int n = nb + 1, nv = D / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  uint16_t* P = partial + t * D;
  auto src = [&](int i) -> const uint16_t* { return i < nb ? blocks + i * block_stride + t * D : P; };
  auto ld = [](const uint16_t* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); };

  // Step 1–2: P up to date (each thread owns its vectors: no hazard), the stored block.
  if (mode != AttnResAdd::none || store_block) {
    const uint16_t* arow = a ? a + (a_ids ? int64_t(a_ids[t]) : t) * D : nullptr;  // a_ids: after the wait
    for (int v = threadIdx.x; v < nv; v += blockDim.x) {
      uint4 pv;
      if (mode == AttnResAdd::replace) {
        pv = ld(arow + 8 * v);
      } else {
        pv = ld(P + 8 * v);
        if (mode == AttnResAdd::add) {
          float f[8], g[8];
          dev::unpack8(pv, f);
          dev::unpack8(ld(arow + 8 * v), g);
#pragma unroll
          for (int j = 0; j < 8; ++j) f[j] = f[j] + g[j];
          pv = dev::pack8(f);
        }
      }
      if (mode != AttnResAdd::none) *reinterpret_cast<uint4*>(P + 8 * v) = pv;
      if (store_block) *reinterpret_cast<uint4*>(store_block + t * D + 8 * v) = pv;
    }
  }

  // Pass 1: per source, v·u and Σv² (the thread re-reads only what it wrote above).
  float dot[kAttnResMaxSources], ss[kAttnResMaxSources];
#pragma unroll
  for (int i = 0; i < kAttnResMaxSources; ++i) dot[i] = ss[i] = 0.0f;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float wa[8], wb[8], u[8];
    dev::unpack8(dev::ld16(mix_norm_w + 8 * v), wa);
    dev::unpack8(dev::ld16(mix_proj_w + 8 * v), wb);
#pragma unroll
    for (int j = 0; j < 8; ++j) u[j] = wa[j] * wb[j];
#pragma unroll
    for (int i = 0; i < kAttnResMaxSources; ++i) {
      if (i < n) {
        float f[8];
        dev::unpack8(ld(src(i) + 8 * v), f);
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
      const float d = dev::warp_sum(dot[i]), s2 = dev::warp_sum(ss[i]);
      if (lane == 0) red[2 * i][warp] = d, red[2 * i + 1][warp] = s2;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the logits live in alpha[] (shared) until normalised: no local-memory array
    float m = -INFINITY;
    for (int i = 0; i < n; ++i) {
      float d = 0.0f, s2 = 0.0f;
      for (int w = 0; w < nw; ++w) d += red[2 * i][w], s2 += red[2 * i + 1][w];
      alpha[i] = d / sqrtf(s2 / float(D) + eps);
      m = fmaxf(m, alpha[i]);
    }
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += (alpha[i] = expf(alpha[i] - m));
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; ++i) alpha[i] = alpha[i] * inv;
  }
  __syncthreads();

  // Pass 2: h = bf16(Σ α_i v_i), Σh².
  float hs = 0.0f;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kAttnResMaxSources; ++i) {
      if (i < n) {
        float f[8];
        dev::unpack8(ld(src(i) + 8 * v), f);
        const float al = alpha[i];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(al, f[j], acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j] = dev::round_bf16(acc[j]);
      h[8 * v + j] = acc[j];
      hs = fmaf(acc[j], acc[j], hs);
    }
  }
  hs = dev::block_sum(hs, &red[0][0]);
  const float r = 1.0f / sqrtf(hs / float(D) + eps);

  // Pass 3: y = w ⊙ bf16(h·r) (and its amax for the FP8 codes).
  float amax = 0.0f;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[8], g[8];
    dev::unpack8(dev::ld16(rms_w + 8 * v), g);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      f[j] = dev::round_bf16(g[j] * dev::round_bf16(h[8 * v + j] * r));
      amax = fmaxf(amax, fabsf(f[j]));
    }
    *reinterpret_cast<uint4*>(y + t * D + 8 * v) = dev::pack8(f);
  }
  if (!q8) return;
  // Pass 4 (FP8 PTPC of y): the same values again from h, amax over the row, codes.
  amax = block_max(amax, &red[2][0]);
  const float s = (amax > 0.0f && isfinite(amax)) ? amax / 448.0f : 1.0f;
  if (threadIdx.x == 0) q_scale[t] = s;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float g[8];
    dev::unpack8(dev::ld16(rms_w + 8 * v), g);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float f = dev::round_bf16(g[j] * dev::round_bf16(h[8 * v + j] * r));
      (j < 4 ? lo : hi) |= uint32_t(dev::f32_to_e4m3_sat(f / s)) << (8 * (j & 3));
    }
    *reinterpret_cast<uint2*>(q8 + t * D + 8 * v) = make_uint2(lo, hi);
  }
}


// One AttnRes point for token blockIdx.y, vectors [rank·per, rank·per + per) of its row on CTA `rank` of the
// cluster (grid.x = C = the cluster size). The same arithmetic per element as attn_res_step_kernel; the
// reductions run over warps, then cluster ranks, so at D = 7168 y may differ from it in the last bit.
// NB ≥ 0: the number of stored blocks known at compile time (the launcher's switch; −1: nb_rt at run time).
// Why: at batch 1 a point's time is its warps' instruction chain, and the per-source steps unrolled to the
// 15-block bound under run-time guards cost ~1,130 instructions a warp at 9.3 cycles each for the reduced
// mini's 0–3 blocks (Nsight Compute, session 28: 9.0 µs a point at 1.49 GHz).
template <int NB>
__global__ void __launch_bounds__(kClusterThreads) attn_res_cluster_kernel(
    const uint16_t* __restrict__ blocks, int64_t block_stride, int nb_rt, uint16_t* __restrict__ partial,
    const uint16_t* __restrict__ a, AttnResAdd mode, uint16_t* __restrict__ store_block,
    const uint16_t* __restrict__ mix_norm_w, const uint16_t* __restrict__ mix_proj_w,
    const uint16_t* __restrict__ rms_w, float eps, uint16_t* __restrict__ y, uint8_t* __restrict__ q8,
    float* __restrict__ q_scale, int D, int per, const int32_t* __restrict__ a_ids) {
  constexpr int S = kAttnResMaxSources;
  static_assert(NB < S, "NB stored blocks and P");
  const int nb = NB >= 0 ? NB : nb_rt;
  __shared__ float red[kClusterThreads / 32][2 * S];  // per warp: dot, Σv² per source (P last); Σh²; amax
  __shared__ float pub[3][2 * S];  // this CTA's partials, read by the cluster: [0] dot/Σv², [1] Σh², [2] amax
  __shared__ float tot[2 * S];
  __shared__ float alpha[S];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), C = int(cluster.num_blocks());
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t t = blockIdx.y;
  const int n = nb + 1, nv = D / 8, v = rank * per + int(threadIdx.x);
  const bool act = int(threadIdx.x) < per && v < nv;
  dev::pdl_trigger();
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wn = zero, wp = zero, wr = zero;  // weights: never written by a kernel, so read before the wait
  if (act) wn = dev::ld16(mix_norm_w + 8 * v), wp = dev::ld16(mix_proj_w + 8 * v), wr = dev::ld16(rms_w + 8 * v);
  dev::pdl_wait();
  auto ld = [](const uint16_t* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); };

  // Steps 1–2 and the loads: each source's vector once, into registers (blocks i < nb; P apart, so that no
  // register array is indexed by the run-time nb).
  uint4 src[S - 1];
#pragma unroll
  for (int i = 0; i < S - 1; ++i) src[i] = (act && i < nb) ? ld(blocks + i * block_stride + t * D + 8 * v) : zero;
  uint4 pv = zero;
  if (act) {
    uint16_t* P = partial + t * D + 8 * v;
    const uint16_t* arow = a ? a + (a_ids ? int64_t(a_ids[t]) : t) * D : nullptr;  // a_ids: after the wait
    if (mode == AttnResAdd::replace) {
      pv = ld(arow + 8 * v);
    } else {
      pv = ld(P);
      if (mode == AttnResAdd::add) {
        float f[8], g[8];
        dev::unpack8(pv, f);
        dev::unpack8(ld(arow + 8 * v), g);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = f[j] + g[j];
        pv = dev::pack8(f);
      }
    }
    if (mode != AttnResAdd::none) *reinterpret_cast<uint4*>(P) = pv;
    if (store_block) *reinterpret_cast<uint4*>(store_block + t * D + 8 * v) = pv;
  }

  // Pass 1: per source, v·u and Σv², summed over the warp, the CTA (warp order), the cluster (rank order).
  float u[8];
  {
    float fa[8], fb[8];
    dev::unpack8(wn, fa);
    dev::unpack8(wp, fb);
#pragma unroll
    for (int j = 0; j < 8; ++j) u[j] = fa[j] * fb[j];  // exact: two bf16 significands fit in f32
  }
  auto dot_ss = [&](const uint4& x, int i) {
    float f[8], d = 0.0f, s2 = 0.0f;
    dev::unpack8(x, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) d = fmaf(f[j], u[j], d), s2 = fmaf(f[j], f[j], s2);
    d = dev::warp_sum(d), s2 = dev::warp_sum(s2);
    if (lane == 0) red[warp][2 * i] = d, red[warp][2 * i + 1] = s2;
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i)
    if (i < nb) dot_ss(src[i], i);
  dot_ss(pv, nb);
  __syncthreads();
  if (int(threadIdx.x) < 2 * n) {
    float s = 0.0f;
    for (int w = 0; w < nw; ++w) s += red[w][threadIdx.x];
    pub[0][threadIdx.x] = s;
  }
  cluster.sync();
  if (int(threadIdx.x) < 2 * n) {
    float s = 0.0f;
    for (int r = 0; r < C; ++r) s += cluster.map_shared_rank(&pub[0][0], r)[threadIdx.x];
    tot[threadIdx.x] = s;
  }
  __syncthreads();
  // The softmax with the one-CTA kernel's operations in its order: logits and exponentials in parallel
  // (lane i: source i), the sum sequential.
  if (warp == 0) {
    const float l = lane < n ? tot[2 * lane] / sqrtf(tot[2 * lane + 1] / float(D) + eps) : -INFINITY;
    float m = l;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane < n) alpha[lane] = expf(l - m);
    __syncwarp();
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += alpha[i];
    const float inv = 1.0f / sum;
    __syncwarp();
    if (lane < n) alpha[lane] = alpha[lane] * inv;
  }
  __syncthreads();

  // Pass 2: h = bf16(Σ α_i v_i) in source order (blocks, then P); Σh² over the cluster.
  float h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto mix = [&](const uint4& x, float al) {
    float f[8];
    dev::unpack8(x, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = fmaf(al, f[j], h[j]);
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i)
    if (i < nb) mix(src[i], alpha[i]);
  mix(pv, alpha[nb]);
  float hs = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    h[j] = dev::round_bf16(h[j]);
    hs = fmaf(h[j], h[j], hs);
  }
  hs = dev::warp_sum(hs);
  if (lane == 0) red[warp][0] = hs;  // pass 1's reads of red[] ended before its cluster barrier
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < nw; ++w) s += red[w][0];
    pub[1][0] = s;
  }
  cluster.sync();
  float hsum = 0.0f;
  for (int r = 0; r < C; ++r) hsum += cluster.map_shared_rank(&pub[1][0], r)[0];
  const float rn = 1.0f / sqrtf(hsum / float(D) + eps);

  // Pass 3: y = w ⊙ bf16(h·r), and its amax for the FP8 codes.
  float g[8], f[8], amax = 0.0f;
  dev::unpack8(wr, g);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    f[j] = dev::round_bf16(g[j] * dev::round_bf16(h[j] * rn));
    amax = fmaxf(amax, fabsf(f[j]));
  }
  if (act) *reinterpret_cast<uint4*>(y + t * D + 8 * v) = dev::pack8(f);
  if (q8) {  // Pass 4 (FP8 PTPC of y): amax over the row (max: any order gives the same), codes.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) red[warp][1] = amax;  // [1]: thread 0 may still be reading red[w][0] of pass 2
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = 0.0f;
      for (int w = 0; w < nw; ++w) m = fmaxf(m, red[w][1]);
      pub[2][0] = m;
    }
    cluster.sync();
    float am = 0.0f;
    for (int r = 0; r < C; ++r) am = fmaxf(am, cluster.map_shared_rank(&pub[2][0], r)[0]);
    const float s = (am > 0.0f && isfinite(am)) ? am / 448.0f : 1.0f;
    if (rank == 0 && threadIdx.x == 0) q_scale[t] = s;
    if (act) {
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) (j < 4 ? lo : hi) |= uint32_t(dev::f32_to_e4m3_sat(f[j] / s)) << (8 * (j & 3));
      *reinterpret_cast<uint2*>(q8 + t * D + 8 * v) = make_uint2(lo, hi);
    }
  }
  cluster.sync();  // no CTA leaves while another may still read its pub[]
}

// The kernels for nb stored blocks (KESTREL_ATTNRES_NB=0: the run-time instantiations, for A/B).
template <int... I>
auto cluster_kernel_table(std::integer_sequence<int, I...>) {
  return std::array{attn_res_cluster_kernel<-1>, attn_res_cluster_kernel<I>...};
}
template <int... I>
auto step_kernel_table(std::integer_sequence<int, I...>) {
  return std::array{attn_res_step_kernel<-1>, attn_res_step_kernel<I>...};
}
size_t nb_index(int nb) {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_ATTNRES_NB");
    return !(e && e[0] == '0');
  }();
  return on && nb >= 0 && nb < kAttnResMaxSources ? size_t(nb) + 1 : 0;
}
auto cluster_kernel_for(int nb) {
  static const auto table = cluster_kernel_table(std::make_integer_sequence<int, kAttnResMaxSources>{});
  return table[nb_index(nb)];
}
auto step_kernel_for(int nb) {
  static const auto table = step_kernel_table(std::make_integer_sequence<int, kAttnResMaxSources>{});
  return table[nb_index(nb)];
}

}  // namespace

int attn_res_cluster_max_t() { return cluster_max_t().load(std::memory_order_relaxed); }
void set_attn_res_cluster_max_t(int t) { cluster_max_t().store(std::clamp(t, 0, kClusterMaxT)); }

void attn_res_step(const uint16_t* blocks, int64_t block_stride, int nb, uint16_t* partial, const uint16_t* a,
                   AttnResAdd mode, uint16_t* store_block, const uint16_t* mix_norm_w, const uint16_t* mix_proj_w,
                   const uint16_t* rms_w, float eps, uint16_t* y, uint8_t* q8, float* q_scale, int64_t T, int64_t D,
                   cudaStream_t stream, const int32_t* a_ids) {
  KCUDA_REQUIRE(partial && mix_norm_w && mix_proj_w && rms_w && y && (nb == 0 || blocks) &&
                    (mode == AttnResAdd::none || a) && (!q8 || q_scale),
                std::string("attn_res_step: null pointer"));
  KCUDA_REQUIRE(!a_ids || mode == AttnResAdd::replace, std::string("attn_res_step: a_ids only with replace"));
  KCUDA_REQUIRE(nb >= 0 && nb + 1 <= kAttnResMaxSources,
                "attn_res_step: " + std::to_string(nb) + " stored blocks (at most " +
                    std::to_string(kAttnResMaxSources - 1) + ")");
  KCUDA_REQUIRE(D > 0 && D % 8 == 0 && D * 4 <= 96 * 1024 && block_stride % 8 == 0,
                "attn_res_step: D = " + std::to_string(D) + " must be a multiple of 8 and <= 24576");
  KCUDA_REQUIRE((nb == 0 || aligned16(blocks)) && aligned16(partial) && (!a || aligned16(a)) &&
                    (!store_block || aligned16(store_block)) && aligned16(mix_norm_w) && aligned16(mix_proj_w) &&
                    aligned16(rms_w) && aligned16(y) && (reinterpret_cast<uintptr_t>(q8) & 7u) == 0,
                std::string("attn_res_step: pointers must be 16-byte aligned (q8 8-byte)"));
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("attn_res_step: bad T"));
  if (T == 0) return;
  const size_t smem = size_t(D) * 4;
  const int64_t nv = D / 8;
  // Small batches: the row over a cluster of C CTAs (enough vectors per CTA to be worth one), `per` vectors each.
  if (T <= attn_res_cluster_max_t() && nv <= int64_t(kClusterMax) * kClusterThreads) {
    const int64_t C = std::clamp<int64_t>((nv + kClusterVecs - 1) / kClusterVecs, 1, kClusterMax);
    const int64_t per = (nv + C - 1) / C;
    launch_pdl_cluster(cluster_kernel_for(nb), dim3(unsigned(C), unsigned(T)), dim3(unsigned((per + 31) / 32 * 32)),
                       0, stream, unsigned(C), blocks, block_stride, nb, partial, a, mode, store_block, mix_norm_w,
                       mix_proj_w, rms_w, eps, y, q8, q_scale, int(D), int(per), a_ids);
    return;
  }
  // One CTA per token. Decode: a thread per 16-byte vector (up to 1024), the shortest chain of dependent steps.
  // Prefill (T ≥ 512, more tokens than resident CTAs): 256 threads looping over the row, so that 7 CTAs fit
  // an SM instead of 2 and their load / reduce / sync phases overlap (measured on the reduced mini's 8K
  // prefill: 4.3 ms for its 8 AttnRes points at one thread per vector).
  const unsigned threads =
      T >= 512 ? unsigned(std::min<int64_t>(256, (nv + 31) / 32 * 32)) : unsigned(std::min<int64_t>(1024, (nv + 31) / 32 * 32));
  const auto kernel = step_kernel_for(nb);
  if (smem > 48 * 1024)  // D > 12288 only (no configuration of ours): the attribute per launch is cheap enough
    KCUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_pdl(kernel, dim3(unsigned(T)), dim3(threads), smem, stream, blocks, block_stride, nb, partial,
             a, mode, store_block, mix_norm_w, mix_proj_w, rms_w, eps, y, q8, q_scale, int(D), a_ids);
}

}  // namespace kestrel::cuda
