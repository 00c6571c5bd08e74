// Fixed-tile grouped MXFP4 GEMM of the routed experts (moe_experts.cu's t8 and t32 paths): one CTA = 4 warps
// = 64 rows of one job (an expert and up to 8·NT of its tokens), a warp 16 rows. Contract: moe_internal.cuh
// (GemmArgs, launch_fixed, t8_ksplit). t8 (NT = 1) is the decode path, t32 (NT = 4) the prefill path for
// weights whose scales cannot be folded into the decode.
//
// Layout of the work: grid = (host bound on jobs) × R/64 × ksplit; CTAs past the device's job count exit at
// once. Scales (ScaleMode): for w1|w3 with every code in [1, 128] folded into the decode (the MMAs accumulate
// scaled weights, the CPU twin's order of operations), else per 32-column block two MMAs into a fresh FP32
// partial, then acc += 2^(e−127)·partial (exact for every e). Weights come from global memory into registers
// STAGES − 1 chunks ahead (ld.global.nc, no L1).
// These kernels are bound by instruction issue as much as by memory: Nsight Compute (H200, session 15, w2 at
// T = 8) has 0.55 warps issued per scheduler cycle; so a variant that needs more instructions a chunk loses
// even when it keeps more bytes in flight (a persistent grid streaming W through a cp.async ring in shared
// memory: 1.8× the time at the same issue rate), and one that needs fewer wins (the folded scales: no FP32
// partial and four FFMAs per block; w1|w3 5–8 % faster a launch).
// K split (t8_ksplit): with few jobs (batch 1: 16 experts of one token) the fixed grid leaves its last wave
// almost empty, and a wave with a few warps per SM keeps far too few bytes in flight; splitting K over 2–8
// CTAs per tile fills the waves; the splits' FP32 partials meet in the last warp of the tile to finish, summed
// in split order (deterministic). At one token where the tiles fill half the resident CTAs (the real shape), w1|w3
// runs moe_t8p.cu's persistent kernel instead (same tiles and sums as split 2, no tail wave; plan_t8 below).
// Measured (H200, session 12, bench_moe; per launch, eager): T = 1 at the real shape w1|w3 85.3 → 75.6 µs with
// K split in 2 (w2 51.4 → 47.2, also in 2); the deep w1|w3 pipeline: t8_deep_allowed below.
// w2 issues its first weight stages before its PDL wait (GemmArgs::w_early: its job list is two launches old), so
// they overlap w1|w3's last wave: H200 (session 16, bench_moe graph, alternated) T = 1 119.3 / 120.3 → 118.4 /
// 118.5 µs, the reduced-mini decode step at batch 1 601.5 / 607.4 → 598.0 / 603.3 µs; T = 8, 64 unchanged.
// Ungrouped (T = 1), w2 waits per slot (GemmArgs::ready) rather than for w1|w3's whole grid: its CTAs for the
// slots finished first fill the slots w1|w3's last wave leaves empty. H200 (session 23, bench_moe graph, three
// alternations): T = 1 106.2 / 106.7 / 108.7 → 102.6 / 102.5 / 102.4 µs (62 → 65 % of copy); the reduced mini's
// step unchanged (its MoE at 4 experts is small). Lost in the same call: letting the combine wait per slot for w2's
// tiles too and prep_kernel under PDL (103.2–103.5 µs, slower by 1), and w1|w3's split forced to 1 (the deep
// kernel: 107.6–108.3), 2 (102.4–102.9, the same) or deep at 3 (107.8–108.2). Also lost (never committed): the
// weights by bulk copies (TMA) into a per-warp ring of 2–3 groups of 4 chunks in shared memory, read into
// registers a group at a time: w1|w3 72 → 92 µs a launch, w2 36 → 43 (eager, T = 1), 102 → 122–130 µs in the
// graph — the ring's coarse arrival (a warp waits for its whole group) and fewer resident CTAs cost more than the
// load instructions it saves. Lost too (session 24, bench_moe graph at T = 1): w1|w3 with 6 stages (117 registers,
// 4 CTAs per SM) 106–108 µs against 103–104, and unsplit with 4 stages (1.16 waves, w2 filling the tail) 109.5.
// Emulation: tests/emu (test_emu_moe.cpp) compiles this file unchanged for the CPU emulation of simt.h: the inline PTX
// of moe_mma.cuh takes the emulator's definitions, and plan_t8 and the launchers run over its emulated CUDA runtime
// (tests/emu/simt_runtime.h), so the test launches what the GPU would.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
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

constexpr int kGemmWarps = 4;
constexpr int kGemmThreads = 32 * kGemmWarps;
constexpr int kCtaRows = kFixedCtaRows;
static_assert(kCtaRows == ml::kTileRows * kGemmWarps, "64 output rows per CTA");

// How a kernel applies the e8m0 scales: per 32-column block to an FP32 partial of two MMAs (acc += 2^(e−127) ·
// partial; kScaleSpecial also decodes the codes 0 and 255), or folded into the weights' decode (moe_mma.cuh:
// codes in [1, 128] only, MoeExpertWeights::fp32_scales false) so the MMAs accumulate scaled products directly.
// w1|w3 → w2 with h scaled by 2^100 (GemmArgs::h_scaled; t8 only, codes in [1, 128]): w1|w3 decodes folded
// and writes h·2^100 (kScaleFoldH; exact in BF16: |h| ≤ β·β_lin), and w2 (kScaleRaw) gives the decode's BF16
// v·2^-126 to the MMA as it is — no multiply; 0 and ±0.5 are BF16 subnormals, which the tensor cores take
// exactly — so each of its FP32 block partials is 2^-26 times kScaleF32's, bit for bit (powers of two commute
// with the rounding while nothing is subnormal: sums above 2^-100, so outputs that are not ≈ 0); the
// accumulators carry the factor to the epilogue, which takes it off. Saves w2 the 4 HMUL2 per packed word,
// ~1/4 of its instructions.
// Measured (H200, session 25, bench_moe, alternated): w2 per launch (eager) at T = 1 / 8 36.2 / 208–209 µs →
// 33.9–34.0 / 195–196 (61 → 65, 80 → 85 % of copy); experts in the graph T = 1 102.5 → 100.4–101.0 µs,
// T = 64 3,213 → 3,065. The same raw decode for w1|w3 (z scaled by 2^100 in the kernel, or once by
// prep_kernel) was no faster than the fold at T = 1 and 8 (73–75 vs 73.4–73.8, 437–438 vs 437–443 µs) and
// slower at T = 64 (2,178–2,281 vs 2,144–2,151): not kept. Nor for t32's w2 (NT = 4, prefill): 9 % slower a
// launch at T = 1,024 / 4,096 (4,431 / 13,284 vs 4,036–4,056 / 12,143–12,155 µs), so h_scaled stays t8's.
// (ScaleMode, kRawUnscale, kRawScaleH: moe_internal.cuh, shared with moe_t8p.cu.)

// NT n-tiles of 8 tokens per job (CT = 8·NT), STAGES chunks of 64 columns in flight per warp.
// With a.ksplit = S > 1, CTA b takes K split b % S (chunks [NC·s/S, NC·(s+1)/S)) of item b / S; each warp
// parks its FP32 partial, and the warp that brings the tile's counter to S sums the S partials in split order
// (deterministic whichever finishes last) and runs the epilogue.
// PDL: everything it reads (job list, activations) comes from earlier kernels, so it waits first; it lets
// dependents launch only after its main loop, so their CTAs do not take slots from its own later waves.
// kJitB: activations are read when a chunk is consumed (mostly L1 hits: the CTA's warps share the columns)
// instead of STAGES − 1 chunks ahead with the weights, so a stage holds only weights and scales (5 registers
// per matrix instead of 13) and the pipeline can be twice as deep in the same registers. (Reading them one
// chunk ahead in two register buffers measured slower: 153 registers, 3 CTAs per SM.)
// MINB > 0 asks ptxas for that many CTAs per SM (__launch_bounds__'s second argument). 0 leaves the code as it
// was; 1 is not the same: it took w2 from 92 to 98 registers and made it 25 % slower (H200, session 21).
// kIds: ungrouped (GemmArgs::ids): job j = slot j of expert ids[j]; a separate instantiation, so the grouped
// kernels' code is unchanged (the runtime branch cost w1|w3 3.5 µs a launch at T = 1: 94 registers, not 89).
template <bool kGlu, int NT, int STAGES, int kScales, bool kJitB, int MINB = 0, bool kIds = false>
__global__ void __launch_bounds__(kGemmThreads, MINB) expert_gemm_kernel(const GemmArgs a) {
  constexpr int NM = kGlu ? 2 : 1;  // weight matrices per warp
  constexpr int E = NM * NT * 4;    // accumulators per lane
  constexpr bool kRaw = kScales == kScaleRaw;
  constexpr bool kFold = kScales == kScaleFold || kScales == kScaleFoldH;
  static_assert(kGlu ? kScales != kScaleRaw : kScales != kScaleFoldH, "h·2^100 goes from w1|w3 to w2");
  // a.w_early (w2 after w1|w3): the job list is the grouping kernel's, complete before w1|w3 passed its own
  // wait and let this kernel launch (launch.h's rule), so only the activations need the wait: the first weight
  // stages are issued before it, overlapping w1|w3's last wave. Ungrouped (kIds), both GEMMs: the ids come from
  // before prep_kernel, an ordinary launch that began only when they were complete.
  // Readiness (GemmArgs::ready): w1|w3 lets w2 launch right after its own wait (prep_kernel's zeroes visible),
  // so w2 starts once every w1|w3 CTA is resident; w2 waits per slot below and keeps the transitive PDL rule by
  // one CTA's wait at the end (its grid cannot complete before w1|w3 has).
  const bool ready = kIds && a.ready != nullptr;
  if (!a.w_early) griddep_wait();
  const int n_rg = a.R / kCtaRows;
  const int nj = kIds ? a.n_ids : *a.n_jobs;
  const int S = a.ksplit;
  const int ks = int(blockIdx.x % unsigned(S));
  const int64_t item = blockIdx.x / unsigned(S);
  if (item >= int64_t(nj) * n_rg) {  // beyond the device's work list
    if (a.w_early) griddep_wait();     // every PDL path waits before it exits (launch.h)
    return;
  }
  // Consecutive CTAs take the same rows of consecutive jobs (an expert's chunks are adjacent): L2 reuse.
  // With readiness, job-major instead: a slot's CTAs adjacent, so the slots finish (and unblock w2) one by one.
  const int rg = ready ? int(item % n_rg) : int(item / nj);
  const int job = ready ? int(item / n_rg) : int(item - int64_t(rg) * nj);
  const int e = kIds ? a.ids[job] : a.jobs[3 * job];
  const int begin = kIds ? job : a.jobs[3 * job + 1];
  const int count = kIds ? 1 : a.jobs[3 * job + 2];
  if (kIds && unsigned(e) >= unsigned(a.X)) {  // an id outside [0, X): nothing to compute
    if (a.w_early) griddep_wait();
    return;
  }
  // Position p of the job's tokens in expert order → slot (ungrouped: the job is the slot).
  auto slot_at = [&](int p) { return kIds ? p : a.order[p]; };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tile = rg * kGemmWarps + warp;
  const int NCall = a.C / ml::kChunkCols;
  const int c_begin = int(int64_t(NCall) * ks / S);
  const int NC = int(int64_t(NCall) * (ks + 1) / S) - c_begin;  // this split's chunks

  const int64_t tile_chunks = int64_t(tile) * NCall + c_begin;
  const uint8_t* wp[NM];
  const uint8_t* wsc[NM];
  wp[0] = a.p0 + e * a.p_stride + tile_chunks * ml::kTileChunkBytes + lane * 16;
  wsc[0] = a.s0 + e * a.s_stride + tile_chunks * ml::kTileChunkScaleBytes + g * 4;
  if constexpr (kGlu) {
    wp[NM - 1] = a.p1 + e * a.p_stride + tile_chunks * ml::kTileChunkBytes + lane * 16;
    wsc[NM - 1] = a.s1 + e * a.s_stride + tile_chunks * ml::kTileChunkScaleBytes + g * 4;
  }
  // Token column n = 8q + g of n-tile q; columns past `count` repeat the last token (their results are dropped).
  const uint16_t* brow[NT];
#pragma unroll
  for (int q = 0; q < NT; ++q) {
    const int slot = slot_at(begin + min(q * 8 + g, count - 1));
    brow[q] = a.x + int64_t(slot / a.x_div) * a.ldx + 8 * t + c_begin * ml::kChunkCols;
  }

  struct Stage {
    uint4 w[NM];                // packed A words of one chunk
    uint32_t s[NM];             // scale word (rows g, g+8 × blocks 0, 1)
    uint4 b[kJitB ? 1 : NT][2]; // B: 8 bf16 of block 0 and block 1 (unused with kJitB)
  };
  Stage st[STAGES];
  float acc[NM][NT][4];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][q][i] = 0.0f;

  auto load_w = [&](Stage& S, int c) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      S.w[m] = ld_stream16(wp[m] + int64_t(c) * ml::kTileChunkBytes);
      S.s[m] = ld_stream4(wsc[m] + int64_t(c) * ml::kTileChunkScaleBytes);
    }
  };
  auto load_sb = [&](Stage& S, int c) {
    if constexpr (!kJitB) {
#pragma unroll
      for (int q = 0; q < NT; ++q) {
        S.b[q][0] = ld_act16(brow[q] + c * ml::kChunkCols);
        S.b[q][1] = ld_act16(brow[q] + c * ml::kChunkCols + 32);
      }
    }
  };
  auto load = [&](Stage& S, int c) {
    load_w(S, c);
    load_sb(S, c);
  };
  uint4 jb[NT][2];  // kJitB: the chunk's activations
  auto load_b = [&](uint4(&B)[NT][2], int c) {
#pragma unroll
    for (int q = 0; q < NT; ++q) {
      B[q][0] = ld_act16(brow[q] + c * ml::kChunkCols);
      B[q][1] = ld_act16(brow[q] + c * ml::kChunkCols + 32);
    }
  };
  auto compute = [&](const Stage& S, const uint4(&Bv)[NT][2]) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const uint32_t words[4] = {S.w[m].x, S.w[m].y, S.w[m].z, S.w[m].w};
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // e8m0 block b of the chunk = k16 steps 2b, 2b+1
        uint32_t a0[4], a1[4];
        if constexpr (kFold) {
          // Scaled weights straight from the decode (moe_mma.cuh): the MMAs accumulate into acc.
          const uint32_t m_g = b ? scale_mult<2>(S.s[m]) : scale_mult<0>(S.s[m]);
          const uint32_t m_g8 = b ? scale_mult<3>(S.s[m]) : scale_mult<1>(S.s[m]);
          decode_step(words[2 * b], m_g, m_g8, a0);
          decode_step(words[2 * b + 1], m_g, m_g8, a1);
#pragma unroll
          for (int q = 0; q < NT; ++q) {
            const uint4 B = Bv[q][b];
            mma_acc(acc[m][q], a0, B.x, B.y);
            mma_acc(acc[m][q], a1, B.z, B.w);
          }
        } else {
          constexpr bool kSpecial = kScales == kScaleSpecial;
          const float sc_g = __uint_as_float(ml::e8m0_f32_bits<kSpecial>(S.s[m], 2 * b));
          const float sc_g8 = __uint_as_float(ml::e8m0_f32_bits<kSpecial>(S.s[m], 2 * b + 1));
          if constexpr (kRaw) {
            decode_step_raw(words[2 * b], a0);
            decode_step_raw(words[2 * b + 1], a1);
          } else {
            decode_step_unscaled(words[2 * b], a0);
            decode_step_unscaled(words[2 * b + 1], a1);
          }
#pragma unroll
          for (int q = 0; q < NT; ++q) {
            const uint4 B = Bv[q][b];
            float p[4];
            mma_first(p, a0, B.x, B.y);
            mma_acc(p, a1, B.z, B.w);
            acc[m][q][0] = fmaf(p[0], sc_g, acc[m][q][0]);  // C rows g (c0, c1) and g+8 (c2, c3)
            acc[m][q][1] = fmaf(p[1], sc_g, acc[m][q][1]);
            acc[m][q][2] = fmaf(p[2], sc_g8, acc[m][q][2]);
            acc[m][q][3] = fmaf(p[3], sc_g8, acc[m][q][3]);
          }
        }
      }
    }
  };

  // Software pipeline: chunk c lives in st[c % STAGES]; the load of chunk c + STAGES − 1 is issued before
  // chunk c is consumed.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < NC) load_w(st[s], s);
  if (ready && !kGlu) {  // this slot's activations: every w1|w3 tile of it stored (released by its counter)
    if (threadIdx.x == 0) {
      while (ld_acquire_gpu(a.ready + job) < a.ready_need) __nanosleep(64);
      __threadfence();
    }
    __syncthreads();
  } else if (a.w_early) {
    griddep_wait();  // the activations come from the kernel before
    if (ready) griddep_launch();
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < NC) load_sb(st[s], s);
  for (int c0 = 0; c0 < NC; c0 += STAGES) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int c = c0 + s;
      if (c < NC) {
        if (c + STAGES - 1 < NC) load(st[(s + STAGES - 1) % STAGES], c + STAGES - 1);
        if constexpr (kJitB) {
          load_b(jb, c);
          compute(st[s], jb);
        } else {
          compute(st[s], st[s].b);
        }
      }
    }
  }
  griddep_launch();
  if (ready && !kGlu && blockIdx.x == gridDim.x - 1) griddep_wait();  // w1|w3 complete before this grid is

  if (S > 1) {  // split K: park this split's partial; the last of the tile's S warps sums them in split order
    const int64_t tid = int64_t(job) * (a.R / ml::kTileRows) + tile;  // (job, 16-row tile)
    float4* mine = reinterpret_cast<float4*>(a.partial + ((tid * S + ks) * 32 + lane) * E);
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int q = 0; q < NT; ++q)
        __stcg(mine + m * NT + q, make_float4(acc[m][q][0], acc[m][q][1], acc[m][q][2], acc[m][q][3]));
    __threadfence();
    __syncwarp();
    int old = 0;
    if (lane == 0) old = atomicAdd(a.counters + tid, 1);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old != S - 1) return;
    __threadfence();
    float sum[NM][NT][4];
    for (int sp = 0; sp < S; ++sp) {
      const float4* src = reinterpret_cast<const float4*>(a.partial + ((tid * S + sp) * 32 + lane) * E);
#pragma unroll
      for (int m = 0; m < NM; ++m)
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          float v[4];
          if (sp == ks) {
            v[0] = acc[m][q][0], v[1] = acc[m][q][1], v[2] = acc[m][q][2], v[3] = acc[m][q][3];
          } else {
            const float4 f = __ldcg(src + m * NT + q);
            v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) sum[m][q][i] = sp == 0 ? v[i] : sum[m][q][i] + v[i];
        }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int q = 0; q < NT; ++q)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][q][i] = sum[m][q][i];
  }

  if constexpr (kRaw) {  // the partials' 2^-26 (exact: a power of two, no subnormal in reach)
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int q = 0; q < NT; ++q)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][q][i] *= kRawUnscale;
  }
  // Epilogue: C fragment (c0, c1) = row g, tokens 2t, 2t+1; (c2, c3) = row g+8.
  const int row0 = tile * ml::kTileRows + g;
#pragma unroll
  for (int q = 0; q < NT; ++q) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = q * 8 + 2 * t + i;
      if (n >= count) continue;
      uint16_t* o = a.out + int64_t(slot_at(begin + n)) * a.R;
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int idx = 2 * rr + i;
        if constexpr (kGlu) {
          float h = situ_glu(dev::round_bf16(acc[0][q][idx]), dev::round_bf16(acc[1][q][idx]), a.beta, a.lbeta);
          if constexpr (kScales == kScaleFoldH) h = dev::round_bf16(h) * kRawScaleH;  // exact: w2's raw input
          o[row0 + 8 * rr] = dev::f32_to_bf16(h);
        } else {
          o[row0 + 8 * rr] = dev::f32_to_bf16(acc[0][q][idx]);
        }
      }
    }
  }
  if (ready && kGlu) {  // release this 16-row tile of the slot to w2
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(a.ready + job, 1);
  }
}

template <bool kGlu, int NT, int STAGES, bool kJitB, int MINB = 0, bool kIds = false>
void launch_gemm_ids(const GemmArgs& a, int scales, unsigned grid, bool pdl, cudaStream_t stream) {
  auto go = [&](auto kernel) { moe_detail::launch(kernel, dim3(grid), dim3(kGemmThreads), 0, stream, pdl, a); };
  if constexpr (NT == 1) {
    if constexpr (kGlu) {
      if (scales == kScaleFoldH) return go(expert_gemm_kernel<kGlu, NT, STAGES, kScaleFoldH, kJitB, MINB, kIds>);
    } else {
      if (scales == kScaleRaw) return go(expert_gemm_kernel<kGlu, NT, STAGES, kScaleRaw, kJitB, MINB, kIds>);
    }
  }
  if (scales == kScaleSpecial)
    go(expert_gemm_kernel<kGlu, NT, STAGES, kScaleSpecial, kJitB, MINB, kIds>);
  else if (scales == kScaleFold)
    go(expert_gemm_kernel<kGlu, NT, STAGES, kScaleFold, kJitB, MINB, kIds>);
  else
    go(expert_gemm_kernel<kGlu, NT, STAGES, kScaleF32, kJitB, MINB, kIds>);
}
// t8 (NT = 1) has an ungrouped instantiation (a.ids); t32 is always grouped.
template <bool kGlu, int NT, int STAGES, bool kJitB, int MINB = 0>
void launch_gemm_nt(const GemmArgs& a, int scales, unsigned grid, bool pdl, cudaStream_t stream) {
  if constexpr (NT == 1) {
    if (a.ids) return launch_gemm_ids<kGlu, NT, STAGES, kJitB, MINB, true>(a, scales, grid, pdl, stream);
  }
  launch_gemm_ids<kGlu, NT, STAGES, kJitB, MINB, false>(a, scales, grid, pdl, stream);
}

// The t8 kernel's pipeline for w1|w3: deep (activations just in time, 8 stages) unless KESTREL_MOE_T8_DEEP=0
// (the 4-stage kernel, below). Measured on the H200 (bench_moe,
// session 12, per launch): w1|w3 at T = 8 / 64 451 / 2,193 µs deep against 472 / 2,382 (74 / 76 % of copy
// against 70 %); the same for w2 (12 stages) fell from 61–63 % to 47 %, so w2 stays at 4 stages.
// t8's w1|w3 runs 8 stages deep with the activations read at use (kJitB) when each warp streams at least 32
// chunks (4 × the stages; from T ≈ 8 at the real shape), else 4 stages (t8_jit below); w2 always 4 stages.
// KESTREL_MOE_T8_DEEP=0: never deep (A/B). Measured (H200, session 12, bench_moe per launch, eager):
// w1|w3 at T = 8 / 64 449 / 2,272 µs deep against 473 / 2,423; at T = 1 (28 chunks a warp) equal; w2 at 12
// stages, activations at use or one chunk ahead, fell from 61–63 % of copy to 47–53 %.
bool t8_deep_allowed() {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_MOE_T8_DEEP");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}
constexpr int kT8DeepStages = 8, kT8DeepMinChunks = 4 * kT8DeepStages;

// t8's 4-stage pipeline (w2 always; w1|w3 below the deep path's 32 chunks a warp) over a grid of at least one
// wave of the staged kernel (before the K split: t8_jit) reads the activations at use (kJitB), w2 asked for ≤ 64
// registers (59: 8 CTAs per SM instead of 5), unless KESTREL_MOE_T8_JIT=0 (the activations staged with the
// weights, as before: w2 92 registers, w1|w3 119). Smaller grids keep the staged kernel: the reduced mini's
// decode step (2 of 4 experts hit: 96–112 CTAs before the split) was 6 µs slower with both GEMMs at use (H200,
// session 21, five alternations, pipelined 578.7–579.3 against 570.6–573.7 µs). Measured (H200, session 21,
// bench_moe, real shape, alternated in one call): experts at T = 1 / 8 / 64, graph, 118.6 / 695 / 3,353 µs staged
// against 108.5 / 635 / 3,110 (55 → 61, 72 → 80, 75 → 81 % of copy); per launch (eager) w2 46.8 / 270 / 1,304 →
// 35.2 / 209 / 1,032 µs, w1|w3 at T = 1 70.0 → 67.7. Warps to switch between pay, not bytes in flight: w2 with 6
// stages at 6 CTAs per SM took 45 / 230 / 1,119 µs; and w1|w3 with one matrix a warp (8 CTAs per SM, 32 rows a
// CTA, the GLU halves meeting in shared memory) was no faster at T = 1 (68.0) and slower at T = 8 / 64 (450 /
// 2,259 against 420 / 2,079): its 32 single-chain warps a SM against 20 warps of two chains each.
constexpr int kT8W2MinCtas = 8;
bool t8_jit_allowed() {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_MOE_T8_JIT");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}
// CTAs of `kernel` (kGemmThreads a CTA, no dynamic shared memory) resident at once on the current device, cached
// per device in `cache`.
template <class Kernel>
int resident_ctas(Kernel kernel, std::atomic<int> (&cache)[16]) {
  int dev = 0;
  KCUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 16 && cache[dev].load() > 0) return cache[dev].load();
  int sms = 0, per_sm = 0;
  KCUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  KCUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemmThreads, 0));
  const int n = std::max(1, sms * per_sm);
  if (dev < 16) cache[dev].store(n);
  return n;
}

// CTAs of the t8 kernel resident at once on this device (jit: the activations read at use): for t8_ksplit.
// The 4-stage kernel's residency (sm_90a: w1|w3 89–96 registers with the activations at use, 5 CTAs per SM,
// 119–127 staged, 4; w2 59, 8, or 91–93 staged, 5). The deep w1|w3 kernel (126) has 4.
int t8_resident(bool glu, bool special, bool jit) {
  static std::atomic<int> cached[2][2][2][16];  // [glu][special][jit][device]
  auto& c = cached[glu][special][jit];
  if (!jit) {
    if (glu)
      return special ? resident_ctas(expert_gemm_kernel<true, 1, 4, kScaleSpecial, false>, c)
                     : resident_ctas(expert_gemm_kernel<true, 1, 4, kScaleF32, false>, c);
    return special ? resident_ctas(expert_gemm_kernel<false, 1, 4, kScaleSpecial, false>, c)
                   : resident_ctas(expert_gemm_kernel<false, 1, 4, kScaleF32, false>, c);
  }
  if (glu)
    return special ? resident_ctas(expert_gemm_kernel<true, 1, 4, kScaleSpecial, true>, c)
                   : resident_ctas(expert_gemm_kernel<true, 1, 4, kScaleF32, true>, c);
  return special ? resident_ctas(expert_gemm_kernel<false, 1, 4, kScaleSpecial, true, kT8W2MinCtas>, c)
                 : resident_ctas(expert_gemm_kernel<false, 1, 4, kScaleF32, true, kT8W2MinCtas>, c);
}

// Whether t8's 4-stage launch of `base` CTAs (jobs × 64-row groups, before the K split) reads the activations at use.
bool t8_jit(bool glu, bool special, int64_t base) {
  return t8_jit_allowed() && base >= t8_resident(glu, special, false);
}

}  // namespace

// K splits of the t8 kernel for `base` CTAs (job bound × row groups) over C columns. Few jobs leave the last
// wave mostly empty (T = 1 at the real shape: 768 CTAs of w1|w3 over 528 slots = 1.45 waves, the second
// running at a third of the bandwidth, for it holds too few warps to keep HBM busy) or, with one or two
// experts, the only wave; so K is split until the waves are ≥ 85 % full (or fill best), keeping ≥ 8 chunks
// (512 columns) per split and the scratch in bounds.
// `forced` ≥ 1 (MoeExpertsOptions::t8_ksplit: tests, benchmarks) takes min(forced, chunks, 8) where the scratch
// holds it.
int t8_ksplit(int forced, bool glu, bool special, int64_t base, int64_t C, int64_t counters_free,
                  int64_t partial_floats, int64_t tiles) {
  const int64_t NC = C / ml::kChunkCols;
  auto scratch_ok = [&](int S) { return tiles <= counters_free && tiles * S * 32 * (glu ? 8 : 4) <= partial_floats; };
  if (forced >= 1) {
    const int S = int(std::min<int64_t>({forced, NC, 8}));
    return scratch_ok(S) ? S : 1;
  }
  const int64_t res = t8_resident(glu, special, t8_jit(glu, special, base));
  auto fits = [&](int S) { return NC / S >= 8 && scratch_ok(S); };
  auto fill = [&](int S) {
    const double w = double(base * S) / double(res);
    return w / std::ceil(w);
  };
  if (fill(1) >= 0.85 || base >= 4 * res) return 1;
  int best = 1;
  for (int S = 2; S <= 8 && fits(S); ++S) {
    if (fill(S) > fill(best) + 0.02) best = S;
    if (fill(best) >= 0.85) break;
  }
  return best;
}

namespace {
// The GEMMs that run persistent at one token (moe_t8p.cu), bit mask 1 w1|w3, 2 w2: w1|w3 unless KESTREL_MOE_T8P
// says otherwise (0: neither, for A/B); KESTREL_MOE_T8P_CTAS caps its CTAs per SM.
int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  return s ? std::atoi(s) : fallback;
}
int t8p_env() {
  static const int v = env_int("KESTREL_MOE_T8P", 1) & 3;
  return v;
}
int t8p_ctas_env() {
  static const int v = env_int("KESTREL_MOE_T8P_CTAS", 0);
  return v;
}
int t8p_kh_env() {
  static const int v = env_int("KESTREL_MOE_T8P_KH", 2) == 1 ? 1 : 2;
  return v;
}
}  // namespace

T8Plan plan_t8(bool grouped, bool special, int64_t n, int64_t X, int64_t Lt, int64_t I, int forced_split, int persist,
               int t8p_split, int t8p_ctas, int t8p_kh, int64_t pf, int64_t cap) {
  T8Plan t;
  const int64_t bound = grouped ? ml::job_bound(n, X, 8) : n;
  persist = grouped || special ? 0 : persist >= 0 ? persist : t8p_env();
  if (t8p_ctas <= 0) t8p_ctas = t8p_ctas_env();
  if (t8p_kh <= 0) t8p_kh = t8p_kh_env();
  if (persist & 1) t.pp13 = t8p_plan(true, n, I, Lt, t8p_split, t8p_ctas, t8p_kh, pf, cap);
  if (t.pp13.grid > 0) {
    t.ks13 = t.pp13.split;
    t.p13 = t8p_partial_floats(true, n, I, t.ks13);
  } else {
    t.ks13 = t8_ksplit(forced_split, true, special, bound * (I / kCtaRows), Lt, cap, pf, bound * (I / ml::kTileRows));
    t.p13 = t.ks13 > 1 ? bound * (I / ml::kTileRows) * t.ks13 * 32 * 8 : 0;
  }
  t.c13 = t.ks13 > 1 ? bound * (I / ml::kTileRows) : 0;
  if (grouped) t.p13 = 0;  // w2 starts after w1|w3 has finished: the partials are shared
  if (persist & 2) t.pp2 = t8p_plan(false, n, Lt, I, t8p_split, 0, t8p_kh, pf - t.p13, cap - t.c13);
  // Beside a persistent w1|w3, the fixed-grid w2 splits K in 2 (unless forced). H200 (bench_moe graph, T = 1, two
  // rounds): session 26 (whole tiles, room left beside them) 100.4–101.2 µs unsplit against 94.0–94.6 (splits 3 / 4:
  // 96.6 / 98.2); session 27 (K halves at 4 CTAs an SM fill the registers, so w2 mostly runs after w1|w3): split 2
  // 91.9 / 91.9 against unsplit 92.7 / 93.0, split 3 92.7 / 92.9, persistent w2 95.1 / 95.8.
  if (t.pp2.grid > 0)
    t.ks2 = t.pp2.split;
  else
    t.ks2 = t8_ksplit(forced_split > 0 ? forced_split : t.pp13.grid > 0 ? 2 : 0, false, special,
                      bound * (Lt / kCtaRows), I, cap - t.c13, pf - t.p13, bound * (Lt / ml::kTileRows));
  t.n_zero = int(t.c13 + (t.ks2 > 1 ? bound * (Lt / ml::kTileRows) : 0));
  return t;
}

namespace {
// grid = (bound on jobs) × (row groups of 64) × a.ksplit; CTAs past the device's job count return at once.
template <bool kGlu>
void launch_gemm(const GemmArgs& a, int ct, bool special, bool fold_ok, int64_t n, int64_t X, bool pdl,
                 cudaStream_t stream) {
  const int64_t base = (a.ids ? n : ml::job_bound(n, X, ct)) * (a.R / kCtaRows), grid = base * a.ksplit;
  KCUDA_REQUIRE(!a.ids || (ct == 8 && a.n_ids == n), std::string("moe expert GEMM: ungrouped needs t8 over n slots"));
  KCUDA_REQUIRE(grid > 0 && grid < (int64_t(1) << 31), "moe expert GEMM: grid " + std::to_string(grid));
  KCUDA_REQUIRE(a.ksplit == 1 || (ct == 8 && a.partial && a.counters), std::string("moe expert GEMM: split scratch"));
  // Folded only for w1|w3: there it measured 5–8 % faster a launch, w2 1–3 % slower (H200, session 15: w1|w3
  // T = 1 / 8 / 64 74.0 → 70.1, 446 → 419, 2,218 → 2,053 µs; w2 47.2 → 48.8, 271 → 281, 1,309 → 1,349).
  const int scales = special                             ? kScaleSpecial
                     : a.h_scaled                        ? (kGlu ? kScaleFoldH : kScaleRaw)
                     : kGlu && fold_ok && !a.no_fold     ? kScaleFold
                                                         : kScaleF32;
  KCUDA_REQUIRE(!a.h_scaled || (ct == 8 && fold_ok && !special),
                std::string("moe expert GEMM: h·2^100 needs t8 and codes in [1, 128]"));
  if constexpr (kGlu) {
    if (ct == 8 && t8_deep_allowed() && a.C / ml::kChunkCols / a.ksplit >= kT8DeepMinChunks)
      return launch_gemm_nt<true, 1, kT8DeepStages, true>(a, scales, unsigned(grid), pdl, stream);
  }
  if (ct == 8 && t8_jit(kGlu, special, base)) {
    if constexpr (kGlu)
      launch_gemm_nt<true, 1, 4, true>(a, scales, unsigned(grid), pdl, stream);
    else
      launch_gemm_nt<false, 1, 4, true, kT8W2MinCtas>(a, scales, unsigned(grid), pdl, stream);
  } else if (ct == 8) {
    launch_gemm_nt<kGlu, 1, 4, false>(a, scales, unsigned(grid), pdl, stream);
  } else
    launch_gemm_nt<kGlu, 4, 2, false>(a, scales, unsigned(grid), pdl, stream);
}

}  // namespace

void launch_fixed(const GemmArgs& a, bool glu, int ct, bool special, bool fold_ok, int64_t n, int64_t X, bool pdl,
                  cudaStream_t stream) {
  if (glu)
    launch_gemm<true>(a, ct, special, fold_ok, n, X, pdl, stream);
  else
    launch_gemm<false>(a, ct, special, fold_ok, n, X, pdl, stream);
}

}  // namespace kestrel::cuda::moe_detail
