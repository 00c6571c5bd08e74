// DSpark draft ops (see dspark.h). Small and simple on purpose: the draft is one to five dense layers over
// a block of Nb ≤ 16 rows per request; the attention is one CTA per (query row, head), three passes over
// the keys (scores to scratch, max and exp-sum, the weighted values).
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/dspark.h"

namespace kestrel::cuda {
namespace {

using dev::bf16_to_f32;
using dev::f32_to_bf16;

constexpr int kThreads = 128;

__global__ void rope_kernel(uint16_t* x, int64_t ld, int64_t heads, int64_t head_stride, int64_t pos0,
                            const float* inv_freq, float mul, int64_t half) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  uint16_t* row = x + t * ld + h * head_stride;
  const float p = float(pos0 + t);
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    // The CPU twin's arithmetic: angle in FP32, cos/sin in FP32 (precise, not the fast intrinsics).
    const float ang = p * inv_freq[i];
    const float c = cosf(ang) * mul, s = sinf(ang) * mul;
    const float x0 = bf16_to_f32(row[2 * i]), x1 = bf16_to_f32(row[2 * i + 1]);
    row[2 * i] = f32_to_bf16(x0 * c - x1 * s);
    row[2 * i + 1] = f32_to_bf16(x1 * c + x0 * s);
  }
}

__device__ float block_reduce(float v, bool is_max, float* sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float r = sh[0];
  for (int i = 1; i < kThreads / 32; ++i) r = is_max ? fmaxf(r, sh[i]) : r + sh[i];
  __syncthreads();
  return r;
}

__global__ void attend_kernel(const uint16_t* q, const uint16_t* kv, const uint16_t* latent, int64_t S, int64_t Hm,
                              int64_t N, int64_t R, int64_t Dv, int64_t C, float scale, float* scratch, uint16_t* o) {
  __shared__ float sh[kThreads / 32];
  const int64_t t = blockIdx.x, h = blockIdx.y, QK = N + R, KW = N + Dv, CW = C + R;
  const uint16_t* qh = q + (t * Hm + h) * QK;
  float* pr = scratch + (t * Hm + h) * S;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < S; j += kThreads) {
    const uint16_t* kn = kv + (j * Hm + h) * KW;
    const uint16_t* kpe = latent + j * CW + C;
    float s = 0.0f;
    for (int64_t d = 0; d < N; ++d) s += bf16_to_f32(qh[d]) * bf16_to_f32(kn[d]);
    for (int64_t d = 0; d < R; ++d) s += bf16_to_f32(qh[N + d]) * bf16_to_f32(kpe[d]);
    s *= scale;
    pr[j] = s;
    m = fmaxf(m, s);
  }
  m = block_reduce(m, true, sh);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < S; j += kThreads) {
    const float e = expf(pr[j] - m);
    pr[j] = e;
    sum += e;
  }
  sum = block_reduce(sum, false, sh);  // also orders the writes of pr before the reads below
  const float inv = 1.0f / sum;
  for (int64_t d = threadIdx.x; d < Dv; d += kThreads) {
    float acc = 0.0f;
    for (int64_t j = 0; j < S; ++j) acc += pr[j] * inv * bf16_to_f32(kv[(j * Hm + h) * KW + N + d]);
    o[(t * Hm + h) * Dv + d] = f32_to_bf16(acc);
  }
}

__global__ void swiglu_kernel(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = bf16_to_f32(g[i]);
    a[i] = f32_to_bf16(x * (1.0f / (1.0f + expf(-x))) * bf16_to_f32(u[i]));
  }
}

}  // namespace

void dspark_rope_interleaved(uint16_t* x, int64_t ld, int64_t T, int64_t heads, int64_t head_stride, int64_t pos0,
                             const float* inv_freq, float cos_sin_mul, int64_t R, cudaStream_t stream) {
  KCUDA_REQUIRE(x && inv_freq, std::string("dspark_rope_interleaved: null pointer"));
  KCUDA_REQUIRE(R > 0 && R % 2 == 0 && R <= 256 && T >= 0 && T < 65536 && heads > 0 && heads < 65536 && pos0 >= 0 &&
                    ld >= R,
                "dspark_rope_interleaved: bad shape T=" + std::to_string(T) + " heads=" + std::to_string(heads) +
                    " R=" + std::to_string(R));
  if (T == 0) return;
  rope_kernel<<<dim3(unsigned(T), unsigned(heads)), 64, 0, stream>>>(x, ld, heads, head_stride, pos0, inv_freq,
                                                                     cos_sin_mul, R / 2);
  KCUDA_CHECK_LAUNCH();
}

void dspark_attend(const uint16_t* q, const uint16_t* kv, const uint16_t* latent, int64_t T, int64_t S, int64_t Hm,
                   int64_t N, int64_t R, int64_t Dv, int64_t C, float scale, float* scratch, uint16_t* o,
                   cudaStream_t stream) {
  KCUDA_REQUIRE(q && kv && latent && scratch && o, std::string("dspark_attend: null pointer"));
  KCUDA_REQUIRE(T >= 0 && T < 65536 && S > 0 && Hm > 0 && Hm < 65536 && N > 0 && R >= 0 && Dv > 0 && C > 0,
                "dspark_attend: bad shape T=" + std::to_string(T) + " S=" + std::to_string(S) +
                    " Hm=" + std::to_string(Hm));
  if (T == 0) return;
  attend_kernel<<<dim3(unsigned(T), unsigned(Hm)), kThreads, 0, stream>>>(q, kv, latent, S, Hm, N, R, Dv, C, scale,
                                                                          scratch, o);
  KCUDA_CHECK_LAUNCH();
}

void dspark_swiglu(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n, cudaStream_t stream) {
  KCUDA_REQUIRE(g && u && a && n >= 0, std::string("dspark_swiglu: bad arguments"));
  if (n == 0) return;
  swiglu_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, stream>>>(g, u, a, n);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
