// Skinny GEMM (see gemm_skinny.h): y = x·Wᵀ for T ≤ 64, W streamed once at close to the copy rate.
//
// Work: a CTA (4 warps, 128 threads) owns one row tile of W (16 rows) and one K range (its split); the
// 4 warps take the range's 128-byte k-steps in turn (warp w: steps w, w+4, ...), so at any moment the
// CTA reads 4 consecutive 128-byte pieces of each of its 16 rows. Per step a lane loads 2×16 bytes of
// rows g and g+8 (g = lane/4) at bytes 16·(lane%4) and 64 + 16·(lane%4) of the step: 4 lanes cover a row's
// 128 bytes, one full cache line, each load instruction whole 32-byte sectors; x's rows (tokens) the same
// way. No ldmatrix, no shared layout of W's tile: the lane's bytes are fed to mma.sync as they are (at
// T ≤ 16 after a round trip through the lane's own slots of a shared-memory ring, see Latency), with the K
// order permuted consistently for W and x (a dot product does not care about the order of its terms): of
// the lane's 8 words, mma j uses words 2j and 2j+1 as the fragment's k pair (2q, 2q+1) / (2q+8, 2q+9) for
// bf16 m16n8k16, or (4q..4q+3) / (4q+16..) for e4m3 m16n8k32 — both the PTX fragment layout of A (rows g,
// g+8) and of B (token column g). Tokens are the MMA's N side (8 per n-tile,
// NT tiles: T ≤ 8, 16, 32, 64); rows ≥ N and tokens ≥ T are zero-filled, never loaded.
//
// Latency: at T ≤ 16 (staged, the decode path) each warp keeps 6 steps of W in flight in its own ring in
// shared memory (cp.async.cg, 16 bytes per lane and piece, zero-filled out of range; 6 × 2 KB a warp, 48 KB a
// CTA, ~60–100 registers): the lane reads back only the pieces it copied, so cp.async.wait_group is the only
// sync. With W in registers instead (U = 4 steps, 8 KB a warp, 110 registers) the grids of 2–3 CTAs per SM
// kept too few bytes in flight (49 % of DRAM peak under Nsight Compute for KDA q|k|v at T = 1), and 8 register
// steps cost CTAs per SM (180 registers) — both measured slower (session 14, batch-1 step: 633–635 µs with 4
// register steps, 782 with 8, 602–606 staged). KESTREL_SKINNY_STAGED=0 keeps the register path at every
// T. At T > 16 W loads run U steps ahead in registers (U = 2). x: D steps ahead on the staged path at T ≤ 8
// (2 at T ≤ 16, one on the register path) or just in time at T > 16: in the steady state a step's share of
// HBM time hides x's L2 latency, but right after the PDL wait the ring's steps are already there and x alone
// sets the pace (session 29). W is read with ld.global.nc.L1::no_allocate
// (read once, leaves L1 to x) or cp.async.cg (L2 only); x with
// ld.global.cg (L2; written by the previous kernel, possibly while this one was already running its
// prologue under PDL). Before griddepcontrol.wait a CTA issues its first steps of W (weights are never
// written), so under PDL the weight stream starts during the previous kernel's tail. Both paths feed the same
// MMAs in the same order: a token's outputs are bit-identical whichever path its batch takes.
//
// Reduction (deterministic): warps 1..3 park their accumulators in shared memory, warp 0 adds them in
// warp order; with a split over CTAs, warp 0 writes its partial (f32, fragment order) and bumps the row
// tile's counter; the CTA that sees the last count sums the S partials in split order (ld.cg) and runs
// the epilogue, then zeroes the counter. At T > 16 (32 or 64 accumulators a lane) all 4 warps of that CTA
// share the sum, each a quarter of the accumulators (same additions, same bits): warp 0 alone had waited
// one L2 round trip per split (S = 14 for a 7168-wide K: ~10 µs; the ptpc-fp8 path's b_proj rows at
// T > 16 go through here, 64 tokens a launch). Split S: the fewest splits that give ≥ 2 CTAs per SM (8 warps,
// each with U·2 KB of W in flight: ~64 KB per SM against the ~50 KB that HBM latency × bandwidth asks),
// and ≥ 8 k-steps per split; all CTAs then fit one wave (4 per SM by registers at T ≤ 16).
// KESTREL_SKINNY_CTAS_PER_SM changes the 2. (More splits to even out the SMs' shares where whole-K tiles do
// not divide over 132 SMs — 327 tiles: busiest SM 3 CTAs against 2.48 — measured slower per kernel: session
// 14, bench/RESULTS.md.) Prefetching weights into L2 lost on the batch-1 step both ways it was tried: this
// launch's rows before its PDL wait (session 17) and the next projection's from this launch's tail (session 21:
// 18–85 µs a step slower for 8–32 MB).
//
// Router tail (ROUTE: GemmRoute on the segments; the staged BF16 kernels at T ≤ 16 only): after the epilogue, the
// CTAs that stored the router segment's tiles count themselves on the workspace's last counter and the last one
// routes the tokens, one warp a token (moe_route.cuh: moe_route's bits) — the decode step's router launch and one
// kernel boundary a MoE layer saved. Opt-in until timed (DecodeOptions::route_in_gemm); its instantiations are
// separate, so the others' PTX did not change with it (96 / 80 registers at NT = 1 / 2, no spills).
//
// Resources (ptxas, sm_90a, no spills, no stack): registers bf16 NT=1 110, NT=2 146, NT=4 95, NT=8 134;
// fp8 124, 166, 136, 178 (so 4, 3, 5, 3 / 4, 3, 3, 2 CTAs per SM); static shared memory 1.5–12 KB; staged
// NT=1 / 2: bf16 94 / 78, fp8 96 / 101 registers (NT=1: x 6 steps ahead) and 48 KB of ring (4 CTAs per
// SM). SASS per step and warp (bf16 NT=1, register path): 4 LDG.E.NA.128.CONSTANT of W issued U steps
// ahead, 2 LDG.E.128 (.cg) of x one step ahead, 4 HMMA.16816.F32.BF16; griddepcontrol.launch_dependents / .wait appear as
// PREEXIT / ACQBULK, the wait after the first U steps of W. On sm_90 ptxas lowers the e4m3 mma.sync
// (m16n8k32) to F2FP.F16.E4M3.UNPACK (exact e4m3 → f16) + two HMMA.16816.F32 (f16): 12 unpacks per MMA,
// ~0.4 warp-instructions per cycle per SM at the copy rate — the FP8 path stays memory-bound, at half the
// weight bytes.
//
// Predicted (H200, copy 4.27 TB/s): a 20+ MB matrix at T ≤ 16 in ≥ 85 % of the copy rate plus ~2 µs of
// launch and tail (e.g. KDA q|k|v|g|f_a|b 90 MB ≈ 23 µs, o_proj 22 MB ≈ 7 µs, MoE latent down 51 MB ≈
// 14 µs); T = 64 within ~20 % of that (x traffic 4× W's from L2).
//
// Length (past ~600 lines): one kernel whose two load paths, split-K ending and router tail share one accumulator
// layout and one launch plan (with the emulation); split into files, that layout would be described in each.
//
// Emulation: tests/emu compiles this file against the CPU emulation of the thread hierarchy (simt.h) to run the
// kernel without a GPU; there the inline-PTX wrappers below take their #else forms and the host side (launchers,
// split choice) is left out, but plan() — the launch geometry — is shared, so the test launches what run() does.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#ifndef KESTREL_SIMT_EMU
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#endif
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemm_epi.cuh"
#include "kernels/cuda/gemm_skinny.h"
#include "kernels/cuda/moe_route.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;  // (8 warps a CTA at T ≤ 16 measured slower, session 14)
constexpr int kStepBytes = 128;  // bytes of each W / x row per k-step

struct Params {
  const uint8_t* x;
  int64_t ldx;  // bytes
  const uint8_t* w;
  int64_t ldw;  // bytes (K · element size)
  const float* x_scale;  // fp8
  const float* w_scale;  // fp8
  int T, N, kbytes;      // kbytes = K · element size
  int ksteps, steps_per_split, splits, tiles;
  float* part;
  unsigned* counters;
  GemmSegs segs;
  unsigned* route_counter;     // segs.route: the workspace's last counter
  int route_tile0, route_tiles;  // the row tiles that hold the router segment's rows
};

template <int I>
__device__ __forceinline__ uint32_t word(const uint4& v) {
  return I == 0 ? v.x : I == 1 ? v.y : I == 2 ? v.z : v.w;
}

#ifndef KESTREL_SIMT_EMU
__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {  // weights: read once, not kept in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_act(const uint8_t* p) {  // activations: L2 (coherent after the PDL wait)
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The staged variant (D > 0): W through shared memory by cp.async (dev::cp_async16: L2 only, zero-filled out of
// range), read back with ld.shared.
__device__ __forceinline__ uint4 ld_smem(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a)
               : "memory");
  return v;
}

template <bool FP8>
__device__ __forceinline__ void mma(float* d /* f32 [4] */, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  if constexpr (FP8) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}
#else
inline uint4 ld16_checked(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw std::runtime_error("simt: 16-byte load not 16-byte aligned");
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline uint4 ld_stream(const uint8_t* p) { return ld16_checked(p); }
inline uint4 ld_act(const uint8_t* p) { return ld16_checked(p); }
inline uint4 ld_smem(uint32_t a) { return ld16_checked(simt::smem_at(a, 16)); }
template <bool FP8>
inline void mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  float (&dd)[4] = *reinterpret_cast<float(*)[4]>(d);
  const uint32_t a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
  if constexpr (FP8) simt::mma_e4m3(dd, a, b);
  else simt::mma(dd, a, b, simt::MmaType::bf16);
}
#endif

// Lane (g, q) of a step: words 0..7 = bytes 32q..32q+31 of the step in rows g / g+8 (W) or token g (x).
// mma j takes words 2j (k pair 2q.. / 4q..) and 2j+1 (2q+8.. / 4q+16..): word 2j is uint4 j>>1, component
// (j&1)·2.
template <bool FP8, int MT, int NT>
__device__ __forceinline__ void mma_step(float (&acc)[MT * NT * 4], const uint4 (&w)[MT][2][2], const uint4 (&x)[NT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float* d = acc + (mt * NT + nt) * 4;
      mma<FP8>(d, word<0>(w[mt][0][0]), word<0>(w[mt][1][0]), word<1>(w[mt][0][0]), word<1>(w[mt][1][0]),
               word<0>(x[nt][0]), word<1>(x[nt][0]));
      mma<FP8>(d, word<2>(w[mt][0][0]), word<2>(w[mt][1][0]), word<3>(w[mt][0][0]), word<3>(w[mt][1][0]),
               word<2>(x[nt][0]), word<3>(x[nt][0]));
      mma<FP8>(d, word<0>(w[mt][0][1]), word<0>(w[mt][1][1]), word<1>(w[mt][0][1]), word<1>(w[mt][1][1]),
               word<0>(x[nt][1]), word<1>(x[nt][1]));
      mma<FP8>(d, word<2>(w[mt][0][1]), word<2>(w[mt][1][1]), word<3>(w[mt][0][1]), word<3>(w[mt][1][1]),
               word<2>(x[nt][1]), word<3>(x[nt][1]));
    }
}

// Split-K: the S partials of row tile `tile` (lane `lane`, E accumulators a lane) summed in split order over
// accumulators [e0, e0 + N), RS splits' loads in flight at once (the same additions in every launch).
template <int E, int N, int RS>
__device__ __forceinline__ void sum_splits(const Params& p, int tile, int lane, int e0, float (&out)[N]) {
  for (int s0 = 0; s0 < p.splits; s0 += RS) {
    float4 pv[RS][N / 4];
#pragma unroll
    for (int k = 0; k < RS; ++k)
      if (s0 + k < p.splits) {
        const float4* src =
            reinterpret_cast<const float4*>(p.part + ((int64_t(s0 + k) * p.tiles + tile) * 32 + lane) * E + e0);
#pragma unroll
        for (int e = 0; e < N / 4; ++e) pv[k][e] = __ldcg(src + e);
      }
#pragma unroll
    for (int k = 0; k < RS; ++k)
      if (s0 + k < p.splits) {
#pragma unroll
        for (int e = 0; e < N / 4; ++e) {
          const float4 v = pv[k][e];
          if (s0 + k == 0) {
            out[4 * e] = v.x, out[4 * e + 1] = v.y, out[4 * e + 2] = v.z, out[4 * e + 3] = v.w;
          } else {
            out[4 * e] += v.x, out[4 * e + 1] += v.y, out[4 * e + 2] += v.z, out[4 * e + 3] += v.w;
          }
        }
      }
  }
}

template <bool FP8, int NT, int MT, int U, bool XPF, int D = 0, bool ROUTE = false>
__global__ void __launch_bounds__(kThreads) skinny_kernel(const __grid_constant__ Params p) {
  static_assert(!XPF || U % 2 == 0, "x prefetch alternates two buffers over an even unroll");
  constexpr int E = MT * NT * 4;  // accumulators per lane
  static_assert(!ROUTE || (E < 16 && !FP8), "the route tail follows the E < 16 BF16 ending");
  __shared__ __align__(16) float red[kWarps - 1][E][32];
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5, g = lane >> 2, q = lane & 3;
  const int tile = int(blockIdx.x), split = int(blockIdx.y);
  dev::pdl_trigger();

  const int s_begin = split * p.steps_per_split;
  const int s_count = min(p.ksteps, s_begin + p.steps_per_split) - s_begin;
  const int n_my = s_count > warp ? (s_count - warp + kWarps - 1) / kWarps : 0;  // this warp's steps
  // Lane (g, q) reads, of each 128-byte step of its rows, the 16-byte pieces at 16q and 64 + 16q: the four
  // lanes of a row cover 64 contiguous bytes per load instruction, two whole 32-byte sectors. (At 32q and
  // 32q + 16, each load took half of four sectors: the batch-1 step was 3 % slower, session 14.)
  constexpr int piece = 64;
  const int lane_off = 16 * q;

  const uint8_t* wrow[MT][2];
  bool wok[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (tile * MT + mt) * 16 + 8 * h + g;
      wok[mt][h] = r < p.N;
      wrow[mt][h] = p.w + int64_t(wok[mt][h] ? r : 0) * p.ldw + lane_off;
    }
  const uint8_t* xrow[NT];
  bool xok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = 8 * nt + g;
    xok[nt] = tok < p.T;
    xrow[nt] = p.x + int64_t(xok[nt] ? tok : 0) * p.ldx + lane_off;
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  auto load_w = [&](uint4(&dst)[MT][2][2], int s) {
    const int off = s * kStepBytes;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const bool in_k = off + lane_off + piece * c + 16 <= p.kbytes;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          dst[mt][h][c] = (in_k && wok[mt][h]) ? ld_stream(wrow[mt][h] + off + piece * c) : zero;
    }
  };
  auto load_x = [&](uint4(&dst)[NT][2], int s) {
    const int off = s * kStepBytes;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const bool in_k = off + lane_off + piece * c + 16 <= p.kbytes;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) dst[nt][c] = (in_k && xok[nt]) ? ld_act(xrow[nt] + off + piece * c) : zero;
    }
  };

  float acc[MT * NT * 4];  // [mt][nt][4]
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.0f;
  if constexpr (D > 0) {
    // Staged: each warp keeps D steps of W in flight in its own shared-memory ring (D · MT · 2 KB) instead of
    // U steps in registers; a lane reads back only the 16-byte pieces it copied itself (piece-major layout:
    // 512 bytes per piece, lanes contiguous, no bank conflicts), so cp.async.wait_group is the only sync.
    uint8_t* ring = dev::dyn_smem<uint8_t>();
    constexpr int kStage = MT * 4 * 512;
    const uint32_t base = dev::smem_addr(ring) + uint32_t(warp * D * kStage + lane * 16);
    auto issue = [&](int slot, int st) {
      const int off = st * kStepBytes;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const bool in_k = off + lane_off + piece * c + 16 <= p.kbytes;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            dev::cp_async16(base + uint32_t(slot * kStage + ((mt * 2 + h) * 2 + c) * 512), wrow[mt][h] + off + piece * c,
                       in_k && wok[mt][h]);
      }
    };
#pragma unroll
    for (int u = 0; u < D; ++u) {  // one group per step, empty past the end: wait_group counts stay uniform
      if (u < n_my) issue(u, s_begin + warp + u * kWarps);
      dev::cp_async_commit();
    }
    dev::pdl_wait();
    // x runs XD steps ahead in a register ring. At NT = 1 XD = D: right after the wait every step whose W is
    // already in the ring has its x in flight too, so those steps cost one L2 round trip together instead of
    // one each (x one step ahead put D round trips in a row on the chain — the whole of a launch whose W fit
    // its rings, e.g. o_proj). NT = 2 keeps 2 (6 would cost ~50 more registers a thread).
    constexpr int XD = NT == 1 ? D : 2;
    uint4 xb[XD][NT][2];
#pragma unroll
    for (int u = 0; u < XD; ++u)
      if (u < n_my) load_x(xb[u], s_begin + warp + u * kWarps);
    for (int i = 0; i < n_my; i += XD) {
#pragma unroll
      for (int u = 0; u < XD; ++u) {
        const int idx = i + u;
        if (idx < n_my) {
          const int st = s_begin + warp + idx * kWarps, slot = XD == D ? u : idx % D;
          dev::cp_async_wait<D - 1>();  // D + idx groups committed: step idx's has landed
          uint4 wv[MT][2][2];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int c = 0; c < 2; ++c)
                wv[mt][h][c] = ld_smem(base + uint32_t(slot * kStage + ((mt * 2 + h) * 2 + c) * 512));
          mma_step<FP8, MT, NT>(acc, wv, xb[u]);
          if (idx + XD < n_my) load_x(xb[u], st + XD * kWarps);  // the MMA has read xb[u]
          if (idx + D < n_my) issue(slot, st + D * kWarps);  // the MMA consumed this slot's registers: in-order issue
          dev::cp_async_commit();
        }
      }
    }
    dev::cp_async_wait<0>();
  } else {
  // Prologue: the first U steps of W (independent of earlier kernels), then wait for them.
  uint4 wb[U][MT][2][2];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < n_my) load_w(wb[u], s_begin + warp + u * kWarps);
  dev::pdl_wait();

  uint4 xb[XPF ? 2 : 1][NT][2];
  if (XPF && n_my > 0) load_x(xb[0], s_begin + warp);
  for (int i = 0; i < n_my; i += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = i + u;
      if (idx < n_my) {
        const int s = s_begin + warp + idx * kWarps;
        const int xi = XPF ? (u & 1) : 0;  // a constant once the loop is unrolled
        if constexpr (XPF) {
          if (idx + 1 < n_my) load_x(xb[xi ^ 1], s + kWarps);
        } else {
          load_x(xb[0], s);
        }
        mma_step<FP8, MT, NT>(acc, wb[u], xb[xi]);
        if (idx + U < n_my) load_w(wb[u], s + U * kWarps);
      }
    }
  }
  }  // register path

  // CTA reduction in warp order.
  float(&a)[E] = acc;
  if (warp > 0) {
#pragma unroll
    for (int e = 0; e < E; ++e) red[warp - 1][e][lane] = a[e];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int w = 0; w < kWarps - 1; ++w)
#pragma unroll
      for (int e = 0; e < E; ++e) a[e] += red[w][e][lane];
  }
  if constexpr (E >= 16) {  // T > 16: the last CTA's sum of the S partials spread over its 4 warps
    if (p.splits > 1) {
      __shared__ unsigned last;
      if (warp == 0) {
        float4* mine = reinterpret_cast<float4*>(p.part + ((int64_t(split) * p.tiles + tile) * 32 + lane) * E);
#pragma unroll
        for (int e = 0; e < E / 4; ++e) mine[e] = make_float4(a[4 * e], a[4 * e + 1], a[4 * e + 2], a[4 * e + 3]);
        __threadfence();
        if (lane == 0) last = atomicAdd(&p.counters[tile], 1u) == unsigned(p.splits - 1);
      }
      __syncthreads();  // also: warp 0 has read red before the other warps reuse it below
      if (!last) return;
      __threadfence();
      // Warp w sums accumulators [w·E/4, (w+1)·E/4) of every lane over the splits in split order (the same
      // additions as warp 0 alone made, so the same bits), 4 splits' loads in flight at a time: with E = 32 and
      // S = 14 one warp alone waited 14 L2 round trips in a row, the 4 warps wait 4 side by side.
      constexpr int EW = E / 4;
      float sum[EW];
      sum_splits<E, EW, 4>(p, tile, lane, warp * EW, sum);
      float* sums = &red[0][0][0];  // f32 [E][32]: 3·E·32 floats of room
#pragma unroll
      for (int e = 0; e < EW; ++e) sums[(warp * EW + e) * 32 + lane] = sum[e];
      __syncthreads();
      if (warp != 0) return;
#pragma unroll
      for (int e = 0; e < E; ++e) a[e] = sums[e * 32 + lane];
      if (lane == 0) p.counters[tile] = 0u;  // ready for the next launch
    }
  }
  // Warp 0: the split-K sum where this CTA is its tile's last split, then the epilogue; false if it is not the last.
  auto finish = [&]() -> bool {
    if (E < 16 && p.splits > 1) {
      float4* mine = reinterpret_cast<float4*>(p.part + ((int64_t(split) * p.tiles + tile) * 32 + lane) * E);
#pragma unroll
      for (int e = 0; e < E / 4; ++e) mine[e] = make_float4(a[4 * e], a[4 * e + 1], a[4 * e + 2], a[4 * e + 3]);
      __threadfence();
      unsigned prev = 0;
      if (lane == 0) prev = atomicAdd(&p.counters[tile], 1u);
      prev = __shfl_sync(0xffffffffu, prev, 0);
      if (prev != unsigned(p.splits - 1)) return false;
      __threadfence();
      // RU = 4 splits' loads in flight at once: the reading CTA waits about one L2 round trip per 4 splits.
      sum_splits<E, E, 4>(p, tile, lane, 0, a);
      if (lane == 0) p.counters[tile] = 0u;  // ready for the next launch
    }

    // Epilogue: d[0] (row g, token 2q), d[1] (g, 2q+1), d[2] (g+8, 2q), d[3] (g+8, 2q+1).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int rb = (tile * MT + mt) * 16;
      if (rb >= p.N) break;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int e0 = (mt * NT + nt) * 4;
        float d[4] = {acc[e0], acc[e0 + 1], acc[e0 + 2], acc[e0 + 3]};
        if constexpr (FP8) {
          const int r0 = rb + g, r1 = rb + g + 8, c0 = 8 * nt + 2 * q, c1 = c0 + 1;
          const float s0 = r0 < p.N ? __ldg(p.w_scale + r0) : 0.0f, s1 = r1 < p.N ? __ldg(p.w_scale + r1) : 0.0f;
          const float x0 = c0 < p.T ? __ldcg(p.x_scale + c0) : 0.0f, x1 = c1 < p.T ? __ldcg(p.x_scale + c1) : 0.0f;
          d[0] = (d[0] * s0) * x0, d[1] = (d[1] * s0) * x1, d[2] = (d[2] * s1) * x0, d[3] = (d[3] * s1) * x1;
        }
        epi::store_frag(p.segs, p.N, p.T, rb, nt, d, g, q);
      }
    }
    return true;
  };
  if constexpr (ROUTE) {  // the router's top-k after the tiles that hold its logits (moe_route.cuh)
    __shared__ unsigned route_go;
    const bool stored = warp == 0 && finish();
    route_dev::route_after_tiles(p.segs, p.N, p.T, p.route_counter, p.route_tile0, p.route_tiles, tile, stored,
                                 kWarps, &route_go);
  } else {
    if (warp != 0) return;
    finish();
  }
}


constexpr int kStages = 6;  // staged variant: 6 steps × 2 KB per warp, 48 KB a CTA (4 CTAs per SM by shared memory)
constexpr int kStagedSmem = kWarps * kStages * 2048;

// The launch geometry for T tokens, K inputs, N rows and at most S0 splits (gemm_skinny_splits): each split
// whole k-steps, none empty; returns NT, the 8-token n-tiles the kernel instantiation covers (1, 2, 4, 8).
int plan(Params& p, int64_t T, int64_t K, int64_t N, bool fp8, int S0) {
  const int esz = fp8 ? 1 : 2;
  p.T = int(T), p.N = int(N), p.kbytes = int(K * esz), p.ldw = K * esz;
  p.ksteps = int((K * esz + kStepBytes - 1) / kStepBytes);
  p.steps_per_split = (p.ksteps + S0 - 1) / S0;
  p.splits = (p.ksteps + p.steps_per_split - 1) / p.steps_per_split;
  p.tiles = int((N + 15) / 16);  // MT = 1 for every instantiation
  return T <= 8 ? 1 : T <= 16 ? 2 : T <= 32 ? 4 : 8;
}

// The router's tiles (segs.route, see route_tail): those holding rows of its segment.
void plan_route(Params& p) {
  const GemmSegs& s = p.segs;
  if (s.route.seg < 0) return;
  const int64_t n0 = s.seg[s.route.seg].n0, n1 = s.route.seg + 1 < s.n ? s.seg[s.route.seg + 1].n0 : p.N;
  p.route_tile0 = int(n0 / 16);
  p.route_tiles = int((n1 - 1) / 16) - p.route_tile0 + 1;
}

// The instantiation for NT n-tiles (plan) with W staged through shared memory or held in registers (the
// choice exists at NT ≤ 2): f.template operator()<Kernel>(its dynamic shared memory, bytes). run() and the
// emulation test (tests/emu) launch through this one table. route: the staged BF16 kernels with the router's
// tail (gemm_skinny_route_ok).
template <bool FP8, class F>
void dispatch(int NT, bool staged, F&& f, bool route = false) {
  if constexpr (!FP8) {
    if (route && staged && NT <= 2) {
      if (NT == 1) f.template operator()<skinny_kernel<false, 1, 1, 4, true, kStages, true>>(kStagedSmem);
      else f.template operator()<skinny_kernel<false, 2, 1, 4, true, kStages, true>>(kStagedSmem);
      return;
    }
  }
  switch (NT) {
    case 1:
      if (staged) f.template operator()<skinny_kernel<FP8, 1, 1, 4, true, kStages>>(kStagedSmem);
      else f.template operator()<skinny_kernel<FP8, 1, 1, 4, true>>(0);
      break;
    case 2:
      if (staged) f.template operator()<skinny_kernel<FP8, 2, 1, 4, true, kStages>>(kStagedSmem);
      else f.template operator()<skinny_kernel<FP8, 2, 1, 4, true>>(0);
      break;
    case 4: f.template operator()<skinny_kernel<FP8, 4, 1, 2, false>>(0); break;
    default: f.template operator()<skinny_kernel<FP8, 8, 1, 2, false>>(0); break;
  }
}

#ifndef KESTREL_SIMT_EMU
template <auto Kernel>
void launch_staged(dim3 grid, cudaStream_t stream, const Params& p) {
  constexpr int smem = kStagedSmem;
  static const bool attr = [] {
    KCUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attr;
  launch_pdl(Kernel, grid, dim3(kThreads), size_t(smem), stream, p);
}

bool staged_on() {  // KESTREL_SKINNY_STAGED=0: W in registers at T ≤ 16 too (A/B timing)
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_SKINNY_STAGED");
    return !(e && e[0] == '0');
  }();
  return on;
}

template <bool FP8>
void run(Params p, int64_t T, int64_t K, int64_t N, const SkinnyWorkspace& ws, cudaStream_t stream) {
  const bool staged = staged_on();
  const int NT = plan(p, T, K, N, FP8, gemm_skinny_splits(N, K, FP8));
  if (p.splits > 1) {
    const size_t need = size_t(p.splits) * size_t(p.tiles) * 32 * size_t(NT * 4) * 4;
    KCUDA_REQUIRE(ws.part && ws.counters && need <= ws.part_bytes && p.tiles < ws.n_counters,
                  "gemm_skinny: split-K workspace too small (" + std::to_string(need) + " bytes, " +
                      std::to_string(p.tiles + 1) + " counters needed)");
    p.part = ws.part, p.counters = ws.counters;
  }
  const bool route = p.segs.route.seg >= 0;
  if (route) {
    KCUDA_REQUIRE(gemm_skinny_route_ok(T, p.segs, N, ws),
                  "gemm_skinny: the router's top-k cannot run in this launch (T=" + std::to_string(T) +
                      "; see gemm_skinny_route_ok)");
    p.route_counter = ws.counters + (ws.n_counters - 1);
    plan_route(p);
  }
  const dim3 grid(unsigned(p.tiles), unsigned(p.splits));
  dispatch<FP8>(
      NT, staged,
      [&]<auto Kernel>(int smem) {
        if (smem > 0) launch_staged<Kernel>(grid, stream, p);
        else launch_pdl(Kernel, grid, dim3(kThreads), 0, stream, p);
      },
      route);
}


bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
#endif  // KESTREL_SIMT_EMU

}  // namespace

#ifndef KESTREL_SIMT_EMU

int gemm_skinny_splits(int64_t N, int64_t K, bool fp8) {
  static const int per_sm = [] {
    const char* e = std::getenv("KESTREL_SKINNY_CTAS_PER_SM");
    const int v = e ? std::atoi(e) : 2;
    return v >= 1 && v <= 32 ? v : 2;
  }();
  const int64_t tiles = (N + 15) / 16, ksteps = (K * (fp8 ? 1 : 2) + kStepBytes - 1) / kStepBytes;
  int64_t S = (int64_t(sm_count()) * per_sm + tiles - 1) / tiles;
  S = std::min<int64_t>(S, std::max<int64_t>(1, ksteps / 8));  // ≥ 2 steps per warp
  return int(std::clamp<int64_t>(S, 1, 16));
}

bool gemm_skinny_ok(const void* x, int64_t ldx, const void* w, int64_t T, int64_t K, int64_t N, const GemmSegs& segs,
                    bool fp8) {
  const int64_t esz = fp8 ? 1 : 2;
  if (!x || !w || T < 1 || T > kSkinnyMaxT || K <= 0 || N <= 0 || N >= (int64_t(1) << 30) ||
      K * esz >= (int64_t(1) << 30))
    return false;
  if ((K * esz) % 16 != 0 || (ldx * esz) % 16 != 0 || ldx < K || !aligned16(x) || !aligned16(w)) return false;
  if (segs.n < 1 || segs.n > kGemmMaxSegs || segs.seg[0].n0 != 0) return false;
  for (int i = 0; i < segs.n; ++i) {
    const GemmSeg& s = segs.seg[i];
    const int64_t end = i + 1 < segs.n ? segs.seg[i + 1].n0 : N;
    if (!s.y || end <= s.n0 || end > N) return false;
    const int64_t len = end - s.n0;
    switch (s.epi) {
      case GemmEpi::bf16: if (s.ldy < len) return false; break;
      case GemmEpi::f32: if (fp8 || s.ldy < len) return false; break;
      case GemmEpi::add_bf16: if (!s.add || s.ldy < len || s.ld_add < len) return false; break;
      case GemmEpi::situ_glu8: if (s.n0 % 16 != 0 || len % 16 != 0 || s.ldy < len / 2) return false; break;
      default: return false;
    }
  }
  return true;
}

bool gemm_skinny_route_ok(int64_t T, const GemmSegs& segs, int64_t N, const SkinnyWorkspace& ws) {
  const GemmRoute& r = segs.route;
  if (r.seg < 0 || r.seg >= segs.n || !r.bias || !r.ids || !r.weights || !ws.counters || ws.n_counters < 1) return false;
  const GemmSeg& s = segs.seg[r.seg];
  const int64_t X = (r.seg + 1 < segs.n ? segs.seg[r.seg + 1].n0 : N) - s.n0;
  return T >= 1 && T <= 16 && staged_on() && s.epi == GemmEpi::f32 && route_dev::warp_route_ok(X, r.K);
}

void gemm_skinny_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t T, int64_t K, int64_t N,
                      const GemmSegs& segs, const SkinnyWorkspace& ws, cudaStream_t stream) {
  KCUDA_REQUIRE(gemm_skinny_ok(x, ldx, w, T, K, N, segs, false),
                "gemm_skinny_bf16: unsupported operands T=" + std::to_string(T) + " K=" + std::to_string(K) +
                    " N=" + std::to_string(N) + " ldx=" + std::to_string(ldx));
  Params p{};
  p.x = reinterpret_cast<const uint8_t*>(x), p.ldx = ldx * 2, p.w = reinterpret_cast<const uint8_t*>(w);
  p.segs = segs;
  run<false>(p, T, K, N, ws, stream);
}

void gemm_skinny_fp8(const uint8_t* x, int64_t ldx, const float* x_scale, const uint8_t* w, const float* w_scale,
                     int64_t T, int64_t K, int64_t N, const GemmSegs& segs, const SkinnyWorkspace& ws,
                     cudaStream_t stream) {
  KCUDA_REQUIRE(x_scale && w_scale && segs.route.seg < 0 && gemm_skinny_ok(x, ldx, w, T, K, N, segs, true),
                "gemm_skinny_fp8: unsupported operands T=" + std::to_string(T) + " K=" + std::to_string(K) +
                    " N=" + std::to_string(N) + " ldx=" + std::to_string(ldx));
  Params p{};
  p.x = x, p.ldx = ldx, p.w = w, p.x_scale = x_scale, p.w_scale = w_scale;
  p.segs = segs;
  run<true>(p, T, K, N, ws, stream);
}

#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda
