// KDA kernels; see kda.h. Correct-first forms:
// - conv: one thread per (token, channel); the history update is a second launch so no thread
//   overwrites history another thread still reads.
// - gates / out-norm: one block of Dk threads per (token, head).
// - recurrent scan: one block of Dk threads per (head, request); thread j owns value column j of S
//   in registers (Dk floats, compile-time indexed), so every state element is read and written once
//   per launch and the reads are coalesced across the warp (row i of S is contiguous in j).
// - decode scan: see the comment at decode_kernel.
// - chunked scan: kda_chunked.cu; the fused decode chain (steps 2–7 in one launch): kda_decode_fused.cu.
// - traced conv / decode scan (DSpark verification, kda.h kda_*_traced): the decode kernels' per-token
//   arithmetic over runs of tokens, storing the state after each token.
// About 800 lines: the decode kernels (blocks, with or without its L2 prefetch, stream, regs) and the traced one
// share decode_tokens' arithmetic, which keeps them bit-identical, and one launcher picks among them; split apart
// they would each need that function exported (the traced conv sits beside the conv it must equal for the same
// reason).
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_internal.cuh"

namespace kestrel::cuda {
namespace {

using kda_detail::kMaxConvW;
using kda_detail::load4;
using kda_detail::store4;
using kda_detail::store4_cs;

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

// conv_decode_kernel over a run of tokens per request (kda_conv_decode_traced): thread (b, c) walks tokens
// cu[b] .. cu[b+1] with the per-token arithmetic of conv_decode_kernel, storing the history after each token
// at trace[t − trace_row0] ([W−1, C] per token, a pool slot's layout).
__global__ void conv_decode_traced_kernel(const uint16_t* __restrict__ x, int64_t ldx, const float* __restrict__ w,
                                          uint16_t* __restrict__ pool, const int32_t* __restrict__ cu,
                                          const int32_t* __restrict__ slots, uint16_t* __restrict__ y, int64_t ldy,
                                          int64_t B, int64_t C, int W, uint16_t* __restrict__ trace,
                                          int64_t trace_row0) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * C) return;
  const int64_t b = i / C, c = i % C;
  uint16_t* hist = pool + int64_t(slots[b]) * (W - 1) * C;
  const float* wc = w + c * W;
  uint16_t h[kMaxConvW];
#pragma unroll
  for (int j = 0; j < kMaxConvW - 1; ++j)
    if (j < W - 1) h[j] = hist[j * C + c];
  for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j)
      if (j < W - 1) acc += wc[j] * dev::bf16_to_f32(h[j]);
    const uint16_t cur = x[t * ldx + c];
    acc += wc[W - 1] * dev::bf16_to_f32(cur);
    y[t * ldy + c] = dev::f32_to_bf16(silu(acc));
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j)
      if (j < W - 1) h[j] = j + 1 < W - 1 ? h[j + 1] : cur;
    uint16_t* ht = trace + (t - trace_row0) * (W - 1) * C;
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j)
      if (j < W - 1) ht[j * C + c] = h[j];
  }
#pragma unroll
  for (int j = 0; j < kMaxConvW - 1; ++j)
    if (j < W - 1) hist[j * C + c] = h[j];
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

// Decode-specialised scan (kda_decode; same contract as kda_recurrent, built for one token per request).
// Work item = (32 value columns, head, request), 128 threads: a batch-1 step of 12 heads × 128 is already 48
// items. Thread (warp w, lane l) holds rows i = 16m + 4w + (l >> 3), m < Dk/16, of the columns 4(l & 7)..+3 of
// the item's slice: every state row is one 128-byte (f32) segment per 8 lanes, loaded and stored as 16-byte
// vectors. Per token the column sums a = Σ_i d_i S_ij k_i, b = Σ_i d_i S_ij q_i and kᵀq are reduced over the
// rows (shuffles, then one shared-memory round over the 4 warps, double-buffered by token parity so one
// barrier per token suffices); then u = β(v − a), o = b + u·kᵀq (= (S + k uᵀ)ᵀq) and S ← d ⊙ S + k uᵀ. Same
// math as recurrent_kernel in another summation order.
// decode_kernel: one block per item (the latency form). decode_stream_kernel: a wave of persistent blocks
// walks the items (consecutive items share a head's q, k, g in L2); each thread copies its own part of the
// next item's slice into shared memory (cp.async) before it computes the current item, so the state reads of
// the whole batch stay in flight (the bandwidth form: the one-item-per-block kernel only has reads in flight
// at the start of each block, which left the FP16 pool at ~2.8 TB/s). Both call decode_tokens: identical bits.
constexpr int kDecodeCols = 32, kDecodeThreads = 128;

// Tokens t0..t1−1 of one work item, on the thread's state registers s (rows 16m + 4w + sub, value columns
// col..col+3 of head h). red: the block's reduction buffer, par: its token parity, carried across items.
// kTrace (kda_decode_traced, f32 pools): the state after each token t is also stored at
// trace[t − trace_row0, h] (the layout of a pool slot, [H, DK, DK] per token) — what the pool would hold after
// a one-token launch at t.
template <int DK, bool kTrace = false, typename TraceT = float>
__device__ __forceinline__ void decode_tokens(float (&s)[DK / 16][4], const float* __restrict__ q,
                                              const float* __restrict__ k, const float* __restrict__ v,
                                              const float* __restrict__ g, int64_t ld, const float* __restrict__ beta,
                                              int64_t ld_beta, int64_t t0, int64_t t1, int64_t h, int col,
                                              float (&red)[2][4][9][8], int& par, float* __restrict__ o,
                                              TraceT* __restrict__ trace = nullptr, int64_t trace_row0 = 0,
                                              int64_t H = 0) {
  constexpr int R = DK / 16;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, sub = lane >> 3, c4 = lane & 7;
  for (int64_t t = t0; t < t1; ++t, par ^= 1) {
    const int64_t row = t * ld + h * DK;
    // Every global read of the token is issued here, before the barrier below.
    const float bt = beta[t * ld_beta + h];
    float vv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) vv[c] = v[row + col + c];
    float kr[R], a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, bq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, kq = 0.0f;
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = 16 * m + 4 * w + sub;
      const float d = expf(g[row + i]), qi = q[row + i];
      kr[m] = k[row + i];
      kq = fmaf(kr[m], qi, kq);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[m][c] *= d;
        a[c] = fmaf(s[m][c], kr[m], a[c]);
        bq[c] = fmaf(s[m][c], qi, bq[c]);
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      a[c] += __shfl_xor_sync(0xffffffffu, a[c], 8);
      a[c] += __shfl_xor_sync(0xffffffffu, a[c], 16);
      bq[c] += __shfl_xor_sync(0xffffffffu, bq[c], 8);
      bq[c] += __shfl_xor_sync(0xffffffffu, bq[c], 16);
    }
    kq += __shfl_xor_sync(0xffffffffu, kq, 8);
    kq += __shfl_xor_sync(0xffffffffu, kq, 16);
    if (sub == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        red[par][w][c][c4] = a[c];
        red[par][w][4 + c][c4] = bq[c];
      }
      red[par][w][8][c4] = kq;
    }
    __syncthreads();  // red[par] is rewritten two tokens later, after every thread passed the next barrier
    float u[4], ob[4], kqs = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = ob[c] = 0.0f;
#pragma unroll
    for (int ww = 0; ww < 4; ++ww) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        u[c] += red[par][ww][c][c4];
        ob[c] += red[par][ww][4 + c][c4];
      }
      kqs += red[par][ww][8][c4];
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = bt * (vv[c] - u[c]);
#pragma unroll
    for (int m = 0; m < R; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[m][c] = fmaf(kr[m], u[c], s[m][c]);
    if (tid < 8) {  // warp 0, sub 0: one writer per column group
#pragma unroll
      for (int c = 0; c < 4; ++c) o[row + col + c] = fmaf(u[c], kqs, ob[c]);
    }
    if constexpr (kTrace) {
      TraceT* St = trace + ((t - trace_row0) * H + h) * DK * DK;
#pragma unroll
      for (int m = 0; m < R; ++m) store4(St + (16 * m + 4 * w + sub) * DK + col, s[m]);
    }
  }
}

// kPf (kKdaDecodePrefetch): after issuing its own state loads the block asks L2 for the slice of the block
// pf_dist places later in launch order (≈ one wave on: SMs × resident blocks), so that block's loads find L2
// rather than HBM — more state bytes in flight than the resident blocks' own loads give. The lanes of column
// group 0 prefetch one 128-byte line per row (the f32 slice's row; half a line is used by an f16 slice). Values
// are untouched: the same bits as kKdaDecodeBlocks.
template <int DK, typename StateT, bool kPf = false>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                  const int32_t* __restrict__ cu, const int32_t* __restrict__ slots, StateT* __restrict__ pool,
                  float* __restrict__ o, int64_t H, int64_t pf_dist = 0) {
  constexpr int R = DK / 16;          // rows per thread
  __shared__ float red[2][4][9][8];   // [token parity][warp][a0..a3, b0..b3, kᵀq][column group]
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, sub = lane >> 3, c4 = lane & 7;
  const int col = blockIdx.x * kDecodeCols + 4 * c4;  // first of this thread's 4 value columns
  StateT* S = pool + (int64_t(slots[b]) * H + h) * DK * DK;  // [DK(key), DK(value)]
  float s[R][4];
#pragma unroll
  for (int m = 0; m < R; ++m) load4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  if constexpr (kPf) {
    const int64_t nx = gridDim.x, ny = gridDim.y;
    const int64_t lin = blockIdx.x + nx * (blockIdx.y + ny * int64_t(blockIdx.z)) + pf_dist;
    if (c4 == 0 && lin < nx * ny * int64_t(gridDim.z)) {
      const int64_t cbf = lin % nx, hf = (lin / nx) % ny, bf = lin / (nx * ny);
      const StateT* Sf = pool + (int64_t(slots[bf]) * H + hf) * DK * DK + cbf * kDecodeCols;
#pragma unroll
      for (int m = 0; m < R; ++m)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(Sf + (16 * m + 4 * w + sub) * DK));
    }
  }
  int par = 0;
  decode_tokens<DK>(s, q, k, v, g, ld, beta, ld_beta, cu[b], cu[b + 1], h, col, red, par, o);
#pragma unroll
  for (int m = 0; m < R; ++m) store4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
}

// decode_kernel with the per-token trace (kda_decode_traced): the same loads, tokens and stores.
template <int DK, typename StateT>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_traced_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                         const int32_t* __restrict__ cu, const int32_t* __restrict__ slots, StateT* __restrict__ pool,
                         float* __restrict__ o, int64_t H, StateT* __restrict__ trace, int64_t trace_row0) {
  constexpr int R = DK / 16;
  __shared__ float red[2][4][9][8];
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, sub = lane >> 3, c4 = lane & 7;
  const int col = blockIdx.x * kDecodeCols + 4 * c4;
  StateT* S = pool + (int64_t(slots[b]) * H + h) * DK * DK;
  float s[R][4];
#pragma unroll
  for (int m = 0; m < R; ++m) load4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  int par = 0;
  decode_tokens<DK, true, StateT>(s, q, k, v, g, ld, beta, ld_beta, cu[b], cu[b + 1], h, col, red, par, o, trace,
                                  trace_row0, H);
#pragma unroll
  for (int m = 0; m < R; ++m) store4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
}

// n_items = B·H·(DK/32), item it = ((b·H) + h)·(DK/32) + column block. Dynamic shared memory: StateT [2][DK][32].
template <int DK, typename StateT>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_stream_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                         const int32_t* __restrict__ cu, const int32_t* __restrict__ slots,
                         StateT* __restrict__ pool, float* __restrict__ o, int64_t H, int64_t n_items) {
  constexpr int R = DK / 16, NCB = DK / kDecodeCols;
  __shared__ float red[2][4][9][8];
  StateT* buf = kda_detail::dyn_smem<StateT>();  // [2][DK][kDecodeCols]: the current and the next item's slice
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, sub = lane >> 3, c4 = lane & 7;
  // This thread's rows and columns of item it's slice into buffer p (it reads back exactly these elements, so
  // its own cp.async wait suffices; no barrier).
  auto fetch = [&](int64_t it, int p) {
    const int64_t b = it / (H * NCB), h = (it / NCB) % H, cb = it % NCB;
    const StateT* S = pool + (int64_t(slots[b]) * H + h) * DK * DK + cb * kDecodeCols + 4 * c4;
    StateT* dst = buf + p * DK * kDecodeCols + 4 * c4;
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int r = 16 * m + 4 * w + sub;
      if constexpr (sizeof(StateT) == 4) {
        kda_detail::cp_async16(dst + r * kDecodeCols, S + r * DK, 16u);
      } else {
        kda_detail::cp_async8(dst + r * kDecodeCols, S + r * DK);
      }
    }
  };
  int par = 0, p = 0;
  int64_t it = blockIdx.x;
  if (it < n_items) fetch(it, 0);
  kda_detail::cp_async_commit();
  for (; it < n_items; it += gridDim.x, p ^= 1) {
    // Buffer p^1 was last read for the previous item, whose stores (which used those reads) precede this.
    if (it + gridDim.x < n_items) fetch(it + gridDim.x, p ^ 1);
    kda_detail::cp_async_commit();
    kda_detail::cp_async_wait<1>();  // this thread's copies of item it
    const int64_t b = it / (H * NCB), h = (it / NCB) % H, cb = it % NCB;
    const int col = int(cb) * kDecodeCols + 4 * c4;
    float s[R][4];
#pragma unroll
    for (int m = 0; m < R; ++m) load4(buf + p * DK * kDecodeCols + (16 * m + 4 * w + sub) * kDecodeCols + 4 * c4, s[m]);
    decode_tokens<DK>(s, q, k, v, g, ld, beta, ld_beta, cu[b], cu[b + 1], h, col, red, par, o);
    StateT* S = pool + (int64_t(slots[b]) * H + h) * DK * DK;
#pragma unroll
    for (int m = 0; m < R; ++m) store4_cs(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  }
}

// decode_regs_kernel: persistent blocks like decode_stream_kernel, but the next item's slice is loaded into a
// second register set (16-byte loads straight to registers, no shared-memory staging) before the current item is
// computed, and stored with plain stores (evict-first stores measured slower for the blocks kernel). Costs
// ~32 more registers per thread, so fewer resident blocks, each with a load always in flight.
template <int DK, typename StateT>
__global__ void __launch_bounds__(kDecodeThreads, 4)
    decode_regs_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                       const int32_t* __restrict__ cu, const int32_t* __restrict__ slots, StateT* __restrict__ pool,
                       float* __restrict__ o, int64_t H, int64_t n_items) {
  constexpr int R = DK / 16, NCB = DK / kDecodeCols;
  __shared__ float red[2][4][9][8];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, sub = lane >> 3, c4 = lane & 7;
  // State slice of item it at this thread's first column (rows 16m + 4w + sub are added by the caller).
  auto slice = [&](int64_t it) {
    const int64_t b = it / (H * NCB), h = (it / NCB) % H, cb = it % NCB;
    return pool + (int64_t(slots[b]) * H + h) * DK * DK + cb * kDecodeCols + 4 * c4;
  };
  float nxt[R][4];
  int64_t it = blockIdx.x;
  if (it < n_items) {
    const StateT* S = slice(it);
#pragma unroll
    for (int m = 0; m < R; ++m) load4(S + (16 * m + 4 * w + sub) * DK, nxt[m]);
  }
  int par = 0;
  for (; it < n_items; it += gridDim.x) {
    float s[R][4];
#pragma unroll
    for (int m = 0; m < R; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[m][c] = nxt[m][c];
    if (it + gridDim.x < n_items) {  // a different slice (slots are distinct per request): no hazard with it
      const StateT* S = slice(it + gridDim.x);
#pragma unroll
      for (int m = 0; m < R; ++m) load4(S + (16 * m + 4 * w + sub) * DK, nxt[m]);
    }
    const int64_t b = it / (H * NCB), h = (it / NCB) % H, cb = it % NCB;
    const int col = int(cb) * kDecodeCols + 4 * c4;
    decode_tokens<DK>(s, q, k, v, g, ld, beta, ld_beta, cu[b], cu[b + 1], h, col, red, par, o);
    StateT* S = pool + (int64_t(slots[b]) * H + h) * DK * DK;
#pragma unroll
    for (int m = 0; m < R; ++m) store4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  }
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

}  // namespace

#ifndef KESTREL_SIMT_EMU
namespace {

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

void kda_conv_decode_traced(const uint16_t* x, int64_t ldx, const float* w, uint16_t* hist_pool,
                            const int32_t* cu_seqlens, const int32_t* slots, uint16_t* y, int64_t ldy, int64_t B,
                            int64_t C, int64_t W, uint16_t* trace, int64_t trace_row0, cudaStream_t stream) {
  KCUDA_REQUIRE(x && w && y && slots && cu_seqlens && trace && W >= 2 && hist_pool,
                std::string("kda_conv_decode_traced: null pointer or W < 2"));
  KCUDA_REQUIRE(W <= kMaxConvW && C > 0 && B >= 0 && ldx >= C && ldy >= C && trace_row0 >= 0,
                "kda_conv_decode_traced: bad shape B=" + std::to_string(B) + " C=" + std::to_string(C) +
                    " W=" + std::to_string(W));
  if (B == 0) return;
  conv_decode_traced_kernel<<<blocks_for(B * C, 256), 256, 0, stream>>>(x, ldx, w, hist_pool, cu_seqlens, slots, y,
                                                                        ldy, B, C, int(W), trace, trace_row0);
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

namespace {
// Per device, measured once: one wave of `Kernel` (SMs × its resident blocks of kDecodeThreads threads with `smem`
// bytes of dynamic shared memory). The occupancy query costs microseconds of host time, which a batch-1 launch
// (a few µs of GPU work) paid on every call: the batch-1 decode measured 7.4–7.6 µs with it, 5.3–5.6 µs without
// (H200, bench_kda, events around one launch). One cache per kernel (the template argument).
template <auto Kernel>
int64_t resident_wave(size_t smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> wave[kMaxDevices];  // 0: not measured yet (threads may race to measure it: same value)
  int dev = 0;
  KCUDA_CHECK(cudaGetDevice(&dev));
  KCUDA_REQUIRE(dev >= 0 && dev < kMaxDevices, "kda_decode: device " + std::to_string(dev));
  int64_t w = wave[dev].load(std::memory_order_relaxed);
  if (w == 0) {
    int sms = 0, per_sm = 0;
    KCUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    KCUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kDecodeThreads, smem));
    w = int64_t(std::max(sms, 1)) * std::max(per_sm, 1);
    wave[dev].store(w, std::memory_order_relaxed);
  }
  return w;
}
template <int DK, typename StateT>
int64_t decode_wave() {  // the streaming kernel, its two slices of shared memory
  return resident_wave<decode_stream_kernel<DK, StateT>>(size_t(2) * DK * kDecodeCols * sizeof(StateT));
}
template <int DK, typename StateT>
int64_t decode_regs_wave() {
  return resident_wave<decode_regs_kernel<DK, StateT>>(0);
}
template <int DK, typename StateT>
int64_t decode_blocks_wave() {  // the prefetching blocks kernel
  return resident_wave<decode_kernel<DK, StateT, true>>(0);
}

// The prefetch distance of kKdaDecodePrefetch in blocks: 3/8 of a wave. Measured on the H200 (bench_kda, FP32
// state, H = 12, B = 1024, 2026-12-02): plain blocks 3.87 TB/s; a distance of 1/8 wave 3.85, 1/4 3.98, 3/8
// 4.00, 1/2 3.98, 5/8 3.78, 3/4 3.56, 1 3.15, 2 2.85 — too near and the line is not there in time, too far
// and it is evicted (by the stores streaming through L2) before its block runs. KESTREL_KDA_PF_WAVES
// overrides the fraction (read once; for measurements).
int64_t prefetch_distance(int64_t wave) {
  static const double waves = [] {
    const char* e = std::getenv("KESTREL_KDA_PF_WAVES");
    const double v = e ? std::atof(e) : 0.375;
    KCUDA_REQUIRE(v > 0.0 && v < 64.0, std::string("KESTREL_KDA_PF_WAVES must be in (0, 64)"));
    return v;
  }();
  return std::max<int64_t>(1, int64_t(waves * double(wave)));
}

// kKdaDecodeAuto: the prefetching kernel past this many waves of blocks, the plain one below (measured: B = 64,
// 2.9 waves, prefetch 2.75–2.89 TB/s against 2.98; B = 256, 11.6 waves, 3.67–3.70 against 3.66; B = 1024 above).
constexpr int64_t kAutoPrefetchWaves = 4;

template <int DK, typename StateT>
void launch_decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                   int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, StateT* state_pool, float* o,
                   int64_t B, int64_t H, KdaDecodeVariant variant, cudaStream_t stream) {
  const int64_t n_items = B * H * (DK / kDecodeCols);
  constexpr size_t smem = size_t(2) * DK * kDecodeCols * sizeof(StateT);
  const int64_t wave = decode_wave<DK, StateT>();
  if (variant == kKdaDecodeRegs) {
    const int64_t rwave = decode_regs_wave<DK, StateT>();
    decode_regs_kernel<DK, StateT><<<unsigned(std::min(n_items, rwave)), kDecodeThreads, 0, stream>>>(
        q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, H, n_items);
  } else if (variant == kKdaDecodeStream) {
    decode_stream_kernel<DK, StateT><<<unsigned(std::min(n_items, wave)), kDecodeThreads, smem, stream>>>(
        q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, H, n_items);
  } else if (variant == kKdaDecodePrefetch ||
             (variant == kKdaDecodeAuto && n_items > kAutoPrefetchWaves * decode_blocks_wave<DK, StateT>())) {
    const dim3 grid{unsigned(DK / kDecodeCols), unsigned(H), unsigned(B)};
    decode_kernel<DK, StateT, true><<<grid, kDecodeThreads, 0, stream>>>(
        q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, H,
        prefetch_distance(decode_blocks_wave<DK, StateT>()));
  } else {
    const dim3 grid{unsigned(DK / kDecodeCols), unsigned(H), unsigned(B)};
    // Plain accesses measured best on the H200 at B = 1024 (3.87 TB/s): evict-first .cs loads and stores gave
    // 3.68, loads with the L2 256-byte fetch hint 3.83 (2026-12-01, bench_kda --only decode).
    decode_kernel<DK><<<grid, kDecodeThreads, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots,
                                                           state_pool, o, H);
  }
  KCUDA_CHECK_LAUNCH();
}

template <typename StateT>
void decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
            int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, StateT* state_pool, float* o, int64_t B,
            int64_t H, int64_t Dk, cudaStream_t stream, KdaDecodeVariant variant) {
  // Vector state access needs a 16-byte (f32) / 8-byte (f16) aligned pool; otherwise the plain kernel.
  if (reinterpret_cast<uintptr_t>(state_pool) % (4 * sizeof(StateT)) != 0) {
    recurrent(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
    return;
  }
  KCUDA_REQUIRE(q && k && v && g && beta && cu_seqlens && slots && state_pool && o,
                std::string("kda_decode: null pointer"));
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && ld >= H * Dk && ld_beta >= H,
                std::string("kda_decode: bad B, H or strides"));
  KCUDA_REQUIRE(variant >= kKdaDecodeAuto && variant <= kKdaDecodePrefetch,
                "kda_decode: bad variant " + std::to_string(int(variant)));
  if (B == 0) return;
  switch (Dk) {
    case 32:
      launch_decode<32>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, variant, stream);
      break;
    case 64:
      launch_decode<64>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, variant, stream);
      break;
    case 128:
      launch_decode<128>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, variant, stream);
      break;
    default:
      KCUDA_REQUIRE(false, "kda_decode: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  }
}
}  // namespace

KdaDecodeVariant kda_decode_default_variant() {
  static const KdaDecodeVariant v = [] {
    const char* e = std::getenv("KESTREL_KDA_DECODE");
    if (e == nullptr || *e == 0) return kKdaDecodeAuto;
    const std::string s = e;
    KCUDA_REQUIRE(s == "auto" || s == "blocks" || s == "stream" || s == "regs" || s == "prefetch",
                  "KESTREL_KDA_DECODE=" + s + " (expected auto, blocks, stream, regs or prefetch)");
    return s == "auto"     ? kKdaDecodeAuto
           : s == "blocks" ? kKdaDecodeBlocks
           : s == "stream" ? kKdaDecodeStream
           : s == "regs"   ? kKdaDecodeRegs
                           : kKdaDecodePrefetch;
  }();
  return v;
}

void kda_decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  decode(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream,
         kda_decode_default_variant());
}
void kda_decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, uint16_t* state_pool, float* o,
                int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  decode(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream,
         kda_decode_default_variant());
}
void kda_decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                int64_t B, int64_t H, int64_t Dk, cudaStream_t stream, KdaDecodeVariant variant) {
  decode(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream, variant);
}
void kda_decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, uint16_t* state_pool, float* o,
                int64_t B, int64_t H, int64_t Dk, cudaStream_t stream, KdaDecodeVariant variant) {
  decode(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream, variant);
}

namespace {
template <typename StateT>
void decode_traced(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                   int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, StateT* state_pool, float* o,
                   int64_t B, int64_t H, int64_t Dk, StateT* trace, int64_t trace_row0, cudaStream_t stream) {
  KCUDA_REQUIRE(q && k && v && g && beta && cu_seqlens && slots && state_pool && o && trace,
                std::string("kda_decode_traced: null pointer"));
  KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(state_pool) % (4 * sizeof(StateT)) == 0 &&
                    reinterpret_cast<uintptr_t>(trace) % (4 * sizeof(StateT)) == 0,
                std::string("kda_decode_traced: the pool and the trace must be 16-byte (f32) / 8-byte (f16) aligned"));
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && ld >= H * Dk && ld_beta >= H && trace_row0 >= 0,
                std::string("kda_decode_traced: bad B, H, strides or trace row"));
  if (B == 0) return;
  const dim3 grid{unsigned(Dk / kDecodeCols), unsigned(H), unsigned(B)};
  switch (Dk) {
    case 32:
      decode_traced_kernel<32, StateT><<<grid, kDecodeThreads, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens,
                                                                           slots, state_pool, o, H, trace, trace_row0);
      break;
    case 64:
      decode_traced_kernel<64, StateT><<<grid, kDecodeThreads, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens,
                                                                           slots, state_pool, o, H, trace, trace_row0);
      break;
    case 128:
      decode_traced_kernel<128, StateT><<<grid, kDecodeThreads, 0, stream>>>(
          q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, H, trace, trace_row0);
      break;
    default:
      KCUDA_REQUIRE(false, "kda_decode_traced: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  }
  KCUDA_CHECK_LAUNCH();
}
}  // namespace

void kda_decode_traced(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                       int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                       int64_t B, int64_t H, int64_t Dk, float* trace, int64_t trace_row0, cudaStream_t stream) {
  decode_traced(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, trace, trace_row0, stream);
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

#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda
