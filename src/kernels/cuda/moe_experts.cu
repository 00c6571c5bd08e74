// Routed MoE experts (MODEL.md §3.6 steps 3–4) on tensor cores: W4A16, MXFP4 weights dequantised in
// registers, BF16 mma.sync.m16n8k16 with FP32 accumulation. Contract in moe.h; weight layout and the
// E2M1 decode trick in moe_layout.h. CPU twin: cpu::moe_experts.
//
// Four launches on one stream, no host synchronisation, fixed grids (CUDA-graph capturable):
//   1. group (one block): slots (t·K + k) counted per expert, scanned, scattered into expert order; the
//      experts' tokens cut into jobs of at most CT tokens (CT = 8 decode, 32 prefill: MoeTokenTile),
//      written as a device work list (expert, first position, count) with its length.
//   2. w13 (expert_gemm_kernel<GLU>): one CTA = 4 warps = 64 rows of W1 and the same 64 rows of W3 for one
//      job; grid = (host bound on jobs) × I/64, CTAs past the device's job count exit at once. Each warp
//      owns a 16-row tile and streams its whole K: per 64 columns one 16-byte load per lane for W1, one
//      for W3 (512 contiguous bytes per warp), one 4-byte scale word each, and the tokens' z as 16-byte
//      loads through L1, all in a register pipeline STAGES chunks deep. Per 32-column e8m0 block: two MMAs
//      (weights = A, 16 rows; tokens = B, 8 per n-tile: "swap AB") into a fresh FP32 partial, then
//      acc += 2^(e−127)·partial (exact for every e). Epilogue: a = bf16(SiTU-GLU(bf16 g, bf16 u)) in
//      registers (a lane holds g and u of the same rows and tokens), stored per slot.
//   3. w2 (expert_gemm_kernel<plain>): the same over W2 with a as input; y = bf16(acc) per slot.
//   4. combine: ũ_t = bf16(Σ_k w_k·y_k) in top-k order, FP32; deterministic (no atomics on values). The
//      order of tokens inside an expert (atomic scatter) never changes a value: every (row, token)
//      output is its own MMA column with the same K order.
//
// Bytes and time (H200, 4.29 TB/s copy; an expert is 17.55 MB: w1|w3 11.70 MB with scales, w2 5.85 MB):
//   group    ids in, order + work list out (KB): one block, ≈ 2–3 µs including its launch.
//   w13      T=1: 16 experts × 11.70 MB = 187 MB → 44 µs at copy speed; T=64: ≈ 600 experts, 7.0 GB → 1.6 ms.
//   w2       T=1: 94 MB → 22 µs; T=64: 3.5 GB → 0.8 ms.
//   combine  T·K·Lt·2 B of y in, T·Lt·2 B out: 2 µs at T ≤ 64.
// Issue budget: at copy speed an SM gets ≈ 110 warp-instruction slots per 512-byte warp load of weights. The
// CT = 8 main loops compile (sm_90a, nvcc 13) to 87 (w13) and 93 (w2) instructions per 512 bytes — decode
// ≈ 15 per 32-bit word, scales 2 per byte, 4 HMMA, 8 FFMA, loads — so they should stay memory-bound; the
// estimate is ≈ 85 % of copy speed: ≈ 80 µs at T = 1 with launch gaps, ≈ 2.9 ms at T = 64. ptxas: 119/123
// registers (w13, plain/exact scales), 76 (w2), no spills, no shared memory: 4 and 6 CTAs per SM.
// Prefill (CT = 32): 16 HMMA per 16-byte weight load; 168 (w13) / 127 (w2) registers; a job's weights come
// from L2 after the first of an expert's jobs reads them.
#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_layout.h"

namespace kestrel::cuda {
namespace {

namespace ml = moe_layout;

constexpr int kGroupThreads = 1024;
constexpr int kMaxGroupExperts = 8192;  // group kernel: two i32 counters per expert in shared memory
constexpr int kGemmWarps = 4;
constexpr int kGemmThreads = 32 * kGemmWarps;
constexpr int kCtaRows = ml::kTileRows * kGemmWarps;  // 64 output rows per CTA
constexpr int kCombineThreads = 256;

// ---- device helpers --------------------------------------------------------------------------------------
// Weights are read once per job: 16-byte loads that skip L1.
__device__ __forceinline__ uint4 ld_stream16(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_stream4(const uint8_t* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// Activations are shared by the four warps of a CTA: through L1.
__device__ __forceinline__ uint4 ld_act16(const uint16_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// d = A·B (C = 0) and d += A·B: m16n8k16, A row-major 16×16 BF16 (4 registers), B 16×8 BF16 (2), FP32 C/D.
__device__ __forceinline__ void mma_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}
__device__ __forceinline__ void mma_acc(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The four A registers (BF16 pairs) of one k16 step from its packed 32-bit word (moe_layout.h).
__device__ __forceinline__ void decode_step(uint32_t w, uint32_t (&a)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t r = ml::e2m1_pair_bits(w, j);
#ifdef KESTREL_MOE_INTEGER_DECODE
    a[j] = ml::e2m1_pair_bf16_exact(r);
#else
    a[j] = bf16x2_mul(r, ml::kBf16x2Pow126);
#endif
  }
}

// SiTU-GLU as cpu::situ_glu computes it (same operation order), on BF16-rounded g and u.
__device__ __forceinline__ float situ_glu(float g, float u, float beta, float lbeta) {
  const float act = beta * tanhf(g / beta) * dev::sigmoid(g);
  return act * (lbeta * tanhf(u / lbeta));
}

// ---- 1. grouping -----------------------------------------------------------------------------------------
// Exclusive block-wide scan of an int pair over kGroupThreads threads; *total gets the sums.
__device__ __forceinline__ int2 block_exclusive_scan2(int2 v, int2* warp_sums /* smem [32] */, int2* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int2 inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, inc.x, o), y = __shfl_up_sync(0xffffffffu, inc.y, o);
    if (lane >= o) inc.x += x, inc.y += y;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int2 s = warp_sums[lane];  // kGroupThreads = 1024: 32 warps, every entry written
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, s.x, o), y = __shfl_up_sync(0xffffffffu, s.y, o);
      if (lane >= o) s.x += x, s.y += y;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  *total = warp_sums[31];
  const int2 before = warp == 0 ? make_int2(0, 0) : warp_sums[warp - 1];
  return make_int2(before.x + inc.x - v.x, before.y + inc.y - v.y);
}

// ids i32 [n] → order i32 [n] (slots grouped by expert, ascending expert), jobs i32 [J, 3] = (expert, first
// position in order, count ≤ ct), *n_jobs = J. Ids outside [0, X) are left out. One block of kGroupThreads.
__global__ void __launch_bounds__(kGroupThreads) group_kernel(const int32_t* __restrict__ ids, int n, int X, int ct,
                                                             int32_t* __restrict__ order, int32_t* __restrict__ jobs,
                                                             int32_t* __restrict__ n_jobs) {
  extern __shared__ int32_t gsm[];  // count [X], cursor [X]
  __shared__ int2 warp_sums[32];
  int32_t* cnt = gsm;
  int32_t* cur = gsm + X;
  const int tid = threadIdx.x;
  for (int e = tid; e < X; e += kGroupThreads) cnt[e] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += kGroupThreads) {
    const int e = ids[i];
    if (unsigned(e) < unsigned(X)) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  // Each thread owns experts [e0, e1): its slot and job totals are scanned across the block.
  const int per = (X + kGroupThreads - 1) / kGroupThreads;
  const int e0 = min(tid * per, X), e1 = min(e0 + per, X);
  int2 mine = make_int2(0, 0);
  for (int e = e0; e < e1; ++e) mine.x += cnt[e], mine.y += (cnt[e] + ct - 1) / ct;
  int2 total;
  int2 base = block_exclusive_scan2(mine, warp_sums, &total);
  for (int e = e0; e < e1; ++e) {
    const int c = cnt[e];
    cur[e] = base.x;
    for (int j = 0; j * ct < c; ++j) {
      int32_t* jb = jobs + 3 * int64_t(base.y + j);
      jb[0] = e;
      jb[1] = base.x + j * ct;
      jb[2] = min(ct, c - j * ct);
    }
    base.x += c;
    base.y += (c + ct - 1) / ct;
  }
  if (tid == 0) *n_jobs = total.y;
  __syncthreads();
  for (int i = tid; i < n; i += kGroupThreads) {
    const int e = ids[i];
    if (unsigned(e) < unsigned(X)) order[atomicAdd(&cur[e], 1)] = i;
  }
}

// ---- 2./3. grouped MXFP4 GEMM ----------------------------------------------------------------------------
struct GemmArgs {
  const uint16_t* x;       // bf16 B rows: slot s reads x + (s / x_div)·ldx (z by token, or a by slot)
  int64_t ldx;
  int x_div;
  const int32_t* order;    // i32 [n] slots grouped by expert
  const int32_t* jobs;     // i32 [J, 3] (expert, first position in order, count)
  const int32_t* n_jobs;   // i32 [1] J
  const uint8_t* p0;       // W1 (GLU) or W: packed, kernel layout
  const uint8_t* s0;       //   e8m0 scales, kernel layout
  const uint8_t* p1;       // W3 (GLU only)
  const uint8_t* s1;
  int64_t p_stride, s_stride;  // bytes between experts
  int R, C;                // rows of W (outputs), columns (K); R % 64 == 0, C % 64 == 0
  uint16_t* out;           // bf16 [n, R]: the row of slot s at out + s·R
  float beta, lbeta;       // SiTU betas (GLU only)
};

// NT n-tiles of 8 tokens per job (CT = 8·NT), STAGES chunks of 64 columns in flight per warp.
template <bool kGlu, int NT, int STAGES, bool kSpecial>
__global__ void __launch_bounds__(kGemmThreads) expert_gemm_kernel(const GemmArgs a) {
  constexpr int NM = kGlu ? 2 : 1;  // weight matrices per warp
  const int n_rg = a.R / kCtaRows;
  const int nj = *a.n_jobs;
  const int64_t item = blockIdx.x;
  if (item >= int64_t(nj) * n_rg) return;  // beyond the device's work list
  // Consecutive CTAs take the same rows of consecutive jobs (an expert's chunks are adjacent): L2 reuse.
  const int rg = int(item / nj), job = int(item - int64_t(rg) * nj);
  const int e = a.jobs[3 * job], begin = a.jobs[3 * job + 1], count = a.jobs[3 * job + 2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tile = rg * kGemmWarps + warp;
  const int NC = a.C / ml::kChunkCols;

  const int64_t tile_chunks = int64_t(tile) * NC;
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
    const int slot = a.order[begin + min(q * 8 + g, count - 1)];
    brow[q] = a.x + int64_t(slot / a.x_div) * a.ldx + 8 * t;
  }

  struct Stage {
    uint4 w[NM];      // packed A words of one chunk
    uint32_t s[NM];   // scale word (rows g, g+8 × blocks 0, 1)
    uint4 b[NT][2];   // B: 8 bf16 of block 0 and block 1
  };
  Stage st[STAGES];
  float acc[NM][NT][4];
#pragma unroll
  for (int m = 0; m < NM; ++m)
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][q][i] = 0.0f;

  auto load = [&](Stage& S, int c) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      S.w[m] = ld_stream16(wp[m] + int64_t(c) * ml::kTileChunkBytes);
      S.s[m] = ld_stream4(wsc[m] + int64_t(c) * ml::kTileChunkScaleBytes);
    }
#pragma unroll
    for (int q = 0; q < NT; ++q) {
      S.b[q][0] = ld_act16(brow[q] + c * ml::kChunkCols);
      S.b[q][1] = ld_act16(brow[q] + c * ml::kChunkCols + 32);
    }
  };
  auto compute = [&](const Stage& S) {
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const uint32_t words[4] = {S.w[m].x, S.w[m].y, S.w[m].z, S.w[m].w};
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // e8m0 block b of the chunk = k16 steps 2b, 2b+1
        const float sc_g = __uint_as_float(ml::e8m0_f32_bits<kSpecial>(S.s[m], 2 * b));
        const float sc_g8 = __uint_as_float(ml::e8m0_f32_bits<kSpecial>(S.s[m], 2 * b + 1));
        uint32_t a0[4], a1[4];
        decode_step(words[2 * b], a0);
        decode_step(words[2 * b + 1], a1);
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          const uint4 B = S.b[q][b];
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
  };

  // Software pipeline: chunk c lives in st[c % STAGES]; the load of chunk c + STAGES − 1 is issued before
  // chunk c is consumed.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < NC) load(st[s], s);
  for (int c0 = 0; c0 < NC; c0 += STAGES) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int c = c0 + s;
      if (c < NC) {
        if (c + STAGES - 1 < NC) load(st[(s + STAGES - 1) % STAGES], c + STAGES - 1);
        compute(st[s]);
      }
    }
  }

  // Epilogue: C fragment (c0, c1) = row g, tokens 2t, 2t+1; (c2, c3) = row g+8.
  const int row0 = tile * ml::kTileRows + g;
#pragma unroll
  for (int q = 0; q < NT; ++q) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = q * 8 + 2 * t + i;
      if (n >= count) continue;
      uint16_t* o = a.out + int64_t(a.order[begin + n]) * a.R;
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int idx = 2 * rr + i;
        if constexpr (kGlu) {
          o[row0 + 8 * rr] = dev::f32_to_bf16(
              situ_glu(dev::round_bf16(acc[0][q][idx]), dev::round_bf16(acc[1][q][idx]), a.beta, a.lbeta));
        } else {
          o[row0 + 8 * rr] = dev::f32_to_bf16(acc[0][q][idx]);
        }
      }
    }
  }
}

// ---- 4. combine ------------------------------------------------------------------------------------------
// ũ[t, j..j+7] = bf16(Σ_k w[t,k]·y[t·K+k, j..j+7]), FP32 in top-k order; out-of-range ids add nothing.
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const uint16_t* __restrict__ y,
                                                                  const float* __restrict__ wts,
                                                                  const int32_t* __restrict__ ids, int64_t T, int K,
                                                                  int X, int Lt, uint16_t* __restrict__ ut) {
  const int per = Lt / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * per) return;
  const int64_t t = i / per;
  const int j = int(i - t * per) * 8;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < K; ++k) {
    const int64_t slot = t * K + k;
    if (unsigned(ids[slot]) >= unsigned(X)) continue;
    const float w = wts[slot];
    float f[8];
    dev::unpack8(dev::ld16(y + slot * Lt + j), f);
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(w, f[q]));  // no FMA: as the CPU twin
  }
  *reinterpret_cast<uint4*>(ut + t * Lt + j) = dev::pack8(acc);
}

// ---- launchers -------------------------------------------------------------------------------------------
size_t round256(size_t n) { return (n + 255) & ~size_t(255); }

int token_tile(MoeTokenTile tile, int64_t n, int64_t X) {
  if (tile == MoeTokenTile::t8) return 8;
  if (tile == MoeTokenTile::t32) return 32;
  return n >= 16 * std::min(X, n) ? 32 : 8;
}

struct Groups {
  int32_t* order;   // i32 [n]
  int32_t* jobs;    // i32 [job_bound(n, X, 8), 3]
  int32_t* n_jobs;  // i32 [1]
};
size_t groups_bytes(int64_t n, int64_t X) {
  return round256(size_t(n) * 4) + round256(size_t(ml::job_bound(n, X, 8)) * 12) + round256(4);
}
Groups carve_groups(char*& p, int64_t n, int64_t X) {
  Groups g;
  g.order = reinterpret_cast<int32_t*>(p);
  p += round256(size_t(n) * 4);
  g.jobs = reinterpret_cast<int32_t*>(p);
  p += round256(size_t(ml::job_bound(n, X, 8)) * 12);
  g.n_jobs = reinterpret_cast<int32_t*>(p);
  p += round256(4);
  return g;
}

void launch_group(const int32_t* ids, int64_t n, int64_t X, int ct, const Groups& g, cudaStream_t stream) {
  const size_t smem = size_t(2 * X) * 4;
  if (smem > 48 * 1024)
    KCUDA_CHECK(cudaFuncSetAttribute(group_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  group_kernel<<<1, kGroupThreads, smem, stream>>>(ids, int(n), int(X), ct, g.order, g.jobs, g.n_jobs);
  KCUDA_CHECK_LAUNCH();
}

template <bool kGlu, int NT, int STAGES>
void launch_gemm_nt(const GemmArgs& a, bool special, unsigned grid, cudaStream_t stream) {
  if (special)
    expert_gemm_kernel<kGlu, NT, STAGES, true><<<grid, kGemmThreads, 0, stream>>>(a);
  else
    expert_gemm_kernel<kGlu, NT, STAGES, false><<<grid, kGemmThreads, 0, stream>>>(a);
  KCUDA_CHECK_LAUNCH();
}

// grid = (bound on jobs) × (row groups of 64); CTAs past the device's job count return at once.
template <bool kGlu>
void launch_gemm(const GemmArgs& a, int ct, bool special, int64_t n, int64_t X, cudaStream_t stream) {
  const int64_t grid = ml::job_bound(n, X, ct) * (a.R / kCtaRows);
  KCUDA_REQUIRE(grid > 0 && grid < (int64_t(1) << 31), "moe expert GEMM: grid " + std::to_string(grid));
  if (ct == 8)
    launch_gemm_nt<kGlu, 1, 4>(a, special, unsigned(grid), stream);
  else
    launch_gemm_nt<kGlu, 4, 2>(a, special, unsigned(grid), stream);
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

}  // namespace

size_t moe_experts_workspace_bytes(int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I) {
  const int64_t n = T * K;
  return groups_bytes(n, X) + round256(size_t(n * I) * 2) + round256(size_t(n * Lt) * 2);
}

void moe_experts_mxfp4(const uint16_t* z, const int32_t* ids, const float* weights, const MoeExpertWeights& w,
                       int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                       void* workspace, uint16_t* ut, cudaStream_t stream, MoeTokenTile tile) {
  KCUDA_REQUIRE(z && ids && weights && workspace && ut && w.w1_packed && w.w1_scale && w.w3_packed && w.w3_scale &&
                    w.w2_packed && w.w2_scale,
                std::string("moe_experts_mxfp4: null pointer"));
  KCUDA_REQUIRE(w.layout == kMoeExpertLayout,
                std::string("moe_experts_mxfp4: expert weights are not in the kernels' layout (pack_experts_mxfp4)"));
  KCUDA_REQUIRE(Lt > 0 && I > 0 && Lt % 64 == 0 && I % 64 == 0 && Lt < (1 << 24) && I < (1 << 24),
                "moe_experts_mxfp4: Lt = " + std::to_string(Lt) + ", I = " + std::to_string(I) +
                    " must be positive multiples of 64");
  KCUDA_REQUIRE(X > 0 && X <= kMaxGroupExperts && K > 0 && K <= X,
                "moe_experts_mxfp4: X = " + std::to_string(X) + ", K = " + std::to_string(K));
  KCUDA_REQUIRE(T >= 0 && T * K < (int64_t(1) << 31), std::string("moe_experts_mxfp4: bad T"));
  KCUDA_REQUIRE(w.w13_packed_stride >= I * Lt / 2 && w.w13_scale_stride >= I * Lt / 32 &&
                    w.w2_packed_stride >= Lt * I / 2 && w.w2_scale_stride >= Lt * I / 32,
                std::string("moe_experts_mxfp4: expert strides too small"));
  KCUDA_REQUIRE(aligned(z, 16) && aligned(ut, 16) && aligned(w.w1_packed, 16) && aligned(w.w3_packed, 16) &&
                    aligned(w.w2_packed, 16) && aligned(w.w1_scale, 4) && aligned(w.w3_scale, 4) &&
                    aligned(w.w2_scale, 4) && w.w13_packed_stride % 16 == 0 && w.w2_packed_stride % 16 == 0 &&
                    w.w13_scale_stride % 4 == 0 && w.w2_scale_stride % 4 == 0 && aligned(workspace, 256),
                std::string("moe_experts_mxfp4: z, ũ and packed weights must be 16-byte aligned, scales 4-byte"));
  if (T == 0) return;
  const int64_t n = T * K;
  const int ct = token_tile(tile, n, X);
  char* p = static_cast<char*>(workspace);
  const Groups grp = carve_groups(p, n, X);
  uint16_t* act = reinterpret_cast<uint16_t*>(p);  // bf16 [n, I], row per slot
  p += round256(size_t(n * I) * 2);
  uint16_t* y = reinterpret_cast<uint16_t*>(p);    // bf16 [n, Lt], row per slot

  launch_group(ids, n, X, ct, grp, stream);
  const GemmArgs a13{z,           Lt,          int(K),      grp.order,  grp.jobs,
                     grp.n_jobs,  w.w1_packed, w.w1_scale,  w.w3_packed, w.w3_scale,
                     w.w13_packed_stride,      w.w13_scale_stride,       int(I),
                     int(Lt),     act,         situ_beta,   situ_linear_beta};
  launch_gemm<true>(a13, ct, w.special_scales, n, X, stream);
  const GemmArgs a2{act,        I,           1,          grp.order, grp.jobs,
                    grp.n_jobs, w.w2_packed, w.w2_scale, nullptr,   nullptr,
                    w.w2_packed_stride,      w.w2_scale_stride,     int(Lt),
                    int(I),     y,           0.0f,       0.0f};
  launch_gemm<false>(a2, ct, w.special_scales, n, X, stream);
  const int64_t outs = T * (Lt / 8);
  KCUDA_REQUIRE((outs + kCombineThreads - 1) / kCombineThreads < (int64_t(1) << 31),
                std::string("moe_experts_mxfp4: too many outputs"));
  combine_kernel<<<unsigned((outs + kCombineThreads - 1) / kCombineThreads), kCombineThreads, 0, stream>>>(
      y, weights, ids, T, int(K), int(X), int(Lt), ut);
  KCUDA_CHECK_LAUNCH();
}

size_t mxfp4_matmul_workspace_bytes(int64_t T) { return round256(size_t(T) * 4) + groups_bytes(T, 1); }

void mxfp4_matmul_packed(const uint16_t* x, const uint8_t* packed, const uint8_t* scale, bool special_scales,
                         int64_t T, int64_t R, int64_t C, void* workspace, uint16_t* y, cudaStream_t stream,
                         MoeTokenTile tile) {
  KCUDA_REQUIRE(x && packed && scale && workspace && y, std::string("mxfp4_matmul_packed: null pointer"));
  KCUDA_REQUIRE(R > 0 && C > 0 && R % 64 == 0 && C % 64 == 0 && R < (1 << 24) && C < (1 << 24),
                "mxfp4_matmul_packed: R = " + std::to_string(R) + ", C = " + std::to_string(C) +
                    " must be positive multiples of 64");
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("mxfp4_matmul_packed: bad T"));
  KCUDA_REQUIRE(aligned(x, 16) && aligned(packed, 16) && aligned(scale, 4) && aligned(workspace, 256),
                std::string("mxfp4_matmul_packed: x and packed must be 16-byte aligned, scales 4-byte"));
  if (T == 0) return;
  const int ct = token_tile(tile, T, 1);
  char* p = static_cast<char*>(workspace);
  int32_t* ids = reinterpret_cast<int32_t*>(p);  // every row routed to "expert" 0
  p += round256(size_t(T) * 4);
  const Groups grp = carve_groups(p, T, 1);
  KCUDA_CHECK(cudaMemsetAsync(ids, 0, size_t(T) * 4, stream));
  launch_group(ids, T, 1, ct, grp, stream);
  const GemmArgs a{x,       C,      1,       grp.order, grp.jobs, grp.n_jobs, packed, scale, nullptr, nullptr,
                   0,       0,      int(R),  int(C),    y,        0.0f,       0.0f};
  launch_gemm<false>(a, ct, special_scales, T, 1, stream);
}

}  // namespace kestrel::cuda
