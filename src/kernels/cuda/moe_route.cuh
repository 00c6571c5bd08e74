// The MoE router's top-k (MODEL.md §3.6 step 1) for one token on one warp, as a device function, and the step that
// runs it in the skinny GEMM's last router CTA after storing the logits (gemm_skinny.h GemmRoute), so the
// decode step needs no router launch of its own. The same selection and weight arithmetic as moe_route's kernels
// (moe.cu), hence the same bits: top-K by the strict total order on (σ(logit) + bias, expert index) — ties to the
// lower index, NaN keys rank lowest — then w = σ of each pick, Σ over the picks in pick order, w/(Σ + 1e-20) if
// renormalising, times `scaling`.
//
// Layout: expert e = 32j + lane sits in slot j of lane `lane` (X ≤ 32·kWarpRouteSlots = 256); a round is a 5-step
// shuffle arg-max of the lanes' cached bests, after which only the winning lane rescans its slots (moe.cu's
// two-level kernel's first level, on every expert at once). K ≤ 32: lane r keeps pick r.
// Why only small X: at the real model's 896 experts a lane would hold 28 slots and every round's rescan is a serial
// chain (one warp a token measured 41.8 µs at top-16 of 896, moe.cu's header); there the router keeps its launch.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemm_skinny.h"

namespace kestrel::cuda::route_dev {

inline constexpr int kWarpRouteSlots = 8;  // slots a lane: X ≤ 256
inline constexpr int kWarpRouteMaxK = 32;  // one pick a lane

// True if route_token_warp takes X experts, top-K.
__host__ __device__ inline bool warp_route_ok(int64_t X, int64_t K) {
  return X >= 1 && X <= 32 * kWarpRouteSlots && K >= 1 && K <= kWarpRouteMaxK && K <= X;
}

struct WCand {
  float key;
  int idx;
};
__device__ __forceinline__ bool wbetter(const WCand& a, const WCand& b) {
  return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}

// The calling warp (all 32 lanes, converged) routes one token: logits f32 [X] (read through L2: other CTAs of the
// same grid wrote them), bias f32 [X] (a weight), ids i32 [K], wts f32 [K]. warp_route_ok(X, K) must hold.
__device__ inline void route_token_warp(const float* logits, const float* __restrict__ bias, int X, int K, bool renorm,
                                        float scaling, int32_t* ids, float* wts) {
  const int lane = int(threadIdx.x) & 31;
  float s[kWarpRouteSlots], key[kWarpRouteSlots];
  uint32_t taken = 0;  // bit j: slot j chosen already, or past X (never a candidate)
#pragma unroll
  for (int j = 0; j < kWarpRouteSlots; ++j) {
    const int e = 32 * j + lane;
    if (e < X) {
      s[j] = dev::sigmoid(__ldcg(logits + e));
      const float k = s[j] + __ldg(bias + e);
      key[j] = isnan(k) ? -INFINITY : k;  // NaN ranks below every number
    } else {
      s[j] = 0.0f, key[j] = -INFINITY, taken |= 1u << j;
    }
  }
  WCand mine{-INFINITY, 0x7fffffff};
  float mine_s = 0.0f;
  auto rescan = [&] {  // the lane's best free slot (−inf keys included: at equal keys the lower index wins)
    mine = WCand{-INFINITY, 0x7fffffff};
#pragma unroll
    for (int j = 0; j < kWarpRouteSlots; ++j) {
      const WCand c{key[j], 32 * j + lane};
      if (!((taken >> j) & 1u) && wbetter(c, mine)) mine = c, mine_s = s[j];
    }
  };
  rescan();
  float sum = 0.0f;  // Σ of the chosen σ in pick order (every lane the same)
  int my_id = 0;
  float my_w = 0.0f;
  for (int r = 0; r < K; ++r) {
    WCand best = mine;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const WCand other{__shfl_xor_sync(0xffffffffu, best.key, o), __shfl_xor_sync(0xffffffffu, best.idx, o)};
      if (wbetter(other, best)) best = other;
    }
    const int winner = best.idx & 31;
    const float ws = __shfl_sync(0xffffffffu, mine_s, winner);
    sum += ws;
    if (lane == r) my_id = best.idx, my_w = ws;
    if (lane == winner) {
      taken |= 1u << (best.idx >> 5);
      rescan();
    }
  }
  if (lane < K) {
    float v = my_w;
    if (renorm) v /= (sum + 1e-20f);
    ids[lane] = my_id;
    wts[lane] = v * scaling;
  }
}

// The route step of a GEMM whose segments carry one (gemm_skinny.h GemmRoute), called by every warp of each CTA
// after its epilogue (stored: this CTA wrote its row tile — false for a split-K CTA that was not its tile's last).
// The CTAs that stored one of the `tiles` row tiles from `tile0` (those holding the router segment's rows) bump
// *counter after a fence, as split-K's last-CTA rule does; the one that sees the last count routes the T tokens,
// warp w taking tokens w, w + nwarps, ..., from the logits the other CTAs wrote (visible after their fences, read
// through L2), and leaves the counter zero for the next launch (which reads it only after its PDL wait).
__device__ inline void route_after_tiles(const GemmSegs& segs, int N, int T, unsigned* counter, int tile0, int tiles,
                                         int tile, bool stored, int nwarps, unsigned* go /* smem */) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  if (warp == 0) {
    unsigned last = 0;
    if (stored && tile >= tile0 && tile < tile0 + tiles) {
      __threadfence();  // this tile's logits before the count
      if (lane == 0) last = atomicAdd(counter, 1u) == unsigned(tiles - 1);
    }
    last = __shfl_sync(0xffffffffu, last, 0);
    if (lane == 0) *go = last;
  }
  __syncthreads();
  if (!*go) return;
  __threadfence();
  const GemmRoute& r = segs.route;
  const GemmSeg& sg = segs.seg[r.seg];
  const int X = int((r.seg + 1 < segs.n ? segs.seg[r.seg + 1].n0 : int64_t(N)) - sg.n0);
  for (int t = warp; t < T; t += nwarps)
    route_token_warp(static_cast<const float*>(sg.y) + int64_t(t) * sg.ldy, r.bias, X, r.K, r.renormalize, r.scaling,
                     r.ids + int64_t(t) * r.K, r.weights + int64_t(t) * r.K);
  if (threadIdx.x == 0) *counter = 0u;
}

}  // namespace kestrel::cuda::route_dev
