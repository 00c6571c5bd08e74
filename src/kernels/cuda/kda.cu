// KDA kernels; see kda.h. Correct-first forms:
// - conv: one thread per (token, channel); the history update is a second launch so no thread
//   overwrites history another thread still reads.
// - gates / out-norm: one block of Dk threads per (token, head).
// - recurrent scan: one block of Dk threads per (head, request); thread j owns value column j of S
//   in registers (Dk floats, compile-time indexed), so every state element is read and written once
//   per launch and the reads are coalesced across the warp (row i of S is contiguous in j).
// - decode scan: see the comment at decode_kernel.
// - chunked scan: kda_chunked.cu.
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/launch.h"

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

// Decode-specialised scan (kda_decode; same contract as kda_recurrent, built for one token per request).
// One block of 128 threads per (32 value columns, head, request), so a batch-1 step of 12 heads × 128
// already runs 48 blocks. Thread (warp w, lane l) holds rows i = 16m + 4w + (l >> 3), m < Dk/16, of the
// columns 4(l & 7)..+3 of the block's slice: every state row is one 128-byte (f32) segment per 8 lanes,
// loaded and stored as 16-byte vectors. Per token the column sums a = Σ_i d_i S_ij k_i, b = Σ_i d_i S_ij q_i
// and kᵀq are reduced over the rows (shuffles, then one shared-memory round over the 4 warps, double-
// buffered by token parity so one barrier per token suffices); then u = β(v − a), o = b + u·kᵀq
// (= (S + k uᵀ)ᵀq) and S ← d ⊙ S + k uᵀ. Same math as recurrent_kernel in another summation order.
__device__ __forceinline__ void load4(const float* p, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float (&x)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = __half2float(__ushort_as_half(uint16_t(v.x))), x[1] = __half2float(__ushort_as_half(uint16_t(v.x >> 16)));
  x[2] = __half2float(__ushort_as_half(uint16_t(v.y))), x[3] = __half2float(__ushort_as_half(uint16_t(v.y >> 16)));
}
__device__ __forceinline__ void store4(float* p, const float (&x)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store4(uint16_t* p, const float (&x)[4]) {
  const uint32_t lo = uint32_t(__half_as_ushort(__float2half_rn(x[0]))) |
                      (uint32_t(__half_as_ushort(__float2half_rn(x[1]))) << 16);
  const uint32_t hi = uint32_t(__half_as_ushort(__float2half_rn(x[2]))) |
                      (uint32_t(__half_as_ushort(__float2half_rn(x[3]))) << 16);
  *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}

constexpr int kDecodeCols = 32, kDecodeThreads = 128;

template <int DK, typename StateT>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ g, int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                  const int32_t* __restrict__ cu, const int32_t* __restrict__ slots, StateT* __restrict__ pool,
                  float* __restrict__ o, int64_t H) {
  constexpr int R = DK / 16;          // rows per thread
  __shared__ float red[2][4][9][8];   // [token parity][warp][a0..a3, b0..b3, kᵀq][column group]
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, sub = lane >> 3, c4 = lane & 7;
  const int col = blockIdx.x * kDecodeCols + 4 * c4;  // first of this thread's 4 value columns
  StateT* S = pool + (int64_t(slots[b]) * H + h) * DK * DK;  // [DK(key), DK(value)]
  float s[R][4];
#pragma unroll
  for (int m = 0; m < R; ++m) load4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  const int64_t t0 = cu[b], t1 = cu[b + 1];
  int par = 0;
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
  }
#pragma unroll
  for (int m = 0; m < R; ++m) store4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
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

namespace {
template <typename StateT>
void decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
            int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, StateT* state_pool, float* o, int64_t B,
            int64_t H, int64_t Dk, cudaStream_t stream) {
  // Vector state access needs a 16-byte (f32) / 8-byte (f16) aligned pool; otherwise the plain kernel.
  if (reinterpret_cast<uintptr_t>(state_pool) % (4 * sizeof(StateT)) != 0) {
    recurrent(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
    return;
  }
  KCUDA_REQUIRE(q && k && v && g && beta && cu_seqlens && slots && state_pool && o,
                std::string("kda_decode: null pointer"));
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && ld >= H * Dk && ld_beta >= H,
                std::string("kda_decode: bad B, H or strides"));
  if (B == 0) return;
  const dim3 grid{unsigned(Dk / kDecodeCols), unsigned(H), unsigned(B)};
  switch (Dk) {
    case 32:
      decode_kernel<32><<<grid, kDecodeThreads, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots,
                                                             state_pool, o, H);
      break;
    case 64:
      decode_kernel<64><<<grid, kDecodeThreads, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots,
                                                             state_pool, o, H);
      break;
    case 128:
      decode_kernel<128><<<grid, kDecodeThreads, 0, stream>>>(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots,
                                                              state_pool, o, H);
      break;
    default:
      KCUDA_REQUIRE(false, "kda_decode: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  }
  KCUDA_CHECK_LAUNCH();
}
}  // namespace

void kda_decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  decode(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
}

void kda_decode(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, uint16_t* state_pool, float* o,
                int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  decode(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
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

// ---- the fused decode chain (kda_decode_fused) -------------------------------------------------------------
// One CTA of 4·DK threads per (head h, row b). Phases, separated by barriers:
//  A. threads < 3·DK run the conv of one q/k/v channel of the head (conv_decode_kernel's arithmetic,
//     history shifted in place); then every thread starts its state loads (the decode_kernel layout: DK/32
//     slices of 128 threads, slice c owning value columns 32c..32c+31) and all threads compute the f_b rows
//     of the head (4 threads per output, FP32, shuffle-summed, rounded to bf16);
//  Resources (ptxas): ≤ 64 registers at 512 threads (two CTAs per SM at Dk = 128), no spills.
//  B. one warp each sums q² and k²; threads < DK normalise, form g and keep exp(g) (qk_norm_gates' formulas);
//  C. the delta-rule step of decode_kernel for one token, o into shared memory;
//  D. one warp sums o²; threads < DK write ô (out_norm_gate's formula).
namespace {

template <int DK, typename StateT>
__global__ void __launch_bounds__(4 * DK, 256 / DK) kda_decode_fused_kernel(const KdaDecodeIn in, const KdaDecodeWeights wt,
                                                                   uint16_t* __restrict__ hist_pool,
                                                                   const int32_t* __restrict__ slots,
                                                                   StateT* __restrict__ pool,
                                                                   uint16_t* __restrict__ ohat, int H, int W) {
  constexpr int R = DK / 16, SL = DK / 32;
  __shared__ float cv[3 * DK];     // conv + SiLU outputs (bf16 values): q | k | v
  __shared__ float zs[DK];         // z (bf16 values)
  __shared__ float qs[DK], ks[DK], ds[DK];
  __shared__ float os[DK];
  __shared__ float red[SL][4][9][8];
  __shared__ float sums[3];
  dev::pdl_trigger();
  dev::pdl_wait();
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  if (in.cu && in.cu[b + 1] - in.cu[b] != 1) return;  // a padded row of a graph bucket: no token, no state
  const int64_t HD = int64_t(H) * DK, C3 = 3 * HD;
  const int slot = slots[b];
  // A. state loads first (longest latency), in decode_kernel's layout.
  const int lane = tid & 31, warp = tid >> 5, slice = warp >> 2, w = warp & 3, sub = lane >> 3, c4 = lane & 7;
  const int col = slice * 32 + 4 * c4;
  StateT* S = pool + (int64_t(slot) * H + h) * DK * DK;
  if (tid < 3 * DK) {
    const int part = tid / DK, i = tid % DK;
    const int64_t ch = part * HD + int64_t(h) * DK + i;
    uint16_t* hist = hist_pool + int64_t(slot) * (W - 1) * C3;
    const float* wc = wt.conv + ch * W;
    uint16_t hv[kMaxConvW];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j) {
      if (j < W - 1) {
        hv[j] = hist[j * C3 + ch];
        acc += wc[j] * dev::bf16_to_f32(hv[j]);
      }
    }
    const uint16_t cur = in.qkv[int64_t(b) * in.ld_qkv + ch];
    acc += wc[W - 1] * dev::bf16_to_f32(cur);
    cv[tid] = dev::round_bf16(acc * dev::sigmoid(acc));
#pragma unroll
    for (int j = 0; j < kMaxConvW - 1; ++j)
      if (j < W - 1) hist[j * C3 + ch] = j + 1 < W - 1 ? hv[j + 1] : cur;
  }
  // The state loads go out here, under the f_b reads and the norms (after the conv: fewer live registers).
  float s[R][4];
#pragma unroll
  for (int m = 0; m < R; ++m) load4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  {  // z = bf16(f_b[h·DK + i, :]·fa), 4 threads per output, DK/4 terms each.
    const int i = tid >> 2, part = tid & 3;
    const uint16_t* fr = wt.f_b + (int64_t(h) * DK + i) * DK + part * (DK / 4);
    const uint16_t* fa = in.fa + int64_t(b) * in.ld_fa + part * (DK / 4);
    float acc = 0.0f;
#pragma unroll 8
    for (int j = 0; j < DK / 4; ++j) acc = fmaf(dev::bf16_to_f32(fr[j]), dev::bf16_to_f32(fa[j]), acc);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (part == 0) zs[i] = dev::round_bf16(acc);
  }
  __syncthreads();
  // B. norms and gates.
  if (warp < 2) {
    float a = 0.0f;
    for (int i = lane; i < DK; i += 32) a = fmaf(cv[warp * DK + i], cv[warp * DK + i], a);
    a = dev::warp_sum(a);
    if (lane == 0) sums[warp] = a;
  }
  __syncthreads();
  if (tid < DK) {
    const float qn = (1.0f / sqrtf(float(DK))) / sqrtf(sums[0] + 1e-6f), kn = 1.0f / sqrtf(sums[1] + 1e-6f);
    qs[tid] = cv[tid] * qn;
    ks[tid] = cv[DK + tid] * kn;
    const float a = expf(wt.a_log[h]);
    const float zi = zs[tid] + wt.dt_bias[int64_t(h) * DK + tid];
    ds[tid] = expf(wt.lower * dev::sigmoid(a * zi));
  }
  __syncthreads();
  // C. one delta-rule step (decode_kernel's arithmetic for one token).
  {
    const float bt = dev::sigmoid(dev::bf16_to_f32(in.bl[int64_t(b) * in.ld_bl + h]));
    float vv[4], kr[R], a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, bq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, kq = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) vv[c] = cv[2 * DK + col + c];
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = 16 * m + 4 * w + sub;
      const float d = ds[i], qi = qs[i];
      kr[m] = ks[i];
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
        red[slice][w][c][c4] = a[c];
        red[slice][w][4 + c][c4] = bq[c];
      }
      red[slice][w][8][c4] = kq;
    }
    __syncthreads();
    float u[4], ob[4], kqs = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = ob[c] = 0.0f;
#pragma unroll
    for (int ww = 0; ww < 4; ++ww) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        u[c] += red[slice][ww][c][c4];
        ob[c] += red[slice][ww][4 + c][c4];
      }
      kqs += red[slice][ww][8][c4];
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = bt * (vv[c] - u[c]);
#pragma unroll
    for (int m = 0; m < R; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[m][c] = fmaf(kr[m], u[c], s[m][c]);
    if (w == 0 && sub == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) os[col + c] = fmaf(u[c], kqs, ob[c]);
    }
#pragma unroll
    for (int m = 0; m < R; ++m) store4(S + (16 * m + 4 * w + sub) * DK + col, s[m]);
  }
  __syncthreads();
  // D. ô = bf16(RMSNorm(o) ⊙ σ(gate)).
  if (warp == 0) {
    float a = 0.0f;
    for (int i = lane; i < DK; i += 32) a = fmaf(os[i], os[i], a);
    a = dev::warp_sum(a);
    if (lane == 0) sums[2] = a;
  }
  __syncthreads();
  if (tid < DK) {
    const float r = 1.0f / sqrtf(sums[2] / float(DK) + wt.eps);
    const int64_t c = int64_t(h) * DK + tid;
    const float gt = dev::sigmoid(dev::bf16_to_f32(in.gate[int64_t(b) * in.ld_gate + c]));
    ohat[int64_t(b) * HD + c] = dev::f32_to_bf16(os[tid] * r * wt.o_norm[tid] * gt);
  }
}

template <typename StateT>
void decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool, const int32_t* slots,
                  StateT* pool, uint16_t* ohat, int64_t B, int64_t H, int64_t Dk, int64_t W, cudaStream_t stream) {
  KCUDA_REQUIRE(in.qkv && in.gate && in.fa && in.bl && w.conv && w.f_b && w.dt_bias && w.a_log && w.o_norm && slots &&
                    pool && ohat && (W == 1 || hist_pool),
                std::string("kda_decode_fused: null pointer"));
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && W >= 1 && W <= kMaxConvW,
                std::string("kda_decode_fused: bad B, H or W"));
  KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(pool) % (4 * sizeof(StateT)) == 0,
                std::string("kda_decode_fused: the state pool must be aligned for 4-element vectors"));
  if (B == 0) return;
  const dim3 grid{unsigned(H), unsigned(B), 1u};
  switch (Dk) {
    case 32: {
      void (*k)(KdaDecodeIn, KdaDecodeWeights, uint16_t*, const int32_t*, StateT*, uint16_t*, int, int) =
          kda_decode_fused_kernel<32, StateT>;
      launch_pdl(k, grid, dim3(128), 0, stream, in, w, hist_pool, slots, pool, ohat, int(H), int(W));
      break;
    }
    case 64: {
      void (*k)(KdaDecodeIn, KdaDecodeWeights, uint16_t*, const int32_t*, StateT*, uint16_t*, int, int) =
          kda_decode_fused_kernel<64, StateT>;
      launch_pdl(k, grid, dim3(256), 0, stream, in, w, hist_pool, slots, pool, ohat, int(H), int(W));
      break;
    }
    case 128: {
      void (*k)(KdaDecodeIn, KdaDecodeWeights, uint16_t*, const int32_t*, StateT*, uint16_t*, int, int) =
          kda_decode_fused_kernel<128, StateT>;
      launch_pdl(k, grid, dim3(512), 0, stream, in, w, hist_pool, slots, pool, ohat, int(H), int(W));
      break;
    }
    default: KCUDA_REQUIRE(false, "kda_decode_fused: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  }
}

}  // namespace

void kda_decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool, const int32_t* slots,
                      float* state_pool, uint16_t* ohat, int64_t B, int64_t H, int64_t Dk, int64_t W,
                      cudaStream_t stream) {
  decode_fused(in, w, hist_pool, slots, state_pool, ohat, B, H, Dk, W, stream);
}
void kda_decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool, const int32_t* slots,
                      uint16_t* state_pool, uint16_t* ohat, int64_t B, int64_t H, int64_t Dk, int64_t W,
                      cudaStream_t stream) {
  decode_fused(in, w, hist_pool, slots, state_pool, ohat, B, H, Dk, W, stream);
}

}  // namespace kestrel::cuda
