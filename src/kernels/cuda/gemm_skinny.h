// The skinny GEMM of the decode path: y = x·Wᵀ for T ≤ 64 token rows, built to stream W at close to the
// copy bandwidth (a decode projection reads every weight byte once and does 2·T FLOPs per weight; at
// T ≤ 64 that is memory-bound on an H200, and cuBLASLt's kernels reach only 26–62 % of the copy rate at
// these shapes). CPU twins: cpu::gemm_bf16 / cpu::gemm_bf16_f32 (BF16) and cpu::gemm_ptpc_fp8 (FP8).
// Design, resources and predicted times: the header of gemm_skinny.cu.
//
// Stacked projections: several weight matrices that read the same input are stacked row-wise at upload
// (one matrix [N, K]); a GemmSegs list says where each stacked matrix's rows go, each with its own output
// buffer and epilogue, so one launch computes them all with each output the FP32 dot product rounded
// once, as separate GEMMs would:
//   bf16      y[t, n − n0] = bf16(acc)
//   f32       y[t, n − n0] = acc                       (the router, the indexer head weights, lm_head)
//   add_bf16  y[t, n − n0] = bf16(bf16(acc) + add[t, n − n0])   (add may be y itself: in place)
//   situ_glu8 W rows interleaved by 8: rows 16j..16j+7 are gate rows 8j..8j+7, rows 16j+8..16j+15 the up
//             rows 8j..8j+7; y[t, f] = bf16(SiTU-GLU(bf16(acc_gate f), bf16(acc_up f))) for f < len/2 —
//             exactly situ_glu_bf16 over the bf16 outputs of the [gate | up] GEMM (MODEL.md §3.6 step 3).
//
// Determinism: no float atomics. K is split over the 4 warps of a CTA (reduced through shared memory in
// warp order) and, for matrices with few row tiles, over CTAs (partials in a workspace, summed in split
// order by the last CTA of each row tile to arrive, found by an integer counter). The split count is a
// function of (N, K) and the SM count only, not of T, so a token's outputs are bit-identical for every
// T ≤ 64 (the decode projections are batch invariant).
//
// FP8 (--quantization ptpc-fp8): W e4m3 [N, K] with per-output-channel FP32 scales, x e4m3 [T, K] with
// per-token FP32 scales (PTPC), e4m3 × e4m3 → FP32 on the tensor cores (mma.m16n8k32), then
// v = (acc·w_scale[n])·x_scale[t] and the epilogue above (f32 segments are not allowed: FP32 outputs
// stay BF16 GEMMs).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

inline constexpr int kGemmMaxSegs = 8;
inline constexpr int64_t kSkinnyMaxT = 64;

enum class GemmEpi : uint8_t { bf16 = 0, f32 = 1, add_bf16 = 2, situ_glu8 = 3 };

// Rows [n0, next segment's n0 or N) of the stacked W go to y (row stride ldy elements).
struct GemmSeg {
  int64_t n0 = 0;
  void* y = nullptr;     // bf16 or f32 (f32 kind) [T, ·]
  int64_t ldy = 0;
  GemmEpi epi = GemmEpi::bf16;
  const uint16_t* add = nullptr;  // add_bf16: bf16 [T, ·], row stride ld_add (may alias y)
  int64_t ld_add = 0;
};
// The MoE router's top-k over an f32 segment (MODEL.md §3.6 step 1): ids and weights exactly moe_route's (moe.h)
// on the segment's [T, X] logits (X = the segment's length). The skinny kernel runs it in the last CTA to store
// the segment's rows (gemm_skinny_route_ok; one router launch and one kernel boundary fewer a MoE layer); every
// other GEMM path leaves it to the caller (model/cuda/linear.cpp launches moe_route after the GEMM).
struct GemmRoute {
  int seg = -1;                 // index of the f32 segment holding the logits; −1: no route
  const float* bias = nullptr;  // f32 [X]
  int K = 0;
  bool renormalize = false;
  float scaling = 1.0f;
  int32_t* ids = nullptr;    // i32 [T, K]
  float* weights = nullptr;  // f32 [T, K]
};

struct GemmSegs {
  GemmSeg seg[kGemmMaxSegs];
  int n = 0;
  float glu_beta = 1.0f, glu_linear_beta = 1.0f;  // situ_glu8 segments
  GemmRoute route;
};

// Split-K scratch, owned by the caller: partial sums (f32) and one counter per row tile; the last counter is the
// router's (GemmRoute), so a split launch's tiles stay below n_counters. The counters must
// be zero before the first launch; every launch leaves them zero. One workspace serves launches on one
// stream (PDL-ordered launches included: a launch touches it only after its griddepcontrol.wait).
struct SkinnyWorkspace {
  float* part = nullptr;
  size_t part_bytes = 0;
  unsigned* counters = nullptr;
  int64_t n_counters = 0;
};
// What a workspace must hold so that every shape gets its preferred split (8 MiB of partials, 4096 counters).
inline constexpr size_t kSkinnyPartBytes = size_t(8) << 20;
inline constexpr int64_t kSkinnyCounters = 4096;

// True if the skinny kernel takes these operands: 1 ≤ T ≤ 64, K a multiple of 8 (bf16) / 16 (fp8), x and W
// 16-byte aligned, x row stride a multiple of 16 bytes, segments valid (ascending from 0, within N, outputs
// non-null, GLU segments starting and ending on multiples of 16 rows).
bool gemm_skinny_ok(const void* x, int64_t ldx, const void* w, int64_t T, int64_t K, int64_t N, const GemmSegs& segs,
                    bool fp8);
// The split over CTAs the launcher uses for an [N, K] matrix (a function of N, K and the SM count).
int gemm_skinny_splits(int64_t N, int64_t K, bool fp8);
// True if gemm_skinny_bf16 runs segs.route in its own launch for T tokens (T ≤ 16 on the staged path — the
// decode buckets; X ≤ 256 experts, K ≤ min(X, 32): moe_route.cuh; the segment f32; a workspace with counters);
// otherwise a route on the segments is refused by the launcher and belongs to the caller.
bool gemm_skinny_route_ok(int64_t T, const GemmSegs& segs, int64_t N, const SkinnyWorkspace& ws);

void gemm_skinny_bf16(const uint16_t* x /* bf16 [T, K], row stride ldx */, int64_t ldx,
                      const uint16_t* w /* bf16 [N, K], contiguous */, int64_t T, int64_t K, int64_t N,
                      const GemmSegs& segs, const SkinnyWorkspace& ws, cudaStream_t stream);

void gemm_skinny_fp8(const uint8_t* x /* e4m3 [T, K], row stride ldx */, int64_t ldx,
                     const float* x_scale /* f32 [T] */, const uint8_t* w /* e4m3 [N, K], contiguous */,
                     const float* w_scale /* f32 [N] */, int64_t T, int64_t K, int64_t N, const GemmSegs& segs,
                     const SkinnyWorkspace& ws, cudaStream_t stream);

// The wide GEMM (gemm_wide.cu): BF16, 17–64 token rows, a CTA per 64 rows of W and all tokens (x read from
// L2 once per 64 rows instead of once per 16), the same segments, epilogues, determinism and batch invariance
// (for every T in 17..64) as the skinny kernel, the same workspace. True if it takes these operands: the
// skinny kernel's rules (bf16), K a multiple of 128, ldx a multiple of 8, a workspace with counters for every
// 64-row tile.
bool gemm_wide_ok(const void* x, int64_t ldx, const void* w, int64_t T, int64_t K, int64_t N, const GemmSegs& segs,
                  const SkinnyWorkspace& ws);
// Its split over CTAs for an [N, K] matrix (a function of N, K, the SM count and the workspace's size).
int gemm_wide_splits(int64_t N, int64_t K, const SkinnyWorkspace& ws);
void gemm_wide_bf16(const uint16_t* x /* bf16 [T, K], row stride ldx */, int64_t ldx,
                    const uint16_t* w /* bf16 [N, K], contiguous */, int64_t T, int64_t K, int64_t N,
                    const GemmSegs& segs, const SkinnyWorkspace& ws, cudaStream_t stream);

}  // namespace kestrel::cuda
