// KDA kernels; see kda.h. Correct-first forms:
// - conv: one thread per (token, channel); the history update is a second launch so no thread
//   overwrites history another thread still reads.
// - gates / out-norm: one block of Dk threads per (token, head).
// - recurrent scan: one block of Dk threads per (head, request); thread j owns value column j of S
//   in registers (Dk floats, compile-time indexed), so every state element is read and written once
//   per launch and the reads are coalesced across the warp (row i of S is contiguous in j).
// - chunked scan: see the comment at chunked_kernel.
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/kda.h"

namespace kestrel::cuda {
namespace {

constexpr int kMaxConvW = 8;

__device__ __forceinline__ float silu(float x) { return x * dev::sigmoid(x); }

__global__ void conv_prefill_kernel(const uint16_t* __restrict__ x, int64_t ldx, const float* __restrict__ w,
                                    const uint16_t* __restrict__ hist, uint16_t* __restrict__ y, int64_t ldy,
                                    int64_t T, int64_t C, int W) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * C) return;
  const int64_t t = i / C, c = i % C;
  const float* wc = w + c * W;
  float acc = 0.0f;
  for (int j = 0; j < W - 1; ++j) {
    const int64_t p = t - (W - 1) + j;  // input position; < 0 means history row W-1+p
    const uint16_t xv = p >= 0 ? x[p * ldx + c] : hist[(W - 1 + p) * C + c];
    acc += wc[j] * dev::bf16_to_f32(xv);
  }
  acc += wc[W - 1] * dev::bf16_to_f32(x[t * ldx + c]);
  y[t * ldy + c] = dev::f32_to_bf16(silu(acc));
}

__global__ void conv_hist_update_kernel(const uint16_t* __restrict__ x, int64_t ldx, uint16_t* __restrict__ hist,
                                        int64_t T, int64_t C, int W) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  uint16_t nh[kMaxConvW];
#pragma unroll
  for (int j = 0; j < kMaxConvW - 1; ++j) {
    if (j < W - 1) {
      const int64_t p = T - (W - 1) + j;
      nh[j] = p >= 0 ? x[p * ldx + c] : hist[(j + T) * C + c];
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxConvW - 1; ++j)
    if (j < W - 1) hist[j * C + c] = nh[j];
}

__global__ void conv_decode_kernel(const uint16_t* __restrict__ x, int64_t ldx, const float* __restrict__ w,
                                   uint16_t* __restrict__ pool, const int32_t* __restrict__ slots,
                                   uint16_t* __restrict__ y, int64_t ldy, int64_t B, int64_t C, int W) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * C) return;
  const int64_t b = i / C, c = i % C;
  uint16_t* hist = pool + int64_t(slots[b]) * (W - 1) * C;
  const float* wc = w + c * W;
  uint16_t h[kMaxConvW];
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxConvW - 1; ++j) {
    if (j < W - 1) {
      h[j] = hist[j * C + c];
      acc += wc[j] * dev::bf16_to_f32(h[j]);
    }
  }
  const uint16_t cur = x[b * ldx + c];
  acc += wc[W - 1] * dev::bf16_to_f32(cur);
  y[b * ldy + c] = dev::f32_to_bf16(silu(acc));
#pragma unroll
  for (int j = 0; j < kMaxConvW - 1; ++j)
    if (j < W - 1) hist[j * C + c] = j + 1 < W - 1 ? h[j + 1] : cur;
}

__global__ void qk_norm_gates_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, int64_t ld_in,
                                     const uint16_t* __restrict__ z, const float* __restrict__ dt_bias,
                                     const float* __restrict__ a_log, const uint16_t* __restrict__ bl, float lower,
                                     float* __restrict__ q_out, float* __restrict__ k_out, float* __restrict__ g,
                                     float* __restrict__ beta, int64_t H, int Dk) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.y, h = blockIdx.x;
  const int i = threadIdx.x;
  const int64_t HD = H * Dk;
  const int64_t c = h * Dk + i;
  const float qv = dev::bf16_to_f32(q[t * ld_in + c]), kv = dev::bf16_to_f32(k[t * ld_in + c]);
  const float qq = dev::block_sum(qv * qv, scratch);
  const float kk = dev::block_sum(kv * kv, scratch);
  const float qn = (1.0f / sqrtf(float(Dk))) / sqrtf(qq + 1e-6f), kn = 1.0f / sqrtf(kk + 1e-6f);
  q_out[t * HD + c] = qv * qn;
  k_out[t * HD + c] = kv * kn;
  const float a = expf(a_log[h]);
  const float zi = dev::bf16_to_f32(z[t * HD + c]) + dt_bias[c];
  g[t * HD + c] = lower * dev::sigmoid(a * zi);
  if (i == 0) beta[t * H + h] = dev::sigmoid(dev::bf16_to_f32(bl[t * H + h]));
}

// State element load / store: FP32 as is; FP16 (the --kda-state-dtype f16 pool) widened on load and
// rounded to nearest even on store, once per launch, as model/kda.cpp does around its scan.
__device__ __forceinline__ float load_state(const float* p) { return *p; }
__device__ __forceinline__ float load_state(const uint16_t* p) { return __half2float(__ushort_as_half(*p)); }
__device__ __forceinline__ void store_state(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_state(uint16_t* p, float x) { *p = __half_as_ushort(__float2half_rn(x)); }

template <int DK, typename StateT>
__global__ void __launch_bounds__(DK) recurrent_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                       const float* __restrict__ v, const float* __restrict__ g,
                                                       int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                                                       const int32_t* __restrict__ cu, const int32_t* __restrict__ slots,
                                                       StateT* __restrict__ pool, float* __restrict__ o, int64_t H) {
  __shared__ float ks[DK], qs[DK], ds[DK];
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int j = threadIdx.x;
  StateT* S = pool + (int64_t(slots[b]) * H + h) * DK * DK;  // [DK(key), DK(value)]
  float s[DK];
#pragma unroll
  for (int i = 0; i < DK; ++i) s[i] = load_state(S + i * DK + j);
  const int64_t t0 = cu[b], t1 = cu[b + 1];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = t * ld + h * DK;
    __syncthreads();  // previous token's readers are done with ks/qs/ds
    ks[j] = k[row + j];
    qs[j] = q[row + j];
    ds[j] = expf(g[row + j]);
    __syncthreads();
    float u = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
      s[i] *= ds[i];
      u = fmaf(s[i], ks[i], u);
    }
    u = beta[t * ld_beta + h] * (v[row + j] - u);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
      s[i] = fmaf(ks[i], u, s[i]);
      acc = fmaf(s[i], qs[i], acc);
    }
    o[row + j] = acc;
  }
#pragma unroll
  for (int i = 0; i < DK; ++i) store_state(S + i * DK + j, s[i]);
}

// Chunked scan (kda_scan.h's WY/UT form), one block per (value slice of 32 columns, head, request).
// Value columns of S evolve independently (u, o and S_end are linear in v column by column), so a head
// is split over Dk/32 blocks; each block recomputes the chunk's key-side matrices. Per 64-token chunk:
//   G (cumulative log-decay per key channel; running sum in f64) → A_ts, QK_ts (s ≤ t) → rhs
//   v − (e^G⊙k)·S₀ and (e^G⊙q)·S₀ → forward substitution for u (one warp per 4 columns, no block
//   barriers) → o = (e^G⊙q)·S₀ + QK·u and S_end = e^{G_end}⊙S₀ + (e^{G_end−G}⊙k)ᵀ·u.
// The pairwise decays e^{G_t − G_s} are factored through a reference r = G at the end of the previous
// 16-token sub-chunk of t: e^{G_t−r}·e^{r−G_s}. The first factor is ≤ 1; the second is ≤ 1 for s in an
// earlier sub-chunk and ≤ e^{16·5} = e^80 (f32-safe) inside t's own, given the §3.3 bound g > −5. So the
// 64×64×Dk pair products cost matrix FMAs, not one exponential each.
// The matrix products (A/QK, the S₀ products, the state update) run on the tensor cores as 3xTF32 WMMA
// (x = hi + lo with hi, lo TF32; a·b ≈ hi·hi + hi·lo + lo·hi), which keeps FP32-level accuracy; the
// forward substitution and the intra-chunk output (small, triangular) stay on the CUDA cores.
constexpr int kChunk = 64, kSub = 16, kVs = 32, kChunkThreads = 256;

namespace wm = nvcuda::wmma;
using Acc = wm::fragment<wm::accumulator, 16, 16, 8, float>;

template <class Frag>
__device__ __forceinline__ void split_tf32(Frag& hi, Frag& lo) {
#pragma unroll
  for (int i = 0; i < hi.num_elements; ++i) {
    const float x = hi.x[i], h = wm::__float_to_tf32(x);
    hi.x[i] = h;
    lo.x[i] = wm::__float_to_tf32(x - h);
  }
}

// acc += A[16, 8·steps] · B[8·steps, 16] from shared memory (one warp). Layouts as WMMA's: a row-major A
// advances by columns, a column-major one by lda·8; likewise for B.
template <class LA, class LB>
__device__ __forceinline__ void mma_3xtf32(Acc& acc, const float* a, int lda, const float* b, int ldb, int steps) {
  constexpr bool a_row = std::is_same<LA, wm::row_major>::value, b_row = std::is_same<LB, wm::row_major>::value;
  for (int k = 0; k < steps; ++k) {
    wm::fragment<wm::matrix_a, 16, 16, 8, wm::precision::tf32, LA> ah, al;
    wm::fragment<wm::matrix_b, 16, 16, 8, wm::precision::tf32, LB> bh, bl;
    wm::load_matrix_sync(ah, a + (a_row ? k * 8 : k * 8 * lda), lda);
    wm::load_matrix_sync(bh, b + (b_row ? k * 8 * ldb : k * 8), ldb);
    split_tf32(ah, al);
    split_tf32(bh, bl);
    wm::mma_sync(acc, al, bh, acc);
    wm::mma_sync(acc, ah, bl, acc);
    wm::mma_sync(acc, ah, bh, acc);
  }
}

template <int K>
struct ChunkSmem {
  static constexpr int KP = K + 4;  // WMMA: row stride a multiple of 4 floats, tiles 32-byte aligned
  static constexpr size_t floats =
      size_t(4 * kChunk * KP + 2 * kSub * KP + K * kVs + 2 * kChunk * kChunk + 2 * kChunk * kVs + kChunk + K);
  static constexpr size_t bytes = floats * 4;
};

template <int K>
__global__ void __launch_bounds__(kChunkThreads)
    chunked_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                   const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                   const int32_t* __restrict__ cu, const int32_t* __restrict__ slots, float* __restrict__ pool,
                   float* __restrict__ o, int64_t H) {
  constexpr int CH = kChunk, KP = ChunkSmem<K>::KP, VS = kVs, NT = kChunkThreads;
  extern __shared__ __align__(128) float sm[];
  float* Kc = sm;              // [CH, KP] k, later e^G ⊙ k
  float* Qc = Kc + CH * KP;    // [CH, KP] q, later e^G ⊙ q
  float* Gc = Qc + CH * KP;    // [CH, KP] cumulative log-decay (rows ≥ n repeat the last)
  float* E1 = Gc + CH * KP;    // [CH, KP] k_s e^{r − G_s}, later k_s e^{G_end − G_s}
  float* Ek = E1 + CH * KP;    // [kSub, KP] k_t e^{G_t − r}
  float* Eq = Ek + kSub * KP;  // [kSub, KP] q_t e^{G_t − r}
  float* S = Eq + kSub * KP;   // [K, VS] this block's state columns
  float* A = S + K * VS;       // [CH, CH]
  float* QK = A + CH * CH;     // [CH, CH]
  float* V = QK + CH * CH;     // [CH, VS] v, later (e^G⊙q)·S₀
  float* U = V + CH * VS;      // [CH, VS] rhs, then u
  float* bs = U + CH * VS;     // [CH] β
  float* eG = bs + CH;         // [K] e^{G_end}
  const int v0 = blockIdx.x * VS, tid = threadIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  float* Sg = pool + (int64_t(slots[b]) * H + h) * K * K;
  for (int idx = tid; idx < K * VS; idx += NT) S[idx] = Sg[(idx / VS) * K + v0 + idx % VS];
  const int64_t T0 = cu[b], T1 = cu[b + 1];
  for (int64_t c0 = T0; c0 < T1; c0 += CH) {
    const int n = int(T1 - c0 < CH ? T1 - c0 : int64_t(CH));
    __syncthreads();  // the previous chunk is done with every buffer
    // 16-byte loads, all issued before the first shared-memory store: one memory latency per chunk, not
    // one per loop trip (the block is alone on its SM, so nothing else hides it).
    {
      constexpr int KV = K / 4, NL = CH * KV / NT, NV = CH * (VS / 4) / NT;
      float4 kr[NL], qr[NL], gr[NL], vr[NV];
#pragma unroll
      for (int l = 0; l < NL; ++l) {
        const int idx = tid + l * NT, t = idx / KV, i4 = idx % KV;
        const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const int64_t row = (c0 + t) * ld + h * K + 4 * i4;
        kr[l] = t < n ? __ldg(reinterpret_cast<const float4*>(k + row)) : z;
        qr[l] = t < n ? __ldg(reinterpret_cast<const float4*>(q + row)) : z;
        gr[l] = t < n ? __ldg(reinterpret_cast<const float4*>(g + row)) : z;
      }
#pragma unroll
      for (int l = 0; l < NV; ++l) {
        const int idx = tid + l * NT, t = idx / (VS / 4), c4 = idx % (VS / 4);
        vr[l] = t < n ? __ldg(reinterpret_cast<const float4*>(v + (c0 + t) * ld + h * K + v0 + 4 * c4))
                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int l = 0; l < NL; ++l) {
        const int idx = tid + l * NT, t = idx / KV, i = 4 * (idx % KV);
        *reinterpret_cast<float4*>(Kc + t * KP + i) = kr[l];
        *reinterpret_cast<float4*>(Qc + t * KP + i) = qr[l];
        *reinterpret_cast<float4*>(Gc + t * KP + i) = gr[l];
      }
#pragma unroll
      for (int l = 0; l < NV; ++l) *reinterpret_cast<float4*>(V + 4 * (tid + l * NT)) = vr[l];
    }
    if (tid < CH) bs[tid] = tid < n ? beta[(c0 + tid) * ld_beta + h] : 0.0f;
    __syncthreads();
    if (tid < K) {
      double acc = 0.0;
      for (int t = 0; t < CH; ++t) {
        if (t < n) acc += double(Gc[t * KP + tid]);
        Gc[t * KP + tid] = float(acc);
      }
      eG[tid] = float(exp(acc));
    }
    __syncthreads();
    // A_ts = Σ_i k_t k_s e^{G_t − G_s} (s < t), QK_ts = Σ_i q_t k_s e^{G_t − G_s} (s ≤ t), 16 rows at a time.
    for (int j = 0; j * kSub < n; ++j) {
      const int ns = kSub * (j + 1), t0 = kSub * j;
      for (int idx = tid; idx < ns * K; idx += NT) {
        const int s = idx / K, i = idx % K;
        const float r = j ? Gc[(t0 - 1) * KP + i] : 0.0f;
        E1[s * KP + i] = Kc[s * KP + i] * expf(r - Gc[s * KP + i]);
      }
      for (int idx = tid; idx < kSub * K; idx += NT) {
        const int tt = idx / K, i = idx % K, t = t0 + tt;
        const float r = j ? Gc[(t0 - 1) * KP + i] : 0.0f;
        const float e = expf(Gc[t * KP + i] - r);
        Ek[tt * KP + i] = Kc[t * KP + i] * e;
        Eq[tt * KP + i] = Qc[t * KP + i] * e;
      }
      __syncthreads();
      // Warp w: product w & 1 (A from Ek, QK from Eq), column tile w >> 1 of [16, ns]. Entries with s ≥ t
      // (A) or s > t (QK) are computed too (finite: E1 ≤ e^80·|k|) and never read.
      {
        const int w = tid >> 5, ct = w >> 1;
        if (ct <= j) {
          Acc acc;
          wm::fill_fragment(acc, 0.0f);
          mma_3xtf32<wm::row_major, wm::col_major>(acc, (w & 1) ? Eq : Ek, KP, E1 + ct * 16 * KP, KP, K / 8);
          wm::store_matrix_sync(((w & 1) ? QK : A) + t0 * CH + ct * 16, acc, CH, wm::mem_row_major);
        }
      }
      __syncthreads();
    }
    // kt = e^G ⊙ k, qt = e^G ⊙ q in place; E1 = e^{G_end − G} ⊙ k for the state update.
    for (int idx = tid; idx < CH * K; idx += NT) {
      const int t = idx / K, i = idx % K;
      const float G = Gc[t * KP + i], kr = Kc[t * KP + i], e = expf(G);
      E1[t * KP + i] = kr * expf(Gc[(n - 1) * KP + i] - G);
      Kc[t * KP + i] = kr * e;
      Qc[t * KP + i] *= e;
    }
    __syncthreads();
    // rhs = v − kt·S₀ (into U) and qt·S₀ (into V): warp w owns the 16×16 tile (w >> 1, w & 1) of both, so
    // it alone reads V there before overwriting it.
    {
      const int w = tid >> 5, lane = tid & 31, rt = w >> 1, ct = w & 1;
      Acc fw, fo;
      wm::fill_fragment(fw, 0.0f);
      wm::fill_fragment(fo, 0.0f);
      mma_3xtf32<wm::row_major, wm::row_major>(fw, Kc + rt * 16 * KP, KP, S + ct * 16, VS, K / 8);
      mma_3xtf32<wm::row_major, wm::row_major>(fo, Qc + rt * 16 * KP, KP, S + ct * 16, VS, K / 8);
      float* tU = U + rt * 16 * VS + ct * 16;
      float* tV = V + rt * 16 * VS + ct * 16;
      wm::store_matrix_sync(tU, fw, VS, wm::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) tU[(e / 16) * VS + e % 16] = tV[(e / 16) * VS + e % 16] - tU[(e / 16) * VS + e % 16];
      __syncwarp();
      wm::store_matrix_sync(tV, fo, VS, wm::mem_row_major);
    }
    __syncthreads();
    // u_t = β_t (rhs_t − Σ_{s<t} A_ts u_s): warp w owns columns 4w..4w+3, 8 lanes per column split the sum.
    {
      const int lane = tid & 31, c = 4 * (tid >> 5) + (lane >> 3), p = lane & 7;
      for (int t = 0; t < n; ++t) {
        float part = 0.0f;
        for (int s = p; s < t; s += 8) part = fmaf(A[t * CH + s], U[s * VS + c], part);
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        part += __shfl_xor_sync(0xffffffffu, part, 4);
        const float ut = bs[t] * (U[t * VS + c] - part);
        __syncwarp();
        if (p == 0) U[t * VS + c] = ut;
        __syncwarp();
      }
    }
    __syncthreads();
    for (int idx = tid; idx < n * VS; idx += NT) {
      const int t = idx / VS, c = idx % VS;
      float acc = V[idx];
      for (int s = 0; s <= t; ++s) acc = fmaf(QK[t * CH + s], U[s * VS + c], acc);
      o[(c0 + t) * ld + h * K + v0 + c] = acc;
    }
    // S_end = e^{G_end} ⊙ S₀ + E1ᵀ·U over all 64 rows (rows ≥ n of E1 and U are zero): tiles of [K, VS].
    {
      const int w = tid >> 5, lane = tid & 31;
      for (int tile = w; tile < (K / 16) * (VS / 16); tile += NT / 32) {
        const int rt = tile / (VS / 16), ct = tile % (VS / 16);
        float* tS = S + rt * 16 * VS + ct * 16;
        for (int e = lane; e < 256; e += 32) tS[(e / 16) * VS + e % 16] *= eG[rt * 16 + e / 16];
        __syncwarp();
        Acc acc;
        wm::load_matrix_sync(acc, tS, VS, wm::mem_row_major);
        mma_3xtf32<wm::col_major, wm::row_major>(acc, E1 + rt * 16, KP, U + ct * 16, VS, CH / 8);
        wm::store_matrix_sync(tS, acc, VS, wm::mem_row_major);
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < K * VS; idx += NT) Sg[(idx / VS) * K + v0 + idx % VS] = S[idx];
}

__global__ void out_norm_gate_kernel(const float* __restrict__ o, const uint16_t* __restrict__ gate,
                                     const float* __restrict__ o_norm, float eps, uint16_t* __restrict__ ohat,
                                     int64_t H, int Dk) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.y, h = blockIdx.x;
  const int j = threadIdx.x;
  const int64_t idx = t * H * Dk + h * Dk + j;
  const float ov = o[idx];
  const float ss = dev::block_sum(ov * ov, scratch);
  const float r = 1.0f / sqrtf(ss / float(Dk) + eps);
  const float gt = dev::sigmoid(dev::bf16_to_f32(gate[idx]));
  ohat[idx] = dev::f32_to_bf16(ov * r * o_norm[j] * gt);
}

unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  KCUDA_REQUIRE(b < (int64_t(1) << 31), "too many elements: " + std::to_string(n));
  return unsigned(b);
}

void check_heads(int64_t T, int64_t H, int64_t Dk, const char* what) {
  KCUDA_REQUIRE(T >= 0 && T < 65536 * 1024 && H > 0 && H < (int64_t(1) << 31),
                std::string(what) + ": bad T or H");
  KCUDA_REQUIRE(Dk >= 32 && Dk <= 1024 && Dk % 32 == 0,
                std::string(what) + ": Dk = " + std::to_string(Dk) + " must be a multiple of 32 in [32, 1024]");
}

}  // namespace

void kda_conv_prefill(const uint16_t* x, int64_t ldx, const float* w, uint16_t* hist, uint16_t* y, int64_t ldy,
                      int64_t T, int64_t C, int64_t W, cudaStream_t stream) {
  KCUDA_REQUIRE(x && w && y && (W == 1 || hist), std::string("kda_conv_prefill: null pointer"));
  KCUDA_REQUIRE(W >= 1 && W <= kMaxConvW && C > 0 && T >= 0 && ldx >= C && ldy >= C,
                "kda_conv_prefill: bad shape T=" + std::to_string(T) + " C=" + std::to_string(C) +
                    " W=" + std::to_string(W));
  if (T == 0) return;
  conv_prefill_kernel<<<blocks_for(T * C, 256), 256, 0, stream>>>(x, ldx, w, hist, y, ldy, T, C, int(W));
  KCUDA_CHECK_LAUNCH();
  if (W > 1) {
    conv_hist_update_kernel<<<blocks_for(C, 256), 256, 0, stream>>>(x, ldx, hist, T, C, int(W));
    KCUDA_CHECK_LAUNCH();
  }
}

void kda_conv_decode(const uint16_t* x, int64_t ldx, const float* w, uint16_t* hist_pool, const int32_t* slots,
                     uint16_t* y, int64_t ldy, int64_t B, int64_t C, int64_t W, cudaStream_t stream) {
  KCUDA_REQUIRE(x && w && y && slots && (W == 1 || hist_pool), std::string("kda_conv_decode: null pointer"));
  KCUDA_REQUIRE(W >= 1 && W <= kMaxConvW && C > 0 && B >= 0 && ldx >= C && ldy >= C,
                "kda_conv_decode: bad shape B=" + std::to_string(B) + " C=" + std::to_string(C) +
                    " W=" + std::to_string(W));
  if (B == 0) return;
  conv_decode_kernel<<<blocks_for(B * C, 256), 256, 0, stream>>>(x, ldx, w, hist_pool, slots, y, ldy, B, C, int(W));
  KCUDA_CHECK_LAUNCH();
}

void kda_qk_norm_gates(const uint16_t* q, const uint16_t* k, int64_t ld_in, const uint16_t* z, const float* dt_bias,
                       const float* a_log, const uint16_t* b, float lower, float* q_out, float* k_out, float* g,
                       float* beta, int64_t T, int64_t H, int64_t Dk, cudaStream_t stream) {
  KCUDA_REQUIRE(q && k && z && dt_bias && a_log && b && q_out && k_out && g && beta,
                std::string("kda_qk_norm_gates: null pointer"));
  check_heads(T, H, Dk, "kda_qk_norm_gates");
  KCUDA_REQUIRE(ld_in >= H * Dk, std::string("kda_qk_norm_gates: ld_in too small"));
  KCUDA_REQUIRE(T < 65536, std::string("kda_qk_norm_gates: T must be < 65536 per launch"));
  if (T == 0) return;
  qk_norm_gates_kernel<<<dim3(unsigned(H), unsigned(T)), unsigned(Dk), 0, stream>>>(
      q, k, ld_in, z, dt_bias, a_log, b, lower, q_out, k_out, g, beta, H, int(Dk));
  KCUDA_CHECK_LAUNCH();
}

namespace {
template <typename StateT>
void recurrent(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
               int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, StateT* state_pool, float* o,
               int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  KCUDA_REQUIRE(q && k && v && g && beta && cu_seqlens && slots && state_pool && o,
                std::string("kda_recurrent: null pointer"));
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && ld >= H * Dk && ld_beta >= H,
                std::string("kda_recurrent: bad B, H or strides"));
  if (B == 0) return;
  const dim3 grid{unsigned(H), unsigned(B), 1u};
  switch (Dk) {
    case 32:
      recurrent_kernel<32><<<grid, 32, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, H);
      break;
    case 64:
      recurrent_kernel<64><<<grid, 64, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, H);
      break;
    case 128:
      recurrent_kernel<128><<<grid, 128, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o,
                                                      H);
      break;
    default:
      KCUDA_REQUIRE(false, "kda_recurrent: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  }
  KCUDA_CHECK_LAUNCH();
}
}  // namespace

void kda_recurrent(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                   int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                   int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  recurrent(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
}

void kda_recurrent(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                   int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, uint16_t* state_pool, float* o,
                   int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  recurrent(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
}

void kda_chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                 int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                 int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  KCUDA_REQUIRE(q && k && v && g && beta && cu_seqlens && slots && state_pool && o,
                std::string("kda_chunked: null pointer"));
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && ld >= H * Dk && ld_beta >= H && ld % 4 == 0,
                std::string("kda_chunked: bad B, H or strides (ld must be a multiple of 4)"));
  for (const float* p : {q, k, v, g})
    KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0, std::string("kda_chunked: q/k/v/g must be 16-byte aligned"));
  if (B == 0) return;
  auto run = [&](auto kernel, size_t smem, int K) {
    KCUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<dim3(unsigned(K / kVs), unsigned(H), unsigned(B)), kChunkThreads, smem, stream>>>(
        q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, H);
  };
  switch (Dk) {
    case 32: run(chunked_kernel<32>, ChunkSmem<32>::bytes, 32); break;
    case 64: run(chunked_kernel<64>, ChunkSmem<64>::bytes, 64); break;
    case 128: run(chunked_kernel<128>, ChunkSmem<128>::bytes, 128); break;
    default:
      KCUDA_REQUIRE(false, "kda_chunked: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  }
  KCUDA_CHECK_LAUNCH();
}

void kda_out_norm_gate(const float* o, const uint16_t* gate, const float* o_norm, float eps, uint16_t* ohat, int64_t T,
                       int64_t H, int64_t Dk, cudaStream_t stream) {
  KCUDA_REQUIRE(o && gate && o_norm && ohat, std::string("kda_out_norm_gate: null pointer"));
  check_heads(T, H, Dk, "kda_out_norm_gate");
  KCUDA_REQUIRE(T < 65536, std::string("kda_out_norm_gate: T must be < 65536 per launch"));
  if (T == 0) return;
  out_norm_gate_kernel<<<dim3(unsigned(H), unsigned(T)), unsigned(Dk), 0, stream>>>(o, gate, o_norm, eps, ohat, H,
                                                                                    int(Dk));
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
