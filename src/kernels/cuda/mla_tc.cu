// Tensor-core MLA attention over the paged latent cache (see mla_tc.h): the core of mla_decode_paged and
// mla_prefill_paged. CPU twin: cpu::mla_attn_absorbed over model::MlaCacheView::read_latent.
//
// Shape of the work (MODEL.md §3.4 absorbed form, MQA view): per query row, Q = [q̃ | q_pe] is [Hm, C+R]
// (C+R = 576 at K3 size), every key is one latent row [ĉ | k_pe] of the cache, shared by all heads;
// scores S = Q·Kᵀ·(N+R)^−½, P = softmax(S) online, ô = P·ĉ (V is the ĉ part of the same rows).
// One CTA per (row, split) with 8 warps (256 threads, one CTA per SM); all Hm ≤ 16 heads of the row are
// the M = 16 side of mma.sync.m16n8k16 (bf16 operands, FP32 accumulation), zero rows pad Hm to 16.
//
// Per 64-key tile (N), staged in shared memory:
//  - S: warp w computes the partial scores of keys [16·(w>>1), +16) over one half of the K = C+R
//    dimension (w&1): its half of Q lives in registers as A fragments for the whole CTA (72 regs at K3
//    size), keys come from the tile by ldmatrix. The two halves meet in an 8 KB f32 buffer; after one
//    barrier every warp reads the full 16×64 score tile, laid out so that a thread reads exactly the
//    values its P A-fragments need (the C-fragment of two n8 tiles is the A-fragment of one k16 step).
//  - softmax: every warp computes the same running max / sum for rows g and g+8 of its lane (quad
//    shuffles; identical inputs and order, so the warps agree bit for bit), P is rounded to bf16 and the
//    row sum l adds the rounded values (P·V and l see the same numbers).
//  - O += P·V: warp w owns columns [w·C/8, (w+1)·C/8) of ô (32 f32 accumulators per thread at K3 size),
//    V fragments by ldmatrix.trans from the same tile.
// Two barriers per tile. Tiles are fetched with cp.async 16-byte copies (zero-filled past the end of the key
// list), three stages deep (four with FP8); a row's pool address needs its position (the selection, for
// sparse rows) and its page (block table): both loads run one iteration ahead in registers, so no warp
// waits on a dependent load inside the loop.
//
// BF16 pages: 64-key tiles of bf16 [ĉ | k_pe] rows. When a row has a multiple of 8 16-byte chunks (K3: 72)
// chunk c of row r sits at c ^ (r & 7) (XOR swizzle: ldmatrix's 8 rows hit 8 different bank groups, no
// padding); otherwise (nano: 10 chunks) rows are padded to an odd number of chunks. 3 stages × 72 KB + 8 KB
// = 224 KB.
//
// FP8 pages (656 B/token: e4m3 ĉ, f32 scale 2^k per 128 columns, bf16 k_pe) stay raw in shared memory
// (4 stages × 41 KB + 8.5 KB = 173 KB; rows of an odd number of 16-byte chunks, k_pe 16-byte aligned) and
// the MMAs read them directly — no dequantised copy, no third barrier:
//  - scores: ĉ·q̃ as an f16 MMA. ldmatrix (b16 units) hands a thread 4 e4m3 bytes of one key; one cvt per
//    pair turns them into the f16 B fragment (e4m3 ⊂ f16, exact), with the k order of the fragment permuted
//    to the byte order (slots 2q, 2q+1, 2q+8, 2q+9 ↔ bytes 4q..4q+3) and q̃ loaded in the same order. q̃ is
//    rounded to f16 after a power-of-two scale 2^es that puts the row's max |q̃| in [2^14, 2^15) (2^−11
//    relative, finer than the BF16 path's 2^−9). Each 128-column group sums into its own accumulator and
//    is multiplied by its key's f32 scale as it is added in; k_pe·q_pe runs as in the BF16 path with q_pe
//    scaled by the same 2^es (exact); the scores are divided by 2^es through the softmax's scale.
//  - P·V: ldmatrix.trans of the raw bytes gives [V(k, c), V(k, c+1), V(k+1, c), V(k+1, c+1)]; two bit
//    placements (shift, mask: e4m3_even/odd in mla_tc_body.h) make bf16 fragments of columns c and c+1
//    whose values are exactly e4m3·2^−120 (subnormals included), the ô columns being split into an even
//    and an odd n8 tile. A warp's ô columns lie in one scale group, so the key's scale goes into P:
//    P' = bf16(p)·bf16(s·2^56) (a power of two: exact), and ô comes out in units of 2^−64, scaled back in
//    the epilogue. l still sums bf16(p): P·V and l see the same numbers, as in the BF16 path.
//  So the MMAs multiply exactly the BF16 values MlaCacheView::read_latent returns (times powers of two), for
//  scales up to 2^71 (|ĉ| < 10^24; larger ones saturate to inf); only q̃ (f16) and p (bf16) are rounded.
//
// The kernel body is mla_tc_body.h (shared with the CPU emulation test tests/unit/test_mla_tc_emulated.cpp);
// this file supplies the warp primitives (mma.sync, ldmatrix, cp.async, shuffles), the launch and the plan.
//
// Numerics vs the CPU twin (FP32 q̃, FP32 p, FP32 ô): q̃ (bf16; FP8 path f16) and p are rounded for the MMA
// (relative 2^−9 each); sums run in FP32 in another order. Expected relative L2 error ≲ 3e-3, tested at
// 1e-2 (tests/gpu/test_mla_tc_gpu.cpp).
//
// Bytes and time (K3 TP8 rank: Hm 12, C 512, R 64; H200 copy 4.29 TB/s read+write, taken as the read
// ceiling): decode reads every key row once per query row — BF16 1152 B, FP8 656 B — plus 4 B per page and
// per selected key of lookups. B = 64, S = 32K: 2.42 GB BF16 → 0.56 ms floor; FP8 1.38 GB → 0.32 ms.
// One CTA per SM streams a 64-key tile (BF16 73.7 KB) every ~4.5 k cycles at that rate. Per full tile and
// warp the loop executes ~1.0 k SASS instructions (BF16; 68 HMMA, 34 LDSM, 18 LDGSTS.128; ptxas: 255
// registers, no spills, 224 KB shared): ~2 k issue cycles per SM sub-partition, and ~190 KB of shared-memory
// reads (~1.5 k cycles) — memory-bound with margin (measured 95 % of copy for the core at B = 64, S = 32K).
// FP8 (237 registers, 173 KB shared): no dequantisation pass — ~1.15 k instructions per warp and tile (68
// HMMA, 18 LDSM, 64 F2FP.F16.E4M3, 16 HMUL2, ~190 shift/select for the P·V bytes, 11 LDGSTS.128), ~2.3 k
// issue cycles per sub-partition against ~2.6 k cycles of HBM time per 42 KB tile at 4.3 TB/s: near
// balance, predicted 65–75 % of the copy rate at B = 64, S = 32K (≈ 0.43–0.50 ms; the dequantising loop was
// ~1.65 k instructions plus a barrier: 0.88 ms, 37 %). Top-2048 rows read 2048 rows each (B = 64: 151 MB
// BF16, ~40 µs plus the merge). Small batches split keys (B = 1, S = 32K: 128 CTAs of 256 keys), costing a
// prologue and pipeline fill per CTA — a one-tile CTA took ~25 µs while the Q-fragment loads ran one L2 round
// trip after another; batched (one round trip) it should take ~8–10 µs — plus q̃ and the merge (mla_decode.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mla_tc.h"

// ---- the warp primitives the kernel body is written against (see mla_tc_body.h) --------------------------
#define KTC_NS tc
#define KTC_DEV __device__ __forceinline__
#define KTC_UNROLL _Pragma("unroll")

namespace kestrel::cuda::tc {
namespace {

KTC_DEV void sync_block() { __syncthreads(); }
KTC_DEV int shfl(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
KTC_DEV float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
KTC_DEV int warp_min(int v) { return __reduce_min_sync(0xffffffffu, v); }
KTC_DEV int warp_max(int v) { return __reduce_max_sync(0xffffffffu, v); }
KTC_DEV bool warp_any(bool v) { return __any_sync(0xffffffffu, v); }
KTC_DEV void smem_atomic_min(int* p, int v) { atomicMin(p, v); }
KTC_DEV void smem_atomic_max(int* p, int v) { atomicMax(p, v); }
template <typename T>
KTC_DEV T ldg(const T* p) {
  return __ldg(p);
}
KTC_DEV uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// src_bytes 0 reads nothing and zero-fills the destination (rows past the end of the key list).
KTC_DEV void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
KTC_DEV void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
KTC_DEV void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
KTC_DEV void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

KTC_DEV void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
KTC_DEV void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// d += a·b, m16n8k16, bf16 inputs, f32 accumulators (PTX fragment layouts: g = lane/4, q = lane%4;
// A: a[0] (g, 2q..), a[1] (g+8, 2q..), a[2] (g, 2q+8..), a[3] (g+8, 2q+8..); B: b0 (k 2q.., n g),
// b1 (k 2q+8.., n g); C: d[0..1] (g, 2q..), d[2..3] (g+8, 2q..)).
KTC_DEV void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same with f16 operands (the FP8 path's scores: f16 q̃ against e4m3 keys, both exact in f16).
KTC_DEV void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats → bf16x2 / f16x2 (RNE), lo in the low half.
KTC_DEV uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
KTC_DEV uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Bytes 0, 1 (lo) or 2, 3 (hi) of v → f16x2, exact: one F2FP, which reads either half of its source.
KTC_DEV uint32_t e4m3x2_lo_to_f16x2(uint32_t v) {
  uint32_t d;
  asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(d) : "r"(v));
  return d;
}
KTC_DEV uint32_t e4m3x2_hi_to_f16x2(uint32_t v) {
  uint32_t d;
  asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;\n}" : "=r"(d) : "r"(v));
  return d;
}

// bf16x2 product, round to nearest even (HMUL2.BF16; subnormal inputs are kept on sm_90).
KTC_DEV uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

}  // namespace
}  // namespace kestrel::cuda::tc

#include "kernels/cuda/mla_tc_body.h"

namespace kestrel::cuda::tc {
namespace {

static_assert(Shape<512, 64, false>::NT == kKeysPerTile, "tile size");

template <int C, int R, bool FP8>
__global__ void __launch_bounds__(kThreads, 1) mla_tc_kernel(const Params p) {
  pdl_enter();
  extern __shared__ __align__(128) uint8_t smem[];
  mla_tc_body<C, R, FP8>(p, smem, int(threadIdx.x), int(blockIdx.x), int(blockIdx.y));
}

template <int C, int R, bool FP8>
void launch(const Params& prm, cudaStream_t stream, bool pdl) {
  constexpr int smem = Shape<C, R, FP8>::SMEM;
  static const bool attr_set = [] {  // once per instantiation (one device per process)
    KCUDA_CHECK(cudaFuncSetAttribute(mla_tc_kernel<C, R, FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attr_set;
  const dim3 grid(unsigned(prm.B), unsigned(prm.n_splits));
  launch_kernel(mla_tc_kernel<C, R, FP8>, grid, dim3(kThreads), size_t(smem), stream, pdl, prm);
}

bool g_pdl = true;

}  // namespace

void set_pdl(bool on) { g_pdl = on; }
bool pdl_enabled() { return g_pdl; }

bool supported(const MlaDims& d) {
  return d.Hm >= 1 && d.Hm <= kMaxHeads && ((d.C == 512 && d.R == 64) || (d.C == 64 && d.R == 16));
}

int sm_count() {
  static const int n = [] {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
      sms = 132;  // H100/H200; only the split heuristic depends on it
    return sms;
  }();
  return n;
}

// Split-KV: a CTA handles `per` tiles; CTAs run one per SM in waves. Cost in half-tile times ≈
// waves · (2·per + 2 + split), where 2 is the prologue and pipeline fill and `split` (1 when split) the
// partial results a split CTA writes and the merge reads back (12 heads × 512 f32 ≈ a third of a BF16
// tile); the fewest splits among the cheapest plans win. Rows of a launch may be shorter than max_keys
// (varlen, causal prefill): their CTAs finish early and the next wave starts sooner, which this ignores.
Plan plan(int64_t B, int64_t max_keys) {
  const int64_t tiles = std::max<int64_t>(1, (max_keys + kKeysPerTile - 1) / kKeysPerTile);
  const int64_t sms = sm_count();
  int64_t best_cost = INT64_MAX, best_per = tiles;
  for (int64_t s = 1; s <= std::min<int64_t>(tiles, kMaxSplits); ++s) {
    const int64_t per = (tiles + s - 1) / s, n = (tiles + per - 1) / per;
    const int64_t waves = (B * n + sms - 1) / sms, cost = waves * (2 * per + 2 + (n > 1 ? 1 : 0));
    if (cost < best_cost) best_cost = cost, best_per = per;
  }
  Plan pl;
  pl.chunk = int(best_per * kKeysPerTile);
  pl.n_splits = int((tiles + best_per - 1) / best_per);
  return pl;
}

void attend(const Args& a, cudaStream_t stream) {
  const MlaDims& d = a.d;
  const PagedMlaCache& c = *a.cache;
  KCUDA_REQUIRE(supported(d), "mla tensor-core attention: unsupported shape Hm=" + std::to_string(d.Hm) +
                                  " C=" + std::to_string(d.C) + " R=" + std::to_string(d.R));
  KCUDA_REQUIRE(a.B > 0 && a.B < (int64_t(1) << 31) && a.plan.n_splits >= 1 && a.plan.n_splits <= kMaxSplits &&
                    a.plan.chunk > 0 && a.plan.chunk % kKeysPerTile == 0,
                std::string("mla tensor-core attention: bad batch or plan"));
  KCUDA_REQUIRE(a.sel ? (a.Ksel > 0 && a.Ksel < (int64_t(1) << 30)) : a.lens != nullptr,
                std::string("mla tensor-core attention: dense rows need lens, sparse rows Ksel > 0"));
  KCUDA_REQUIRE(a.qt && a.q && c.latent && c.block_tables && c.block_size > 0 && c.bt_stride > 0,
                std::string("mla tensor-core attention: null pointer"));
  KCUDA_REQUIRE(a.ohat ? a.plan.n_splits == 1 : (a.part_ml && a.part_acc),
                std::string("mla tensor-core attention: output form"));
  Params p{};
  p.arena = c.latent, p.bt = c.block_tables, p.bt_stride = c.bt_stride, p.req = a.req, p.lens = a.lens;
  p.sel = a.sel, p.Ksel = a.Ksel, p.qt = a.qt, p.q = a.q, p.part_ml = a.part_ml, p.part_acc = a.part_acc;
  p.ohat = a.ohat, p.sl2 = 1.4426950408889634f / std::sqrt(float(d.N + d.R));
  p.P = c.block_size, p.B = int(a.B), p.Hm = int(d.Hm), p.N = int(d.N), p.n_splits = a.plan.n_splits;
  p.chunk = a.plan.chunk, p.longest_first = a.longest_first;
  const bool fp8 = c.latent_format == LatentFormat::fp8;
  if (d.C == 512) {
    if (fp8)
      launch<512, 64, true>(p, stream, a.pdl);
    else
      launch<512, 64, false>(p, stream, a.pdl);
  } else {
    if (fp8)
      launch<64, 16, true>(p, stream, a.pdl);
    else
      launch<64, 16, false>(p, stream, a.pdl);
  }
}

}  // namespace kestrel::cuda::tc
