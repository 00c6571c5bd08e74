// Prefill GEMM of the routed experts (moe_experts.cu, many tokens per expert): each CTA multiplies one job —
// an expert and up to kWideTokens = 128 of its tokens — by 128 (w1|w3: of each) or 256 (w2) rows of the
// expert's MXFP4 weights, on BF16 mma.sync with the weights decoded in registers. Contract: moe_internal.cuh.
//
// Tiles. 8 warps; a warp owns two 16-row A tiles — w1|w3: the same 16 rows of W1 and of W3, so g and u of an
// output meet in one thread and SiTU-GLU runs in registers; w2: two adjacent tiles — against all the job's
// tokens, ⌈count/8⌉ n-tiles of 8 (at most 16; n-tiles past the count are skipped, so a 73-token job costs 10
// n-tiles, not 16). 2 × 16 × 4 FP32 accumulators per thread; each decoded A fragment feeds 2·⌈count/8⌉ MMAs
// and each B fragment 4.
// Operands. Weights: each lane streams its 16 bytes per chunk (64 columns) and 4 scale bytes per tile from
// global memory into a register ring kAStages chunks deep (every byte read by one warp only); scales folded
// into the decode multiply (moe_mma.cuh). Tokens: the CTA cp.asyncs the job's activation rows, chunk by chunk,
// into a shared ring of kBStages × [128 tokens][64 columns] bf16 (16 KB each, zero rows past the count);
// the 16-byte unit u of token r sits at unit u ^ 4(r & 1), so the B loads (lane g, t: unit 4b + t of token
// 8q + g, one LDS.128 = B registers of two k16 steps) hit 8 distinct 16-byte bank groups per phase.
// One __syncthreads per chunk guards the shared ring.
// Order. blockIdx → (job, row group) with the row group fastest: the CTAs that share a job's activations run
// together (L2), and an expert's jobs follow each other (its weights are still in L2 for the next job).
// Per warp and 32-column block at 16 n-tiles: 64 HMMA, 16 LDS.128, 4 words decoded (≈ 60 instructions) —
// about 2.2 instructions per HMMA, within mma.sync's issue budget; shared-memory traffic 128 B per HMMA.
#include <algorithm>

#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_mma.cuh"

namespace kestrel::cuda::moe_detail {
namespace {

using namespace moe_dev;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kNq = kWideTokens / 8;  // n-tiles
constexpr int kAStages = 4;  // 3 chunks ahead: ≈ 3 × 107·⌈count/8⌉ cycles of MMAs cover the DRAM latency
constexpr int kBStages = 4;
constexpr int kBStageBytes = kWideTokens * ml::kChunkCols * 2;  // 16 KB
constexpr size_t kSmem = size_t(kBStages) * kBStageBytes;

template <bool kGlu>
constexpr int rows_per_cta() {
  return kGlu ? kWarps * ml::kTileRows : 2 * kWarps * ml::kTileRows;
}

template <bool kGlu>
__global__ void __launch_bounds__(kThreads, 1) wide_gemm_kernel(const GemmArgs a) {
  extern __shared__ __align__(128) uint8_t bsm[];  // bf16 [kBStages][128 tokens][64 columns], swizzled units
  griddep_wait();  // the job list and (w2) the activations come from the kernels before
  griddep_launch();
  const int nj = __ldcg(a.n_jobs);
  const int n_rg = (a.R + rows_per_cta<kGlu>() - 1) / rows_per_cta<kGlu>();
  const int64_t item = blockIdx.x;
  if (item >= int64_t(nj) * n_rg) return;  // beyond the device's work list
  const int job = int(item / n_rg), rg = int(item - int64_t(job) * n_rg);
  const int e = __ldcg(a.jobs + 3 * job), begin = __ldcg(a.jobs + 3 * job + 1), count = __ldcg(a.jobs + 3 * job + 2);
  const int nq = (count + 7) >> 3;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int NC = a.C / ml::kChunkCols;
  const uint32_t bbase = smem_addr(bsm);

  // B producer: thread i copies 16-byte unit (i & 7) of tokens (i >> 3) + 32k, k = 0..3.
  const int unit = threadIdx.x & 7, tok0 = threadIdx.x >> 3;
  const uint16_t* src[4];
  bool need[4], valid[4];
  const uint32_t dst = uint32_t(tok0 * 128 + ((unit ^ ((tok0 & 1) << 2)) << 4));  // + 32k·128 for token tok0 + 32k
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int tok = tok0 + 32 * k;
    need[k] = tok < nq * 8;
    valid[k] = tok < count;
    const int slot = __ldcg(a.order + begin + (valid[k] ? tok : 0));
    src[k] = a.x + int64_t(slot / a.x_div) * a.ldx + unit * 8;
  }
  auto load_b = [&](int c) {
    const uint32_t s = bbase + uint32_t((c % kBStages) * kBStageBytes) + dst;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (need[k]) cp_async16(s + uint32_t(k * 32 * 128), src[k] + c * ml::kChunkCols, valid[k]);
  };

  // A: this warp's two tiles (w1|w3: tile w of W1 and W3; w2: tiles 2w, 2w+1) of row group rg.
  const int RT = a.R / ml::kTileRows;
  int tile[2];
  const uint8_t* wp[2];
  const uint8_t* wsc[2];
  if constexpr (kGlu) {
    tile[0] = tile[1] = rg * kWarps + warp;
  } else {
    tile[0] = 2 * (rg * kWarps + warp);
    tile[1] = tile[0] + 1;
  }
  const bool active = tile[1] < RT;  // R need not fill the last row group
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const uint8_t* P = kGlu && m == 1 ? a.p1 : a.p0;
    const uint8_t* S = kGlu && m == 1 ? a.s1 : a.s0;
    const int64_t tc = int64_t(active ? tile[m] : 0) * NC;
    wp[m] = P + e * a.p_stride + tc * ml::kTileChunkBytes + lane * 16;
    wsc[m] = S + e * a.s_stride + tc * ml::kTileChunkScaleBytes + g * 4;
  }
  struct AStage {
    uint4 w[2];
    uint32_t s[2];
  };
  AStage st[kAStages];
  auto load_a = [&](AStage& S, int c) {
    if (!active) return;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      S.w[m] = ld_stream16(wp[m] + int64_t(c) * ml::kTileChunkBytes);
      S.s[m] = ld_stream4(wsc[m] + int64_t(c) * ml::kTileChunkScaleBytes);
    }
  };

  float acc[2][kNq][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int q = 0; q < kNq; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][q][i] = 0.0f;

  auto compute = [&](const AStage& S, int c) {
    const uint32_t bs = bbase + uint32_t((c % kBStages) * kBStageBytes) + uint32_t(g * 128);
#pragma unroll
    for (int b = 0; b < 2; ++b) {  // e8m0 block b = k16 steps 2b, 2b+1
      uint32_t A0[2][4], A1[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const uint32_t w0 = b == 0 ? S.w[m].x : S.w[m].z, w1 = b == 0 ? S.w[m].y : S.w[m].w;
        const uint32_t mg = b == 0 ? scale_mult<0>(S.s[m]) : scale_mult<2>(S.s[m]);
        const uint32_t mg8 = b == 0 ? scale_mult<1>(S.s[m]) : scale_mult<3>(S.s[m]);
        decode_step(w0, mg, mg8, A0[m]);
        decode_step(w1, mg, mg8, A1[m]);
      }
      const uint32_t off = uint32_t(((4 * b + t) ^ ((g & 1) << 2)) << 4);
#pragma unroll
      for (int q = 0; q < kNq; ++q) {
        if (q < nq) {
          const uint4 B = lds128(bs + uint32_t(q * 8 * 128) + off);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            mma_acc(acc[m][q], A0[m], B.x, B.y);
            mma_acc(acc[m][q], A1[m], B.z, B.w);
          }
        }
      }
    }
  };

  // Pipelines: B chunk c in shared slot c % kBStages (kBStages − 1 ahead, one commit group per chunk);
  // A chunk c in st[c % kAStages] (kAStages − 1 ahead).
#pragma unroll
  for (int s = 0; s < kBStages - 1; ++s) {
    if (s < NC) load_b(s);
    cp_async_commit();
  }
#pragma unroll
  for (int s = 0; s < kAStages - 1; ++s)
    if (s < NC) load_a(st[s], s);
  for (int c0 = 0; c0 < NC; c0 += kAStages) {
#pragma unroll
    for (int s = 0; s < kAStages; ++s) {
      const int c = c0 + s;
      if (c < NC) {  // uniform over the CTA
        cp_async_wait<kBStages - 2>();
        __syncthreads();  // chunk c visible to all; chunk c − 1's slot free
        if (c + kBStages - 1 < NC) load_b(c + kBStages - 1);
        cp_async_commit();
        if (c + kAStages - 1 < NC) load_a(st[(s + kAStages - 1) % kAStages], c + kAStages - 1);
        if (active) compute(st[s], c);
      }
    }
  }
  cp_async_wait<0>();
  if (!active) return;

  // Epilogue: C fragment (c0, c1) = row g, tokens 2t, 2t+1 of the n-tile; (c2, c3) = row g + 8.
#pragma unroll
  for (int q = 0; q < kNq; ++q) {
    if (q >= nq) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int n = q * 8 + 2 * t + i;
      if (n >= count) continue;
      uint16_t* o = a.out + int64_t(__ldcg(a.order + begin + n)) * a.R;
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int idx = 2 * rr + i;
        if constexpr (kGlu) {
          o[tile[0] * ml::kTileRows + g + 8 * rr] = dev::f32_to_bf16(
              situ_glu(dev::round_bf16(acc[0][q][idx]), dev::round_bf16(acc[1][q][idx]), a.beta, a.lbeta));
        } else {
#pragma unroll
          for (int m = 0; m < 2; ++m) o[tile[m] * ml::kTileRows + g + 8 * rr] = dev::f32_to_bf16(acc[m][q][idx]);
        }
      }
    }
  }
}

}  // namespace

void launch_wide(const GemmArgs& a, bool glu, int64_t jobs_bound, bool pdl, cudaStream_t stream) {
  const int64_t rows = glu ? rows_per_cta<true>() : rows_per_cta<false>();
  const int64_t grid = jobs_bound * ((a.R + rows - 1) / rows);
  KCUDA_REQUIRE(grid > 0 && grid < (int64_t(1) << 31), "moe wide GEMM: grid " + std::to_string(grid));
  static bool attr_set[2] = {false, false};  // the same value every time: a benign race
  if (!attr_set[glu]) {
    if (glu)
      KCUDA_CHECK(cudaFuncSetAttribute(wide_gemm_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    else
      KCUDA_CHECK(cudaFuncSetAttribute(wide_gemm_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    attr_set[glu] = true;
  }
  if (glu)
    launch(wide_gemm_kernel<true>, dim3(unsigned(grid)), dim3(kThreads), kSmem, stream, pdl, a);
  else
    launch(wide_gemm_kernel<false>, dim3(unsigned(grid)), dim3(kThreads), kSmem, stream, pdl, a);
}

}  // namespace kestrel::cuda::moe_detail
