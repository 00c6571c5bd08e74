// Paged MLA prefill (paged.h: mla_prefill_paged), MODEL.md §3.4 in the absorbed (MQA) form over the §0.3
// caches, dense-causal or over the §3.5 indexer selection, for every prefill row of a step in one launch.
//
// Why absorbed and per row: a sparse row attends to its own ≤ 2048 keys, so its heads are the only rows
// that share keys (FlashMLA's sparse prefill is organised the same way, one token's heads per CTA); the
// dense rows (contexts ≤ top-k, or models without an indexer) reuse the same core with keys 0..pos. The
// core (mla_tc.cu) reads each key row straight from its page; nothing is gathered or expanded through
// kv_b. Cost per row: keys × (C+R)·2 B from L2/HBM and Hm_pad·keys·(2(C+R) + 2C) FLOP on the tensor
// cores (16 × 2048 × 2176 ≈ 71 MFLOP for a top-2048 row). For long dense contexts the naive form
// (expand K/V once, then share them across the chunk's rows) does fewer FLOPs and bytes; with the indexer
// every row beyond 2048 positions is sparse, so this path is the one K3.1 runs.
//
// Steps: q̃ = W_UKᵀ q_nope (FP32; mla_decode.cu's absorb: CUDA cores for ≤ 64 rows, else one batched
// cuBLASLt GEMM); the core writes ô as normalised bf16 [T, Hm, C]
// (with few long rows the plan splits keys, and a small kernel merges the splits into bf16 ô); then
// o_h = ô_h·W_UV,hᵀ per head by cuBLASLt (bf16 out), rows longest first so that the causal tail is short.
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/mla_tc.h"
#include "kernels/cuda/paged.h"

namespace kestrel::cuda {
namespace {

struct PrefillWs {
  float* qt;        // f32 [T, Hm, C]
  uint16_t* ohat;   // bf16 [T, Hm, C]
  float* part_ml;   // f32 [T, splits, Hm, 2] (splits > 1 only)
  float* part_acc;  // f32 [T, splits, Hm, C] (splits > 1 only)
  size_t bytes;
};
size_t align256(size_t n) { return (n + 255) / 256 * 256; }
PrefillWs prefill_ws(const MlaDims& d, int64_t T, const tc::Plan& pl, void* base) {
  char* p = static_cast<char*>(base);
  const size_t qt = align256(size_t(T * d.Hm * d.C) * 4), oh = align256(size_t(T * d.Hm * d.C) * 2);
  const bool split = pl.n_splits > 1;
  const size_t ml = split ? align256(size_t(T * pl.n_splits * d.Hm) * 8) : 0;
  const size_t acc = split ? align256(size_t(T * pl.n_splits * d.Hm * d.C) * 4) : 0;
  PrefillWs w{};
  w.qt = reinterpret_cast<float*>(p);
  w.ohat = reinterpret_cast<uint16_t*>(p ? p + qt : nullptr);
  w.part_ml = split && p ? reinterpret_cast<float*>(p + qt + oh) : nullptr;
  w.part_acc = split && p ? reinterpret_cast<float*>(p + qt + oh + ml) : nullptr;
  w.bytes = qt + oh + ml + acc;
  return w;
}

// Keys are split only while the rows alone leave SMs idle: with T ≥ #SMs rows (a real prefill chunk) one
// CTA per row, longest first, balances well and needs no partials (which would be 24 KB per row and split).
tc::Plan prefill_plan(int64_t T, int64_t max_keys) {
  if (T < tc::sm_count()) return tc::plan(T, max_keys);
  tc::Plan pl;
  pl.chunk = int((std::max<int64_t>(max_keys, 1) + tc::kKeysPerTile - 1) / tc::kKeysPerTile * tc::kKeysPerTile);
  return pl;
}

// ô[t, h] = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s as bf16; one CTA of C/2 threads per (row, head),
// a column pair each, splits added in order with 8 or 16 loads in flight (tc::merge_step).
__global__ void __launch_bounds__(256, 4)
    merge_bf16_kernel(int Hm, int C, int n_splits, const float* __restrict__ part_ml /* f32 [T, n_splits, Hm, 2] */,
                      const float* __restrict__ part_acc /* f32 [T, n_splits, Hm, C] */,
                      uint16_t* __restrict__ ohat /* bf16 [T, Hm, C] */) {
  __shared__ float wr[tc::kMaxSplits];
  __shared__ float inv_l;
  const int tid = threadIdx.x, lane = tid & 31, t = blockIdx.x, h = blockIdx.y;
  const int64_t sstride = int64_t(Hm) * 2, astride = int64_t(Hm) * C;
  if (tid < 32) {
    const float* ml = part_ml + (int64_t(t) * n_splits * Hm + h) * 2;
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
    if (lane == 0) inv_l = L > 0.0f ? 1.0f / L : 0.0f;
  }
  __syncthreads();
  for (int c = 2 * tid; c < C; c += 2 * blockDim.x) {
    const float* acc = part_acc + (int64_t(t) * n_splits * Hm + h) * C + c;
    float x = 0.0f, y = 0.0f;
    int s = 0;
    for (; s + 16 <= n_splits; s += 16) tc::merge_step<16>(acc, astride, wr, s, x, y);
    if (s + 8 <= n_splits) tc::merge_step<8>(acc, astride, wr, s, x, y), s += 8;
    for (; s < n_splits; ++s)
      if (wr[s] != 0.0f) {
        const float2 v = __ldg(reinterpret_cast<const float2*>(acc + s * astride));
        x += wr[s] * v.x, y += wr[s] * v.y;
      }
    const uint32_t v = uint32_t(dev::f32_to_bf16(x * inv_l)) | (uint32_t(dev::f32_to_bf16(y * inv_l)) << 16);
    *reinterpret_cast<uint32_t*>(ohat + (int64_t(t) * Hm + h) * C + c) = v;
  }
}

}  // namespace

size_t mla_prefill_paged_workspace_bytes(const MlaDims& d, int64_t T, int64_t max_keys) {
  if (!tc::supported(d)) return mla_decode_paged_simple_workspace_bytes(d, T, max_keys);
  return prefill_ws(d, T, prefill_plan(T, max_keys), nullptr).bytes;
}

void mla_prefill_paged(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b, const PagedMlaCache& c,
                       const MlaPagedBatch& rows, void* workspace, uint16_t* o, cudaStream_t stream) {
  if (rows.B == 0) return;
  if (!tc::supported(d)) {
    mla_decode_paged_simple(lt, d, q, kv_b, c, rows, workspace, o, stream);
    return;
  }
  KCUDA_REQUIRE(rows.B > 0 && rows.B < (int64_t(1) << 31) && rows.max_keys > 0,
                std::string("mla_prefill_paged: bad rows (T, max_keys)"));
  KCUDA_REQUIRE(q && kv_b && workspace && o && (rows.lens || rows.sel) && (!rows.sel || rows.Ksel > 0),
                std::string("mla_prefill_paged: null pointer"));
  KCUDA_REQUIRE(c.latent && c.block_tables && c.block_size > 0 && c.bt_stride > 0,
                std::string("mla_prefill_paged: null cache or block table"));
  KCUDA_REQUIRE(c.C == d.C && c.R == d.R, std::string("mla_prefill_paged: cache C/R differ from the layer's"));
  const int64_t T = rows.B, Hm = d.Hm, N = d.N, Dv = d.Dv, C = d.C;
  const tc::Plan pl = prefill_plan(T, rows.max_keys);
  const PrefillWs ws = prefill_ws(d, T, pl, workspace);
  const bool pdl = tc::pdl_enabled();
  tc::absorb(lt, d, q, kv_b, ws.qt, T, stream, pdl);
  tc::Args a;
  a.d = d, a.cache = &c, a.lens = rows.lens, a.req = rows.req, a.sel = rows.sel, a.Ksel = rows.Ksel, a.B = T;
  a.plan = pl, a.qt = ws.qt, a.q = q, a.longest_first = true, a.pdl = pdl;
  if (pl.n_splits == 1) {
    a.ohat = ws.ohat;
    tc::attend(a, stream);
  } else {
    a.part_ml = ws.part_ml, a.part_acc = ws.part_acc;
    tc::attend(a, stream);
    const unsigned threads = unsigned(std::min<int64_t>(256, C / 2));
    merge_bf16_kernel<<<dim3(unsigned(T), unsigned(Hm)), threads, 0, stream>>>(int(Hm), int(C), pl.n_splits,
                                                                               ws.part_ml, ws.part_acc, ws.ohat);
    KCUDA_CHECK_LAUNCH();
  }
  // o[:, h] = ô[:, h] · W_UV,hᵀ (W_UV,h = kv_b rows [h(N+Dv)+N, +Dv), bf16 [Dv, C]).
  for (int64_t h = 0; h < Hm; ++h)
    lt.bf16(ws.ohat + h * C, Hm * C, kv_b + (h * (N + Dv) + N) * C, o + h * Dv, Hm * Dv, T, C, Dv, stream);
}

}  // namespace kestrel::cuda
