// Routed MoE experts (MODEL.md §3.6 steps 3–4) on tensor cores: W4A16, MXFP4 weights dequantised in
// registers, BF16 mma.sync.m16n8k16 with FP32 accumulation. Contract in moe.h; weight layout and the
// E2M1 decode trick in moe_layout.h; shared device code in moe_mma.cuh. CPU twin: cpu::moe_experts.
//
// Four launches on one stream, no host synchronisation, fixed grids (CUDA-graph capturable):
//   1. group (one block): slots (t·K + k) counted per expert, scanned, scattered into expert order; the
//      experts' tokens cut into jobs of at most CT tokens, written as a device work list (expert, first
//      position, count) with its length. It also zeroes the decode GEMMs' counters. Ungrouped decode (one job
//      per slot: stream at T ≤ 2, t8 at T = 1, where the top-k slots are distinct experts) runs prep_kernel
//      instead, which only zeroes them; t8's GEMMs then read the ids (from before prep_kernel) and their first
//      weight stages before their PDL wait. H200 (session 22, bench_moe, alternated): T = 1 graph 109.3 / 108.2 →
//      105.7 / 105.9 µs (61 → 62 % of copy); the reduced mini's step unchanged within its noise (±1 µs). Zeroing
//      them in the router's launch instead, with no prep_kernel, measured within the noise (session 24: prep_kernel
//      triggers its dependents at once, so w1|w3 already starts with it).
//   2. w1|w3 with SiTU-GLU fused: a = bf16(SiTU-GLU(bf16 g, bf16 u)) per slot. Ungrouped t8 at the real shape:
//      persistent (moe_t8p.cu: a resident grid, each CTA streaming tiles in turn through one pipeline, each tile's
//      K in halves over two warps), and w2 beside it splits K in 2. H200 (bench_moe, alternated): T = 1 graph
//      100.4–100.5 → 94.0–94.6 µs with whole tiles (session 26), → 91.5–92.0 µs (71–72 % of copy) with K halves
//      and 4 CTAs an SM (session 27). KESTREL_MOE_T8P=0 (or MoeExpertsOptions::t8_persist = 0): the fixed grid.
//   3. w2: y = bf16(a·W2ᵀ) per slot. Ungrouped t8: it starts during w1|w3's last wave and each CTA waits only
//      for its own slot's w1|w3 tiles (per-slot readiness counters, zeroed with the split counters; moe_t8.cu).
//      H200 (session 23, bench_moe, alternated): T = 1 graph 106.5 → 102.5 µs (62 → 65 % of copy). t8 hands
//      it h·2^100 and it decodes without the BF16 multiply (GemmArgs::h_scaled; moe_t8.cu kScaleRaw).
//   4. combine: ũ_t = bf16(Σ_k w_k·y_k) in top-k order, FP32; deterministic (no atomics on values); with
//      MoeExpertsOptions::norm_w also §3.6 step 5's RMSNorm of ũ (moe_combine.cu: one CTA per token, or at T ≤ 64
//      with MoeExpertsOptions::combine_cluster / KESTREL_MOE_COMBINE_CLUSTER=1 a cluster of CTAs per token).
// Four GEMM families (moe.h MoeTokenTile):
//   stream (moe_stream.cu), decode: persistent stream-K grid, CT = 8, scales folded into the decode.
//   wide (moe_wide.cu), prefill: CT = 128, 8-warp CTAs of 128/256 weight rows × all the job's tokens.
//   t8 / t32 (moe_t8.cu): one CTA = 4 warps = 64 rows for one job, FP32 scale per 32-column block (where the
//      codes allow, t8's w1|w3 folds them into the decode and w2 takes h·2^100 raw): the path for weights whose
//      scales cannot be folded, and (t8) the decode path, its K split over 2–8 CTAs when few jobs would leave its
//      last wave almost empty (the tile counters and partials below).
//   dense (moe_dense.cu), large prefill: per hit expert, dequantise to BF16 and two cuBLASLt GEMMs; the one
//      path with a host synchronisation (it reads the job list), so never chosen while a graph is captured.
// With stream, wide and t8, launches 2–4 use programmatic dependent launch (moe_mma.cuh): each starts its CTAs
// while the previous kernel drains, the stream GEMMs even their first weight loads.
// The order of tokens inside an expert (atomic scatter) never changes a value: every (row, token) output is
// its own MMA column with the same K order.
//
// Bytes and time (H200, 4.27 TB/s copy; an expert is 17.55 MB: w1|w3 11.70 MB with scales, w2 5.85 MB):
//   T = 1: 16 experts, 281 MB → 66 µs at copy speed. The fixed-grid t8 kernels measured 124 µs (53 %; per
//   launch, PDL off: group 8.6, w1|w3 72.6 = 61 %, w2 48.1 = 46 %, combine 5.9): 768 and 896 CTAs for 528
//   and 792 slots (1.45 and 1.13 waves; the second runs with a few warps per SM, far too few bytes in flight),
//   while at T = 8 (11 waves) the same kernels stream at 80 / 74 %. stream was meant to fix that but streams
//   slower per byte (52 % at T = 8, without PDL; not for its ring: moe_stream.cu), so T = 1 splits
//   t8's K instead (session 12: w1|w3 and w2 × 2; since session 21 w1|w3 × 3 and w2 unsplit at 8 CTAs per SM;
//   session 22, ungrouped: 106 µs = 62 % of copy in the graph; session 23, w2 per-slot readiness: 102.5 µs = 65 %;
//   session 25, w2's raw decode: 100.4–101.0 µs = 66 %; session 26, persistent w1|w3: 94.0–94.6 µs = 70 %; session 27, its K halves: 91.5–92.0 µs = 71–72 %).
//   See bench/RESULTS.md.
//   T = 4096: 4.3 TFLOP (16 slots × 4096 tokens × 3 GEMMs of 3584 × 3072). t32: 26.6 ms (163 TFLOP/s: an FFMA per
//   accumulator per 32-column block, 4 HMMA per decoded word). wide: 2·⌈count/8⌉ HMMA per decoded word, no
//   scale FMAs, ≈ 2.2 instructions per HMMA; ≈ 73 tokens per expert = 10 n-tiles of 16; predicted 8–11 ms.
// Emulation: tests/emu (test_emu_moe.cpp) compiles this file for the CPU emulation of simt.h and runs the launchers
// as they are (the CUDA runtime they call: tests/emu/simt_runtime.h); only what g++ cannot take is behind
// KESTREL_SIMT_EMU: the <<<...>>> launches (there the same grids through moe_detail::launch, PDL off as here) and the
// extern __shared__ declaration (there the emulator's dynamic shared memory).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_layout.h"
#include "kernels/cuda/moe_mma.cuh"

namespace kestrel::cuda {
namespace {

namespace ml = moe_layout;
using namespace moe_dev;
using moe_detail::GemmArgs;
using moe_detail::StreamArgs;

constexpr int kGroupThreads = 1024;
constexpr int kMaxGroupExperts = 8192;  // group kernel: two i32 counters per expert in shared memory

// ---- device helpers: moe_mma.cuh ---------------------------------------------------------------------

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
// Also zeroes the decode GEMMs' split-tile counters, i32 [n_zero].
__global__ void __launch_bounds__(kGroupThreads) group_kernel(const int32_t* __restrict__ ids, int n, int X, int ct,
                                                             int32_t* __restrict__ order, int32_t* __restrict__ jobs,
                                                             int32_t* __restrict__ n_jobs, int32_t* __restrict__ zero,
                                                             int n_zero) {
#ifndef KESTREL_SIMT_EMU
  extern __shared__ int32_t gsm[];  // count [X], cursor [X]
#else
  int32_t* const gsm = dev::dyn_smem<int32_t>();
#endif
  __shared__ int2 warp_sums[32];
  griddep_launch();  // the next GEMM may start its CTAs now; it waits for this kernel before reading its output
  int32_t* cnt = gsm;
  int32_t* cur = gsm + X;
  const int tid = threadIdx.x;
  for (int i = tid; i < n_zero; i += kGroupThreads) zero[i] = 0;
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

// Ungrouped decode: only the counters to zero, i32 [n_zero].
__global__ void __launch_bounds__(kGroupThreads) prep_kernel(int32_t* __restrict__ zero, int n_zero) {
  griddep_launch();
  for (int i = threadIdx.x; i < n_zero; i += kGroupThreads) zero[i] = 0;
}

// ---- launchers -------------------------------------------------------------------------------------------
size_t round256(size_t n) { return (n + 255) & ~size_t(255); }

enum class Path { t8, t32, stream, wide, dense };

bool env_is(const char* name, const char* value) {
  const char* s = std::getenv(name);
  return s != nullptr && std::strcmp(s, value) == 0;
}

// moe.h MoeTokenTile; n slots over X experts.
constexpr int64_t kDenseMinSlots = 256;  // slots per hit expert from which dequantise + cuBLASLt wins (moe_dense.cu)
int64_t slots_per_expert(int64_t n, int64_t X) { return n / std::max<int64_t>(1, std::min(X, n)); }
Path choose_path(MoeTokenTile tile, int64_t n, int64_t X, bool fp32_scales) {
  // see moe.h: t8 (K split for few slots) and t32 measured faster than stream at every size
  static const bool all_new = env_is("KESTREL_MOE_PATH", "stream");
  static const bool all_old = env_is("KESTREL_MOE_PATH", "t8");
  const int64_t per_expert = n / std::max<int64_t>(1, std::min(X, n));  // slots per possibly-hit expert
  switch (tile) {
    case MoeTokenTile::t8:
      return Path::t8;
    case MoeTokenTile::t32:
      return Path::t32;
    case MoeTokenTile::stream:
      return fp32_scales ? Path::t8 : Path::stream;
    case MoeTokenTile::wide:
      return fp32_scales ? Path::t32 : Path::wide;
    case MoeTokenTile::dense:
      return Path::dense;
    case MoeTokenTile::automatic:
      break;
  }
  if (fp32_scales || all_old) return per_expert >= 16 ? Path::t32 : Path::t8;
  if (all_new) return per_expert >= 16 ? Path::wide : Path::stream;
  return per_expert >= 16 ? Path::t32 : Path::t8;
}
int path_ct(Path p) { return p == Path::t32 ? 32 : p == Path::wide ? moe_detail::kWideTokens : 8; }
bool use_pdl(Path p, const MoeExpertsOptions& opt) {
  static const bool env_off = env_is("KESTREL_MOE_PDL", "0");
  if (opt.marks != nullptr || p == Path::t32 || p == Path::dense) return false;
  return opt.pdl == 1 || (opt.pdl == -1 && !env_off);
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
// The decode GEMMs' scratch: partials f32 (shared by w1|w3 and w2, which run one after the other) and two
// counter arrays i32 [kMaxStreamWarps].
struct StreamScratch {
  float* partial;
  int32_t* counters;  // w1|w3 at counters, w2 at counters + kMaxStreamWarps
};
size_t stream_scratch_bytes() {
  return round256(moe_detail::kStreamPartialBytes) + round256(2 * moe_detail::kStreamCounterBytes);
}
StreamScratch carve_stream(char*& p) {
  StreamScratch s;
  s.partial = reinterpret_cast<float*>(p);
  p += round256(moe_detail::kStreamPartialBytes);
  s.counters = reinterpret_cast<int32_t*>(p);
  p += round256(2 * moe_detail::kStreamCounterBytes);
  return s;
}

void launch_group(const int32_t* ids, int64_t n, int64_t X, int ct, const Groups& g, int32_t* zero, int n_zero,
                  cudaStream_t stream) {
  const size_t smem = size_t(2 * X) * 4;
#ifndef KESTREL_SIMT_EMU
  if (smem > 48 * 1024)
    KCUDA_CHECK(cudaFuncSetAttribute(group_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  group_kernel<<<1, kGroupThreads, smem, stream>>>(ids, int(n), int(X), ct, g.order, g.jobs, g.n_jobs, zero, n_zero);
  KCUDA_CHECK_LAUNCH();
#else
  moe_detail::launch(group_kernel, dim3(1), dim3(kGroupThreads), smem, stream, false, ids, int(n), int(X), ct, g.order,
                     g.jobs, g.n_jobs, zero, n_zero);
#endif
}

// One GEMM (w1|w3 if glu, else w / w2) over the grouping `grp` (ungrouped stream path: grp.jobs == nullptr)
// by path p; `first`: the GEMM right after the grouping kernel.
void run_gemm(Path p, bool glu, const GemmArgs& a, const Groups& grp, const int32_t* ids, int64_t n, int64_t X,
              bool special, bool fold_ok, const StreamScratch& ss, int ctas, bool first, bool pdl,
              cudaStream_t stream) {
  switch (p) {
    case Path::t8:
    case Path::t32:
      moe_detail::launch_fixed(a, glu, path_ct(p), special, fold_ok, n, X, pdl, stream);
      return;
    case Path::stream: {
      const StreamArgs s{a, ids, int(n), int(X), ss.partial, ss.counters + (glu ? 0 : moe_detail::kMaxStreamWarps),
                         first && grp.jobs != nullptr};
      moe_detail::launch_stream(s, glu, ctas, pdl, stream);
      return;
    }
    case Path::wide:
      moe_detail::launch_wide(a, glu, ml::job_bound(n, X, moe_detail::kWideTokens), pdl, stream);
      return;
    case Path::dense:  // moe_dense.cu runs both GEMMs itself
      KCUDA_REQUIRE(false, std::string("moe expert GEMM: the dense path has no grouped-kernel GEMM"));
  }
}

// t8 ungrouped at T = 1 (GemmArgs::ids) unless KESTREL_MOE_T8_UNGROUPED=0 (A/B).
bool t8_ungrouped_allowed() {
  static const bool on = !env_is("KESTREL_MOE_T8_UNGROUPED", "0");
  return on;
}

// w2's first weight stages before its PDL wait (GemmArgs::w_early) unless KESTREL_MOE_W_EARLY=0 (A/B).
bool w_early_allowed() {
  static const bool on = !env_is("KESTREL_MOE_W_EARLY", "0");
  return on;
}

// w1|w3's scales folded into the decode (GemmArgs::no_fold false) unless KESTREL_MOE_FOLD=0 (A/B).
bool fold_env_off() {
  static const bool off = env_is("KESTREL_MOE_FOLD", "0");
  return off;
}

// t8: h handed to w2 as h·2^100 for its raw decode (moe_t8.cu kScaleRaw) unless KESTREL_MOE_RAW=0 (A/B).
bool t8_raw_allowed() {
#ifdef KESTREL_MOE_INTEGER_DECODE
  return false;  // the raw decode relies on BF16 subnormal inputs
#else
  static const bool on = !env_is("KESTREL_MOE_RAW", "0");
  return on;
#endif
}

// Ungrouped t8: w2 waits per slot for w1|w3's tiles (GemmArgs::ready) instead of the whole grid, unless
// KESTREL_MOE_T8_READY=0 (A/B).
bool t8_ready_allowed() {
  static const bool on = !env_is("KESTREL_MOE_T8_READY", "0");
  return on;
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

void mark(const MoeExpertsOptions& opt, int i, cudaStream_t stream) {
  if (opt.marks != nullptr) KCUDA_CHECK(cudaEventRecord(opt.marks[i], stream));
}

}  // namespace

size_t moe_experts_workspace_bytes(int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, MoeTokenTile tile) {
  const int64_t n = T * K;
  const bool dense = tile == MoeTokenTile::dense ||
                     (tile == MoeTokenTile::automatic && slots_per_expert(n, X) >= kDenseMinSlots);
  return groups_bytes(n, X) + round256(size_t(n * I) * 2) + round256(size_t(n * Lt) * 2) + stream_scratch_bytes() +
         (dense ? moe_detail::dense_scratch_bytes(T, Lt, I) : 0);
}

void moe_experts_mxfp4(const uint16_t* z, const int32_t* ids, const float* weights, const MoeExpertWeights& w,
                       int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                       void* workspace, uint16_t* ut, cudaStream_t stream, MoeTokenTile tile) {
  MoeExpertsOptions opt;
  opt.tile = tile;
  moe_experts_mxfp4(z, ids, weights, w, T, X, K, Lt, I, situ_beta, situ_linear_beta, workspace, ut, stream, opt);
}

void moe_experts_mxfp4(const uint16_t* z, const int32_t* ids, const float* weights, const MoeExpertWeights& w,
                       int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                       void* workspace, uint16_t* ut, cudaStream_t stream, const MoeExpertsOptions& opt) {
  KCUDA_REQUIRE(z && ids && weights && workspace && ut && w.w1_packed && w.w1_scale && w.w3_packed && w.w3_scale &&
                    w.w2_packed && w.w2_scale,
                std::string("moe_experts_mxfp4: null pointer"));
  KCUDA_REQUIRE(w.layout == kMoeExpertLayout,
                std::string("moe_experts_mxfp4: expert weights are not in the kernels' layout (pack_experts_mxfp4)"));
  KCUDA_REQUIRE(Lt > 0 && I > 0 && Lt % 64 == 0 && I % 64 == 0 && Lt < (1 << 24) && I < (1 << 24),
                "moe_experts_mxfp4: Lt = " + std::to_string(Lt) + ", I = " + std::to_string(I) +
                    " must be positive multiples of 64");
  // K may exceed X: under expert parallelism X is the rank's own experts (moe_local_ids) and K the global top-k.
  KCUDA_REQUIRE(X > 0 && X <= kMaxGroupExperts && K > 0 && K <= 64,
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
  Path path = choose_path(opt.tile, n, X, w.fp32_scales || w.special_scales);
  if (opt.tile == MoeTokenTile::automatic && opt.lt != nullptr && slots_per_expert(n, X) >= kDenseMinSlots) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    KCUDA_CHECK(cudaStreamIsCapturing(stream, &cs));
    if (cs == cudaStreamCaptureStatusNone) path = Path::dense;
  }
  KCUDA_REQUIRE(path != Path::dense || opt.lt != nullptr,
                std::string("moe_experts_mxfp4: the dense path needs MoeExpertsOptions::lt"));
  const int ct = path_ct(path);
  const bool pdl = use_pdl(path, opt);
  // Ungrouped (no grouping kernel, one job per slot): stream at T ≤ 2; t8 at T = 1, where the token's top-k
  // slots are distinct experts, so there is nothing to share, and both GEMMs may load weights before their PDL
  // wait (the ids come from before prep_kernel).
  const bool grouped = path == Path::stream ? opt.grouped == 1 || (opt.grouped == -1 && T > 2)
                       : path == Path::t8   ? opt.grouped == 1 || (opt.grouped == -1 && (T > 1 || !t8_ungrouped_allowed()))
                                            : true;
  char* p = static_cast<char*>(workspace);
  Groups grp = carve_groups(p, n, X);
  uint16_t* act = reinterpret_cast<uint16_t*>(p);  // bf16 [n, I], row per slot
  p += round256(size_t(n * I) * 2);
  uint16_t* y = reinterpret_cast<uint16_t*>(p);    // bf16 [n, Lt], row per slot
  p += round256(size_t(n * Lt) * 2);
  const StreamScratch ss = carve_stream(p);
  int ctas13 = 0, ctas2 = 0;
  if (path == Path::stream) {
    ctas13 = moe_detail::stream_grid(true, opt.stream_ctas);
    ctas2 = moe_detail::stream_grid(false, opt.stream_ctas);
  }
  // Counters to zero: w1|w3's [0, 4·ctas13) and w2's [kMaxStreamWarps, kMaxStreamWarps + 4·ctas2): one range.
  int n_zero = path == Path::stream ? moe_detail::kMaxStreamWarps + moe_detail::kStreamWarps * ctas2 : 0;
  // t8: the K splits and counters (moe_t8.cu plan_t8), the persistent w1|w3 (moe_t8p.cu) where it applies.
  moe_detail::T8Plan t8;
  if (path == Path::t8) {
    t8 = moe_detail::plan_t8(grouped, w.special_scales, n, X, Lt, I, opt.t8_ksplit, opt.t8_persist, opt.t8p_split,
                             opt.t8p_ctas, opt.t8p_kh, int64_t(moe_detail::kStreamPartialBytes / 4),
                             2 * int64_t(moe_detail::kMaxStreamWarps));
    n_zero = t8.n_zero;
  }
  // Ungrouped t8 with w2's early weights: per-slot readiness counters after the split counters (GemmArgs::ready),
  // zeroed with them.
  int32_t* ready = nullptr;
  if (path == Path::t8 && !grouped && w_early_allowed() && t8_ready_allowed() &&
      n_zero + n <= 2 * int64_t(moe_detail::kMaxStreamWarps)) {
    ready = ss.counters + n_zero;
    n_zero += int(n);
  }

  // t8: w1|w3 hands w2 h·2^100 for its raw decode (GemmArgs::h_scaled) where the codes allow the fold and
  // |h| ≤ β·β_lin (SiTU) stays far below BF16's 2^128 / 2^100.
  const int t8_scales = opt.t8_scales >= 0               ? opt.t8_scales
                        : fold_env_off()                  ? 0
                        : t8_raw_allowed()                ? 2
                                                          : 1;
  const bool h_scaled = path == Path::t8 && t8_scales == 2 && !w.special_scales && !w.fp32_scales &&
                        std::fabs(situ_beta * situ_linear_beta) < 1e6f;

  mark(opt, 0, stream);
  if (path == Path::dense) {
    // One job per hit expert (ct = n); the GEMMs on cuBLASLt, y in slot order for the combine below.
    launch_group(ids, n, X, int(n), grp, ss.counters, 0, stream);
    mark(opt, 1, stream);
    const moe_detail::DenseArgs da{z,   int(K), grp.order, grp.jobs,  grp.n_jobs, &w,       T,  n, X,
                                   Lt,  I,      situ_beta, situ_linear_beta,       opt.lt,   p,  y};
    moe_detail::run_dense(da, stream);
    mark(opt, 2, stream);
    mark(opt, 3, stream);
  } else if (grouped) {
    launch_group(ids, n, X, ct, grp, ss.counters, n_zero, stream);
  } else {
    grp = Groups{nullptr, nullptr, nullptr};
#ifndef KESTREL_SIMT_EMU
    prep_kernel<<<1, kGroupThreads, 0, stream>>>(ss.counters, n_zero);
    KCUDA_CHECK_LAUNCH();
#else
    moe_detail::launch(prep_kernel, dim3(1), dim3(kGroupThreads), 0, stream, false, ss.counters, n_zero);
#endif
  }
  if (path != Path::dense) {
    mark(opt, 1, stream);
    // Ungrouped t8 (GemmArgs::ids): jobs from the ids; w1|w3 may then load weights before its PDL wait too.
    auto ungroup = [&](GemmArgs& a) {
      if (path == Path::t8 && !grouped) a.ids = ids, a.n_ids = int(n), a.X = int(X), a.w_early = w_early_allowed();
      a.ready = ready, a.ready_need = int(I / ml::kTileRows);
    };
    GemmArgs a13{z,           Lt,          int(K),      grp.order,  grp.jobs,
                       grp.n_jobs,  w.w1_packed, w.w1_scale,  w.w3_packed, w.w3_scale,
                       w.w13_packed_stride,      w.w13_scale_stride,       int(I),
                       int(Lt),     act,         situ_beta,   situ_linear_beta,
                       t8.ks13,     ss.partial,  ss.counters};
    ungroup(a13);
    a13.h_scaled = h_scaled;
    a13.no_fold = t8_scales == 0;
    if (t8.pp13.grid > 0)
      moe_detail::launch_t8p(a13, true, !w.fp32_scales, t8.pp13, pdl, stream);
    else
      run_gemm(path, true, a13, grp, ids, n, X, w.special_scales, !w.fp32_scales, ss, ctas13, true, pdl, stream);
    mark(opt, 2, stream);
    GemmArgs a2{act,        I,           1,          grp.order, grp.jobs,
                      grp.n_jobs, w.w2_packed, w.w2_scale, nullptr,   nullptr,
                      w.w2_packed_stride,      w.w2_scale_stride,     int(Lt),
                      int(I),     y,           0.0f,       0.0f,
                      t8.ks2,     ss.partial + t8.p13,  ss.counters + t8.c13};
    a2.w_early = path == Path::t8 && w_early_allowed();
    ungroup(a2);
    a2.h_scaled = h_scaled;
    if (t8.pp2.grid > 0)
      moe_detail::launch_t8p(a2, false, !w.fp32_scales, t8.pp2, pdl, stream);
    else
      run_gemm(path, false, a2, grp, ids, n, X, w.special_scales, !w.fp32_scales, ss, ctas2, false, pdl, stream);
    mark(opt, 3, stream);
  }
  const int64_t ldn = opt.normed_ld ? opt.normed_ld : Lt;
  if (opt.norm_w) {
    KCUDA_REQUIRE(opt.normed && aligned(opt.normed, 16) && aligned(opt.norm_w, 16) && T < (int64_t(1) << 31) &&
                      ldn >= Lt && ldn % 8 == 0,
                  "moe_experts_mxfp4: the fused latent norm needs 16-byte aligned norm_w and normed rows (normed_ld " +
                      std::to_string(ldn) + ")");
  }
  moe_detail::launch_combine(static_cast<const uint16_t*>(y), weights, ids, T, K, X, Lt, ut, opt.norm_w, opt.norm_eps,
                             opt.normed, ldn, pdl, stream, opt.combine_cluster);
  mark(opt, 4, stream);
}

size_t mxfp4_matmul_workspace_bytes(int64_t T) {
  return round256(size_t(T) * 4) + groups_bytes(T, 1) + stream_scratch_bytes();
}

void mxfp4_matmul_packed(const uint16_t* x, const uint8_t* packed, const uint8_t* scale, bool special_scales,
                         bool fp32_scales, int64_t T, int64_t R, int64_t C, void* workspace, uint16_t* y,
                         cudaStream_t stream, MoeTokenTile tile) {
  KCUDA_REQUIRE(x && packed && scale && workspace && y, std::string("mxfp4_matmul_packed: null pointer"));
  KCUDA_REQUIRE(R > 0 && C > 0 && R % 64 == 0 && C % 64 == 0 && R < (1 << 24) && C < (1 << 24),
                "mxfp4_matmul_packed: R = " + std::to_string(R) + ", C = " + std::to_string(C) +
                    " must be positive multiples of 64");
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("mxfp4_matmul_packed: bad T"));
  KCUDA_REQUIRE(aligned(x, 16) && aligned(packed, 16) && aligned(scale, 4) && aligned(workspace, 256),
                std::string("mxfp4_matmul_packed: x and packed must be 16-byte aligned, scales 4-byte"));
  KCUDA_REQUIRE(tile != MoeTokenTile::dense, std::string("mxfp4_matmul_packed: no dense path (use GemmLt)"));
  if (T == 0) return;
  const Path path = choose_path(tile, T, 1, fp32_scales || special_scales);
  const bool pdl = use_pdl(path, MoeExpertsOptions{});
  char* p = static_cast<char*>(workspace);
  int32_t* ids = reinterpret_cast<int32_t*>(p);  // every row routed to "expert" 0
  p += round256(size_t(T) * 4);
  const Groups grp = carve_groups(p, T, 1);
  const StreamScratch ss = carve_stream(p);
  const int ctas = path == Path::stream ? moe_detail::stream_grid(false, 0) : 0;
  KCUDA_CHECK(cudaMemsetAsync(ids, 0, size_t(T) * 4, stream));
  launch_group(ids, T, 1, path_ct(path), grp, ss.counters + moe_detail::kMaxStreamWarps,
               path == Path::stream ? moe_detail::kStreamWarps * ctas : 0, stream);
  const GemmArgs a{x,       C,      1,       grp.order, grp.jobs, grp.n_jobs, packed, scale, nullptr, nullptr,
                   0,       0,      int(R),  int(C),    y,        0.0f,       0.0f,   1,     nullptr, nullptr};
  run_gemm(path, false, a, grp, ids, T, 1, special_scales, !fp32_scales, ss, ctas, true, pdl, stream);
}

}  // namespace kestrel::cuda
