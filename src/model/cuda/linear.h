// Lin(W)(x) on the GPU for every projection of the forward, one call per (possibly stacked) weight
// (MODEL.md §3 conventions: FP32 accumulation, each output rounded once to BF16, or kept FP32).
//
// A LinearDev is one weight matrix as uploaded: BF16 [N, K], or (--quantization ptpc-fp8) e4m3 [N, K] with
// per-output-channel FP32 scales. Several matrices that read the same input are stacked row-wise at upload
// (weights.h); the GemmSegs of a call route each stacked matrix's rows to its own output and epilogue
// (kernels/cuda/gemm_skinny.h). linear() picks the kernel:
//  - T ≤ skinny_max_t (decode): the skinny GEMM, all segments and epilogues in one launch (FP8: the
//    activation is quantised per token first, or its codes come from the producing kernel, `pre`);
//  - T ≤ 64 above that, BF16 (batched decode), stacks of ≥ wide_min_segs outputs: the wide GEMM (gemm_wide.cu),
//    all segments in one launch;
//  - otherwise (prefill) cuBLASLt per segment (BF16, or FP8 with outer-vector scales), the add and SiTU-GLU
//    epilogues as separate elementwise kernels: the same numerics as the skinny path up to FP32 order.
//
// Switches (read once per CudaModel from the environment; bench/gpu and the GPU tests use them to show
// what each change is worth): KESTREL_SKINNY=0 (cuBLASLt for every GEMM), KESTREL_SKINNY_MAX_T (default 16),
// KESTREL_WIDE=N (the wide GEMM for 17–64 rows, stacks of ≥ N outputs; default 3, 0 = off),
// KESTREL_KDA_FUSED_MAX_T (default 16: the fused KDA decode chain up to that many rows),
// KESTREL_FUSE=0 (no fused decode kernels: AttnRes, KDA chain, GEMM epilogues, MLA's norms), KESTREL_MLA_NORMS=0
// (MLA's norms and cache writes as five launches), KESTREL_ROUTE_IN_GEMM=1 (the MoE router's top-k in the skinny
// GEMM's tail), KESTREL_GRAPH_ATTN=0 (the
// attention stays an eager island between graph segments), KESTREL_PDL=0 (kernels/cuda/launch.h),
// KESTREL_SPEC_TRACE=launches (DSpark verify rows' KDA position by position, speculative.cpp),
// KESTREL_SPEC_GRAPHS=0 / KESTREL_SPEC_GRAPH_PAD=1 (DSpark steps in CUDA graphs, graphs.h).
#pragma once

#include <cstdint>

#include "kernels/cuda/gemm_skinny.h"

namespace kestrel::model::gpu {

struct Context;
using u16 = uint16_t;

struct LinearDev {
  const u16* w = nullptr;         // bf16 [N, K] (null when quantised)
  const uint8_t* w8 = nullptr;    // e4m3 [N, K] (ptpc-fp8)
  const float* ws = nullptr;      // f32 [N]: per-output-channel scales (ptpc-fp8)
  int64_t N = 0, K = 0;
  bool fp8() const { return w8 != nullptr; }
};

// An activation's PTPC FP8 codes, when the producing kernel made them (e4m3 [T, K] contiguous, f32 [T]).
struct Fp8Act {
  const uint8_t* q = nullptr;
  const float* s = nullptr;
};

struct DecodeOptions {
  bool skinny = true;
  // The skinny GEMM up to 16 rows, cuBLASLt above: on the H200 the reduced-mini decode step took 710 µs at
  // batch 1 with it (778 without) but 3,002 µs at batch 64 with it up to 64 rows (1,991 with cuBLASLt).
  int64_t skinny_max_t = 16;
  // BF16 projections of skinny_max_t < T ≤ 64 rows on the wide GEMM instead of cuBLASLt when their stack has at
  // least this many output segments (KESTREL_WIDE=N; 0 = never, 1 = every projection). cuBLASLt takes one launch
  // per segment plus the epilogues' (SiTU-GLU, the router's FP32 GEMM), the wide GEMM one launch for the stack.
  // Batch-64 step on the H200 (session 30, two rounds): 3 → 1,071 / 1,043 µs, 4 → 1,073 / 1,076, 1 (every
  // projection) → 1,118–1,141, 0 → 1,103–1,110. 3 takes the KDA, MLA and MoE input stacks.
  int wide_min_segs = 3;
  bool fuse = true;
  bool graph_attn = true;
  // DSpark verify rows: the traced KDA kernels, one launch per layer (false: KESTREL_SPEC_TRACE=launches,
  // one launch per position and request; model/cuda/speculative.cpp).
  bool spec_trace_kernels = true;
  // DSpark steps in CUDA graphs (graphs.h): pure-verify steps through verify buckets and decode steps with
  // taps through decode buckets (false: KESTREL_SPEC_GRAPHS=0, both eager as before); verify buckets padded
  // to a power of two within the skinny GEMM (true: KESTREL_SPEC_GRAPH_PAD=1; default: exact counts).
  bool spec_graphs = true;
  bool spec_graph_pad = false;
  // The latent MoE's RMSNorm of ũ in the experts' combine launch (moe.cpp; false: KESTREL_COMBINE_NORM=0).
  bool combine_norm = true;
  bool embed_in_point = true;  // the first AttnRes point gathers P from the embedding table (KESTREL_EMBED_IN_POINT)
  // MLA's q_a and kv_a norms, the indexer's key norm and both cache writes in one launch (mla.cpp; false:
  // KESTREL_MLA_NORMS=0, five launches).
  bool mla_norms = true;
  // MLA's output gate σ(g) applied in the absorbed decode's last launch when every attended row is a decode row
  // (mla.cpp; false: KESTREL_MLA_GATE_IN_MERGE=0, the gate's own launch after the attention).
  bool mla_gate_in_merge = true;
  // The MoE router's top-k in the tail of the skinny GEMM that makes its logits, on one rank at T ≤ 16 and X ≤ 256
  // (moe.cpp, gemm_skinny.h GemmRoute): one launch and one kernel boundary fewer a MoE layer. Off until timed on
  // the GPU (KESTREL_ROUTE_IN_GEMM=1: on).
  bool route_in_gemm = false;
  // Pure-decode steps of at most this many rows run KDA's steps 2–7 as the one fused launch (kda.cpp, which
  // says why 16; KESTREL_KDA_FUSED_MAX_T).
  int64_t kda_fused_max_t = 16;
  static DecodeOptions from_env();
};

// Segment helpers.
inline cuda::GemmSeg seg_bf16(int64_t n0, u16* y, int64_t ldy) { return {n0, y, ldy, cuda::GemmEpi::bf16, nullptr, 0}; }
inline cuda::GemmSeg seg_f32(int64_t n0, float* y, int64_t ldy) { return {n0, y, ldy, cuda::GemmEpi::f32, nullptr, 0}; }
inline cuda::GemmSeg seg_add(int64_t n0, u16* y, int64_t ldy, const u16* add, int64_t ld_add) {
  return {n0, y, ldy, cuda::GemmEpi::add_bf16, add, ld_add};
}
inline cuda::GemmSeg seg_glu(int64_t n0, u16* y, int64_t ldy) { return {n0, y, ldy, cuda::GemmEpi::situ_glu8, nullptr, 0}; }

// The segments' outputs := x·Wᵀ, x bf16 [T, W.K] with row stride ldx.
void linear(Context& c, const LinearDev& W, const u16* x, int64_t ldx, int64_t T, const cuda::GemmSegs& segs,
            const Fp8Act* pre = nullptr);
// One plain segment: y (bf16 [T, N], row stride ldy) = bf16(x·Wᵀ).
void linear(Context& c, const LinearDev& W, const u16* x, int64_t ldx, int64_t T, u16* y, int64_t ldy,
            const Fp8Act* pre = nullptr);

}  // namespace kestrel::model::gpu
