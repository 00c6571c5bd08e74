// The DSA indexer on tensor cores (see indexer.h): scores by BF16 mma.sync with FP32 accumulation, ReLU and
// the head-weighted sum fused in registers, and a chunked per-row radix top-k (indexer_topk.cu: the select
// kernel, run after each key chunk), for every row of a step.
//
// Scores kernel. A CTA (8 warps) owns a group of 8 consecutive query rows and a span of key positions
// (a multiple of 128) inside the current key chunk. Consecutive active rows of the group that read the
// same request form a segment; for each segment the CTA streams its span in 128-key tiles: cp.async
// copies whole 64-token kernel pages (values then scales, MODEL.md §3.5 — exactly the bytes of the pool)
// into a 3-stage ring, then the CTA dequantises a tile once into a BF16 [128 keys, Di] tile in shared
// memory, which every row of the segment reads (prefill rows of a request share each key tile; decode
// rows, one per request, are one-row segments). BF16 pages are copied straight into the MMA layout.
// Dequantisation is exact (§0.12: e4m3·2^k and e2m1·2^k are BF16 values):
//  - FP8: cvt.rn.f16x2.e4m3x2 (exact, every e4m3 is a normal f16), the f16 bits moved into a BF16
//    (value·2^−112, still normal), one mul.rn.bf16x2 by 2^112; the per-token scale 2^k is applied to the
//    FP32 score afterwards (a power of two commutes with every rounding: relu(s·d) = s·relu(d)).
//  - MXFP4: each e2m1 nibble is re-coded as the e4m3 byte of value·2^−6, then the FP8 path, and the
//    e8m0 block scale 2^(E−127) is folded into the BF16 multiplier (2^(E−9), or two steps when E > 136).
// Q of a row (32 heads, padded with zero heads when Hi < 32, × Di) sits in registers as mma A fragments;
// the tile is the B operand (ldmatrix from an XOR-swizzled layout: conflict-free). A warp computes
// [32 heads × 16 keys] per step (4 or 2 mma.m16n8k16 per 16 of Di), then in registers:
// ReLU, × w'[h] (w' = w·(Hi·Di)^−½ in FP32, as the twin), and the sum over the 32 heads by a 3-level
// butterfly across lanes (4 shuffles for 16 keys) whose tree is the same for every key, so equal keys
// give bit-equal scores (exact ties stay exact ties). Rows of a segment with r rows use 8/r warps each
// (split over the tile's keys), so decode rows keep all 8 warps busy. One FP32 score per (row, key) is
// written to the chunk's score buffer; nothing else.
//
// Numerics (why the selection can differ from the twin only inside a band): products of BF16 values are
// exact in FP32; the twin sums them sequentially, the tensor core in its own order (and possibly with
// truncation), so |d_gpu − d| and |d_cpu − d| ≤ c·Di·2^−24·Σ_i|q_i·k_i|; ReLU is 1-Lipschitz; the head
// sums add ≤ (Hi+1)·2^−24·Σ_h|w'_h·r_h|. Hence both FP32 scores lie within
// β = (4·Di + 2·Hi + 8)·2^−24 · Σ_h |w'_h|·Σ_i |q_h,i·k_i| of the exact score, and any key farther than 2β
// from the row's threshold is selected by both or by neither (tests/gpu/test_indexer_gpu.cpp asserts it).
// Not covered: keys holding NaN bytes (e4m3 0x7F/0xFF) score as finite values here (the twin: NaN → last);
// MXFP4 blocks with E ≤ 1 dequantise to BF16 subnormals (exact if the multiply keeps them, as the H200 does).
//
// Resources (ptxas, sm_90a): scores kernel 123–124 registers (Di 128; 87–92 at Di 64, 63–72 at Di 32), no spills,
// __launch_bounds__(256, 2); shared memory per CTA at Di 128: FP8 84 KB (3 × 16.5 KB ring + 32 KB tile),
// MXFP4 58 KB, BF16 97 KB: two CTAs per SM.
// SASS of the scores kernel: HMMA.16816.F32.BF16, LDSM.16.M88.4, LDGSTS.E.BYPASS.128, F2FP.F16.E4M3.UNPACK_B,
// HMUL2.BF16_V2.
//
// Cost at the real shape (Hi 32, Di 128, Ki 2048), B decode rows of S keys each: key bytes B·S·132 (FP8) or
// B·S·68 (MXFP4), FLOPs 2·B·S·32·128, scores 4·B·S bytes written and read once (then shared memory).
// B = 64, S = 32K: 277 MB of keys → ~65 µs at the H200's ~4.3 TB/s copy rate; 17 GFLOP (~30 µs at ~600
// TFLOP/s of mma.sync) and the dequantisation (~3 ALU ops per element) overlap it; the select ~10 µs
// (64 CTAs in parallel): predicted ~80–120 µs against 8.2 ms for the exact-order kernel. Prefill, T rows of
// one request: each key tile is read from L2 once per 8-row group, FLOPs 2·T·S·32·128 (T = 2048,
// S = 32K: 0.55 TFLOP → ~1 ms at ~50% of mma.sync peak; the select ~0.15 ms).
#include <algorithm>
#include <climits>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/indexer_topk.h"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;   // 8 warps
constexpr int kTile = 128;      // keys per tile
constexpr int kGroupRows = 8;   // rows per CTA group (one warp-row of 32 padded heads each)
constexpr int kStages = 3;      // cp.async ring of raw tiles
constexpr int kMaxHeads = 32;   // heads padded to two m16 tiles
constexpr int64_t kScoreBudget = int64_t(1) << 26;  // f32 scores per chunk over all rows (256 MiB)
constexpr int64_t kMinChunk = 8192;

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

template <int DI, IndexKeyFormat F>
struct Layout {
  static constexpr int VB = F == IndexKeyFormat::bf16 ? 2 * DI : F == IndexKeyFormat::fp8 ? DI : DI / 2;
  static constexpr int SB = F == IndexKeyFormat::bf16 ? 0 : F == IndexKeyFormat::fp8 ? 4 : DI / 32;
  static constexpr int TB = VB + SB;                                  // bytes per token
  static constexpr bool kDequant = F != IndexKeyFormat::bf16;
  static constexpr int kStageBytes = round_up(kTile * (kDequant ? TB : 2 * DI), 128);
  static constexpr int kTileBytes = kTile * DI * 2;                   // bf16 [128, DI]
  static constexpr int kSmem = kStages * kStageBytes + (kDequant ? kTileBytes : 0) + kTile * 4;
};

// Byte offset of 16-byte chunk c of key n in a BF16 [128, DI] tile: chunk index XOR a row-dependent
// pattern so that the 8 rows one ldmatrix phase reads land in 8 different bank groups.
template <int DI>
__device__ __forceinline__ int tile_off(int n, int c) {
  constexpr int CPR = DI / 8;                       // chunks per key
  constexpr int DIV = CPR >= 8 ? 1 : 8 / CPR;       // keys per 128-byte line
  constexpr int MOD = CPR >= 8 ? 8 : CPR;
  return n * DI * 2 + ((c ^ ((n / DIV) % MOD)) << 4);
}

using dev::cp_async16;  // 16-byte copies global → shared (device_util.cuh)
using dev::cp_async_commit;
using dev::cp_async_wait;
using dev::smem_addr;

// Two e4m3 pairs (a 32-bit word) → two f16x2 words, exactly.
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}
// f16x2 whose values have at most 3 mantissa bits (e4m3 images; normal or zero) → the BF16x2 of value·2^−112.
__device__ __forceinline__ uint32_t f16x2_to_bf16x2_down(uint32_t h) {
  return ((h & 0x7FFF7FFFu) >> 3) | (h & 0x80008000u);
}
__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// 4 e4m3 bytes → 2 BF16x2 words of (value · mult), mult a BF16x2 power of two (see the header).
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t w, uint32_t m1, uint32_t m2, bool two, uint32_t* out) {
  uint32_t lo, hi;
  e4m3x4_to_f16x4(w, lo, hi);
  lo = bmul2(f16x2_to_bf16x2_down(lo), m1);
  hi = bmul2(f16x2_to_bf16x2_down(hi), m1);
  if (two) lo = bmul2(lo, m2), hi = bmul2(hi, m2);
  out[0] = lo, out[1] = hi;
}
// 8 packed e2m1 codes (low nibble = even element) → 8 e4m3 bytes of value·2^−6, in element order.
__device__ __forceinline__ void e2m1x8_to_e4m3x8(uint32_t w, uint32_t& a, uint32_t& b) {
  const uint32_t x = w & 0x0F0F0F0Fu, y = (w >> 4) & 0x0F0F0F0Fu;  // even / odd elements, one per byte
  const uint32_t fx = ((x & 0x07070707u) << 2) | ((x & 0x08080808u) << 4);
  const uint32_t fy = ((y & 0x07070707u) << 2) | ((y & 0x08080808u) << 4);
  a = __byte_perm(fx, fy, 0x5140);  // e0 e1 e2 e3
  b = __byte_perm(fx, fy, 0x7362);  // e4 e5 e6 e7
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float relu(float x) { return x < 0.0f ? 0.0f : x; }  // NaN kept, as the twin's max

struct ScoreArgs {
  const uint16_t* qi;      // bf16 [T, Hi*Di]
  const float* hw;         // f32 [T, Hi]
  const uint8_t* arena;    // key pages
  const int32_t* tables;   // i32 [rows, bt_stride]
  int64_t bt_stride;
  const int32_t* lens;     // i32 [T]
  const int32_t* req;      // i32 [T] or null
  float* scores;           // f32 [T, ldc]: position chunk0 + i of row t at t·ldc + i
  int64_t ldc;
  int T, Hi, Ki, max_len, P, KP, kp_shift;  // KP = 2^kp_shift: kernel-page tokens (64, or P ∈ {16, 32})
  int chunk0, chunk_end, span;    // this launch's key range and the span per CTA (multiples of 128)
  float scale;                    // (Hi·Di)^−½
};

template <int DI, IndexKeyFormat F>
__global__ void __launch_bounds__(kThreads, 2) indexer_scores_tc(const ScoreArgs a) {
  using L = Layout<DI, F>;
  constexpr int KS = DI / 16;  // k-steps
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* stages = smem;
  uint8_t* tile = smem + kStages * L::kStageBytes;  // bf16 [128, DI] (quantised formats)
  float* sc = reinterpret_cast<float*>(tile + (L::kDequant ? L::kTileBytes : 0));  // f32 [128] FP8 scales
  __shared__ int s_row0[kGroupRows], s_nrows[kGroupRows], s_req[kGroupRows], s_end[kGroupRows];
  __shared__ int s_job0[kGroupRows + 1], s_nseg;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int span0 = a.chunk0 + int(blockIdx.x) * a.span;
  const int span1 = min(span0 + a.span, a.chunk_end);
  const int g0 = int(blockIdx.y) * kGroupRows;

  // Segments: consecutive active rows of the group with the same request.
  if (warp == 0) {
    const int t = g0 + lane;
    const bool valid = lane < kGroupRows && t < a.T;
    const int len = valid ? min(max(a.lens[t], 0), a.max_len) : 0;
    const int r = valid ? (a.req ? a.req[t] : t) : -1;
    const bool active = valid && len > a.Ki && len > span0;
    int nseg = 0, cur_n = 0, cur_req = -1, cur_end = 0, job = 0;
    auto close = [&] {
      if (cur_n == 0) return;
      const int end = min(span1, cur_end);
      if (lane == 0) s_nrows[nseg] = cur_n, s_req[nseg] = cur_req, s_end[nseg] = end, s_job0[nseg] = job;
      job += (end - span0 + kTile - 1) / kTile;
      ++nseg, cur_n = 0;
    };
    for (int i = 0; i < kGroupRows; ++i) {
      const int li = __shfl_sync(0xffffffffu, len, i), ri = __shfl_sync(0xffffffffu, r, i);
      const bool ai = __shfl_sync(0xffffffffu, int(active), i) != 0;
      if (!ai) {
        close();
        continue;
      }
      if (cur_n > 0 && ri == cur_req) {
        ++cur_n, cur_end = max(cur_end, li);
        continue;
      }
      close();
      if (lane == 0) s_row0[nseg] = g0 + i;
      cur_n = 1, cur_req = ri, cur_end = li;
    }
    close();
    if (lane == 0) s_job0[nseg] = job, s_nseg = nseg;
  }
  __syncthreads();
  const int nseg = s_nseg;
  if (nseg == 0) return;
  const int njobs = s_job0[nseg];
  auto seg_of = [&](int j) {
    int s = 0;
    while (s + 1 < nseg && j >= s_job0[s + 1]) ++s;
    return s;
  };

  // Copies tile j's kernel pages (those starting before the segment's end) into ring stage st.
  const int kp_bytes = a.KP * L::TB, nkp = kTile >> a.kp_shift;
  auto issue = [&](int j) {
    if (j < njobs) {
      const int s = seg_of(j), p0 = span0 + (j - s_job0[s]) * kTile, end = s_end[s];
      const int32_t* table = a.tables + int64_t(s_req[s]) * a.bt_stride;
      uint8_t* dst = stages + (j % kStages) * L::kStageBytes;
      const int cpk = kp_bytes / 16;
      for (int kp = 0; kp < nkp; ++kp) {
        const int pos = p0 + kp * a.KP;
        if (pos >= end) break;
        const uint8_t* src =
            a.arena + (int64_t(table[pos / a.P]) * a.P + ((pos % a.P) & ~(a.KP - 1))) * L::TB;
        for (int ci = tid; ci < cpk; ci += kThreads) {
          if constexpr (L::kDequant) {
            cp_async16(smem_addr(dst + kp * kp_bytes + ci * 16), src + ci * 16);
          } else {
            const int n = kp * a.KP + ci / (DI / 8), c = ci % (DI / 8);
            cp_async16(smem_addr(dst + tile_off<DI>(n, c)), src + ci * 16);
          }
        }
      }
    }
    cp_async_commit();
  };

  // Per-warp state of the current segment: Q fragments, head weights, row.
  uint32_t qf[2][KS][4];
  float w4[4];
  int cur_seg = -1, row = -1, row_len = 0, wpr = 8, part = 0;
  bool two_m = a.Hi > 16;
  const int g = lane >> 2, cq = lane & 3;

  issue(0);
  issue(1);
  for (int j = 0; j < njobs; ++j) {
    cp_async_wait<1>();
    __syncthreads();  // tile j's bytes visible to all; every warp is done with tile j−1
    issue(j + 2);
    const uint8_t* raw = stages + (j % kStages) * L::kStageBytes;
    const uint8_t* bt = raw;
    if constexpr (L::kDequant) {
      if constexpr (F == IndexKeyFormat::fp8) {
        for (int it = tid; it < kTile * (DI / 16); it += kThreads) {
          const int n = it / (DI / 16), c16 = it % (DI / 16), kp = n >> a.kp_shift, r = n & (a.KP - 1);
          const uint8_t* src = raw + kp * kp_bytes;
          const uint4 v = *reinterpret_cast<const uint4*>(src + r * DI + c16 * 16);
          uint32_t o[8];
          e4m3x4_to_bf16(v.x, 0x77807780u, 0, false, o);
          e4m3x4_to_bf16(v.y, 0x77807780u, 0, false, o + 2);
          e4m3x4_to_bf16(v.z, 0x77807780u, 0, false, o + 4);
          e4m3x4_to_bf16(v.w, 0x77807780u, 0, false, o + 6);
          // Half the threads store their odd chunk first, so a phase of 8 stores hits 8 bank groups.
          const int first = (c16 >> 2) & 1;
          *reinterpret_cast<uint4*>(tile + tile_off<DI>(n, 2 * c16 + first)) =
              first ? make_uint4(o[4], o[5], o[6], o[7]) : make_uint4(o[0], o[1], o[2], o[3]);
          *reinterpret_cast<uint4*>(tile + tile_off<DI>(n, 2 * c16 + 1 - first)) =
              first ? make_uint4(o[0], o[1], o[2], o[3]) : make_uint4(o[4], o[5], o[6], o[7]);
          if (c16 == 0) sc[n] = *reinterpret_cast<const float*>(src + a.KP * DI + r * 4);
        }
      } else {
        for (int it = tid; it < kTile * (DI / 32); it += kThreads) {
          const int n = it / (DI / 32), b = it % (DI / 32), kp = n >> a.kp_shift, r = n & (a.KP - 1);
          const uint8_t* src = raw + kp * kp_bytes;
          const uint4 v = *reinterpret_cast<const uint4*>(src + r * (DI / 2) + b * 16);
          const uint32_t E = src[a.KP * (DI / 2) + r * (DI / 32) + b];
          // value = e2m1·2^(E−127) = (e2m1·2^−118) · 2^(E−9); BF16 holds 2^(E−9) while E + 118 ≤ 254.
          const bool two = E > 136 && E < 255;
          uint32_t m1 = E == 255 ? 0x7FC07FC0u : two ? 0x7A807A80u : ((E + 118u) << 7) * 0x10001u;
          const uint32_t m2 = (E << 7) * 0x10001u;
          const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {  // (a phase of 8 stores meets 2-way bank conflicts; cheaper than avoiding)
            uint32_t e0, e1, o[4];
            e2m1x8_to_e4m3x8(words[q], e0, e1);
            e4m3x4_to_bf16(e0, m1, m2, two, o);
            e4m3x4_to_bf16(e1, m1, m2, two, o + 2);
            *reinterpret_cast<uint4*>(tile + tile_off<DI>(n, 4 * b + q)) = make_uint4(o[0], o[1], o[2], o[3]);
          }
        }
      }
      __syncthreads();  // the BF16 tile is complete
      bt = tile;
    }

    const int s = seg_of(j), p0 = span0 + (j - s_job0[s]) * kTile;
    if (s != cur_seg) {  // a new segment: this warp's row, split and Q fragments
      cur_seg = s;
      const int nr = s_nrows[s], np = nr <= 1 ? 1 : nr <= 2 ? 2 : nr <= 4 ? 4 : 8;
      wpr = kGroupRows / np;
      const int ri = warp / wpr;
      part = warp % wpr;
      row = ri < nr ? s_row0[s] + ri : -1;
      if (row >= 0) {
        row_len = min(max(a.lens[row], 0), a.max_len);
        const uint16_t* q = a.qi + int64_t(row) * a.Hi * DI;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int h0 = 16 * mt + g, h1 = h0 + 8;
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) {
            const int k0 = 16 * ks + 2 * cq;
            qf[mt][ks][0] = h0 < a.Hi ? *reinterpret_cast<const uint32_t*>(q + h0 * DI + k0) : 0u;
            qf[mt][ks][1] = h1 < a.Hi ? *reinterpret_cast<const uint32_t*>(q + h1 * DI + k0) : 0u;
            qf[mt][ks][2] = h0 < a.Hi ? *reinterpret_cast<const uint32_t*>(q + h0 * DI + k0 + 8) : 0u;
            qf[mt][ks][3] = h1 < a.Hi ? *reinterpret_cast<const uint32_t*>(q + h1 * DI + k0 + 8) : 0u;
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = g + 8 * i;
          w4[i] = h < a.Hi ? __fmul_rn(a.hw[int64_t(row) * a.Hi + h], a.scale) : 0.0f;
        }
      }
    }
    if (row >= 0) {
      const int kw = kTile / wpr;  // this warp's keys of the tile: [part·kw, part·kw + kw)
      const uint32_t tile_base = smem_addr(bt);
      for (int n0 = part * kw; n0 < part * kw + kw; n0 += 16) {
        if (p0 + n0 >= row_len) break;
        float acc[2][2][4];
#pragma unroll
        for (int i = 0; i < 16; ++i) (&acc[0][0][0])[i] = 0.0f;
        // ldmatrix rows: lanes 0–7 keys n0..n0+7 at k-chunk 2ks, 8–15 the same keys at 2ks+1,
        // 16–31 keys n0+8..n0+15 likewise → b0,b1 of n-tile 0 and b0,b1 of n-tile 1.
        const int kn = n0 + (lane & 7) + ((lane >> 4) << 3), khalf = (lane >> 3) & 1;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          uint32_t b[4];
          ldmatrix_x4(tile_base + tile_off<DI>(kn, 2 * ks + khalf), b);
          mma_bf16(acc[0][0], qf[0][ks], b[0], b[1]);
          mma_bf16(acc[0][1], qf[0][ks], b[2], b[3]);
          if (two_m) {
            mma_bf16(acc[1][0], qf[1][ks], b[0], b[1]);
            mma_bf16(acc[1][1], qf[1][ks], b[2], b[3]);
          }
        }
        // acc[mt][nt][i]: head 16mt + g (+8 for i ≥ 2), key n0 + 8nt + 2cq + (i & 1).
        float Lv[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int p = 0; p < 2; ++p)
            Lv[nt][p] = w4[0] * relu(acc[0][nt][p]) + w4[1] * relu(acc[0][nt][2 + p]) + w4[2] * relu(acc[1][nt][p]) +
                        w4[3] * relu(acc[1][nt][2 + p]);
        // Sum over g (lane bits 4, 3, 2) by a reduce-scatter butterfly: lane keeps n-tile = bit 4,
        // then parity = bit 3; every key sees the same addition tree.
        const bool b4 = lane & 16, b3 = lane & 8;
        float k0 = b4 ? Lv[1][0] : Lv[0][0], k1 = b4 ? Lv[1][1] : Lv[0][1];
        const float s0 = b4 ? Lv[0][0] : Lv[1][0], s1 = b4 ? Lv[0][1] : Lv[1][1];
        k0 += __shfl_xor_sync(0xffffffffu, s0, 16);
        k1 += __shfl_xor_sync(0xffffffffu, s1, 16);
        float v = b3 ? k1 : k0;
        v += __shfl_xor_sync(0xffffffffu, b3 ? k0 : k1, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        const int n = n0 + 8 * int(b4) + 2 * cq + int(b3), pos = p0 + n;
        if (!(lane & 4) && pos < row_len) {
          if constexpr (F == IndexKeyFormat::fp8) v *= sc[n];
          a.scores[int64_t(row) * a.ldc + (pos - a.chunk0)] = v;
        }
      }
    }
  }
  cp_async_wait<0>();
}

int num_sms() {
  static int n = [] {
    int dev = 0, v = 0;
    KCUDA_CHECK(cudaGetDevice(&dev));
    KCUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

template <int DI, IndexKeyFormat F>
void launch_scores(const ScoreArgs& a, int groups, cudaStream_t stream) {
  const int n_span = (a.chunk_end - a.chunk0 + a.span - 1) / a.span;
  const int smem = Layout<DI, F>::kSmem;
  KCUDA_CHECK(cudaFuncSetAttribute(indexer_scores_tc<DI, F>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  indexer_scores_tc<DI, F><<<dim3(unsigned(n_span), unsigned(groups)), kThreads, smem, stream>>>(a);
  KCUDA_CHECK_LAUNCH();
}

template <int DI>
void launch_scores_fmt(IndexKeyFormat f, const ScoreArgs& a, int groups, cudaStream_t stream) {
  switch (f) {
    case IndexKeyFormat::bf16: launch_scores<DI, IndexKeyFormat::bf16>(a, groups, stream); break;
    case IndexKeyFormat::fp8: launch_scores<DI, IndexKeyFormat::fp8>(a, groups, stream); break;
    case IndexKeyFormat::mxfp4: launch_scores<DI, IndexKeyFormat::mxfp4>(a, groups, stream); break;
  }
}

int64_t round128(int64_t x) { return (x + 127) / 128 * 128; }

}  // namespace

// Workspace layout: f32 scores [T, chunk] at offset 0, then u32 running top-k keys [T, Ki]; chunk is a multiple
// of 128, so the second part starts 512-byte aligned and the total is exactly 4·T·(chunk + Ki) bytes.
size_t indexer_select_paged_tc_workspace_bytes(int64_t T, int64_t max_len, int64_t Ki) {
  if (T <= 0) return 0;
  int64_t chunk = round128(std::max<int64_t>(max_len, 1));
  if (T * chunk > kScoreBudget)
    chunk = std::max(round128(std::max(Ki, kMinChunk)), kScoreBudget / T / 128 * 128);
  return size_t(4 * T * (chunk + Ki));
}

int64_t indexer_select_paged_tc_chunk(int64_t T, int64_t max_len, int64_t Ki, size_t ws) {
  if (T <= 0 || int64_t(ws) <= 4 * T * Ki) return 0;
  const int64_t chunk = (int64_t(ws) - 4 * T * Ki) / (4 * T) / 128 * 128;
  return std::min(chunk, round128(std::max<int64_t>(max_len, 1)));
}

void indexer_select_paged_tc(const uint16_t* qi, const float* hw, const PagedMlaCache& c, const int32_t* lens,
                             const int32_t* req, int64_t T, int64_t max_len, int64_t Hi, int64_t Ki, void* workspace,
                             size_t workspace_bytes, int32_t* sel, cudaStream_t stream) {
  KCUDA_REQUIRE(T >= 0 && T <= int64_t(kGroupRows) * 65535,
                "indexer_select_paged_tc: T = " + std::to_string(T) + " out of range");
  if (T == 0) return;
  KCUDA_REQUIRE(lens && sel && Ki > 0 && Ki < (int64_t(1) << 24) && max_len > 0 && max_len < (int64_t(1) << 30),
                std::string("indexer_select_paged_tc: bad lens/sel/Ki/max_len"));
  if (max_len <= Ki) {  // every row selects all its visible keys: no scores
    indexer_detail::select_merge(nullptr, 1, nullptr, sel, lens, 0, int(Ki), int(max_len), 0, T, stream);
    return;
  }
  KCUDA_REQUIRE(qi && hw && c.keys && c.block_tables && c.bt_stride > 0 && workspace,
                std::string("indexer_select_paged_tc: null pointer"));
  KCUDA_REQUIRE(Hi >= 1 && Hi <= kMaxHeads, "indexer_select_paged_tc: Hi = " + std::to_string(Hi) + " (1..32)");
  KCUDA_REQUIRE(c.Di == 32 || c.Di == 64 || c.Di == 128,
                "indexer_select_paged_tc: Di = " + std::to_string(c.Di) + " not in {32, 64, 128}");
  const int P = c.block_size;
  KCUDA_REQUIRE(P > 0 && (P % 64 == 0 || P == 16 || P == 32),
                "indexer_select_paged_tc: block size " + std::to_string(P) + " (a multiple of 64, or 16, 32)");
  KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(c.keys) % 16 == 0 && reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                std::string("indexer_select_paged_tc: keys and workspace must be 16-byte aligned"));
  const int64_t chunk = indexer_select_paged_tc_chunk(T, max_len, Ki, workspace_bytes);
  KCUDA_REQUIRE(chunk >= std::max<int64_t>(round128(Ki), 128),
                "indexer_select_paged_tc: workspace of " + std::to_string(workspace_bytes) +
                    " bytes holds no key chunk of at least Ki for " + std::to_string(T) + " rows");
  float* scores = static_cast<float*>(workspace);
  uint32_t* skeys = reinterpret_cast<uint32_t*>(scores + T * chunk);

  ScoreArgs a{};
  a.qi = qi, a.hw = hw, a.arena = c.keys, a.tables = c.block_tables, a.bt_stride = c.bt_stride;
  a.lens = lens, a.req = req, a.scores = scores, a.ldc = chunk;
  a.T = int(T), a.Hi = int(Hi), a.Ki = int(Ki), a.max_len = int(max_len), a.P = P, a.KP = P % 64 == 0 ? 64 : P;
  a.kp_shift = a.KP == 64 ? 6 : a.KP == 32 ? 5 : 4;
  a.scale = 1.0f / sqrtf(float(Hi) * float(c.Di));  // the twin's (Hi·Di)^−½
  const int groups = int((T + kGroupRows - 1) / kGroupRows);
  // The select keeps a row's candidates (≤ chunk + Ki order keys) in shared memory when they fit.
  const int64_t cache_cap = std::min<int64_t>(chunk + Ki, indexer_detail::kSelCacheMax);
  const int64_t target_ctas = 4 * int64_t(num_sms());
  for (int64_t chunk0 = 0; chunk0 < max_len; chunk0 += chunk) {
    const int64_t keys = std::min(chunk, round128(max_len) - chunk0);
    a.chunk0 = int(chunk0), a.chunk_end = int(chunk0 + keys);
    // Span per CTA: enough CTAs for ~2 waves at 2 CTAs per SM, at most 8192 keys.
    a.span = int(std::clamp<int64_t>(round128((keys * groups + target_ctas - 1) / target_ctas), 128, 8192));
    switch (c.Di) {
      case 32: launch_scores_fmt<32>(c.key_format, a, groups, stream); break;
      case 64: launch_scores_fmt<64>(c.key_format, a, groups, stream); break;
      default: launch_scores_fmt<128>(c.key_format, a, groups, stream); break;
    }
    indexer_detail::select_merge(scores, chunk, skeys, sel, lens, int(chunk0), int(Ki), int(max_len), int(cache_cap),
                                 T, stream);
  }
}

}  // namespace kestrel::cuda
