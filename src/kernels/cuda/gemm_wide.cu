// Wide GEMM (gemm_skinny.h: gemm_wide_bf16): y = x·Wᵀ for 17–64 token rows, BF16, W streamed once, on wgmma.
// model/cuda/linear.h takes it for stacked projections of ≥ 3 outputs (KESTREL_WIDE): there it replaces one
// cuBLASLt launch per output plus the epilogues' launches, and the batch-64 decode step fell from 1,103–1,110 to
// 1,043–1,071 µs on the H200 (session 30). On single matrices it is still slower than cuBLASLt (below); for
// every projection the step took 1,116–1,141 µs.
//
// Why a second kernel: the skinny kernel's CTA owns 16 rows of W, so at T = 64 every CTA reads all of x
// (64 tokens × K) from L2 for only 16 rows of W (x's L2 traffic 4× W's); it measured 2–3.5× slower than
// cuBLASLt there. cuBLASLt's kernels reach ~52 % of the copy rate over the batch-64 step's projections
// (session 29: 513 µs exposed for ~1.15 GB, 26 split-K reduce launches among them). Here a CTA owns 64 rows of
// W and all (≤ 64) tokens: x is read from L2 once per 64 rows.
//
// Layout: a CTA is one warpgroup (4 warps, 128 threads) computing D[64 rows, 8·NT tokens] (NT = 4 at T ≤ 32,
// 8 at T ≤ 64; tokens ≥ T are zero-filled, never loaded) with wgmma.m64n{32,64}k16 (A = W, B = x, both
// K-major in shared memory, FP32 accumulators in registers; warp w holds rows 16w..16w+15 in the mma.sync
// m16n8 fragment layout, so the epilogue is gemm_epi.cuh's). K is walked in steps of 128 elements: a stage
// holds W's 64 rows × 256 B (16 KB) and x's 8·NT rows × 256 B, each as two 128-byte-swizzled halves (chunk c
// of row r at c ^ (r & 7); the descriptors' 128-byte swizzle mode, 1024-byte-aligned atoms), copied by all
// 128 threads with cp.async.cg (L2 only). The thread's chunks share one swizzled offset, so the copy's
// addresses are fixed pointers plus the step's k offset.
//
// Pipeline: a 4-stage ring loaded 2 steps ahead, one wgmma group left in flight (the slot a load overwrites
// was read two steps back). Before griddepcontrol.wait the CTA issues W's first 2 stages (weights are never
// written), so under PDL the weight stream starts in the previous kernel's tail; x follows the wait.
// cp.async writes through the generic proxy and wgmma reads through the async proxy:
// fence.proxy.async before the barrier that publishes a stage. The accumulators are fenced around each
// wgmma group (fence_acc), or ptxas serialises the wgmma (C7514).
//
// What was measured on the way (session 30; bench_ops --only proj at B = 64, µs, cuBLASLt beside): with
// ldmatrix + mma.sync and 64-element steps the 7168² anchor took 53.7 (38.1) — Nsight Compute put a third of
// the samples in the prologue/epilogue and the loop at ~810 cycles a step, latency-bound on 1.7 CTAs an SM;
// wgmma alone changed nothing; 128 rows a CTA doubled the time; rotating each tile's k order (L2 hot lines)
// changed nothing; 128-element steps: 45.3; then one wgmma group in flight, 4 stages, 1 CTA an SM: small
// shapes to cuBLASLt's level (o_proj 19.6 vs 17.8, q_a 25.0 vs 18.6), the anchor 46.8 (38.5). The KDA stack
// (6284 rows: 44 vs 53 µs) is the one shape where it beats cuBLASLt clearly.
//
// Split-K (deterministic, as in the skinny kernel): S = max(1, SMs / tiles) splits (one CTA an SM: one
// wave), ≥ 2 k-steps each, at most 16 and what the workspace holds at NT = 8 — a function of (N, K), the
// device and the workspace only, so a token's outputs are bit-identical for every T in 17..64 (batch
// invariance for CUDA-graph buckets). Each thread writes its NT·4 partials; the last CTA of a row tile to
// bump the tile's counter sums the S partials in split order (ld.cg) and runs the epilogue, then zeroes the
// counter.
//
// Resources (ptxas, sm_90a, no spills): 132 registers at NT = 8, 102 at NT = 4; 129 KB of dynamic shared
// memory at NT = 8 (1 CTA an SM). Requires K % 128 == 0 (every projection of mini and the real model).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemm_epi.cuh"
#include "kernels/cuda/gemm_skinny.h"
#include "kernels/cuda/launch.h"

namespace kestrel::cuda {
namespace {

// A k-step is 128 elements of K: 256 bytes of each W / x row, as two 128-byte-swizzled halves (k 0–63, 64–127).
// ST ring stages; AS = 1 wgmma group left in flight at the end of a step; stages are loaded D = ST − 1 − AS
// steps ahead (the slot a load overwrites was read by the wgmma of step i − 1 − AS, complete by then).
constexpr int kThreads = 128, kRows = 64, kStepElems = 128, ST = 4, AS = 1, D = ST - 1 - AS;
constexpr int kWBytes = 2 * 8192;  // W stage: bf16 [64, 128] as two [64, 64] halves
template <int NT>
__host__ __device__ constexpr int x_half_bytes() { return NT * 8 * 128; }  // x half: bf16 [8·NT, 64]
template <int NT>
__host__ __device__ constexpr int stage_bytes() { return kWBytes + 2 * x_half_bytes<NT>(); }
template <int NT>
__host__ __device__ constexpr int smem_bytes() { return ST * stage_bytes<NT>() + 1024; }  // + alignment slack

struct Params {
  const uint16_t* x;  // bf16 [T, K], row stride ldx
  int64_t ldx;
  const uint16_t* w;  // bf16 [N, K]
  int T, N, K;
  int ksteps, steps_per_split, splits, tiles;
  float* part;
  unsigned* counters;
  GemmSegs segs;
};

// wgmma (sm_90a). Shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle: start address
// >> 4 (bits 0–13), leading byte offset (unused for this layout: 1), stride byte offset 1024 >> 4 (one 8-row
// atom of 128-byte rows, bits 32–45), swizzle mode 1 = 128 B (bits 62–63). The tile base is 1024-byte
// aligned; a k16 slice further along the row is the same descriptor with the start 32 bytes on.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
  return uint64_t((saddr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async wrote the tiles through the generic proxy; wgmma reads them through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from touching the accumulators while a wgmma group may be writing them (without it ptxas
// serialises the wgmma of the in-flight variant, C7514).
template <int NT>
__device__ __forceinline__ void fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[nt][j])::"memory");
}

// D[64 rows, 8·NT tokens] += A[64, 16] · B[8·NT, 16]ᵀ, both K-major bf16 in shared memory, FP32 accumulators
// in the m16n8 fragment layout per warp (rows 16·warp + g / + 8, tokens 8·nt + 2q / + 1).
template <int NT>
__device__ __forceinline__ void wgmma_k16(float (&d)[NT][4], uint64_t da, uint64_t db);
template <>
__device__ __forceinline__ void wgmma_k16<8>(float (&d)[8][4], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_k16<4>(float (&d)[4][4], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db));
}

template <int NT>
__global__ void __launch_bounds__(kThreads) wide_kernel(const __grid_constant__ Params p) {
  constexpr int E = NT * 4, kXH = x_half_bytes<NT>(), kStage = stage_bytes<NT>();
  constexpr int IX = NT / 2;  // x chunks a thread copies per half
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int tile = int(blockIdx.x), split = int(blockIdx.y);
  dev::pdl_trigger();

  const int s_begin = split * p.steps_per_split;
  const int n = min(p.ksteps, s_begin + p.steps_per_split) - s_begin;
  const uint32_t base = (dev::smem_addr(smem) + 1023u) & ~1023u;  // the swizzle atoms' alignment

  // Copy roles. A thread copies 16-byte chunk c = tid % 8 of rows tid/8 + 16·i of each half: W i < 4 (64 rows),
  // x i < NT/2 (8·NT tokens). Those rows share row & 7, so every destination is one swizzled offset plus a
  // constant; the sources are fixed pointers plus the step's k offset.
  const int r0 = tid >> 3, c = tid & 7;
  const uint32_t dst0 = uint32_t(r0 * 128 + ((c ^ (r0 & 7)) << 4));
  const int row0 = tile * kRows;
  const uint16_t* wsrc[4];
  bool win[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = row0 + r0 + 16 * i;
    win[i] = r < p.N;
    wsrc[i] = p.w + int64_t(win[i] ? r : 0) * p.K + int64_t(s_begin) * kStepElems + c * 8;
  }
  const uint16_t* xsrc[IX];
  bool xin[IX];
#pragma unroll
  for (int i = 0; i < IX; ++i) {
    const int t = r0 + 16 * i;
    xin[i] = t < p.T;
    xsrc[i] = p.x + int64_t(xin[i] ? t : 0) * p.ldx + int64_t(s_begin) * kStepElems + c * 8;
  }
  auto issue_w = [&](int slot, int st) {
    const uint32_t d = base + uint32_t(slot * kStage) + dst0;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        dev::cp_async16(d + uint32_t(h * 8192 + i * 2048), wsrc[i] + st * kStepElems + 64 * h, win[i]);
  };
  auto issue_x = [&](int slot, int st) {
    const uint32_t d = base + uint32_t(slot * kStage + kWBytes) + dst0;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < IX; ++i)
        dev::cp_async16(d + uint32_t(h * kXH + i * 2048), xsrc[i] + st * kStepElems + 64 * h, xin[i]);
  };

#pragma unroll
  for (int s = 0; s < D; ++s) {
    if (s < n) issue_w(s, s);
    dev::cp_async_commit();
  }
  dev::pdl_wait();
#pragma unroll
  for (int s = 0; s < D; ++s)
    if (s < n) issue_x(s, s);
  dev::cp_async_commit();
  dev::cp_async_wait<0>();

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

  for (int i = 0; i < n; ++i) {
    if (i > 0) dev::cp_async_wait<D - 1>();  // stage i has landed (this thread's copies) ...
    fence_proxy_async();
    __syncthreads();  // ... everyone's, and step i − 1 − AS's wgmma (waited below) has left its slot
    const int nx = i + D;
    if (nx < n) {
      issue_w(nx % ST, nx);
      issue_x(nx % ST, nx);
    }
    dev::cp_async_commit();  // empty past the end: the wait counts stay uniform

    const uint32_t sw = base + uint32_t((i % ST) * kStage), sx = sw + kWBytes;
    fence_acc(acc);
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint64_t da = sw128_desc(sw + uint32_t(h * 8192)), db = sw128_desc(sx + uint32_t(h * kXH));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_k16<NT>(acc, da + 2 * kk, db + 2 * kk);  // k16 slice kk: start + 32 B
    }
    wgmma_commit();
    fence_acc(acc);
    wgmma_wait<AS>();
  }
  wgmma_wait<0>();
  fence_acc(acc);
  dev::cp_async_wait<0>();

  if (p.splits > 1) {
    __shared__ unsigned last;
    float4* mine = reinterpret_cast<float4*>(p.part + ((int64_t(split) * p.tiles + tile) * kThreads + tid) * E);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mine[nt] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&p.counters[tile], 1u) == unsigned(p.splits - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The S partials in split order, RS splits' loads in flight at a time (4 at NT = 8 took 196 registers).
    constexpr int RS = NT == 8 ? 2 : 4;
    for (int s0 = 0; s0 < p.splits; s0 += RS) {
      float4 pv[RS][NT];
#pragma unroll
      for (int k = 0; k < RS; ++k)
        if (s0 + k < p.splits) {
          const float4* src =
              reinterpret_cast<const float4*>(p.part + ((int64_t(s0 + k) * p.tiles + tile) * kThreads + tid) * E);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) pv[k][nt] = __ldcg(src + nt);
        }
#pragma unroll
      for (int k = 0; k < RS; ++k)
        if (s0 + k < p.splits) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const float4 v = pv[k][nt];
            float(&d)[4] = acc[nt];
            if (s0 + k == 0) {
              d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
            } else {
              d[0] += v.x, d[1] += v.y, d[2] += v.z, d[3] += v.w;
            }
          }
        }
    }
    if (tid == 0) p.counters[tile] = 0u;  // ready for the next launch
  }

  const int rb = row0 + 16 * warp;
  if (rb >= p.N) return;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (8 * nt >= p.T) break;
    epi::store_frag(p.segs, p.N, p.T, rb, nt, acc[nt], g, q);
  }
}


template <int NT>
void launch(dim3 grid, cudaStream_t stream, const Params& p) {
  static const bool attr = [] {
    KCUDA_CHECK(cudaFuncSetAttribute(wide_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<NT>()));
    return true;
  }();
  (void)attr;
  launch_pdl(wide_kernel<NT>, grid, dim3(kThreads), size_t(smem_bytes<NT>()), stream, p);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Partial bytes of one (split, tile) at NT = 8: the most any T needs.
constexpr size_t kPartPerTile = size_t(kThreads) * 32 * 4;

}  // namespace

int gemm_wide_splits(int64_t N, int64_t K, const SkinnyWorkspace& ws) {
  const int64_t tiles = (N + kRows - 1) / kRows, ksteps = K / kStepElems;
  // One CTA per SM at most (the ring's 129 KB of shared memory at NT = 8): the grid stays one wave.
  int64_t S = std::max<int64_t>(1, int64_t(sm_count()) / tiles);
  S = std::min<int64_t>(S, std::max<int64_t>(1, ksteps / 2));
  S = std::min<int64_t>(S, int64_t(ws.part_bytes / (kPartPerTile * size_t(tiles))));
  S = std::clamp<int64_t>(S, 1, 16);
  // The split count that the steps per split actually give (no empty splits).
  const int64_t per = (ksteps + S - 1) / S;
  return int((ksteps + per - 1) / per);
}

bool gemm_wide_ok(const void* x, int64_t ldx, const void* w, int64_t T, int64_t K, int64_t N, const GemmSegs& segs,
                  const SkinnyWorkspace& ws) {
  if (T < 1 || T > kSkinnyMaxT || K <= 0 || K % kStepElems != 0 || ldx % 8 != 0 || !aligned16(x) || !aligned16(w))
    return false;
  if (!gemm_skinny_ok(x, ldx, w, T, K, N, segs, false)) return false;  // the segment rules and size limits
  if (segs.route.seg >= 0) return false;  // the router's top-k is the caller's after this kernel (gemm_skinny.h)
  const int64_t tiles = (N + kRows - 1) / kRows;
  // (gemm_wide_splits caps the split count by the workspace's partials.)
  return tiles <= ws.n_counters && ws.counters && ws.part;
}

void gemm_wide_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t T, int64_t K, int64_t N,
                    const GemmSegs& segs, const SkinnyWorkspace& ws, cudaStream_t stream) {
  KCUDA_REQUIRE(gemm_wide_ok(x, ldx, w, T, K, N, segs, ws),
                "gemm_wide_bf16: unsupported operands T=" + std::to_string(T) + " K=" + std::to_string(K) +
                    " N=" + std::to_string(N) + " ldx=" + std::to_string(ldx));
  Params p{};
  p.x = x, p.ldx = ldx, p.w = w, p.segs = segs;
  p.T = int(T), p.N = int(N), p.K = int(K);
  p.ksteps = int(K / kStepElems);
  p.splits = gemm_wide_splits(N, K, ws);
  p.steps_per_split = (p.ksteps + p.splits - 1) / p.splits;
  p.tiles = int((N + kRows - 1) / kRows);
  if (p.splits > 1) p.part = ws.part, p.counters = ws.counters;
  const dim3 grid(unsigned(p.tiles), unsigned(p.splits));
  if (T <= 32) launch<4>(grid, stream, p);
  else launch<8>(grid, stream, p);
}

}  // namespace kestrel::cuda
