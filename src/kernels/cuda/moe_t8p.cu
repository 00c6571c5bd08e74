// Persistent t8 for one token (ungrouped decode, T = 1; moe_experts.cu runs it for w1|w3): the same tiles,
// decode and sums as moe_t8.cu's ungrouped t8 kernel (bit-identical for the same K split), but a grid of at
// most the resident CTAs, each taking the units u = blockIdx.x, + gridDim.x, … in turn with ONE software
// pipeline over all of them: the first weight loads of a CTA's next unit are in flight while the current
// unit's last chunks are consumed and its epilogue runs.
//
// Why: at T = 1 the fixed-grid t8 kernel streamed w1|w3 at ~61 % of copy (the same kernel at T = 8: 79 %). Its
// grid (768 tiles × K split 2 = 1,536 CTAs for 660 resident: 2.3 waves) pays per CTA a cold start (the ids, the
// first STAGES − 1 loads with nothing to overlap), a drain and the split's exchange, and leaves its last wave a
// third full. Here units are whole tiles (no K split: the exchange's fence stalls a warp whose next unit's loads
// are in flight — split 14, units of 4 chunks: 2.2× the fixed grid's time; split 7: graph 116–118 µs), k units
// per CTA with k the fewest that fit the resident CTAs and the grid ⌈tiles / k⌉ (T = 1 at the real shape: 384
// CTAs × 2 units of 56 chunks), so every CTA streams the same bytes and there is no tail wave.
// Measured (H200, session 26, bench_moe, T = 1, alternated in each call): w1|w3 per launch 72.2–73.3 → 65.8–66.6
// µs (61 → 67 % of copy); the experts in the graph 100.4–100.5 → 94.0–94.6 µs (65 → 70 %) with w2 beside it split
// in 2 (moe_experts.cu; unsplit w2: 100.4–101.2, the persistent w1|w3's gain lost to w2's later start);
// scoreboard 95.6 µs = 69.0 % of the run's copy (bench/gpu/perf.json).
// K halves (session 27): with whole tiles as units the real shape's 768 tiles fill only 384 CTAs (2.9 warps a
// scheduler, Nsight Compute: 0.54 instructions issued a cycle, a third of the samples waiting on weights), so
// by default a CTA's 4 warps take 2 tiles and split each tile's K in halves: warp w + 2 parks its partial in
// shared memory at the unit's end, one barrier, warp w adds it (halves in K order: bit-identical to the fixed
// grid's split 2) and runs the epilogue — twice the units, a 512-CTA grid of 3 units each, no global exchange.
// With 4 CTAs an SM asked of ptxas (launch_any): w1|w3 65–68 → 59.6–60.4 µs a launch, graph 94.6–95.3 → 91.5–92.0
// (71–72 % of copy); K halves alone at 5 CTAs: −0.3 to −0.6 in the graph. KESTREL_MOE_T8P_KH=1 for A/B.
// Not the memory pattern: a probe streaming the same bytes in the same 512-byte pieces, 4 in flight a
// stream, no compute, took 44–46 µs — the kernel's issue rate and the loads' distance are the gap.
// Lost (sessions 26–27): w2 persistent too (graph 108–115 µs: w2's CTAs cannot be resident beside w1|w3's, so its
// statically assigned units wait); 8-stage pipelines (KESTREL_MOE_T8P_DEEP=1, launch_any); capping the CTAs per SM
// at 3 or 4 with whole tiles (the same 384-CTA grid), or at 2 (256 CTAs × 3 units: graph 109–110 µs); 3 CTAs per
// SM with K halves (384 × 4 units: 95.4–95.7 against 92.0–92.8); the weight loads as volatile asm (no change).
//
// Layout of the work: the valid slots (ids in [0, X)) are compacted per CTA into shared memory (an id outside
// [0, X) — expert parallelism — costs nothing); unit u = (valid slot j, row group rg, K split ks) with
// u = (j·n_rg + rg)·S + ks: round i of the grid takes consecutive units, so the slots finish in order (w2 waits
// per slot: GemmArgs::ready). A warp owns 16 rows of its CTA's row group (64 rows; 32 with K halves, warps w
// and w + 2 on one tile), as in t8.
// Code layout matters: with the epilogue inlined in the unrolled loop (once per stage, where a unit may end) the
// hot loop spread over ~90 KB of code, instruction fetch stalled, and the same work as the fixed-grid kernel ran
// 28 % slower (w2 at T = 1, same grid: 43.4 against 33.8 µs); so a unit's last group of STAGES chunks is peeled
// (STAGES divides a unit's chunks; t8p_plan) and the epilogue runs once per unit outside the unrolled code.
// Split partials (forced splits only: tests, benchmarks): only token column 0 of the MMA's 8 is a real token, so a
// warp parks just its lanes t = 0's two FP32 values per matrix, f32 [tiles, S, 8 (g), NM, 2] — 1/8 of t8's — and
// the warp that brings the tile's counter to S sums them in split order, as t8 does.
// PDL: the ids come from before prep_kernel (GemmArgs::w_early), so the compaction and the first weight loads
// run before the wait. w1|w3 lets w2 launch right after its wait (readiness) or after its loop; w2 waits per
// unit on its slot's readiness counter, and its last CTA waits on the grid before it exits (launch.h's
// transitive rule), as moe_t8.cu does.
// Emulation: tests/emu (test_emu_moe.cpp) compiles this file for the CPU emulation of simt.h, where the inline PTX
// below takes the emulator's definition and the launchers run as they are (tests/emu/simt_runtime.h).
#include <algorithm>
#include <atomic>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_layout.h"
#include "kernels/cuda/moe_mma.cuh"

namespace kestrel::cuda::moe_detail {
namespace {

namespace ml = moe_layout;
using namespace moe_dev;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kCtaRows = kFixedCtaRows;

// A chunk's two activation vectors (blocks 0 and 1) in one asm statement, so both loads issue together at the
// top of the chunk (ptxas otherwise placed the second after the first block's MMAs: two exposed latencies).
#ifndef KESTREL_SIMT_EMU
__device__ __forceinline__ void ld_act16x2(const uint16_t* p, uint4 (&b)[2]) {
  asm volatile(
      "ld.global.v4.u32 {%0, %1, %2, %3}, [%8];\n\t"
      "ld.global.v4.u32 {%4, %5, %6, %7}, [%8+64];"
      : "=r"(b[0].x), "=r"(b[0].y), "=r"(b[0].z), "=r"(b[0].w), "=r"(b[1].x), "=r"(b[1].y), "=r"(b[1].z), "=r"(b[1].w)
      : "l"(p));
}
#endif  // KESTREL_SIMT_EMU (tests/emu/simt.h defines it)

template <bool kGlu, int STAGES, int kScales, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) t8p_kernel(const GemmArgs a) {
  constexpr int NM = kGlu ? 2 : 1;  // weight matrices per warp
  constexpr bool kRaw = kScales == kScaleRaw;
  constexpr bool kFold = kScales == kScaleFold || kScales == kScaleFoldH;
  static_assert(kGlu ? kScales != kScaleRaw : kScales != kScaleFoldH, "h·2^100 goes from w1|w3 to w2");
  static_assert(kScales != kScaleSpecial, "special codes: the fixed-grid kernel");
  __shared__ int s_slot[kT8pMaxSlots], s_e[kT8pMaxSlots];
  __shared__ int s_nv;
  __shared__ float2 s_half[2][kWarps / 2][8][NM];  // KH = 2: the second half's partials, by unit parity
  const bool ready = a.ready != nullptr;
  if (!a.w_early) griddep_wait();
  // Valid slots, compacted in slot order (every CTA alike; n_ids ≤ kT8pMaxSlots, checked on the host).
  if (threadIdx.x < 32) {
    int nv = 0;
    for (int j0 = 0; j0 < a.n_ids; j0 += 32) {
      const int j = j0 + int(threadIdx.x);
      const int e = j < a.n_ids ? a.ids[j] : -1;
      const bool ok = unsigned(e) < unsigned(a.X);
      const unsigned m = __ballot_sync(0xffffffffu, ok);
      if (ok) {
        const int at = nv + __popc(m & ((1u << threadIdx.x) - 1u));
        s_slot[at] = j, s_e[at] = e;
      }
      nv += __popc(m);
    }
    if (threadIdx.x == 0) s_nv = nv;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // KH = 2: warps w and w + 2 share a 16-row tile, each with half kq of the (split's) chunks.
  const int KH = a.t8p_kh, TW = kWarps / KH, tw = warp % TW, kq = warp / TW;  // tiles a CTA, this warp's
  const int n_rg = a.R / (ml::kTileRows * TW), S = a.ksplit, NCall = a.C / ml::kChunkCols, NC = NCall / (S * KH);
  const int U = s_nv * n_rg * S, G = int(gridDim.x);
  const int nu = int(blockIdx.x) < U ? (U - 1 - int(blockIdx.x)) / G + 1 : 0;  // this CTA's units
  if (nu == 0) {
    if (a.w_early || (ready && !kGlu)) griddep_wait();  // every PDL path waits before it exits (launch.h)
    if (kGlu && ready) griddep_launch();
    return;
  }
  struct Unit {
    int j, tile, ks;  // compacted slot, 16-row tile, K split
  };
  auto unit = [&](int u) {
    Unit r;
    r.ks = u % S;
    const int item = u / S;
    r.j = item / n_rg;
    r.tile = (item - r.j * n_rg) * TW + tw;
    return r;
  };

  // Weight pointers of the unit being consumed (cp), at its chunk 0; the CTA's next unit as (expert, first
  // chunk) only (registers), its pointers formed once per unit for the loads of the last STAGES − 1 chunks,
  // which are the next unit's first chunks.
  struct Ptrs {
    const uint8_t* w[NM];
    const uint8_t* s[NM];
  };
  auto point = [&](int e, int64_t tc, Ptrs& p) {
    p.w[0] = a.p0 + e * a.p_stride + tc * ml::kTileChunkBytes + lane * 16;
    p.s[0] = a.s0 + e * a.s_stride + tc * ml::kTileChunkScaleBytes + g * 4;
    if constexpr (kGlu) {
      p.w[1] = a.p1 + e * a.p_stride + tc * ml::kTileChunkBytes + lane * 16;
      p.s[1] = a.s1 + e * a.s_stride + tc * ml::kTileChunkScaleBytes + g * 4;
    }
  };
  int ne = 0, ntc = 0;  // the next unit's expert and first chunk
  auto aim = [&](int u) {
    const Unit r = unit(u);
    ne = s_e[r.j];
    ntc = r.tile * NCall + (r.ks * KH + kq) * NC;
  };
  Ptrs cp;
  aim(int(blockIdx.x));
  point(ne, ntc, cp);
  if (nu > 1) aim(int(blockIdx.x) + G);
  struct Stage {
    uint4 w[NM];      // packed A words of one chunk
    uint32_t s[NM];   // scale word (rows g, g+8 × blocks 0, 1)
  };
  Stage st[STAGES];
  auto load = [&](Stage& s, const Ptrs& p, int c) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      s.w[m] = ld_stream16(p.w[m] + int64_t(c) * ml::kTileChunkBytes);
      s.s[m] = ld_stream4(p.s[m] + int64_t(c) * ml::kTileChunkScaleBytes);
    }
  };

  // Consumer: unit cur; brow: its activations (token column n = g repeats the one token).
  int ucur = int(blockIdx.x);  // (its slot, tile and split recomputed where needed: registers)
  const uint16_t* brow = nullptr;
  auto aim_b = [&] {
    const Unit cur = unit(ucur);
    brow = a.x + int64_t(s_slot[cur.j] / a.x_div) * a.ldx + 8 * t + int64_t(cur.ks * KH + kq) * NC * ml::kChunkCols;
  };
  float acc[NM][4];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;

  auto compute = [&](const Stage& s, const uint4 (&B)[2]) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const uint32_t words[4] = {s.w[m].x, s.w[m].y, s.w[m].z, s.w[m].w};
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // e8m0 block b of the chunk = k16 steps 2b, 2b+1
        uint32_t a0[4], a1[4];
        if constexpr (kFold) {
          const uint32_t m_g = b ? scale_mult<2>(s.s[m]) : scale_mult<0>(s.s[m]);
          const uint32_t m_g8 = b ? scale_mult<3>(s.s[m]) : scale_mult<1>(s.s[m]);
          decode_step(words[2 * b], m_g, m_g8, a0);
          decode_step(words[2 * b + 1], m_g, m_g8, a1);
          mma_acc(acc[m], a0, B[b].x, B[b].y);
          mma_acc(acc[m], a1, B[b].z, B[b].w);
        } else {
          const float sc_g = __uint_as_float(ml::e8m0_f32_bits<false>(s.s[m], 2 * b));
          const float sc_g8 = __uint_as_float(ml::e8m0_f32_bits<false>(s.s[m], 2 * b + 1));
          if constexpr (kRaw) {
            decode_step_raw(words[2 * b], a0);
            decode_step_raw(words[2 * b + 1], a1);
          } else {
            decode_step_unscaled(words[2 * b], a0);
            decode_step_unscaled(words[2 * b + 1], a1);
          }
          float p[4];
          mma_first(p, a0, B[b].x, B[b].y);
          mma_acc(p, a1, B[b].z, B[b].w);
          acc[m][0] = fmaf(p[0], sc_g, acc[m][0]);  // C rows g (c0, c1) and g+8 (c2, c3)
          acc[m][1] = fmaf(p[1], sc_g, acc[m][1]);
          acc[m][2] = fmaf(p[2], sc_g8, acc[m][2]);
          acc[m][3] = fmaf(p[3], sc_g8, acc[m][3]);
        }
      }
    }
  };

  // w2: before a unit's first activations, its slot's w1|w3 tiles must all be stored (released by the counter).
  auto wait_ready = [&] {
    if constexpr (!kGlu) {
      if (ready) {
        if (lane == 0) {
          const int32_t* r = a.ready + s_slot[unit(ucur).j];
          while (ld_acquire_gpu(r) < a.ready_need) __nanosleep(64);
          __threadfence();
        }
        __syncwarp();
      }
    }
  };

  // The end of a unit: park / sum the split partials, then the epilogue of token column 0 (lanes t = 0 hold
  // rows g and g + 8 in acc[m][0], acc[m][2]), then the next unit's state.
  auto finish = [&](int i) {
    const Unit cur = unit(ucur);
    const int slot = s_slot[cur.j];
    if (KH > 1) {  // the second half's partial to its partner through shared memory (parity i: one barrier a unit)
      float2* r = s_half[i & 1][tw][g];
      if (kq == 1 && t == 0) {
#pragma unroll
        for (int m = 0; m < NM; ++m) r[m] = make_float2(acc[m][0], acc[m][2]);
      }
      __syncthreads();
      if (kq == 0 && t == 0) {  // halves summed in K order, as a split's partials are
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m][0] = acc[m][0] + r[m].x, acc[m][2] = acc[m][2] + r[m].y;
      }
    }
    bool last = kq == 0;
    if (S > 1 && last) {
      const int64_t tid = int64_t(slot) * (a.R / ml::kTileRows) + cur.tile;  // (slot, 16-row tile)
      float2* part = reinterpret_cast<float2*>(a.partial) + (tid * S * 8 + g) * NM;  // [S][8][NM] float2
      if (t == 0) {
#pragma unroll
        for (int m = 0; m < NM; ++m) __stcg(part + int64_t(cur.ks) * 8 * NM + m, make_float2(acc[m][0], acc[m][2]));
      }
      __threadfence();
      __syncwarp();
      int old = 0;
      if (lane == 0) old = atomicAdd(a.counters + tid, 1);
      old = __shfl_sync(0xffffffffu, old, 0);
      last = old == S - 1;
      if (last && t == 0) {
        __threadfence();
        float sum[NM][2];
        for (int sp = 0; sp < S; ++sp) {
#pragma unroll
          for (int m = 0; m < NM; ++m) {
            float2 v = make_float2(acc[m][0], acc[m][2]);
            if (sp != cur.ks) v = __ldcg(part + int64_t(sp) * 8 * NM + m);
            sum[m][0] = sp == 0 ? v.x : sum[m][0] + v.x;
            sum[m][1] = sp == 0 ? v.y : sum[m][1] + v.y;
          }
        }
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m][0] = sum[m][0], acc[m][2] = sum[m][1];
      }
    }
    if (last) {
      if (t == 0) {
        uint16_t* o = a.out + int64_t(slot) * a.R + cur.tile * ml::kTileRows + g;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          if constexpr (kGlu) {
            float h = situ_glu(dev::round_bf16(acc[0][2 * rr]), dev::round_bf16(acc[1][2 * rr]), a.beta, a.lbeta);
            if constexpr (kScales == kScaleFoldH) h = dev::round_bf16(h) * kRawScaleH;  // exact: w2's raw input
            o[8 * rr] = dev::f32_to_bf16(h);
          } else {
            float y = acc[0][2 * rr];
            if constexpr (kRaw) y *= kRawUnscale;  // the partials' 2^-26 (exact: a power of two)
            o[8 * rr] = dev::f32_to_bf16(y);
          }
        }
      }
      if (kGlu && ready) {  // release this 16-row tile of the slot to w2
        __threadfence();
        __syncwarp();
        if (lane == 0) atomicAdd(a.ready + slot, 1);
      }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;
  };

  // The pipeline: chunk c of every unit lives in st[c % STAGES] (STAGES divides NC); the load of the chunk
  // STAGES − 1 ahead is issued before a chunk is consumed — in a unit's last group of STAGES chunks, the next
  // unit's first ones. The last group is peeled so every pointer and stage index is known at compile time, and
  // finish() runs once per unit outside the unrolled groups (the header: code layout).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load(st[s], cp, s);
  if constexpr (kGlu) {
    if (a.w_early) griddep_wait();  // the activations come from the kernel before
    if (ready) griddep_launch();
  } else {
    if (a.w_early && !ready) griddep_wait();
  }
  for (int i = 0; i < nu; ++i) {
    const bool more = i + 1 < nu;
    ucur = int(blockIdx.x) + i * G;
    aim_b();
    wait_ready();
    for (int c0 = 0; c0 < NC - STAGES; c0 += STAGES) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) {
        uint4 B[2];
        ld_act16x2(brow + (c0 + s) * ml::kChunkCols, B);
        load(st[(s + STAGES - 1) % STAGES], cp, c0 + s + STAGES - 1);
        compute(st[s], B);
      }
    }
    Ptrs np;
    point(ne, ntc, np);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {  // the last group: chunk NC − STAGES + s
      uint4 B[2];
      ld_act16x2(brow + (NC - STAGES + s) * ml::kChunkCols, B);
      if (s == 0)
        load(st[STAGES - 1], cp, NC - 1);
      else if (more)
        load(st[s - 1], np, s - 1);
      compute(st[s], B);
    }
    finish(i);
    cp = np;
    if (i + 2 < nu) aim(int(blockIdx.x) + (i + 2) * G);
  }
  if (!(kGlu && ready)) griddep_launch();
  if (!kGlu && ready && blockIdx.x == gridDim.x - 1) griddep_wait();  // w1|w3 complete before this grid is
}

template <bool kGlu, int STAGES, int MINB>
void launch_scales(const GemmArgs& a, int scales, int grid, bool pdl, cudaStream_t stream) {
  auto go = [&](auto kernel) { moe_detail::launch(kernel, dim3(unsigned(grid)), dim3(kThreads), 0, stream, pdl, a); };
  if constexpr (kGlu) {
    if (scales == kScaleFoldH) return go(t8p_kernel<true, STAGES, kScaleFoldH, MINB>);
    if (scales == kScaleFold) return go(t8p_kernel<true, STAGES, kScaleFold, MINB>);
    return go(t8p_kernel<true, STAGES, kScaleF32, MINB>);
  } else {
    if (scales == kScaleRaw) return go(t8p_kernel<false, STAGES, kScaleRaw, MINB>);
    return go(t8p_kernel<false, STAGES, kScaleF32, MINB>);
  }
}

// Pipeline depth and CTAs asked per SM: 4 stages, w1|w3 at 4 CTAs (127 registers, no spill; the grid at T = 1
// is 4 CTAs an SM at most, K halves) and w2 at 8 (≤ 64 registers, 92 bytes of spill stores). Asking w1|w3 for 5
// CTAs (the fixed-grid kernel's 102-register cap) spilled 56 bytes and left ptxas no room to keep the loads
// ahead: Nsight Compute put a third of the warps' samples on a long-scoreboard wait at the first use of a
// stage's weights (H200, session 27: w1|w3 a launch 65–68 → 62 µs, graph −1 to −2 µs; 3 CTAs: no better).
// KESTREL_MOE_T8P_DEEP=1: 8 stages (w1|w3 at 4 CTAs, w2 at 6), for A/B: slower (first code layout: w1|w3 115
// against 98 µs a launch, w2 62 against 43; session 27 at 5 CTAs for the 4-stage one: graph 97.7–97.9 against
// 94.6–95.0 µs).
bool deep() {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_MOE_T8P_DEEP");
    return e && e[0] == '1';
  }();
  return on;
}

template <bool kGlu>
void launch_any(const GemmArgs& a, int scales, int grid, bool pdl, cudaStream_t stream) {
  if (deep())
    launch_scales<kGlu, 8, kGlu ? 4 : 6>(a, scales, grid, pdl, stream);
  else
    launch_scales<kGlu, 4, kGlu ? 4 : 8>(a, scales, grid, pdl, stream);
}

// Resident CTAs per SM of the kernel launch_any would run.
int per_sm(bool glu) {
  static std::atomic<int> cached[2][2][16];  // [glu][deep][device]
  int dev = 0;
  KCUDA_CHECK(cudaGetDevice(&dev));
  const bool d = deep();
  if (dev < 16 && cached[glu][d][dev].load() > 0) return cached[glu][d][dev].load();
  int n = 0;
  auto occ = [&](auto kernel) { KCUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0)); };
  if (glu)
    d ? occ(t8p_kernel<true, 8, kScaleFoldH, 4>) : occ(t8p_kernel<true, 4, kScaleFoldH, 4>);
  else
    d ? occ(t8p_kernel<false, 8, kScaleRaw, 6>) : occ(t8p_kernel<false, 4, kScaleRaw, 8>);
  n = std::max(n, 1);
  if (dev < 16) cached[glu][d][dev].store(n);
  return n;
}

}  // namespace

T8pPlan t8p_plan(bool glu, int64_t n, int64_t R, int64_t C, int forced_split, int ctas_per_sm, int kh,
                 int64_t partial_floats, int64_t counters_free) {
  T8pPlan p;
  if (n < 1 || n > kT8pMaxSlots || R % kCtaRows != 0 || C % ml::kChunkCols != 0) return p;
  kh = kh == 2 && forced_split <= 1 ? 2 : 1;  // halves only without a K split (bit-identical to the fixed grid's 2)
  int dev = 0, sms = 0;
  KCUDA_CHECK(cudaGetDevice(&dev));
  KCUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int per = ctas_per_sm > 0 ? std::min(ctas_per_sm, per_sm(glu)) : per_sm(glu);
  const int64_t res = int64_t(sms) * per, NCall = C / ml::kChunkCols, base = n * (R / kCtaRows) * kh;
  const int64_t tiles = n * (R / ml::kTileRows);
  const int64_t stages = deep() ? 8 : 4;  // launch_any's pipeline: a unit's chunks must be a multiple of it
  auto fits = [&](int64_t S) {
    return NCall % (S * kh) == 0 && (NCall / (S * kh)) % stages == 0 &&
           (S == 1 || (tiles <= counters_free && t8p_partial_floats(glu, n, R, int(S)) <= partial_floats));
  };
  // No K split unless forced (tests, benchmarks): the header says why. Units are whole tiles (or halves), k per
  // CTA, the grid ⌈base / k⌉ with k the fewest that fits the resident CTAs: every CTA streams the same chunks.
  // Without a forced split, only where the tiles alone give every resident CTA about one unit or more (the
  // reduced mini's 2 slots: 192 half-tile units for 528 CTAs keep the fixed grid and its K split).
  if (forced_split <= 0 && base * 2 < res) return p;
  int64_t best_S = forced_split > 0 ? forced_split : 1;
  if (!fits(best_S)) best_S = 0;
  if (best_S == 0) return p;
  const int64_t U = base * best_S, k = (U + res - 1) / res;
  p.split = int(best_S);
  p.kh = kh;
  p.grid = int((U + k - 1) / k);  // every CTA k units but the last few
  return p;
}

void launch_t8p(const GemmArgs& a_in, bool glu, bool fold_ok, const T8pPlan& plan, bool pdl, cudaStream_t stream) {
  GemmArgs a = a_in;
  a.t8p_kh = plan.kh;
  const int grid = plan.grid, S = a.ksplit * a.t8p_kh;
  KCUDA_REQUIRE(a.ids && a.n_ids >= 1 && a.n_ids <= kT8pMaxSlots && grid > 0,
                std::string("moe persistent t8: ungrouped, 1..64 slots"));
  KCUDA_REQUIRE(a.t8p_kh == 1 || (a.t8p_kh == 2 && a.ksplit == 1), std::string("moe persistent t8: K halves, no split"));
  const int stages = deep() ? 8 : 4;
  KCUDA_REQUIRE(a.ksplit >= 1 && a.C % ml::kChunkCols == 0 && (a.C / ml::kChunkCols) % S == 0 &&
                    (a.C / ml::kChunkCols / S) % stages == 0 && a.R % kCtaRows == 0,
                "moe persistent t8: split " + std::to_string(S) + " of " + std::to_string(a.C) +
                    " columns: a unit's 64-column chunks must be a multiple of " + std::to_string(stages));
  KCUDA_REQUIRE(a.ksplit == 1 || (a.partial && a.counters), std::string("moe persistent t8: split scratch"));
  const int scales = a.h_scaled ? (glu ? kScaleFoldH : kScaleRaw) : glu && !a.no_fold && fold_ok ? kScaleFold : kScaleF32;
  if (glu)
    launch_any<true>(a, scales, grid, pdl, stream);
  else
    launch_any<false>(a, scales, grid, pdl, stream);
}

}  // namespace kestrel::cuda::moe_detail
