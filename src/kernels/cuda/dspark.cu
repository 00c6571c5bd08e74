// DSpark draft ops (see dspark.h). Small and simple on purpose: the draft is one to five dense layers over
// a block of Nb ≤ 16 rows per request; the attention is one CTA per (query row, head), three passes over
// the keys (scores to scratch, max and exp-sum, the weighted values), varlen over requests when batched.
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
                            const int32_t* pos, const float* inv_freq, float mul, int64_t half) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  uint16_t* row = x + t * ld + h * head_stride;
  const float p = float(pos ? int64_t(pos[t]) : pos0 + t);  // the same int64 → float either way: the same bits
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

// kbeg / klen null: every query row over keys [0, S); else row t over keys [kbeg[t], kbeg[t] + klen[t]) (the
// batched draft: each request's rows over its own context + block), S then the scratch row stride. The loops
// run over the row's keys in the same order either way, so a request's rows get the same bits batched or alone.
__global__ void attend_kernel(const uint16_t* q, const uint16_t* kv, const uint16_t* latent, int64_t S,
                              const int32_t* kbeg, const int32_t* klen, int64_t Hm, int64_t N, int64_t R, int64_t Dv,
                              int64_t C, float scale, float* scratch, uint16_t* o) {
  __shared__ float sh[kThreads / 32];
  const int64_t t = blockIdx.x, h = blockIdx.y, QK = N + R, KW = N + Dv, CW = C + R;
  const uint16_t* qh = q + (t * Hm + h) * QK;
  float* pr = scratch + (t * Hm + h) * S;
  if (kbeg) {
    kv += int64_t(kbeg[t]) * Hm * KW;
    latent += int64_t(kbeg[t]) * CW;
    S = min(int64_t(klen[t]), S);  // the launcher's contract says klen ≤ Smax; never past the scratch row
  }
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

__global__ void scale_kernel(uint16_t* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = f32_to_bf16(bf16_to_f32(x[i]) * s);
}

// dspark_markov_greedy: CTA b walks its steps; per step the W1 row of the previous token in shared memory,
// each thread the tokens v ≡ tid (mod blockDim) with the sum in k order (__fmul_rn / __fadd_rn: never fused,
// like the host's), keeping its first maximum, then a CTA reduction to the lowest id of the largest value.
constexpr int kMarkovThreads = 1024;
__device__ __forceinline__ bool markov_better(float v, int i, float bv, int bi) {
  // bi < 0: nothing yet. Larger value wins; equal values: the lower id (the host's first maximum).
  return bi < 0 || (i >= 0 && (v > bv || (v == bv && i < bi)));
}
__global__ void __launch_bounds__(kMarkovThreads)
    markov_greedy_kernel(const float* __restrict__ base, int64_t Nb, const uint16_t* __restrict__ w1,
                         const uint16_t* __restrict__ w2, const int32_t* __restrict__ anchors, int64_t V, int64_t r,
                         int64_t steps, int32_t* __restrict__ ids) {
  extern __shared__ float e[];  // f32 [r]: W1[prev]
  __shared__ float wv[kMarkovThreads / 32];
  __shared__ int wi[kMarkovThreads / 32];
  __shared__ int prev_s;
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  if (tid == 0) prev_s = anchors[b];
  __syncthreads();
  for (int64_t i = 0; i < steps; ++i) {
    const int prev = prev_s;
    for (int64_t k = tid; k < r; k += blockDim.x) e[k] = bf16_to_f32(w1[int64_t(prev) * r + k]);
    __syncthreads();
    const float* bl = base + (b * Nb + i) * V;
    float bv = 0.0f;
    int bi = -1;
    for (int64_t v = tid; v < V; v += blockDim.x) {
      const uint16_t* row = w2 + v * r;
      float s = 0.0f;
      for (int64_t k = 0; k < r; ++k) s = __fadd_rn(s, __fmul_rn(bf16_to_f32(row[k]), e[k]));
      const float val = __fadd_rn(bl[v], s);
      if (bi < 0 || val > bv) bv = val, bi = int(v);  // v ascends: the thread's first maximum
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_down_sync(0xffffffffu, bv, off);
      const int oi = __shfl_down_sync(0xffffffffu, bi, off);
      if (oi >= 0 && markov_better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (lane == 0) wv[warp] = bv, wi[warp] = bi;
    __syncthreads();
    if (tid == 0) {
      float best = wv[0];
      int at = wi[0];
      for (int w = 1; w < nw; ++w)
        if (wi[w] >= 0 && markov_better(wv[w], wi[w], best, at)) best = wv[w], at = wi[w];
      ids[b * steps + i] = at;
      prev_s = at;
    }
    __syncthreads();  // prev_s written; e and the warp slots free again
  }
}
}  // namespace

void dspark_rope_interleaved(uint16_t* x, int64_t ld, int64_t T, int64_t heads, int64_t head_stride, int64_t pos0,
                             const float* inv_freq, float cos_sin_mul, int64_t R, cudaStream_t stream,
                             const int32_t* pos) {
  KCUDA_REQUIRE(x && inv_freq, std::string("dspark_rope_interleaved: null pointer"));
  KCUDA_REQUIRE(R > 0 && R % 2 == 0 && R <= 256 && T >= 0 && T < 65536 && heads > 0 && heads < 65536 && pos0 >= 0 &&
                    ld >= R,
                "dspark_rope_interleaved: bad shape T=" + std::to_string(T) + " heads=" + std::to_string(heads) +
                    " R=" + std::to_string(R));
  if (T == 0) return;
  rope_kernel<<<dim3(unsigned(T), unsigned(heads)), 64, 0, stream>>>(x, ld, heads, head_stride, pos0, pos,
                                                                     inv_freq, cos_sin_mul, R / 2);
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
  attend_kernel<<<dim3(unsigned(T), unsigned(Hm)), kThreads, 0, stream>>>(q, kv, latent, S, nullptr, nullptr, Hm, N,
                                                                          R, Dv, C, scale, scratch, o);
  KCUDA_CHECK_LAUNCH();
}

void dspark_attend_varlen(const uint16_t* q, const uint16_t* kv, const uint16_t* latent, int64_t T,
                          const int32_t* kbeg, const int32_t* klen, int64_t Smax, int64_t Hm, int64_t N, int64_t R,
                          int64_t Dv, int64_t C, float scale, float* scratch, uint16_t* o, cudaStream_t stream) {
  KCUDA_REQUIRE(q && kv && latent && kbeg && klen && scratch && o, std::string("dspark_attend_varlen: null pointer"));
  KCUDA_REQUIRE(T >= 0 && T < 65536 && Smax > 0 && Hm > 0 && Hm < 65536 && N > 0 && R >= 0 && Dv > 0 && C > 0,
                "dspark_attend_varlen: bad shape T=" + std::to_string(T) + " Smax=" + std::to_string(Smax) +
                    " Hm=" + std::to_string(Hm));
  if (T == 0) return;
  attend_kernel<<<dim3(unsigned(T), unsigned(Hm)), kThreads, 0, stream>>>(q, kv, latent, Smax, kbeg, klen, Hm, N, R,
                                                                          Dv, C, scale, scratch, o);
  KCUDA_CHECK_LAUNCH();
}

void dspark_markov_greedy(const float* base, int64_t Nb, const uint16_t* w1, const uint16_t* w2,
                          const int32_t* anchors, int64_t n, int64_t V, int64_t r, int64_t steps, int32_t* ids,
                          cudaStream_t stream) {
  KCUDA_REQUIRE(base && w1 && w2 && anchors && ids, std::string("dspark_markov_greedy: null pointer"));
  KCUDA_REQUIRE(n >= 0 && n < 65536 && V > 0 && V < (int64_t(1) << 31) && r > 0 && r <= 8192 && steps >= 0 &&
                    steps <= Nb,
                "dspark_markov_greedy: bad shape n=" + std::to_string(n) + " V=" + std::to_string(V) +
                    " r=" + std::to_string(r) + " steps=" + std::to_string(steps) + " Nb=" + std::to_string(Nb));
  if (n == 0 || steps == 0) return;
  markov_greedy_kernel<<<unsigned(n), kMarkovThreads, size_t(r) * 4, stream>>>(base, Nb, w1, w2, anchors, V, r, steps,
                                                                               ids);
  KCUDA_CHECK_LAUNCH();
}

void dspark_swiglu(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n, cudaStream_t stream) {
  KCUDA_REQUIRE(g && u && a && n >= 0, std::string("dspark_swiglu: bad arguments"));
  if (n == 0) return;
  swiglu_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, stream>>>(g, u, a, n);
  KCUDA_CHECK_LAUNCH();
}

void dspark_scale_bf16(uint16_t* x, int64_t n, float s, cudaStream_t stream) {
  KCUDA_REQUIRE(x && n >= 0, std::string("dspark_scale_bf16: bad arguments"));
  if (n == 0) return;
  scale_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, stream>>>(x, n, s);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
