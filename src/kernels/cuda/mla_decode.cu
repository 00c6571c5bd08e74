// Paged absorbed MLA decode (paged.h: mla_decode_paged), MODEL.md §3.4 absorbed form over the §0.3 caches.
// Steps: q̃_h = W_UK,hᵀ q_nope,h for all rows and heads by one batched cuBLASLt GEMM (FP32 out); the
// tensor-core attention core (mla_tc.cu) over the pages, split over keys so that a few rows still fill
// the SMs; then one kernel that merges the splits by log-sum-exp and applies W_UV.
//
// Merge + W_UV: one block per (8 rows, head). Warp r merges row r's splits into ô (FP32, in shared
// memory): M = max_s m_s, w_s = 2^(m_s − M), ô = Σ_s w_s acc_s / Σ_s w_s l_s (a split with no keys has
// m = −inf, weight 0, and its accumulator is never read). Then o_h[e] = Σ_c W_UV,h[e, c] ô[c] for the 8
// rows at once, so W_UV,h (Dv × C bf16, 128 KB at K3 size) is read once per 8 rows instead of once per
// row. ô stays FP32 like the CPU twin's; only o is rounded (bf16).
// Bytes: the partials are B·splits·Hm·(C+2)·4 written and read once (64 rows × 2 splits × 12 heads: 6 MB,
// ~0.3 % of a 32K-token step's cache reads), W_UV Hm·Dv·C·2 per 8 rows from L2.
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/mla_tc.h"
#include "kernels/cuda/paged.h"

namespace kestrel::cuda {
namespace {

constexpr int kCombRows = 8;  // rows per merge block = warps per block

struct DecodeWs {
  float* qt;        // f32 [B, Hm, C]
  float* part_ml;   // f32 [B, splits, Hm, 2]
  float* part_acc;  // f32 [B, splits, Hm, C]
  size_t bytes;
};
size_t align256(size_t n) { return (n + 255) / 256 * 256; }
DecodeWs decode_ws(const MlaDims& d, int64_t B, const tc::Plan& pl, void* base) {
  char* p = static_cast<char*>(base);
  DecodeWs w{};
  const size_t qt = align256(size_t(B * d.Hm * d.C) * 4), ml = align256(size_t(B * pl.n_splits * d.Hm) * 8);
  const size_t acc = align256(size_t(B * pl.n_splits * d.Hm * d.C) * 4);
  w.qt = reinterpret_cast<float*>(p);
  w.part_ml = reinterpret_cast<float*>(p ? p + qt : nullptr);
  w.part_acc = reinterpret_cast<float*>(p ? p + qt + ml : nullptr);
  w.bytes = qt + ml + acc;
  return w;
}

__global__ void __launch_bounds__(32 * kCombRows)
    merge_uv_kernel(int B, int Hm, int C, int N, int Dv, int n_splits,
                    const float* __restrict__ part_ml /* f32 [B, n_splits, Hm, 2] */,
                    const float* __restrict__ part_acc /* f32 [B, n_splits, Hm, C] */,
                    const uint16_t* __restrict__ kv_b /* bf16 [Hm*(N+Dv), C] */,
                    uint16_t* __restrict__ o /* bf16 [B, Hm*Dv] */) {
  extern __shared__ __align__(16) float msm[];
  float* oh = msm;                      // f32 [kCombRows, C]
  float* wts = msm + kCombRows * C;     // f32 [kCombRows, n_splits]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, h = blockIdx.y, b0 = blockIdx.x * kCombRows;
  const int b = b0 + w;
  float* ohr = oh + w * C;
  float* wr = wts + w * n_splits;
  if (b < B) {
    const int64_t sstride = int64_t(Hm) * 2;  // floats between splits in part_ml
    const float* ml = part_ml + (int64_t(b) * n_splits * Hm + h) * 2;
    float M = -INFINITY;
    for (int s = lane; s < n_splits; s += 32) M = fmaxf(M, ml[s * sstride]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.0f;
    for (int s = lane; s < n_splits; s += 32) {
      const float m = ml[s * sstride];
      const float wv = m == -INFINITY ? 0.0f : exp2f(m - M);
      wr[s] = wv;
      L += wv * ml[s * sstride + 1];
    }
    L = dev::warp_sum(L);
    __syncwarp();
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;  // no key at all: ô = 0, as the CPU's empty sum
    const float* acc = part_acc + (int64_t(b) * n_splits * Hm + h) * C;
    const int64_t astride = int64_t(Hm) * C;
    for (int c = lane; c < C; c += 32) {
      float a = 0.0f;
      for (int s = 0; s < n_splits; ++s) {
        const float wv = wr[s];
        if (wv != 0.0f) a += wv * acc[s * astride + c];
      }
      ohr[c] = a * inv;
    }
  } else {
    for (int c = lane; c < C; c += 32) ohr[c] = 0.0f;
  }
  __syncthreads();
  // o[b0 + r, h, e] = Σ_c W_UV,h[e, c] ô[r, c]: warp w takes e = w, w + 8, ...; lanes split c in 8s.
  const uint16_t* wuv = kv_b + (int64_t(h) * (N + Dv) + N) * C;  // bf16 [Dv, C]
  for (int e = w; e < Dv; e += kCombRows) {
    float acc[kCombRows];
#pragma unroll
    for (int r = 0; r < kCombRows; ++r) acc[r] = 0.0f;
    for (int c8 = lane; c8 < C / 8; c8 += 32) {
      float wf[8];
      dev::unpack8(dev::ld16(wuv + int64_t(e) * C + c8 * 8), wf);
#pragma unroll
      for (int r = 0; r < kCombRows; ++r) {
        const float4 x0 = *reinterpret_cast<const float4*>(oh + r * C + c8 * 8);
        const float4 x1 = *reinterpret_cast<const float4*>(oh + r * C + c8 * 8 + 4);
        acc[r] += wf[0] * x0.x + wf[1] * x0.y + wf[2] * x0.z + wf[3] * x0.w + wf[4] * x1.x + wf[5] * x1.y +
                  wf[6] * x1.z + wf[7] * x1.w;
      }
    }
    float mine = 0.0f;
#pragma unroll
    for (int r = 0; r < kCombRows; ++r) {
      const float s = dev::warp_sum(acc[r]);
      if (lane == r) mine = s;
    }
    if (lane < kCombRows && b0 + lane < B) o[(int64_t(b0 + lane) * Hm + h) * Dv + e] = dev::f32_to_bf16(mine);
  }
}

}  // namespace

size_t mla_decode_paged_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys) {
  if (!tc::supported(d)) return mla_decode_paged_simple_workspace_bytes(d, B, max_keys);
  return decode_ws(d, B, tc::plan(B, max_keys), nullptr).bytes;
}

void mla_decode_paged(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b, const PagedMlaCache& c,
                      const MlaPagedBatch& bt, void* workspace, uint16_t* o, cudaStream_t stream) {
  if (bt.B == 0) return;
  if (!tc::supported(d)) {
    mla_decode_paged_simple(lt, d, q, kv_b, c, bt, workspace, o, stream);
    return;
  }
  KCUDA_REQUIRE(bt.B > 0 && bt.B < (int64_t(1) << 31) && bt.max_keys > 0,
                std::string("mla_decode_paged: bad batch (B, max_keys)"));
  KCUDA_REQUIRE(q && kv_b && workspace && o && (bt.lens || bt.sel) && (!bt.sel || bt.Ksel > 0),
                std::string("mla_decode_paged: null pointer"));
  KCUDA_REQUIRE(c.latent && c.block_tables && c.block_size > 0 && c.bt_stride > 0,
                std::string("mla_decode_paged: null cache or block table"));
  KCUDA_REQUIRE(c.C == d.C && c.R == d.R, std::string("mla_decode_paged: cache C/R differ from the layer's"));
  const int64_t Hm = d.Hm, N = d.N, R = d.R, Dv = d.Dv, C = d.C, QK = N + R;
  const tc::Plan pl = tc::plan(bt.B, bt.max_keys);
  const DecodeWs ws = decode_ws(d, bt.B, pl, workspace);
  // q̃_h[B, C] = q_nope,h[B, N] · W_UK,h[N, C], batched over heads (FP32 out).
  lt.batched_xw_f32(q, Hm * QK, QK, kv_b, C, (N + Dv) * C, ws.qt, Hm * C, C, bt.B, N, C, Hm, stream);
  tc::Args a;
  a.d = d, a.cache = &c, a.lens = bt.lens, a.req = bt.req, a.sel = bt.sel, a.Ksel = bt.Ksel, a.B = bt.B;
  a.plan = pl, a.qt = ws.qt, a.q = q, a.part_ml = ws.part_ml, a.part_acc = ws.part_acc;
  tc::attend(a, stream);
  const size_t smem = size_t(kCombRows) * size_t(C + pl.n_splits) * 4;
  const dim3 grid(unsigned((bt.B + kCombRows - 1) / kCombRows), unsigned(Hm));
  merge_uv_kernel<<<grid, 32 * kCombRows, smem, stream>>>(int(bt.B), int(Hm), int(C), int(N), int(Dv), pl.n_splits,
                                                          ws.part_ml, ws.part_acc, kv_b, o);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
