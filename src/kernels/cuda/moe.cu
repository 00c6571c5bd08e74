// MoE router (MODEL.md §3.6 step 1) and the expert-parallel id map; see moe.h. The routed experts are in
// moe_experts.cu.
//
// Router, three kernels with the same selection (the top K by a strict total order on (key, index): ties to the
// lower index, so any reduction order picks the same experts) and the same weight arithmetic (Σ in pick order,
// then w/(Σ + 1e-20)·scaling), so the same bits:
//   two-level (X ≤ 2048, every K; route_2l_kernel below): per token, 8 warps each pick their own experts' top-K
//     with shuffles alone, then one warp merges the 8 ordered lists — no barrier but the one between the levels;
//   block (any X ≤ 8192): per token, the scores in shared memory and a block-wide arg-max a round: two
//     __syncthreads, a serial pass over the warps' winners and, per candidate, a pass over the picks so far;
//   sort (X ≤ 2048; route_sort_kernel below): the two levels of two-level as bitonic sorting networks;
//   radix (X ≤ 2048; route_radix_kernel below, opt-in): a radix select of the K-th key over all 8 warps.
// H200 (session 32, bench_ops --only route, 20 launches in a graph, µs a launch, T = 1 / 8 / 64): top-16 of 896
// (the real shape) block 34.6 / 32.3 / 31.9 → two-level 17.5 / 16.9 / 16.9; top-2 of 112 (the reduced mini)
// 3.7 / 3.8 / 3.8 → 3.0 / 3.1 / 3.1; the reduced mini's step b1 543.5 / 546.0 → 537.5 / 539.5 µs (alternated).
// Lost: one warp per token with 28 slots a lane (41.8 µs at top-16: the winning lane's 28-slot rescan is a serial
// chain in every round). Still ~0.5 µs a round a level at top-16 — hence the third kernel, sorting networks
// (route_sort_kernel). Session 33, same bench, µs a launch (T = 1..64), two-level / sort: top-2 of 112 2.5–2.7 /
// 3.3–3.4; top-8 of 112 7.1–7.2 / 5.0–5.1; top-4 of 896 5.9–6.0 / 9.8–9.9; top-8 of 896 9.5–9.6 / 11.2–11.3;
// top-16 of 896 16.8–16.9 / 15.3–15.6. Two levels cost ~0.8–0.9 µs a pick; the network's cost grows with the
// slots a lane (J) and not with K, so the crossover moves with J: K ≈ 3 at J = 1, ≈ 13 at J = 4.
// All launch with PDL (launch.h): the bias (a weight) is read before the wait. KESTREL_ROUTE=auto|block|two-level|
// sort (or set_moe_route_kernel) picks the kernel at X ≤ 2048 (A/B timing, tests); the default, auto, takes the
// sorting networks at K ≥ 4·J and two levels below.
//
// Emulation: tests/emu compiles this file against simt.h (the launchers, which need CUDA, are left out there)
// to run the three kernels against cpu::moe_route in CI.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <string>

#ifndef KESTREL_SIMT_EMU
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#endif
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe.h"

namespace kestrel::cuda {
namespace {

constexpr int kRouteThreads = 256;
constexpr int kMaxExperts = 8192;
constexpr int kMaxTopK = 64;

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
  float* s = dev::dyn_smem<float>();  // f32 [X]: σ(logits)
  float* sel = s + X;                 // f32 [X]: σ + bias, NaN → −inf
  __shared__ Cand warp_best[32];
  __shared__ int chosen[kMaxTopK];
  const int64_t t = blockIdx.x;
  dev::pdl_trigger();
  dev::pdl_wait();  // the logits come from the kernel before
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

// Two levels, one block of 8 warps per token; J = slots a lane, X ≤ 256·J. Expert e = 256j + 32w + l sits in
// lane l of warp w (coalesced loads). Level 1: warp w picks the top min(K, its experts) of its own experts, in
// order, into shared memory — a round is a 5-step shuffle arg-max of the lanes' cached bests, after which only
// the winning lane rescans its J slots. Level 2: warp 0 merges the 8 ordered lists, lane i holding the head of
// list i: a round is again a shuffle arg-max, and the winning list moves its head on. The global top-K is the
// top-K of the union of the warps' top-K lists, and every arg-max is over the same strict order, so the picks
// and their order are the block kernel's.
constexpr int kRoute2Warps = 8;
template <int J>
__global__ void __launch_bounds__(32 * kRoute2Warps) route_2l_kernel(const float* __restrict__ logits,
                                                                   const float* __restrict__ bias, int X, int K,
                                                                   bool renorm, float scaling, int32_t* __restrict__ ids,
                                                                   float* __restrict__ wts) {
  __shared__ float c_key[kRoute2Warps][kMaxTopK], c_s[kRoute2Warps][kMaxTopK];  // level 1's lists, in order
  __shared__ int c_idx[kRoute2Warps][kMaxTopK];
  const int lane = int(threadIdx.x) & 31, w = int(threadIdx.x) >> 5;
  const int64_t t = blockIdx.x;
  auto expert = [&](int j) { return 256 * j + 32 * w + lane; };
  // How many experts warp v holds: each slot row j gives it min(32, X − (256j + 32v)) if positive.
  auto list_len = [&](int v) {
    int n = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) n += min(32, max(0, X - (256 * j + 32 * v)));
    return min(K, n);
  };
  float b[J];  // the bias: a weight, never written by a kernel, so read before the wait
#pragma unroll
  for (int j = 0; j < J; ++j) b[j] = expert(j) < X ? __ldg(bias + expert(j)) : 0.0f;
  dev::pdl_trigger();
  dev::pdl_wait();  // the logits come from the kernel before
  float s[J], key[J];
  uint32_t taken = 0;  // bit j: slot j chosen already, or past X (never a candidate)
#pragma unroll
  for (int j = 0; j < J; ++j) {
    if (expert(j) < X) {
      s[j] = dev::sigmoid(logits[t * X + expert(j)]);
      const float k = s[j] + b[j];
      key[j] = isnan(k) ? -INFINITY : k;  // NaN ranks below every number
    } else {
      s[j] = 0.0f, key[j] = -INFINITY, taken |= 1u << j;
    }
  }
  // Level 1. The lane's best free slot (−inf keys included: at equal keys the lower index wins).
  Cand mine;
  float mine_s = 0.0f;
  auto rescan = [&] {
    mine = Cand{-INFINITY, 0x7fffffff};
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const Cand c{key[j], expert(j)};
      if (!((taken >> j) & 1u) && better(c, mine)) mine = c, mine_s = s[j];
    }
  };
  auto warp_best = [](Cand best) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const Cand other{__shfl_xor_sync(0xffffffffu, best.key, o), __shfl_xor_sync(0xffffffffu, best.idx, o)};
      if (better(other, best)) best = other;
    }
    return best;  // the same in every lane
  };
  rescan();
  const int rounds = list_len(w);  // warp-uniform
  for (int r = 0; r < rounds; ++r) {
    const Cand best = warp_best(mine);
    const int winner = best.idx & 31;
    const float ws = __shfl_sync(0xffffffffu, mine_s, winner);
    if (lane == 0) c_key[w][r] = best.key, c_idx[w][r] = best.idx, c_s[w][r] = ws;
    if (lane == winner) {
      taken |= 1u << (best.idx >> 8);
      rescan();
    }
  }
  __syncthreads();
  if (w != 0) return;
  // Level 2: lanes 0..7 walk the lists (the other lanes hold nothing that can win).
  const int len = lane < kRoute2Warps ? list_len(lane) : 0;
  int pos = 0;
  Cand head;
  float head_s = 0.0f;
  auto load = [&] {
    head = Cand{-INFINITY, 0x7fffffff};
    if (pos < len) head = Cand{c_key[lane][pos], c_idx[lane][pos]}, head_s = c_s[lane][pos];
  };
  load();
  float sum = 0.0f;  // Σ of the chosen σ in round order (every lane the same)
  int id_lo = 0, id_hi = 0;
  float w_lo = 0.0f, w_hi = 0.0f;  // lane l keeps rounds l and 32 + l
  for (int r = 0; r < K; ++r) {
    const Cand best = warp_best(head);
    const int winner = (best.idx >> 5) & (kRoute2Warps - 1);  // the warp (list) that holds expert best.idx
    const float ws = __shfl_sync(0xffffffffu, head_s, winner);
    sum += ws;
    if (lane == (r & 31)) {
      if (r < 32) id_lo = best.idx, w_lo = ws;
      else id_hi = best.idx, w_hi = ws;
    }
    if (lane == winner) {
      ++pos;
      load();
    }
  }
  auto put = [&](int r, int id, float v) {
    if (renorm) v /= (sum + 1e-20f);
    ids[t * K + r] = id;
    wts[t * K + r] = v * scaling;
  };
  if (lane < K) put(lane, id_lo, w_lo);
  if (32 + lane < K) put(32 + lane, id_hi, w_hi);
}

// Sorting networks instead of K rounds (route_sort_kernel; auto's pick where K ≥ 4·J, see the header;
// bit-exact against the twin on the SIMT emulator in CI and against the other kernels in GpuOps.MoeRoute):
// the same two levels and layout as route_2l_kernel, but level 1 sorts each warp's 32·J (key, index) pairs with a
// bitonic network (in-register steps for strides < J, shuffles above: 15 dependent shuffle stages at J = 4
// against 16 rounds × 5), and level 2 sorts the 8 lists (each padded to Kp, a power of two ≥ K; J2 = 8·Kp/32 a
// lane) the same way; the top K are positions 0..K−1 in the block kernel's order. σ of a pick is recomputed from
// its logit (the same function of the same input: the same bits) and Σ runs over the picks in order.
template <int N>
__device__ __forceinline__ void bitonic_sort_desc(Cand (&v)[N], int lane) {
  // Position of v[j] in lane l: p = l·N + j. A pair (p, p ^ st) with p the lower keeps the better in front when
  // its k-block is descending ((p & k) == 0), at the back otherwise; the last k-block (k = 32·N) is descending.
#pragma unroll
  for (int k = 2; k <= 32 * N; k <<= 1) {
#pragma unroll
    for (int st = k >> 1; st > 0; st >>= 1) {
      if (st >= N) {
        const int lm = st / N;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const Cand o{__shfl_xor_sync(0xffffffffu, v[j].key, lm), __shfl_xor_sync(0xffffffffu, v[j].idx, lm)};
          const int p = lane * N + j;
          const bool lower = (lane & lm) == 0, desc = (p & k) == 0;
          const bool o_first = better(o, v[j]);
          if (lower == desc ? o_first : !o_first) v[j] = o;  // lower of a descending pair takes the better one
        }
      } else {
#pragma unroll
        for (int j = 0; j < N; ++j)
          if ((j & st) == 0) {
            const int q = j | st, p = lane * N + j;
            const bool desc = (p & k) == 0;
            if (desc ? better(v[q], v[j]) : better(v[j], v[q])) {
              const Cand t = v[j];
              v[j] = v[q], v[q] = t;
            }
          }
      }
    }
  }
}

template <int J, int J2>
__global__ void __launch_bounds__(32 * kRoute2Warps) route_sort_kernel(const float* __restrict__ logits,
                                                                     const float* __restrict__ bias, int X, int K,
                                                                     bool renorm, float scaling,
                                                                     int32_t* __restrict__ ids, float* __restrict__ wts) {
  constexpr int Kp = 32 * J2 / kRoute2Warps;  // a list's room in level 2 (≥ K)
  __shared__ Cand lists[kRoute2Warps][Kp];
  __shared__ float sv[kMaxTopK];
  const int lane = int(threadIdx.x) & 31, w = int(threadIdx.x) >> 5;
  const int64_t t = blockIdx.x;
  const Cand none{-INFINITY, 0x7fffffff};  // sorts after every expert, a NaN one included (lower index)
  float b[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = 256 * j + 32 * w + lane;
    b[j] = e < X ? __ldg(bias + e) : 0.0f;
  }
  dev::pdl_trigger();
  dev::pdl_wait();  // the logits come from the kernel before
  Cand v[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = 256 * j + 32 * w + lane;
    v[j] = none;
    if (e < X) {
      const float k = dev::sigmoid(logits[t * X + e]) + b[j];
      v[j] = Cand{isnan(k) ? -INFINITY : k, e};
    }
  }
  bitonic_sort_desc<J>(v, lane);
  // The warp's best Kp (≥ K) in order: what lies past its K-th cannot be among the K best of all.
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int p = lane * J + j;
    if (p < Kp) lists[w][p] = v[j];
  }
  for (int p = 32 * J + lane; p < Kp; p += 32) lists[w][p] = none;  // a list's room past its warp's experts
  __syncthreads();
  if (w != 0) return;
  Cand u[J2];  // position p = lane·J2 + j of the 8 lists side by side
#pragma unroll
  for (int j = 0; j < J2; ++j) {
    const int p = lane * J2 + j;
    u[j] = lists[p / Kp][p % Kp];
  }
  bitonic_sort_desc<J2>(u, lane);
#pragma unroll
  for (int j = 0; j < J2; ++j) {
    const int r = lane * J2 + j;
    if (r < K) sv[r] = dev::sigmoid(logits[t * X + u[j].idx]);
  }
  __syncwarp();
  float sum = 0.0f;  // Σ of the chosen σ in pick order, as the other kernels
  for (int r = 0; r < K; ++r) sum += sv[r];
#pragma unroll
  for (int j = 0; j < J2; ++j) {
    const int r = lane * J2 + j;
    if (r < K) {
      float x = sv[r];
      if (renorm) x /= (sum + 1e-20f);
      ids[t * K + r] = u[j].idx;
      wts[t * K + r] = x * scaling;
    }
  }
}
// Radix select instead of rounds or networks (route_radix_kernel, X ≤ 2048; KESTREL_ROUTE=radix — opt-in until
// timed). Why: the other kernels leave the selection to one or two warps whose instruction chains are long — the
// sort kernel at top-16 of 896 is ~4,400 SASS instructions, one warp running about half of them in a row after the
// barrier (its 15.3 µs a launch) — where here every pass spreads over the 8 warps. Each expert becomes one 45-bit
// key c = (monotone bits of σ + bias, NaN → −inf) << 13 | (8191 − e): distinct keys, larger = earlier in the order
// (ties to the lower index). The K-th largest key is found 8 bits at a time from the top: per pass a 256-bin
// histogram of the keys still in play (warp-aggregated shared-memory atomics: most keys share their top digits),
// one warp's scan of the bins from the top for the digit where the count reaches the picks still wanted, and an
// early stop once a bin holds exactly those (usually after 2–4 passes; 6 at most). The K picks are gathered, each
// placed by its rank among them (K compares), and the weights are the other kernels': σ of the picks, Σ in pick
// order, w/(Σ + 1e-20)·scaling — the same bits.
constexpr int kRadixThreads = 256, kRadixBits = 45, kRadixIdxBits = 13;
__device__ __forceinline__ uint64_t radix_key(float k, int e) {
  if (isnan(k)) k = -INFINITY;  // NaN ranks below every number
  if (k == 0.0f) k = 0.0f;      // −0 and +0 are one key (the others compare them equal)
  const uint32_t u = __float_as_uint(k);
  const uint32_t mono = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // order-preserving
  return (uint64_t(mono) << kRadixIdxBits) | uint64_t((1 << kRadixIdxBits) - 1 - e);
}
template <int J>
__global__ void __launch_bounds__(kRadixThreads) route_radix_kernel(const float* __restrict__ logits,
                                                                  const float* __restrict__ bias, int X, int K,
                                                                  bool renorm, float scaling, int32_t* __restrict__ ids,
                                                                  float* __restrict__ wts) {
  __shared__ unsigned hist[256];
  __shared__ int sh_d, sh_above, sh_hd, n_pick;
  __shared__ uint64_t pick_c[kMaxTopK];
  __shared__ float pick_s[kMaxTopK], sorted_s[kMaxTopK];
  __shared__ float sh_sum;
  const int tid = int(threadIdx.x), lane = tid & 31;
  const int64_t t = blockIdx.x;
  float b[J];  // the bias: a weight, read before the wait
#pragma unroll
  for (int j = 0; j < J; ++j) b[j] = 256 * j + tid < X ? __ldg(bias + 256 * j + tid) : 0.0f;
  dev::pdl_trigger();
  dev::pdl_wait();  // the logits come from the kernel before
  uint64_t c[J];  // 0 past X: below every expert's key (never picked, K ≤ X)
  float s[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = 256 * j + tid;
    c[j] = 0, s[j] = 0.0f;
    if (e < X) {
      s[j] = dev::sigmoid(logits[t * X + e]);
      c[j] = radix_key(s[j] + b[j], e);
    }
  }
  if (tid == 0) n_pick = 0;
  // Invariant: the picks are the keys whose bits from `prev` up exceed P's, plus `rem` of those equal to them.
  uint64_t P = 0;
  int prev = kRadixBits, shift = kRadixBits, rem = K;
  for (int pass = 0; pass < (kRadixBits + 7) / 8; ++pass) {  // the last pass (shift 0) always ends it
    shift = max(0, prev - 8);
    const int width = prev - shift;
    hist[tid] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const bool in_play = (c[j] >> prev) == (P >> prev);
      const unsigned d = in_play ? unsigned(c[j] >> shift) & ((1u << width) - 1u) : 256u;
      const unsigned same = __match_any_sync(0xffffffffu, d);
      if (in_play && lane == __ffs(same) - 1) atomicAdd(&hist[d], unsigned(__popc(same)));
    }
    __syncthreads();
    if (tid < 32) {  // lane l: bins 255 − 8l − i, i = 0..7 (from the top)
      int h[8], tot = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) tot += (h[i] = int(hist[255 - 8 * lane - i]));
      int incl = tot;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      int run = incl - tot;  // keys in the bins above this lane's
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (run < rem && run + h[i] >= rem) sh_d = 255 - 8 * lane - i, sh_above = run, sh_hd = h[i];
        run += h[i];
      }
    }
    __syncthreads();
    P |= uint64_t(sh_d) << shift;
    prev = shift;
    if (sh_above + sh_hd == rem) break;  // the bin holds exactly the picks still wanted (always so at shift 0)
    rem -= sh_above;
  }
  // The picks: keys whose bits from `shift` up reach P's — exactly K of them.
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (c[j] != 0 && (c[j] >> shift) >= (P >> shift)) {
      const int slot = atomicAdd(&n_pick, 1);
      pick_c[slot] = c[j], pick_s[slot] = s[j];
    }
  __syncthreads();
  if (tid < K) {  // place pick tid by its rank among the K
    const uint64_t mine = pick_c[tid];
    int rank = 0;
    for (int i = 0; i < K; ++i) rank += pick_c[i] > mine;
    ids[t * K + rank] = (1 << kRadixIdxBits) - 1 - int(mine & ((1u << kRadixIdxBits) - 1u));
    sorted_s[rank] = pick_s[tid];
  }
  __syncthreads();
  if (tid == 0) {
    float sum = 0.0f;  // Σ of the chosen σ in pick order, as the other kernels
    for (int r = 0; r < K; ++r) sum += sorted_s[r];
    sh_sum = sum;
  }
  __syncthreads();
  if (tid < K) {
    float v = sorted_s[tid];
    if (renorm) v /= (sh_sum + 1e-20f);
    wts[t * K + tid] = v * scaling;
  }
}

// Level 2's slots a lane for K picks: 8 lists of Kp = the power of two ≥ K (at least 4), over 32 lanes.
int route_sort_slots2(int64_t K) { return K <= 4 ? 1 : K <= 8 ? 2 : K <= 16 ? 4 : K <= 32 ? 8 : 16; }

// The slots a lane for X experts: 1, 2, 4 or 8 (0: more than 2048, the block kernel's).
int route_2l_slots(int64_t X) { return X <= 256 ? 1 : X <= 512 ? 2 : X <= 1024 ? 4 : X <= 2048 ? 8 : 0; }

// ---- expert parallelism: global → local ids --------------------------------------------------------
__global__ void local_ids_kernel(const int32_t* __restrict__ ids, int n, int lo, int count,
                                 int32_t* __restrict__ local) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int e = ids[i] - lo;
  local[i] = unsigned(e) < unsigned(count) ? e : -1;
}

}  // namespace

#ifndef KESTREL_SIMT_EMU
namespace {
std::atomic<MoeRouteKernel>& route_kernel_choice() {
  static std::atomic<MoeRouteKernel> k{[] {
    const char* e = std::getenv("KESTREL_ROUTE");
    const std::string v = e ? e : "auto";
    KCUDA_REQUIRE(v == "auto" || v == "block" || v == "two-level" || v == "sort" || v == "radix",
                  "KESTREL_ROUTE=" + v + " (expected auto, block, two-level, sort or radix)");
    return v == "block"       ? MoeRouteKernel::block
           : v == "sort"      ? MoeRouteKernel::sort
           : v == "radix"     ? MoeRouteKernel::radix
           : v == "two-level" ? MoeRouteKernel::two_level
                              : MoeRouteKernel::automatic;
  }()};
  return k;
}
}  // namespace
MoeRouteKernel moe_route_kernel() { return route_kernel_choice().load(std::memory_order_relaxed); }
void set_moe_route_kernel(MoeRouteKernel k) { route_kernel_choice().store(k); }

void moe_local_ids(const int32_t* ids, int64_t n, int64_t lo, int64_t count, int32_t* local, cudaStream_t stream) {
  KCUDA_REQUIRE(ids && local, std::string("moe_local_ids: null pointer"));
  KCUDA_REQUIRE(n >= 0 && n < (int64_t(1) << 31) && lo >= 0 && count > 0 && lo + count <= kMaxExperts,
                "moe_local_ids: n = " + std::to_string(n) + ", experts [" + std::to_string(lo) + ", " +
                    std::to_string(lo + count) + ")");
  if (n == 0) return;
  constexpr int kThreads = 256;
  local_ids_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(ids, int(n), int(lo), int(count),
                                                                                     local);
  KCUDA_CHECK_LAUNCH();
}

void moe_route(const float* logits, const float* bias, int64_t T, int64_t X, int64_t K, bool renormalize,
               float scaling, int32_t* ids, float* weights, cudaStream_t stream) {
  KCUDA_REQUIRE(logits && bias && ids && weights, std::string("moe_route: null pointer"));
  KCUDA_REQUIRE(X > 0 && X <= kMaxExperts && K > 0 && K <= kMaxTopK && K <= X,
                "moe_route: X = " + std::to_string(X) + ", K = " + std::to_string(K));
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("moe_route: bad T"));
  if (T == 0) return;
  MoeRouteKernel kind = moe_route_kernel();
  // auto: the sorting networks from 4 picks per slot a lane (the measured crossovers, see the header).
  if (kind == MoeRouteKernel::automatic)
    kind = K >= 4 * int64_t(route_2l_slots(X)) ? MoeRouteKernel::sort : MoeRouteKernel::two_level;
  const int J = kind == MoeRouteKernel::block ? 0 : route_2l_slots(X);
  if (J > 0 && kind == MoeRouteKernel::radix) {
    auto go = [&](auto kernel) {
      launch_pdl(kernel, dim3(unsigned(T)), dim3(kRadixThreads), 0, stream, logits, bias, int(X), int(K), renormalize,
                 scaling, ids, weights);
    };
    if (J == 1) go(route_radix_kernel<1>);
    else if (J == 2) go(route_radix_kernel<2>);
    else if (J == 4) go(route_radix_kernel<4>);
    else go(route_radix_kernel<8>);
    return;
  }
  if (J > 0 && kind == MoeRouteKernel::sort) {
    const int J2 = route_sort_slots2(K);
    auto go = [&](auto kernel) {
      launch_pdl(kernel, dim3(unsigned(T)), dim3(32 * kRoute2Warps), 0, stream, logits, bias, int(X), int(K),
                 renormalize, scaling, ids, weights);
    };
    auto by_j2 = [&]<int JJ>() {
      if (J2 == 1) go(route_sort_kernel<JJ, 1>);
      else if (J2 == 2) go(route_sort_kernel<JJ, 2>);
      else if (J2 == 4) go(route_sort_kernel<JJ, 4>);
      else if (J2 == 8) go(route_sort_kernel<JJ, 8>);
      else go(route_sort_kernel<JJ, 16>);
    };
    if (J == 1) by_j2.template operator()<1>();
    else if (J == 2) by_j2.template operator()<2>();
    else if (J == 4) by_j2.template operator()<4>();
    else by_j2.template operator()<8>();
    return;
  }
  if (J > 0) {
    auto go = [&](auto kernel) {
      launch_pdl(kernel, dim3(unsigned(T)), dim3(32 * kRoute2Warps), 0, stream, logits, bias, int(X), int(K),
                 renormalize, scaling, ids, weights);
    };
    if (J == 1) go(route_2l_kernel<1>);
    else if (J == 2) go(route_2l_kernel<2>);
    else if (J == 4) go(route_2l_kernel<4>);
    else go(route_2l_kernel<8>);
    return;
  }
  const size_t smem = size_t(2 * X) * 4;
  if (smem > 48 * 1024)
    KCUDA_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  launch_pdl(route_kernel, dim3(unsigned(T)), dim3(kRouteThreads), smem, stream, logits, bias, int(X), int(K),
             renormalize, scaling, ids, weights);
}
#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda
