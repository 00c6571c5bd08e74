// What the MoE expert kernel files share on the host side: argument structs, the launchers of the decode
// (moe_stream.cu) and prefill (moe_wide.cu, moe_dense.cu) GEMMs that moe_experts.cu calls, and a launch helper
// that adds the programmatic-dependent-launch attribute. Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.h"

namespace kestrel::cuda {
class GemmLt;
}
namespace kestrel::cuda::moe_detail {

// A grouped MXFP4 GEMM over a device work list (moe_experts.cu: group_kernel): job j = (expert, first position
// in `order`, count) of jobs i32 [J, 3], J = *n_jobs.
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
  // Fixed-tile kernels (t8) only: K split over `ksplit` CTAs per (job, row group) when that fills the last
  // wave (moe_experts.cu choose_ksplit); the splits' FP32 partials f32 [jobs, R/16, ksplit, 32, NM·4] and
  // one counter per (job, 16-row tile), i32 [jobs · R/16], zero when the kernel starts.
  int ksplit = 1;
  float* partial = nullptr;
  int32_t* counters = nullptr;
  // Fixed-tile kernels: the job list comes from a kernel at least two launches back (w2 after w1|w3; either
  // GEMM when ungrouped, behind prep_kernel), so the first weight stages may be loaded before the PDL wait
  // (moe_t8.cu). KESTREL_MOE_W_EARLY=0 turns it off for w2.
  bool w_early = false;
  // Fixed-tile kernels, ungrouped (one token: its top-k slots are distinct experts, nothing to share): with ids
  // set, job j = slot j of expert ids[j] (count 0 outside [0, X)), J = n_ids; jobs, order, n_jobs unused.
  const int32_t* ids = nullptr;  // i32 [n_ids]
  int n_ids = 0, X = 0;
  // Ungrouped t8 with w_early only: readiness per slot, i32 [n_ids], zero when w1|w3 starts (moe_t8.cu). w1|w3
  // adds 1 to ready[job] per finished 16-row tile and lets w2 launch right after its own PDL wait; w2 then waits until
  // ready[job] == ready_need (w1|w3's tiles per slot) instead of its PDL wait, so the w2 CTAs of the slots done
  // first run beside w1|w3's last wave. Both take the jobs in job-major order then (a slot's CTAs adjacent).
  int32_t* ready = nullptr;
  int ready_need = 0;
  // t8 only, both GEMMs alike (codes in [1, 128]): w1|w3 writes h·2^100 and w2 reads it with the raw decode
  // (moe_t8.cu kScaleFoldH / kScaleRaw).
  bool h_scaled = false;
  bool no_fold = false;   // FP32 scales even where w1|w3 could fold them (MoeExpertsOptions::t8_scales = 0)
  int t8p_kh = 1;         // persistent t8 only: K halves per CTA (T8pPlan::kh)
};

// Fixed-tile GEMM (moe_t8.cu): t8 (ct = 8, the decode path) or t32 (ct = 32); grid = job_bound(n, X, ct) ×
// R/kFixedCtaRows × a.ksplit. `special`: the e8m0 scales include the special codes (MoeExpertWeights);
// `fold_ok`: every code is in [1, 128] (not MoeExpertWeights::fp32_scales), so the scales may be folded into
// the decode.
inline constexpr int kFixedCtaRows = 64;
// How a t8/t32 kernel applies the e8m0 scales (moe_t8.cu explains each).
enum ScaleMode : int { kScaleF32 = 0, kScaleSpecial = 1, kScaleFold = 2, kScaleFoldH = 3, kScaleRaw = 4 };
inline constexpr float kRawUnscale = 67108864.0f;            // 2^26 = 2^126 / 2^100
inline constexpr float kRawScaleH = 1.2676506002282294e30f;  // 2^100
void launch_fixed(const GemmArgs& a, bool glu, int ct, bool special, bool fold_ok, int64_t n, int64_t X, bool pdl,
                  cudaStream_t stream);
// t8's K split for `base` CTAs over C columns and `tiles` (job, 16-row tile) pairs, given the counters and
// partial floats the scratch holds (1 when a split does not fit); forced ≥ 1 (MoeExpertsOptions::t8_ksplit)
// takes min(forced, C/64, 8).
int t8_ksplit(int forced, bool glu, bool special, int64_t base, int64_t C, int64_t counters_free,
              int64_t partial_floats, int64_t tiles);

// Persistent t8 for one token (moe_t8p.cu): ungrouped (a.ids, 1..kT8pMaxSlots slots), a grid of at most the
// resident CTAs, each running one pipeline over its units. t8p_plan gives the grid for n slots of R rows
// (ctas_per_sm > 0 caps the CTAs per SM) with no K split, or with forced_split > 0 that split (it must leave a
// unit a multiple of the pipeline's stages and fit the scratch's partial floats and free counters); grid 0:
// not applicable (also, unforced, when the n·R/64 tiles are fewer than half the resident CTAs). kh = 2 (asked,
// no K split): a CTA's 4 warps take 2 tiles, each tile's K in halves summed in shared memory (twice the units,
// so more warps resident: moe_t8p.cu); bit-identical to the fixed grid split in 2.
inline constexpr int kT8pMaxSlots = 64;
struct T8pPlan {
  int split = 0, grid = 0, kh = 1;
};
T8pPlan t8p_plan(bool glu, int64_t n, int64_t R, int64_t C, int forced_split, int ctas_per_sm, int kh,
                 int64_t partial_floats, int64_t counters_free);
// Split partial floats the kernel uses for n slots of R rows at split S (f32 [n·R/16, S, 8, NM, 2]).
inline int64_t t8p_partial_floats(bool glu, int64_t n, int64_t R, int S) {
  return S > 1 ? n * (R / 16) * S * 8 * 2 * (glu ? 2 : 1) : 0;
}
void launch_t8p(const GemmArgs& a, bool glu, bool fold_ok, const T8pPlan& plan, bool pdl, cudaStream_t stream);

// Launch 4 (moe_combine.cu): ũ = bf16(Σ_k w_k·y_k) per token, bf16 [T, Lt] into ut, from y bf16 [T·K, Lt] (slot
// rows), wts f32 [T, K], ids i32 [T, K] (ids outside [0, X) add nothing); with norm_w (bf16 [Lt]) also the
// RMSNorm of ũ into normed (row stride ldn). `cluster` (MoeExpertsOptions::combine_cluster): with norm_w at
// T ≤ kCombineClusterMaxT, 1 cuts each token's row over a thread-block cluster, 0 keeps one CTA per token,
// −1 asks KESTREL_MOE_COMBINE_CLUSTER (default 0).
inline constexpr int64_t kCombineClusterMaxT = 64;
void launch_combine(const uint16_t* y, const float* wts, const int32_t* ids, int64_t T, int64_t K, int64_t X,
                    int64_t Lt, uint16_t* ut, const uint16_t* norm_w, float eps, uint16_t* normed, int64_t ldn, bool pdl,
                    cudaStream_t stream, int cluster = -1);

// The t8 path's plan for one call (moe_t8.cu plan_t8): K splits of w1|w3 and w2, their tile counters at
// [0, c13) and [c13, n_zero) of the scratch's counters (n_zero: how many the first kernel zeroes, before the
// readiness counters), w2's partials after w1|w3's p13 floats (ungrouped: w2 runs beside w1|w3's last tiles;
// grouped: after it, sharing them, p13 = 0), and the persistent launches (grid > 0) where `persist` (bit mask
// 1 w1|w3, 2 w2; −1: KESTREL_MOE_T8P, default 1) asks for them and t8p_plan accepts (never grouped or with
// special scale codes). The other arguments: MoeExpertsOptions' t8_ksplit, t8p_split, t8p_ctas (0:
// KESTREL_MOE_T8P_CTAS, else all that fit), t8p_kh (0: KESTREL_MOE_T8P_KH, default 2).
struct T8Plan {
  int ks13 = 1, ks2 = 1;
  int64_t c13 = 0, p13 = 0;
  int n_zero = 0;
  T8pPlan pp13, pp2;
};
T8Plan plan_t8(bool grouped, bool special, int64_t n, int64_t X, int64_t Lt, int64_t I, int forced_split, int persist,
               int t8p_split, int t8p_ctas, int t8p_kh, int64_t partial_floats, int64_t counters);

// Decode GEMM (moe_stream.cu): the same work as GemmArgs, or, with jobs == nullptr ("ungrouped"), job j =
// slot j of expert ids[j] (one token; count 0 if the id is outside [0, X)).
struct StreamArgs {
  GemmArgs g;
  const int32_t* ids;   // i32 [n] (ungrouped only)
  int n;                // slots (ungrouped: the number of jobs)
  int X;
  float* partial;       // f32 [NW][2][NM·4][32]: split tiles' partial sums (NW warps of the grid)
  int32_t* counters;    // i32 [NW], zero when the kernel starts
  bool wait_first;      // the job list comes from the immediately preceding kernel (PDL: wait before reading it)
};

inline constexpr int kStreamWarps = 4;        // warps per CTA of the decode GEMM (independent streams)
inline constexpr int kMaxStreamCtas = 1024;   // bound on its grid: scratch below is sized for it
inline constexpr int kMaxStreamWarps = kStreamWarps * kMaxStreamCtas;
// Scratch of one decode GEMM, bytes: partials for GLU (the larger) and counters.
inline constexpr size_t kStreamPartialBytes = size_t(kMaxStreamWarps) * 2 * 8 * 32 * 4;
inline constexpr size_t kStreamCounterBytes = size_t(kMaxStreamWarps) * 4;

// CTAs of the persistent decode GEMM on this device (all resident at once), at most kMaxStreamCtas;
// `ctas_override` > 0 forces a count (tests: other splits of the work).
int stream_grid(bool glu, int ctas_override);
void launch_stream(const StreamArgs& a, bool glu, int ctas, bool pdl, cudaStream_t stream);

// Prefill GEMM (moe_wide.cu): jobs of up to kWideTokens tokens; grid = jobs_bound × row groups.
inline constexpr int kWideTokens = 128;
void launch_wide(const GemmArgs& a, bool glu, int64_t jobs_bound, bool pdl, cudaStream_t stream);

// Prefill path through cuBLASLt (moe_dense.cu): per hit expert, dequantise to BF16 scratch and run both GEMMs;
// writes y (bf16 [n, Lt], the row of slot s at y + s·Lt) for the combine. Synchronises the stream once (the job
// list is read on the host): never inside a CUDA-graph capture.
struct DenseArgs {
  const uint16_t* z;          // bf16 [T, Lt]
  int K;                      // slots per token: slot s reads z row s / K
  const int32_t* order;       // i32 [n] slots grouped by expert
  const int32_t* jobs;        // i32 [J, 3], one job per hit expert (group kernel with ct ≥ n)
  const int32_t* n_jobs;      // i32 [1]
  const MoeExpertWeights* w;  // kernels' layout
  int64_t T, n, X, Lt, I;
  float beta, lbeta;
  GemmLt* lt;
  void* scratch;              // dense_scratch_bytes(T, Lt, I), 256-byte aligned
  uint16_t* y;                // bf16 [n, Lt]
};
size_t dense_scratch_bytes(int64_t T, int64_t Lt, int64_t I);
void run_dense(const DenseArgs& a, cudaStream_t stream);

// Launches kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization if `pdl`, and
// grid.x grouped in thread-block clusters of cluster_x CTAs if cluster_x > 1 (grid.x a multiple of it; at most 8,
// the portable size). The MoE launches decide PDL themselves (MoeExpertsOptions::pdl), not launch.h's switch.
template <typename... KArgs, typename... Args>
void launch_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                    unsigned cluster_x, Args&&... args) {
  KCUDA_REQUIRE(cluster_x >= 1 && cluster_x <= 8 && grid.x % cluster_x == 0,
                std::string("moe launch: cluster size must be 1..8 and divide grid.x"));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  KCUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            Args&&... args) {
  launch_cluster(kernel, grid, block, smem, stream, pdl, 1u, std::forward<Args>(args)...);
}

}  // namespace kestrel::cuda::moe_detail
