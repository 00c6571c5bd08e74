// KDA kernels; see kda.h. Correct-first forms:
// - conv: one thread per (token, channel); the history update is a second launch so no thread
//   overwrites history another thread still reads.
// - gates / out-norm: one block of Dk threads per (token, head).
// - recurrent scan: one block of Dk threads per (head, request); thread j owns value column j of S
//   in registers (Dk floats, compile-time indexed), so every state element is read and written once
//   per launch and the reads are coalesced across the warp (row i of S is contiguous in j).
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

template <int DK>
__global__ void __launch_bounds__(DK) recurrent_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                                       const float* __restrict__ v, const float* __restrict__ g,
                                                       int64_t ld, const float* __restrict__ beta, int64_t ld_beta,
                                                       const int32_t* __restrict__ cu, const int32_t* __restrict__ slots,
                                                       float* __restrict__ pool, float* __restrict__ o, int64_t H) {
  __shared__ float ks[DK], qs[DK], ds[DK];
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int j = threadIdx.x;
  float* S = pool + (int64_t(slots[b]) * H + h) * DK * DK;  // f32 [DK(key), DK(value)]
  float s[DK];
#pragma unroll
  for (int i = 0; i < DK; ++i) s[i] = S[i * DK + j];
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
  for (int i = 0; i < DK; ++i) S[i * DK + j] = s[i];
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

void kda_recurrent(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                   int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
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
