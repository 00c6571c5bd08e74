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

// dspark_markov_greedy, one step i per pair of launches (the chain is sequential; the vocabulary is not):
//  markov_part_kernel: grid (ceil(V / kMarkovTokens), n), CTA c of request b takes tokens [c·kMarkovTokens, +
//    kMarkovTokens), thread tid the tokens c·kMarkovTokens + tid + j·kMarkovThreads (j < kMarkovPerThread,
//    ascending). W1[prev] (prev: anchors[b] or ids[b, i−1]) goes to shared memory; each token's sum runs over k
//    in order from 0 with __fmul_rn / __fadd_rn (never fused, like the host's), the thread's kMarkovPerThread
//    sums side by side so their loads (16-byte rows pieces of W2 when r % 8 == 0) are in flight together; the
//    CTA's best (largest value, lowest id on a tie) goes to the workspace.
//  markov_pick_kernel: one warp per request reduces its CTAs' bests to ids[b, i].
// The previous form, one 1024-thread CTA per request walking all steps, read W2 one dependent bf16 at a time on
// one SM: ≈ 850 µs a step of k3-tiny's draft (V = 12,256, r = 32, 7 steps) on the H200, more than the target's
// verify forward (kestrel serve KESTREL_SPEC_PROFILE, 2026-12-02). (value, id) under markov_better is a strict
// order, so the pick does not depend on how the tokens are split.
constexpr int kMarkovThreads = 256, kMarkovPerThread = 4, kMarkovTokens = kMarkovThreads * kMarkovPerThread;
__device__ __forceinline__ bool markov_better(float v, int i, float bv, int bi) {
  // bi < 0: nothing yet. Larger value wins; equal values: the lower id (the host's first maximum).
  return bi < 0 || (i >= 0 && (v > bv || (v == bv && i < bi)));
}
struct MarkovBest {
  float v;
  int i;
};
__device__ __forceinline__ void warp_best(float& bv, int& bi) {
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, bv, off);
    const int oi = __shfl_down_sync(0xffffffffu, bi, off);
    if (oi >= 0 && markov_better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
}
__global__ void __launch_bounds__(kMarkovThreads)
    markov_part_kernel(const float* __restrict__ base, int64_t Nb, const uint16_t* __restrict__ w1,
                       const uint16_t* __restrict__ w2, const int32_t* __restrict__ anchors, int64_t V, int64_t r,
                       int64_t steps, int64_t i, const int32_t* __restrict__ ids, MarkovBest* __restrict__ part,
                       bool vec) {
  extern __shared__ float e[];  // f32 [r]: W1[prev]
  __shared__ float wv[kMarkovThreads / 32];
  __shared__ int wi[kMarkovThreads / 32];
  const int64_t b = blockIdx.y, c = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int prev = i == 0 ? anchors[b] : ids[b * steps + i - 1];
  for (int64_t k = tid; k < r; k += kMarkovThreads) e[k] = bf16_to_f32(w1[int64_t(prev) * r + k]);
  __syncthreads();
  int64_t v[kMarkovPerThread];
  float sum[kMarkovPerThread];
#pragma unroll
  for (int j = 0; j < kMarkovPerThread; ++j) {
    v[j] = c * kMarkovTokens + tid + int64_t(j) * kMarkovThreads;
    sum[j] = 0.0f;
  }
  if (vec) {  // r % 8 == 0 and W2 16-byte aligned: 8 weights a load
    for (int64_t k0 = 0; k0 < r; k0 += 8) {
      uint4 w[kMarkovPerThread];
#pragma unroll
      for (int j = 0; j < kMarkovPerThread; ++j)
        w[j] = v[j] < V ? __ldg(reinterpret_cast<const uint4*>(w2 + v[j] * r + k0)) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float ek = e[k0 + q];
#pragma unroll
        for (int j = 0; j < kMarkovPerThread; ++j) {
          const uint32_t word = (&w[j].x)[q >> 1];
          const uint16_t h = uint16_t(q & 1 ? word >> 16 : word & 0xffffu);
          sum[j] = __fadd_rn(sum[j], __fmul_rn(bf16_to_f32(h), ek));
        }
      }
    }
  } else {
    for (int64_t k = 0; k < r; ++k) {
      const float ek = e[k];
#pragma unroll
      for (int j = 0; j < kMarkovPerThread; ++j)
        if (v[j] < V) sum[j] = __fadd_rn(sum[j], __fmul_rn(bf16_to_f32(w2[v[j] * r + k]), ek));
    }
  }
  const float* bl = base + (b * Nb + i) * V;
  float bv = 0.0f;
  int bi = -1;
#pragma unroll
  for (int j = 0; j < kMarkovPerThread; ++j) {  // v ascends with j: the thread's first maximum
    if (v[j] >= V) continue;
    const float val = __fadd_rn(bl[v[j]], sum[j]);
    if (bi < 0 || val > bv) bv = val, bi = int(v[j]);
  }
  warp_best(bv, bi);
  if (lane == 0) wv[warp] = bv, wi[warp] = bi;
  __syncthreads();
  if (tid == 0) {
    float best = wv[0];
    int at = wi[0];
    for (int w = 1; w < kMarkovThreads / 32; ++w)
      if (wi[w] >= 0 && markov_better(wv[w], wi[w], best, at)) best = wv[w], at = wi[w];
    part[b * gridDim.x + c] = MarkovBest{best, at};
  }
}
__global__ void markov_pick_kernel(const MarkovBest* __restrict__ part, int64_t nblk, int64_t steps, int64_t i,
                                   int32_t* __restrict__ ids) {
  const int64_t b = blockIdx.x;
  float bv = 0.0f;
  int bi = -1;
  for (int64_t c = threadIdx.x; c < nblk; c += 32) {
    const MarkovBest p = part[b * nblk + c];
    if (p.i >= 0 && markov_better(p.v, p.i, bv, bi)) bv = p.v, bi = p.i;
  }
  warp_best(bv, bi);
  if (threadIdx.x == 0) ids[b * steps + i] = bi;
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

size_t dspark_markov_greedy_workspace_bytes(int64_t n, int64_t V) {
  return size_t(std::max<int64_t>(n, 0)) * size_t((std::max<int64_t>(V, 0) + kMarkovTokens - 1) / kMarkovTokens) *
         sizeof(MarkovBest);
}

void dspark_markov_greedy(const float* base, int64_t Nb, const uint16_t* w1, const uint16_t* w2,
                          const int32_t* anchors, int64_t n, int64_t V, int64_t r, int64_t steps, int32_t* ids,
                          void* workspace, cudaStream_t stream) {
  KCUDA_REQUIRE(base && w1 && w2 && anchors && ids && workspace, std::string("dspark_markov_greedy: null pointer"));
  KCUDA_REQUIRE(n >= 0 && n < 65536 && V > 0 && V < (int64_t(1) << 31) && r > 0 && r <= 8192 && steps >= 0 &&
                    steps <= Nb,
                "dspark_markov_greedy: bad shape n=" + std::to_string(n) + " V=" + std::to_string(V) +
                    " r=" + std::to_string(r) + " steps=" + std::to_string(steps) + " Nb=" + std::to_string(Nb));
  if (n == 0 || steps == 0) return;
  const int64_t nblk = (V + kMarkovTokens - 1) / kMarkovTokens;
  const bool vec = r % 8 == 0 && reinterpret_cast<uintptr_t>(w2) % 16 == 0;
  auto* part = static_cast<MarkovBest*>(workspace);
  for (int64_t i = 0; i < steps; ++i) {
    markov_part_kernel<<<dim3(unsigned(nblk), unsigned(n)), kMarkovThreads, size_t(r) * 4, stream>>>(
        base, Nb, w1, w2, anchors, V, r, steps, i, ids, part, vec);
    KCUDA_CHECK_LAUNCH();
    markov_pick_kernel<<<unsigned(n), 32, 0, stream>>>(part, nblk, steps, i, ids);
    KCUDA_CHECK_LAUNCH();
  }
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
