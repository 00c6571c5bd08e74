// Paged absorbed MLA decode (paged.h: mla_decode_paged), MODEL.md §3.4 absorbed form over the §0.3 caches.
// Three launches, chained by programmatic dependent launch (mla_tc.h: each is scheduled while the previous
// one finishes and waits for it before touching memory):
//  1. absorb: q̃_h = W_UK,hᵀ q_nope,h for all rows and heads, FP32. At decode batch sizes (B ≤ 64) a
//     CUDA-core kernel: the work is tiny (B·Hm·N·C MACs) and what costs is reading W_UK (Hm·N·C bf16,
//     1.5 MB at the TP8 shape) and the launch; one CTA per (64 columns, head, 8 rows) reads its 16 KB
//     slice of W_UK once for 8 rows, 96 CTAs at B = 1. Larger batches use cuBLASLt's strided-batched GEMM.
//  2. the tensor-core attention core (mla_tc.cu), split over keys so that a few rows still fill the SMs.
//  3. merge + W_UV: ô = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s, o_h = W_UV,h ô_h. One CTA per
//     (16 or 32 output columns e, head, RBM rows): it merges its RBM rows' splits into shared memory (every
//     column block of a head repeats that merge — partials are L2-resident and the repeat is cheaper than a
//     second launch), then each warp forms o[r, e] = Σ_c W_UV,h[e, c] ô[r, c] for its e, lanes over c in
//     16-byte steps. RBM (rows per CTA) shrinks as the splits grow so that a CTA merges ≤ ~32 split rows:
//     B = 1 with 64 splits is 96 CTAs of one row each; B = 64 with 2 splits 384 CTAs of 8 rows.
//     With a gate (§3.4 step 5), the stored o is bf16(o·σ(g)) — the gate kernel's arithmetic, its launch saved:
//     each CTA reads its RBM × ET gate values into shared memory while the merge runs.
// The merge weights follow the CPU twin: M = max_s m_s, w_s = 2^(m_s − M); a split with no keys has
// m = −inf, weight 0, and its accumulator (never written) is never read. ô stays FP32 like the CPU twin's;
// only o is rounded (bf16). Every sum runs in a fixed order: bit-identical from run to run.
// Bytes: partials B·splits·Hm·(C+2)·4 written once and read (B = 64: 6 MB, ~0.3 % of a 32K-token step's
// cache reads); W_UK and W_UV 1.5 MB each from L2.
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/mla_tc.h"
#include "kernels/cuda/paged.h"

namespace kestrel::cuda {
namespace {

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

// ---- 1. absorb -------------------------------------------------------------------------------------------
constexpr int kAbRows = 8;   // rows per CTA
constexpr int kAbCols = 64;  // q̃ columns per CTA: lane l owns columns 2l, 2l+1
constexpr int kAbMaxN = 512; // q_nope width the shared buffer holds

// CTA (column block x, head y, row block z); warp w sums n ≡ w (mod 8), then the 8 warps' partials are
// added in warp order (fixed order: deterministic).
__global__ void __launch_bounds__(256, 1)
    absorb_kernel(int B, int Hm, int N, int C, int ldq, int Dv, const uint16_t* __restrict__ q /* bf16 [B, Hm, ldq] */,
                  const uint16_t* __restrict__ kv_b /* bf16 [Hm*(N+Dv), C] */,
                  float* __restrict__ qt /* f32 [B, Hm, C] */) {
  tc::pdl_enter();
  extern __shared__ __align__(16) float absm[];
  float* qs = absm;                   // f32 [kAbRows, N]: q_nope of the CTA's rows (0 past B)
  float* red = absm + kAbRows * N;    // f32 [8 warps, kAbRows, kAbCols]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int c0 = blockIdx.x * kAbCols, h = blockIdx.y, b0 = blockIdx.z * kAbRows;
  for (int i = tid; i < kAbRows * (N / 8); i += 256) {  // 16-byte loads, one round (N ≤ 512)
    const int r = i / (N / 8), n = 8 * (i % (N / 8));
    float f[8];
    dev::unpack8(b0 + r < B ? dev::ld16(q + (int64_t(b0 + r) * Hm + h) * ldq + n) : make_uint4(0u, 0u, 0u, 0u), f);
    *reinterpret_cast<float4*>(qs + r * N + n) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(qs + r * N + n + 4) = make_float4(f[4], f[5], f[6], f[7]);
  }
  __syncthreads();
  float acc[kAbRows][2];
#pragma unroll
  for (int r = 0; r < kAbRows; ++r) acc[r][0] = acc[r][1] = 0.0f;
  const uint16_t* wk = kv_b + int64_t(h) * (N + Dv) * C + c0 + 2 * lane;  // W_UK,h[n, c0 + 2·lane]
#pragma unroll 16
  for (int n = w; n < N; n += 8) {
    const uint32_t wv = __ldg(reinterpret_cast<const uint32_t*>(wk + int64_t(n) * C));
    const float w0 = __uint_as_float(wv << 16), w1 = __uint_as_float(wv & 0xffff0000u);
#pragma unroll
    for (int r = 0; r < kAbRows; ++r) {
      const float x = qs[r * N + n];
      acc[r][0] += x * w0, acc[r][1] += x * w1;
    }
  }
#pragma unroll
  for (int r = 0; r < kAbRows; ++r)
    *reinterpret_cast<float2*>(red + (w * kAbRows + r) * kAbCols + 2 * lane) = make_float2(acc[r][0], acc[r][1]);
  __syncthreads();
  for (int i = tid; i < kAbRows * kAbCols; i += 256) {
    const int r = i / kAbCols, c = i % kAbCols;
    if (b0 + r >= B) continue;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s += red[(k * kAbRows + r) * kAbCols + c];
    qt[(int64_t(b0 + r) * Hm + h) * C + c0 + c] = s;
  }
}

// ---- 3. merge + W_UV -------------------------------------------------------------------------------------
// CTA (e block x of ET columns, head y, row block z of RBM rows); C and ET (= 16, or 32 from 4 rows per CTA
// on) compile-time, so every loop below has a fixed trip count and its loads go out together. Shared: ô
// f32 [RBM, C] (zero rows past B), weights f32 [RBM, n_splits]. Warp r < rows computes row r's weights;
// threads merge (row, column pair) units; then warp w forms e = e0 + w + 8i (i < ET/8): lane l takes
// columns 4k..4k+3 for k ≡ l (mod 32).
template <int RBM, int C>
__global__ void __launch_bounds__(256, 2)  // ≤ 128 registers: two CTAs per SM when the grid has several waves
    merge_uv_kernel(int B, int Hm, int N, int Dv, int n_splits,
                    const float* __restrict__ part_ml /* f32 [B, n_splits, Hm, 2] */,
                    const float* __restrict__ part_acc /* f32 [B, n_splits, Hm, C] */,
                    const uint16_t* __restrict__ kv_b /* bf16 [Hm*(N+Dv), C] */,
                    uint16_t* __restrict__ o /* bf16 [B, Hm*Dv] */,
                    const uint16_t* __restrict__ gate /* bf16 [B, Hm*Dv] or null */) {
  constexpr int ET = RBM >= 4 ? 32 : 16, EPW = ET / 8;  // output columns per CTA, per warp
  constexpr int NCH = C / 4, KPL = (NCH + 31) / 32;     // 4-column chunks of a row, per lane
  constexpr int SPL = tc::kMaxSplits / 32;              // splits per lane, at most
  tc::pdl_enter();
  extern __shared__ __align__(16) float msm[];
  __shared__ float inv_l[RBM];
  __shared__ float sg[RBM * ET];    // σ(g) of this CTA's outputs (gate only)
  float* oh = msm;                  // f32 [RBM, C]
  float* wts = msm + RBM * C;       // f32 [RBM, n_splits]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int e0 = blockIdx.x * ET, h = blockIdx.y, b0 = blockIdx.z * RBM;
  const int rows = min(RBM, B - b0);
  const int64_t astride = int64_t(Hm) * C;  // floats between splits
  static_assert(RBM * ET <= 256, "one gate value a thread");
  if (gate && tid < RBM * ET) {  // read now, used at the store (a load there would sit on the chain's end)
    const int r = tid / ET, e = e0 + tid % ET;
    sg[tid] = r < rows && e < Dv ? dev::sigmoid(dev::bf16_to_f32(gate[(int64_t(b0 + r) * Hm + h) * Dv + e])) : 0.0f;
  }
  if (w < rows) {
    // (m, l) of every split in one round of loads, then M = max m, weights 2^(m − M), L = Σ weight·l.
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + int64_t(b0 + w) * n_splits * Hm + h;  // stride Hm
    float* wr = wts + w * n_splits;
    float2 v[SPL];
#pragma unroll
    for (int j = 0; j < SPL; ++j)
      v[j] = lane + 32 * j < n_splits ? __ldg(ml + int64_t(lane + 32 * j) * Hm) : make_float2(-INFINITY, 0.0f);
    float M = -INFINITY;
#pragma unroll
    for (int j = 0; j < SPL; ++j) M = fmaxf(M, v[j].x);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.0f;
#pragma unroll
    for (int j = 0; j < SPL; ++j) {
      const float wv = v[j].x == -INFINITY ? 0.0f : exp2f(v[j].x - M);
      if (lane + 32 * j < n_splits) wr[lane + 32 * j] = wv;
      L += wv * v[j].y;
    }
    L = dev::warp_sum(L);
    if (lane == 0) inv_l[w] = L > 0.0f ? 1.0f / L : 0.0f;  // no key at all: ô = 0, as the CPU's empty sum
  }
  // W_UV rows of this warp's e, loaded while the merge runs (e clamped to Dv − 1, never stored).
  const uint16_t* wuv = kv_b + (int64_t(h) * (N + Dv) + N) * C;  // bf16 [Dv, C]
  uint2 wv[EPW][KPL];
#pragma unroll
  for (int i = 0; i < EPW; ++i)
#pragma unroll
    for (int kk = 0; kk < KPL; ++kk) {
      const int e = min(e0 + w + 8 * i, Dv - 1), k = lane + 32 * kk;
      wv[i][kk] = k < NCH ? __ldg(reinterpret_cast<const uint2*>(wuv + int64_t(e) * C + 4 * k)) : make_uint2(0u, 0u);
    }
  __syncthreads();
  constexpr int HALF = C / 2;
  for (int i = tid; i < RBM * HALF; i += 256) {
    const int r = i / HALF, c = 2 * (i % HALF);
    if (r >= rows) {  // rows past B: zeros, so that the W_UV loop below needs no per-row predicate
      *reinterpret_cast<float2*>(oh + r * C + c) = make_float2(0.0f, 0.0f);
      continue;
    }
    const float* acc = part_acc + (int64_t(b0 + r) * n_splits * Hm + h) * C + c;
    const float* wr = wts + r * n_splits;
    float x = 0.0f, y = 0.0f;
    int s = 0;
    for (; s + 32 <= n_splits; s += 32) tc::merge_step<32>(acc, astride, wr, s, x, y);
    if (s + 16 <= n_splits) tc::merge_step<16>(acc, astride, wr, s, x, y), s += 16;
    if (s + 8 <= n_splits) tc::merge_step<8>(acc, astride, wr, s, x, y), s += 8;
    for (; s < n_splits; ++s)
      if (wr[s] != 0.0f) {
        const float2 v = __ldg(reinterpret_cast<const float2*>(acc + s * astride));
        x += wr[s] * v.x, y += wr[s] * v.y;
      }
    *reinterpret_cast<float2*>(oh + r * C + c) = make_float2(x * inv_l[r], y * inv_l[r]);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < EPW; ++i) {
    const int e = e0 + w + 8 * i;
    float acc[RBM];
#pragma unroll
    for (int r = 0; r < RBM; ++r) acc[r] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KPL; ++kk) {
      const int k = lane + 32 * kk;
      if (k < NCH) {
        const float w0 = __uint_as_float(wv[i][kk].x << 16), w1 = __uint_as_float(wv[i][kk].x & 0xffff0000u);
        const float w2 = __uint_as_float(wv[i][kk].y << 16), w3 = __uint_as_float(wv[i][kk].y & 0xffff0000u);
#pragma unroll
        for (int r = 0; r < RBM; ++r) {
          const float4 x = *reinterpret_cast<const float4*>(oh + r * C + 4 * k);
          acc[r] += w0 * x.x + w1 * x.y + w2 * x.z + w3 * x.w;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RBM; ++r) {
      const float s = dev::warp_sum(acc[r]);
      if (lane == 0 && r < rows && e < Dv) {
        uint16_t v = dev::f32_to_bf16(s);
        if (gate) v = dev::f32_to_bf16(dev::bf16_to_f32(v) * sg[r * ET + (e - e0)]);  // as gate_kernel
        o[(int64_t(b0 + r) * Hm + h) * Dv + e] = v;
      }
    }
  }
}

// The CUDA-core q̃ kernel's layout needs: 64-column blocks, q_nope rows in 16-byte pieces.
bool absorb_fits(const MlaDims& d, const uint16_t* q) {
  return d.C % kAbCols == 0 && d.N > 0 && d.N % 8 == 0 && d.N <= kAbMaxN && (d.N + d.R) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(q) % 16 == 0;
}

template <int RBM, int C>
void launch_merge(const MlaDims& d, int64_t B, int n_splits, const float* part_ml, const float* part_acc,
                  const uint16_t* kv_b, uint16_t* o, cudaStream_t stream, bool pdl, const uint16_t* gate) {
  constexpr int ET = RBM >= 4 ? 32 : 16;
  const dim3 grid(unsigned((d.Dv + ET - 1) / ET), unsigned(d.Hm), unsigned((B + RBM - 1) / RBM));
  const size_t smem = size_t(RBM) * size_t(C + n_splits) * 4;
  tc::launch_kernel(merge_uv_kernel<RBM, C>, grid, dim3(256), smem, stream, pdl, int(B), int(d.Hm), int(d.N),
                    int(d.Dv), n_splits, part_ml, part_acc, kv_b, o, gate);
}

template <int C>
void merge_for(const MlaDims& d, int64_t B, int n_splits, const float* part_ml, const float* part_acc,
               const uint16_t* kv_b, uint16_t* o, cudaStream_t stream, bool pdl, const uint16_t* gate) {
  // Rows per CTA: a CTA merges ≤ ~32 (row, split) partials.
  if (n_splits > 16)
    launch_merge<1, C>(d, B, n_splits, part_ml, part_acc, kv_b, o, stream, pdl, gate);
  else if (n_splits > 8)
    launch_merge<2, C>(d, B, n_splits, part_ml, part_acc, kv_b, o, stream, pdl, gate);
  else if (n_splits > 4)
    launch_merge<4, C>(d, B, n_splits, part_ml, part_acc, kv_b, o, stream, pdl, gate);
  else
    launch_merge<8, C>(d, B, n_splits, part_ml, part_acc, kv_b, o, stream, pdl, gate);
}

}  // namespace

namespace tc {

void absorb_cuda_cores(const MlaDims& d, const uint16_t* q, const uint16_t* kv_b, float* qt, int64_t B,
                       cudaStream_t stream, bool pdl) {
  KCUDA_REQUIRE(B > 0 && B <= int64_t(65535) * kAbRows && absorb_fits(d, q), std::string("mla absorb: unsupported shape"));
  KCUDA_REQUIRE(q && kv_b && qt, std::string("mla absorb: null pointer"));
  const dim3 grid(unsigned(d.C / kAbCols), unsigned(d.Hm), unsigned((B + kAbRows - 1) / kAbRows));
  const size_t smem = size_t(kAbRows) * size_t(d.N + 8 * kAbCols) * 4;
  launch_kernel(absorb_kernel, grid, dim3(256), smem, stream, pdl, int(B), int(d.Hm), int(d.N), int(d.C),
                int(d.N + d.R), int(d.Dv), q, kv_b, qt);
}

void absorb(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b, float* qt, int64_t B,
            cudaStream_t stream, bool pdl) {
  if (B <= kAbsorbMaxRows && absorb_fits(d, q)) {
    absorb_cuda_cores(d, q, kv_b, qt, B, stream, pdl);
    return;
  }
  const int64_t C = d.C, QK = d.N + d.R;
  // q̃_h[B, C] = q_nope,h[B, N] · W_UK,h[N, C], batched over heads.
  lt.batched_xw_f32(q, d.Hm * QK, QK, kv_b, C, (d.N + d.Dv) * C, qt, d.Hm * C, C, B, d.N, C, d.Hm, stream);
}

void merge_uv(const MlaDims& d, int64_t B, int n_splits, const float* part_ml, const float* part_acc,
              const uint16_t* kv_b, uint16_t* o, cudaStream_t stream, bool pdl, const uint16_t* gate) {
  KCUDA_REQUIRE(B > 0 && B < (int64_t(1) << 31) && n_splits >= 1 && n_splits <= kMaxSplits && (d.C == 512 || d.C == 64),
                std::string("mla merge: bad batch, splits or C"));
  KCUDA_REQUIRE(part_ml && part_acc && kv_b && o, std::string("mla merge: null pointer"));
  if (d.C == 512)
    merge_for<512>(d, B, n_splits, part_ml, part_acc, kv_b, o, stream, pdl, gate);
  else
    merge_for<64>(d, B, n_splits, part_ml, part_acc, kv_b, o, stream, pdl, gate);
}

}  // namespace tc

size_t mla_decode_paged_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys) {
  if (!tc::supported(d)) return mla_decode_paged_simple_workspace_bytes(d, B, max_keys);
  return decode_ws(d, B, tc::plan(B, max_keys), nullptr).bytes;
}

void mla_decode_paged(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b, const PagedMlaCache& c,
                      const MlaPagedBatch& bt, void* workspace, uint16_t* o, cudaStream_t stream,
                      const uint16_t* gate) {
  if (bt.B == 0) return;
  if (!tc::supported(d)) {
    mla_decode_paged_simple(lt, d, q, kv_b, c, bt, workspace, o, stream);
    if (gate) sigmoid_gate_bf16(o, gate, bt.B * d.Hm * d.Dv, stream);
    return;
  }
  KCUDA_REQUIRE(bt.B > 0 && bt.B < (int64_t(1) << 31) && bt.max_keys > 0,
                std::string("mla_decode_paged: bad batch (B, max_keys)"));
  KCUDA_REQUIRE(q && kv_b && workspace && o && (bt.lens || bt.sel) && (!bt.sel || bt.Ksel > 0),
                std::string("mla_decode_paged: null pointer"));
  KCUDA_REQUIRE(c.latent && c.block_tables && c.block_size > 0 && c.bt_stride > 0,
                std::string("mla_decode_paged: null cache or block table"));
  KCUDA_REQUIRE(c.C == d.C && c.R == d.R, std::string("mla_decode_paged: cache C/R differ from the layer's"));
  const tc::Plan pl = tc::plan(bt.B, bt.max_keys);
  const DecodeWs ws = decode_ws(d, bt.B, pl, workspace);
  const bool pdl = tc::pdl_enabled();
  tc::absorb(lt, d, q, kv_b, ws.qt, bt.B, stream, pdl);
  tc::Args a;
  a.d = d, a.cache = &c, a.lens = bt.lens, a.req = bt.req, a.sel = bt.sel, a.Ksel = bt.Ksel, a.B = bt.B;
  a.plan = pl, a.qt = ws.qt, a.q = q, a.part_ml = ws.part_ml, a.part_acc = ws.part_acc, a.pdl = pdl;
  tc::attend(a, stream);
  tc::merge_uv(d, bt.B, pl.n_splits, ws.part_ml, ws.part_acc, kv_b, o, stream, pdl, gate);
}

}  // namespace kestrel::cuda
