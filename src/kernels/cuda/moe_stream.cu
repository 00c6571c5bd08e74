// Decode GEMM of the routed experts (moe_experts.cu, few tokens per expert): a persistent, stream-K grouped
// MXFP4 GEMM whose every warp streams the same number of weight bytes. Contract: moe_internal.cuh.
//
// Work. Job j (an expert and up to 8 of its tokens) × row tile r (16 output rows) × chunk c (64 columns) is
// flattened job-major into F = J·RT·NC chunks; within a job that is exactly the order of the expert's packed
// bytes (moe_layout.h), so a warp's share is one contiguous stretch of memory per job. The grid is what fits
// on the device at once (all CTAs resident); warp w of NW takes chunks [w·L, w·L + L), L = ⌈F/NW⌉, so every
// warp streams L chunks — no tail wave, whatever the number of experts hit (T = 1: 16 experts, 768 + 896
// CTAs of the fixed-tile kernel over 132 SMs left 1.45 and 1.13 waves).
// Pipeline. Each lane cp.asyncs its own 16 weight bytes and 4 scale bytes per chunk into a private slot of a
// per-warp shared-memory ring kStages deep (kStages − 1 chunks in flight: 5 KB per w1|w3 warp), so the ring
// needs no barrier and streams across tile and job boundaries; activations come through L1.
// Split tiles. A tile cut by range ends gets FP32 partials from 2+ consecutive warps. Each writes its partial
// (slot 0: its first tile, 1: its last), fences, and bumps the counter of the tile's first contributor (a
// tile cut at its start is that warp's last tile: one counter per warp). The warp that brings the counter to
// the contributor count sums the partials in warp order — the same order whichever warp finishes last, so
// results are deterministic for a given grid — and runs the epilogue (SiTU-GLU for w1|w3, bf16 y for w2).
// Counters are zeroed by the kernel before (group_kernel or prep_kernel).
// PDL. With the job list from the kernel just before (grouped w1|w3) the kernel waits first; otherwise
// (w2, whose jobs come from two kernels back, or ungrouped w1|w3 reading ids) it fills its ring first, then
// waits, so its first weight bytes overlap the previous kernel's tail.
// Per 512 weight bytes a warp issues ≈ 90 instructions (SASS, w1|w3, per 1 KB chunk: 51 LOP3, 38 IMAD, 32 HMUL2,
// 14 SHF, 9 LEA, 8 PRMT, 8 HMMA, 4 LDS, 4 LDGSTS, 2 LDG): about the fixed-tile kernel's 87 — the E2M1 decode
// (≈ 14 integer ops + 4 HMUL2 per 32-bit word) dominates and the scale folding only pays for the cp.async ring.
// At copy speed an SM has ≈ 124 issue slots and ≈ 62 ALU slots per 512 bytes, so it was meant to stream at the
// ≈ 80 % of copy the fixed-tile kernel reaches at T = 8 and 64 at every T. Measured, it does not (H200, session 22,
// bench/RESULTS.md): 47–56 % at T = 1–8 against t8's 61–77 %, and not because of the ring — t8's register
// pipeline in this kernel streamed no faster; making the CTA the unit of the split (its 4 warps on 4 adjacent
// tiles at one chunk, as t8's CTAs) gained 10 µs of w1|w3's 87 at T = 1, still 13 µs behind t8; doing the work
// in rounds lost (each cut tile's partial, fence and counter stall its warp). So `automatic` never picks it.
#include <algorithm>
#include <atomic>

#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_mma.cuh"

namespace kestrel::cuda::moe_detail {
namespace {

using namespace moe_dev;

constexpr int kStages = 6;
constexpr int kThreads = 32 * kStreamWarps;

// Shared bytes per warp: [kStages][NM][32 lanes][16 B] weights, then [kStages][NM][32 lanes][4 B] scale words.
template <int NM>
constexpr int ring_bytes() {
  return kStages * NM * (ml::kTileChunkBytes + 128);
}

struct Job {
  int e, begin, count;
};
// Grouped: the work list. Ungrouped: slot j alone, count 0 if its id is out of range (nothing is computed).
__device__ __forceinline__ Job job_info(const StreamArgs& a, int j) {
  Job jb;
  if (a.g.jobs) {
    jb.e = __ldcg(a.g.jobs + 3 * j);
    jb.begin = __ldcg(a.g.jobs + 3 * j + 1);
    jb.count = __ldcg(a.g.jobs + 3 * j + 2);
  } else {
    jb.e = __ldcg(a.ids + j);
    jb.begin = j;
    jb.count = unsigned(jb.e) < unsigned(a.X) ? 1 : 0;
  }
  return jb;
}
__device__ __forceinline__ int slot_of(const StreamArgs& a, const Job& jb, int n) {
  return a.g.jobs ? __ldcg(a.g.order + jb.begin + n) : jb.begin;
}

template <bool kGlu>
__global__ void __launch_bounds__(kThreads) stream_gemm_kernel(const StreamArgs a) {
  constexpr int NM = kGlu ? 2 : 1;  // weight matrices per chunk (w1, w3)
  constexpr int kAcc = 4 * NM;
  extern __shared__ __align__(16) uint8_t ssm[];
  const GemmArgs& A = a.g;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t wring = smem_addr(ssm) + uint32_t(warp * ring_bytes<NM>() + lane * 16);
  const uint32_t sring = smem_addr(ssm) + uint32_t(warp * ring_bytes<NM>() + kStages * NM * ml::kTileChunkBytes + lane * 4);

  if (a.wait_first) {
    griddep_wait();
    griddep_launch();
  }
  const int J = A.jobs ? __ldcg(A.n_jobs) : a.n;
  const int NC = A.C / ml::kChunkCols;
  const int64_t RT = A.R / ml::kTileRows, per_job = RT * NC, F = int64_t(J) * per_job;
  const int64_t NW = int64_t(gridDim.x) * kStreamWarps, gw = int64_t(blockIdx.x) * kStreamWarps + warp;
  const int64_t L = (F + NW - 1) / NW;
  const int64_t f0 = min(gw * L, F), f1 = min(f0 + L, F);

  // ---- load side: chunk fl into ring slot `slot`, one commit group per call (empty past the range) ----
  int64_t fl = f0, next_jl = f0;  // next_jl: where the load side enters its next job
  const uint8_t* lp[NM];
  const uint8_t* ls[NM];
  bool lvalid = false;
  auto issue = [&](int slot) {
    if (fl < f1) {
      if (fl == next_jl) {
        const int j = int(fl / per_job);
        const Job jb = job_info(a, j);
        lvalid = jb.count > 0;
        const int64_t e = lvalid ? jb.e : 0, off = fl - int64_t(j) * per_job;  // chunk index within the expert
        lp[0] = A.p0 + e * A.p_stride + off * ml::kTileChunkBytes + lane * 16;
        ls[0] = A.s0 + e * A.s_stride + off * ml::kTileChunkScaleBytes + g * 4;
        if constexpr (kGlu) {
          lp[1] = A.p1 + e * A.p_stride + off * ml::kTileChunkBytes + lane * 16;
          ls[1] = A.s1 + e * A.s_stride + off * ml::kTileChunkScaleBytes + g * 4;
        }
        next_jl = (int64_t(j) + 1) * per_job;
      }
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        if (lvalid) {
          cp_async16(wring + uint32_t((slot * NM + m) * ml::kTileChunkBytes), lp[m]);
          cp_async4(sring + uint32_t((slot * NM + m) * 128), ls[m]);
        }
        lp[m] += ml::kTileChunkBytes;
        ls[m] += ml::kTileChunkScaleBytes;
      }
      ++fl;
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  if (!a.wait_first) {
    griddep_wait();
    griddep_launch();
  }

  // ---- compute side ----
  float acc[NM][4];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;
  int64_t next_jc = f0;
  int jc = 0;
  Job cj{0, 0, 0};
  const uint16_t* brow = A.x;
  int c = NC > 0 ? int(f0 % NC) : 0;  // chunk within the tile
  int slot = 0;
  for (int64_t f = f0; f < f1; ++f) {
    issue(slot == 0 ? kStages - 1 : slot - 1);  // chunk f + kStages − 1 into the slot chunk f − 1 used
    if (f == next_jc) {
      jc = int(f / per_job);
      cj = job_info(a, jc);
      next_jc = (int64_t(jc) + 1) * per_job;
      if (cj.count > 0) {  // token column n = g of the n-tile; columns past count repeat the last token
        const int s = slot_of(a, cj, min(g, cj.count - 1));
        brow = A.x + int64_t(s / A.x_div) * A.ldx + 8 * t;
      }
    }
    cp_async_wait<kStages - 1>();  // this lane's copies of chunk f have landed (it reads only its own)
    if (cj.count > 0) {
      const uint4 b0 = ld_act16(brow + c * ml::kChunkCols), b1 = ld_act16(brow + c * ml::kChunkCols + 32);
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        const uint4 w = lds128(wring + uint32_t((slot * NM + m) * ml::kTileChunkBytes));
        const uint32_t sw = lds32(sring + uint32_t((slot * NM + m) * 128));
        uint32_t a0[4], a1[4];
        // e8m0 block 0 of the chunk = k16 steps 0, 1; block 1 = steps 2, 3.
        decode_step(w.x, scale_mult<0>(sw), scale_mult<1>(sw), a0);
        decode_step(w.y, scale_mult<0>(sw), scale_mult<1>(sw), a1);
        mma_acc(acc[m], a0, b0.x, b0.y);
        mma_acc(acc[m], a1, b0.z, b0.w);
        decode_step(w.z, scale_mult<2>(sw), scale_mult<3>(sw), a0);
        decode_step(w.w, scale_mult<2>(sw), scale_mult<3>(sw), a1);
        mma_acc(acc[m], a0, b1.x, b1.y);
        mma_acc(acc[m], a1, b1.z, b1.w);
      }
    }
    slot = slot + 1 == kStages ? 0 : slot + 1;
    if (++c < NC && f + 1 < f1) continue;

    // ---- end of this warp's part of tile tt ----
    const int64_t tt = f / NC, ts = tt * NC, te = ts + NC;
    bool finish = true;
    if (ts < f0 || te > f1) {  // split: contributors ga < gb, in warp order = K order
      const int64_t ga = ts / L, gb = (te - 1) / L;
      const int which = tt == f0 / NC ? 0 : 1;
      float* mine = a.partial + (gw * 2 + which) * (kAcc * 32) + lane;
#pragma unroll
      for (int v = 0; v < kAcc; ++v) __stcg(mine + v * 32, acc[v / 4][v % 4]);
      __threadfence();
      __syncwarp();
      int old = 0;
      if (lane == 0) old = atomicAdd(a.counters + ga, 1);
      old = __shfl_sync(0xffffffffu, old, 0);
      finish = old == int(gb - ga);
      if (finish) {  // the last contributor: sum every partial in warp order
        __threadfence();
        float sum[kAcc];
        for (int64_t q = ga; q <= gb; ++q) {
          float p[kAcc];
          if (q == gw) {
#pragma unroll
            for (int v = 0; v < kAcc; ++v) p[v] = acc[v / 4][v % 4];
          } else {
            const int wq = tt == (q * L) / NC ? 0 : 1;
            const float* src = a.partial + (q * 2 + wq) * (kAcc * 32) + lane;
#pragma unroll
            for (int v = 0; v < kAcc; ++v) p[v] = __ldcg(src + v * 32);
          }
#pragma unroll
          for (int v = 0; v < kAcc; ++v) sum[v] = q == ga ? p[v] : sum[v] + p[v];
        }
#pragma unroll
        for (int v = 0; v < kAcc; ++v) acc[v / 4][v % 4] = sum[v];
      }
    }
    if (finish && cj.count > 0) {
      // C fragment (c0, c1) = row g, tokens 2t, 2t+1; (c2, c3) = row g + 8.
      const int row0 = int(tt - int64_t(jc) * RT) * ml::kTileRows + g;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int n = 2 * t + i;
        if (n >= cj.count) continue;
        uint16_t* o = A.out + int64_t(slot_of(a, cj, n)) * A.R;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int idx = 2 * rr + i;
          if constexpr (kGlu) {
            o[row0 + 8 * rr] = dev::f32_to_bf16(
                situ_glu(dev::round_bf16(acc[0][idx]), dev::round_bf16(acc[1][idx]), A.beta, A.lbeta));
          } else {
            o[row0 + 8 * rr] = dev::f32_to_bf16(acc[0][idx]);
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < NM; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;
    if (c == NC) c = 0;
  }
  cp_async_wait<0>();
}

template <bool kGlu>
constexpr size_t smem_bytes() {
  return size_t(kStreamWarps) * ring_bytes<kGlu ? 2 : 1>();
}

}  // namespace

int stream_grid(bool glu, int ctas_override) {
  if (ctas_override > 0) return std::min(ctas_override, kMaxStreamCtas);
  static std::atomic<int> cached[2][16];  // [glu][device]: CTAs that fit at once
  int dev = 0;
  KCUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 16 && cached[glu][dev].load() > 0) return cached[glu][dev].load();
  int sms = 0, per_sm = 0;
  KCUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (glu)
    KCUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_gemm_kernel<true>, kThreads,
                                                              smem_bytes<true>()));
  else
    KCUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_gemm_kernel<false>, kThreads,
                                                              smem_bytes<false>()));
  const int n = std::clamp(sms * per_sm, 1, kMaxStreamCtas);
  if (dev < 16) cached[glu][dev].store(n);
  return n;
}

void launch_stream(const StreamArgs& a, bool glu, int ctas, bool pdl, cudaStream_t stream) {
  KCUDA_REQUIRE(ctas >= 1 && ctas <= kMaxStreamCtas, "moe stream GEMM: grid " + std::to_string(ctas));
  if (glu)
    launch(stream_gemm_kernel<true>, dim3(unsigned(ctas)), dim3(kThreads), smem_bytes<true>(), stream, pdl, a);
  else
    launch(stream_gemm_kernel<false>, dim3(unsigned(ctas)), dim3(kThreads), smem_bytes<false>(), stream, pdl, a);
}

}  // namespace kestrel::cuda::moe_detail
