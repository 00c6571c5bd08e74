// MoE on the GPU (MODEL.md §3.6 steps 1, 3, 4): the sigmoid router's top-k, and the routed MXFP4
// experts W4A16 on tensor cores, grouped by expert on the device (moe_experts.cu; layout: moe_layout.h).
// CPU twins: cpu::moe_route and cpu::moe_experts (kernels/cpu/moe_ops.h), which read the checkpoint layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

namespace kestrel::cuda {

// After the FP32 router GEMM: s = σ(logits); top-k of s + bias (exact ties to the lower expert
// index; NaN ranks lowest); w = s[idx], renormalised (w/(Σw + 1e-20)) if asked, times `scaling`.
// X ≤ 8192, K ≤ 64. Two levels of warp arg-maxes (or sorting networks) at X ≤ 2048, else a block-wide arg-max
// a round: the same bits (moe.cu).
void moe_route(const float* logits /* f32 [T, X] */, const float* bias /* f32 [X] */, int64_t T, int64_t X, int64_t K,
               bool renormalize, float scaling, int32_t* ids /* i32 [T, K] */, float* weights /* f32 [T, K] */,
               cudaStream_t stream);

// The router kernel moe_route takes at X ≤ 2048 (moe.cu; past that always the block kernel): KESTREL_ROUTE =
// auto (the default: sort from 4 picks per slot a lane, two-level below) | block | two-level | sort | radix (opt-in,
// not yet timed); the setter is for tests and benchmarks. All four kernels give the same bits.
enum class MoeRouteKernel { automatic, block, two_level, sort, radix };
MoeRouteKernel moe_route_kernel();
void set_moe_route_kernel(MoeRouteKernel k);

// Expert parallelism (docs/parallel.md §3): a rank holds experts [lo, lo + count) only. Maps the router's
// global ids to the rank's local ones: local[i] = ids[i] − lo if ids[i] ∈ [lo, lo + count), else −1, which
// moe_experts_mxfp4 (over X = count) skips before its grouping, so other ranks' experts cost nothing here.
// n < 2^31; ids and local may alias.
void moe_local_ids(const int32_t* ids /* i32 [n] */, int64_t n, int64_t lo, int64_t count,
                   int32_t* local /* i32 [n] */, cudaStream_t stream);

// Tag of the tensor-core layout (moe_layout.h) in MoeExpertWeights::layout.
inline constexpr uint32_t kMoeExpertLayout = 0x4d58'3401u;

// All experts' MXFP4 weights in the kernels' layout (moe_layout.h), expert e at e·stride bytes from each base:
//   w1, w3 (logical [I, Lt]): packed u8 [X][I/16][Lt/64][512], scales u8 [X][I/16][Lt/64][32];
//   w2 (logical [Lt, I]):     packed u8 [X][Lt/16][I/64][512], scales u8 [X][Lt/16][I/64][32].
// The same bytes as the checkpoint (MODEL.md §4), permuted; pack_experts_mxfp4 builds it at upload.
class GemmLt;

struct MoeExpertWeights {
  const uint8_t* w1_packed;
  const uint8_t* w1_scale;
  const uint8_t* w3_packed;
  const uint8_t* w3_scale;
  const uint8_t* w2_packed;
  const uint8_t* w2_scale;
  int64_t w13_packed_stride, w13_scale_stride;  // bytes between experts (≥ I·Lt/2, ≥ I·Lt/32)
  int64_t w2_packed_stride, w2_scale_stride;    // bytes between experts (≥ Lt·I/2, ≥ Lt·I/32)
  uint32_t layout = 0;          // kMoeExpertLayout: the bytes are in the kernels' layout (checked by the launcher)
  bool special_scales = false;  // some e8m0 scale is 0 (2^-127) or 255 (NaN): the kernels take the exact path
  bool fp32_scales = false;     // some e8m0 scale is outside [1, 128] (|w| may pass 12): the scales cannot be folded
                                // into the BF16 decode (moe_mma.cuh); the FP32-scale kernels (tiles t8/t32) run
};

// Host pointers to one expert in the checkpoint layout (MODEL.md §4): packed u8 [rows, cols/2], e8m0 [rows, cols/32].
struct MoeExpertHost {
  const uint8_t* w1_packed;  // [I, Lt/2]
  const uint8_t* w1_scale;   // [I, Lt/32]
  const uint8_t* w3_packed;  // [I, Lt/2]
  const uint8_t* w3_scale;   // [I, Lt/32]
  const uint8_t* w2_packed;  // [Lt, I/2]
  const uint8_t* w2_scale;   // [Lt, I/32]
};

// Repacks one MXFP4 matrix W [R, C] from the checkpoint layout to the kernels' layout (host, R % 16 == 0,
// C % 64 == 0). out_packed holds R·C/2 bytes, out_scale R·C/32.
void pack_mxfp4_matrix(const uint8_t* packed /* u8 [R, C/2] */, const uint8_t* scale /* e8m0 [R, C/32] */, int64_t R,
                       int64_t C, uint8_t* out_packed /* u8 [R/16][C/64][512] */,
                       uint8_t* out_scale /* u8 [R/16][C/64][32] */);
// True if any of the n e8m0 codes is 0 or 255 (the kernels' exact scale path is then needed).
bool mxfp4_special_scales(const uint8_t* scale, size_t n);
// True if any of the n e8m0 codes is outside [1, 128] (MoeExpertWeights::fp32_scales).
bool mxfp4_fp32_scales(const uint8_t* scale, size_t n);

// Repacks X experts (host, checkpoint layout) into the kernels' layout and copies them to device memory
// obtained from `device_alloc(bytes)` (six blocks: w1, w1 scales, w3, w3 scales, w2, w2 scales; the caller
// owns them). Lt and I must be multiples of 64. Synchronous; packs several experts in parallel.
MoeExpertWeights pack_experts_mxfp4(const MoeExpertHost* experts /* [X] */, int64_t X, int64_t Lt, int64_t I,
                                    const std::function<void*(size_t)>& device_alloc);

// Which expert GEMMs run (all give the same results up to FP32 summation order):
//   stream  decode: jobs of up to 8 tokens, a persistent stream-K grid (every warp streams the same bytes),
//           e8m0 scales folded into the BF16 decode; at T ≤ 2 the tokens are not grouped (one job per slot).
//   wide    prefill: jobs of up to 128 tokens, 256-thread CTAs of 128/256 weight rows × all the job's tokens.
//   t8, t32 the first tensor-core kernels (fixed grid, FP32 scale per 32-column block — for w1|w3 folded into
//           the decode where the codes allow (KESTREL_MOE_FOLD=0: never), and t8's w2 then decoding h·2^100
//           without the multiply (KESTREL_MOE_RAW=0: not) — tiles of 8 / 32 tokens): the only ones
//           for weights with MoeExpertWeights::fp32_scales (stream/wide fall back to t8/t32).
// `automatic`: t32 when the slots per possibly-hit expert, T·K / min(X, T·K), reach 16, else t8. Measured on the
// H200 (2026-12-01): bench_moe --perf (896 × top-16, 3584→3072): t8 127.8 µs at T=1 (16 slots) / 3.15 ms at
// T=64 / 26.6 ms at T=4096 (t32) against stream 142.4 µs / 4.50 ms and wide 42.1 ms. In the reduced-mini decode
// step (top-2, 2 slots at batch 1) stream beat t8's fixed grid (116 against 174 µs over 3 layers) until t8
// split K to fill its waves (session 12: t8 91 µs, stream 117, eager, so stream is no longer chosen).
// KESTREL_MOE_PATH=stream forces stream/wide at every size (wide from 16 slots per expert), KESTREL_MOE_PATH=t8
// forces t8/t32.
//   dense   prefill: per hit expert, the weights dequantised to BF16 scratch and both GEMMs on cuBLASLt
//           (moe_dense.cu). Needs MoeExpertsOptions::lt, one stream sync per call (never while capturing a
//           graph) and the scratch of moe_experts_workspace_bytes(..., dense); `automatic` takes it from
//           256 slots per hit expert when `lt` is given and the stream is not capturing.
enum class MoeTokenTile { automatic, t8, t32, stream, wide, dense };

// Knobs for benchmarks and tests; the defaults are what the engine runs, with `lt` set.
struct MoeExpertsOptions {
  MoeTokenTile tile = MoeTokenTile::automatic;
  int pdl = -1;          // programmatic dependent launch between the 4 launches: 1 on, 0 off, -1 on unless
                         // KESTREL_MOE_PDL=0 in the environment
  int grouped = -1;      // stream, t8: 1 group tokens by expert, 0 one job per slot (at T > 1 an expert is read per slot),
                         // -1 ungrouped iff T ≤ 2 (stream), T = 1 (t8)
  int stream_ctas = 0;   // stream path: CTAs of the persistent grid (tests force other splits); 0: all that fit
  int t8_ksplit = 0;     // t8 path: K split over this many CTAs per 64-row tile (tests, benchmarks; at most the
                         // tile's 64-column chunks and 8); 0: chosen so the last wave is full (moe_experts.cu)
  int t8_scales = -1;    // t8 path, how the e8m0 scales are applied (moe_t8.cu): 0 FP32 per block in both GEMMs,
                         // 1 folded into w1|w3's decode (w2 FP32), 2 folded, and w2's raw decode of h·2^100;
                         // -1: 2 unless KESTREL_MOE_RAW=0 (then 1) or KESTREL_MOE_FOLD=0 (then 0). Codes
                         // outside [1, 128] always take FP32 scales.
  int t8_persist = -1;   // t8 ungrouped (T = 1): which GEMMs may run the persistent kernel (moe_t8p.cu, where the
                         // tiles fill at least half the resident CTAs), a bit mask: 1 w1|w3, 2 w2; -1:
                         // KESTREL_MOE_T8P, default 1 (w1|w3; w2 then splits K in 2)
  int t8p_ctas = 0;      // persistent w1|w3: CTAs per SM at most (0: all that fit; KESTREL_MOE_T8P_CTAS)
  int t8p_split = 0;     // persistent GEMMs: K split forced (tests, benchmarks); 0: none (moe_t8p.cu)
  int t8p_kh = 0;        // persistent GEMMs without a forced split: 2 cuts each tile's K in halves over two warps
                         // of a CTA (moe_t8p.cu), 1 not; 0: KESTREL_MOE_T8P_KH, default 2
  GemmLt* lt = nullptr;  // cuBLASLt for the dense path (none: dense is never chosen, and forcing it is an error)
  cudaEvent_t* marks = nullptr;  // 5 events recorded before the grouping and after each launch (group,
                                 // w1|w3, w2, combine) for a per-launch breakdown; PDL is off then
  // Non-null: the combine launch also writes normed = RMSNorm_{norm_w}(ũ) (bf16 [T, Lt], eps norm_eps),
  // bit-identical to rmsnorm_bf16 on ũ (MODEL.md §3.6 step 5 in the same launch); ũ is still written.
  const uint16_t* norm_w = nullptr;  // bf16 [Lt]
  float norm_eps = 0.0f;
  uint16_t* normed = nullptr;  // bf16 [T, Lt], row stride normed_ld
  int64_t normed_ld = 0;       // elements between normed's rows (0: Lt); a multiple of 8, at least Lt — the GPU
                               // model writes the rows into the left part of the MoE out-projection's input
  // With norm_w at T ≤ 64 (decode): 1 runs the combine + norm with each token's row cut over a thread-block cluster
  // (moe_combine.cu: ũ the same bits, normed within 2 BF16 ulps of the one-CTA kernel's — the order of its FP32
  // Σx²), 0 one CTA per token; −1: 1 iff KESTREL_MOE_COMBINE_CLUSTER=1 (default off until measured on the GPU).
  int combine_cluster = -1;
};

// Device scratch for moe_experts_mxfp4, in bytes (256-byte aligned pieces).
// With tile = automatic it holds the dense path's scratch (66 MB at the real expert shape + T rows) only where
// `automatic` may choose it (≥ 256 slots per hit expert); forcing dense needs the bytes for tile = dense.
size_t moe_experts_workspace_bytes(int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I,
                                   MoeTokenTile tile = MoeTokenTile::automatic);

// For each (token t, slot k): [g | u] = z_t·[W1; W3]ᵀ (FP32 sums, each rounded to BF16),
// a = bf16(SiTU-GLU(g, u)), y = bf16(a·W2ᵀ); then ũ_t = bf16(Σ_k w_k·y_k) in top-k order.
// Tokens are grouped by expert on the device (no host round trip; graph-capturable), then two tensor-core
// kernels (w1|w3 with SiTU-GLU fused, w2) and the weight combine. Slots whose id is outside [0, X) add
// nothing (K may exceed X: a rank's own experts under expert parallelism, moe_local_ids). Lt and I must be
// multiples of 64; z 16-byte aligned; w from pack_experts_mxfp4.
void moe_experts_mxfp4(const uint16_t* z /* bf16 [T, Lt], contiguous */, const int32_t* ids /* i32 [T, K] */,
                       const float* weights /* f32 [T, K] */, const MoeExpertWeights& w, int64_t T, int64_t X,
                       int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta,
                       void* workspace /* moe_experts_workspace_bytes(...) bytes */, uint16_t* ut /* bf16 [T, Lt] */,
                       cudaStream_t stream, MoeTokenTile tile = MoeTokenTile::automatic);
void moe_experts_mxfp4(const uint16_t* z /* bf16 [T, Lt] */, const int32_t* ids /* i32 [T, K] */,
                       const float* weights /* f32 [T, K] */, const MoeExpertWeights& w, int64_t T, int64_t X,
                       int64_t K, int64_t Lt, int64_t I, float situ_beta, float situ_linear_beta, void* workspace,
                       uint16_t* ut /* bf16 [T, Lt] */, cudaStream_t stream, const MoeExpertsOptions& opt);

// The expert kernels' second stage on its own: y = bf16(x·Wᵀ) for one MXFP4 matrix W [R, C] in the kernels'
// layout (pack_mxfp4_matrix), T rows of x. For the numerics tests (every code, extreme scales) and the
// benchmark. R and C multiples of 64; x 16-byte aligned. special_scales / fp32_scales: as MoeExpertWeights.
size_t mxfp4_matmul_workspace_bytes(int64_t T);
void mxfp4_matmul_packed(const uint16_t* x /* bf16 [T, C] */, const uint8_t* packed, const uint8_t* scale,
                         bool special_scales, bool fp32_scales, int64_t T, int64_t R, int64_t C, void* workspace,
                         uint16_t* y /* bf16 [T, R] */, cudaStream_t stream, MoeTokenTile tile = MoeTokenTile::automatic);

}  // namespace kestrel::cuda
