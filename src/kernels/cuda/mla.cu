// MLA attention and the DSA indexer on the GPU (see mla.h). Straightforward CUDA-core kernels, correct
// first: FP32 scores and softmax, BF16 storage, every rounding point where the CPU twin has it.
//  - naive prefill: one block per (query, head); scores in shared memory; softmax exactly as
//    cpu::softmax_inplace (max, exp, double sum, multiply by the float reciprocal); values summed in key
//    order without fused multiply-add, like the CPU.
//  - absorbed decode: blocks over (key split, request); each block keeps all Hm heads' queries in shared
//    memory and streams 32-key tiles of the 576-wide latent rows through shared memory once for every
//    head (the MQA saving); online softmax; a second kernel merges the splits; a third applies W_UV.
//  - paged reads (paged.h; the tensor-core paged decode/prefill live in mla_tc.cu, this CUDA-core paged
//    decode stays as mla_decode_paged_simple, their fallback for untuned shapes and the benchmark's
//    baseline): the decode and indexer kernels are templates over where a row comes from
//    (ContigRows / PagedRows, ContigKeys / PagedKeys): a paged source looks the page up in the request's
//    block table and dequantises FP8/MXFP4 to the exact bf16 values the CPU reads back, so everything after
//    the load is shared with the contiguous path.
//  - indexer: one thread per (query, key) runs the CPU twin's sequential FP32 dot products with
//    __fmul_rn/__fadd_rn (bit-identical scores); top-k is a 4-pass 8-bit radix select per query on an
//    order-preserving integer image of the score, then an ordered compaction (ascending positions).
#include <cub/block/block_scan.cuh>

#include <cfloat>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/mla.h"
#include "kernels/cuda/paged.h"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

using dev::bf16_to_f32;
using dev::f32_to_bf16;

constexpr int kNaiveThreads = 256;
constexpr int64_t kNaiveMaxSmem = 200 * 1024;

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float s = lane < nw ? scratch[lane] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
  return s;
}

__device__ __forceinline__ double block_sum_d(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double s = lane < nw ? scratch[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Number of keys of query t: entries ≥ 0 of its selection row, or pos0+t+1.
__device__ __forceinline__ int count_keys(const int32_t* sel_row, int64_t Ksel, int64_t p, float* scratch) {
  if (!sel_row) return int(p + 1);
  float c = 0;
  for (int64_t i = threadIdx.x; i < Ksel; i += blockDim.x) c += sel_row[i] >= 0 ? 1.0f : 0.0f;
  return int(dev::block_sum(c, scratch) + 0.5f);
}

// ---- naive prefill -----------------------------------------------------------------------------------------
__global__ void mla_naive_kernel(MlaDims d, const uint16_t* __restrict__ q, const uint16_t* __restrict__ kv,
                                 const uint16_t* __restrict__ latent, const int32_t* __restrict__ sel, int64_t Ksel,
                                 int64_t pos0, uint16_t* __restrict__ o) {
  extern __shared__ float smem[];
  __shared__ float qs[1024];
  __shared__ float scratch[32];
  __shared__ double dscratch[32];
  const int64_t t = blockIdx.x, h = blockIdx.y, Hm = d.Hm, N = d.N, R = d.R, Dv = d.Dv, C = d.C, QK = N + R,
                CW = C + R;
  const int32_t* sel_row = sel ? sel + t * Ksel : nullptr;
  const int nk = count_keys(sel_row, Ksel, pos0 + t, scratch);
  const uint16_t* qh = q + (t * Hm + h) * QK;
  for (int64_t i = threadIdx.x; i < QK; i += blockDim.x) qs[i] = bf16_to_f32(qh[i]);
  __syncthreads();
  const float scale = 1.0f / sqrtf(float(QK));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  float* pr = smem;  // f32 [nk]
  for (int i = warp; i < nk; i += nw) {
    const int64_t j = sel_row ? sel_row[i] : i;
    const uint16_t* kn = kv + (j * Hm + h) * (N + Dv);
    const uint16_t* kpe = latent + j * CW + C;
    float s = 0.0f;
    for (int64_t e = lane; e < N; e += 32) s += qs[e] * bf16_to_f32(kn[e]);
    for (int64_t e = lane; e < R; e += 32) s += qs[N + e] * bf16_to_f32(kpe[e]);
    s = dev::warp_sum(s);
    if (lane == 0) pr[i] = s * scale;
  }
  __syncthreads();
  // softmax as cpu::softmax_inplace: max; x = exp(x − max); double sum; x *= float(1/sum).
  float m = -INFINITY;
  for (int i = threadIdx.x; i < nk; i += blockDim.x) m = fmaxf(m, pr[i]);
  m = block_max(m, scratch);
  double s = 0.0;
  for (int i = threadIdx.x; i < nk; i += blockDim.x) {
    const float e = expf(pr[i] - m);
    pr[i] = e;
    s += double(e);
  }
  s = block_sum_d(s, dscratch);
  const float inv = float(1.0 / s);
  for (int i = threadIdx.x; i < nk; i += blockDim.x) pr[i] = __fmul_rn(pr[i], inv);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < Dv; e += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < nk; ++i) {
      const int64_t j = sel_row ? sel_row[i] : i;
      acc = __fadd_rn(acc, __fmul_rn(pr[i], bf16_to_f32(kv[(j * Hm + h) * (N + Dv) + N + e])));
    }
    o[(t * Hm + h) * Dv + e] = f32_to_bf16(acc);
  }
}

// ---- absorbed decode ---------------------------------------------------------------------------------------
constexpr int kTile = 32;        // keys per shared-memory tile
constexpr int kDecThreads = 128;  // 4 warps
constexpr int kMaxHeads = 16;
constexpr int kColsPerThread = 4;  // value columns per thread: C ≤ 4·128

struct DecodeSmem {
  static size_t bytes(int64_t Hm, int64_t CW) {
    const int64_t cwp = CW + 2;  // odd 32-bit word stride: conflict-free per-key reads
    return size_t(Hm * CW * 4 + kTile * cwp * 2 + kMaxHeads * kTile * 4 + 4 * kMaxHeads * 4) + 64;
  }
};

// Where the latent rows come from. bind(b) gives row b's cursor; load8(j, c8) returns values
// 8·c8 .. 8·c8+7 of key position j as 8 packed bf16.
//  - ContigRows: one contiguous bf16 [S, C+R] buffer per request (mla.h).
//  - PagedRows<fmt>: the paged arena through the request's block table (paged.h); FP8 values are
//    dequantised to their exact bf16 value e4m3·s, so the math after the load is format-independent.
struct ContigRows {
  const uint16_t* const* caches;
  int CW;
  struct Row {
    const uint16_t* p;
    int CW;
    __device__ __forceinline__ uint4 load8(int64_t j, int c8) const { return dev::ld16(p + j * CW + c8 * 8); }
  };
  __device__ __forceinline__ Row bind(int b) const { return {caches[b], CW}; }
};

__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return __ldg(reinterpret_cast<const uint32_t*>(p)); }

template <LatentFormat F>
struct PagedRows {
  const uint8_t* arena;
  const int32_t* bt;
  int64_t bt_stride;
  const int32_t* req;
  int P, C;
  int64_t tb;
  struct Row {
    const uint8_t* arena;
    const int32_t* table;
    int P, C;
    int64_t tb;
    __device__ __forceinline__ uint4 load8(int64_t j, int c8) const {
      const uint8_t* tok = arena + (int64_t(table[j / P]) * P + j % P) * tb;
      if (F == LatentFormat::bf16) return dev::ld16(tok + c8 * 16);
      const int c = c8 * 8;
      if (c < C) {
        const float s = __ldg(reinterpret_cast<const float*>(tok + C + (c / 128) * 4));
        const uint32_t w0 = ld32(tok + c), w1 = ld32(tok + c + 4);
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          f[i] = dev::e4m3_to_f32(uint8_t(w0 >> (8 * i))) * s;
          f[4 + i] = dev::e4m3_to_f32(uint8_t(w1 >> (8 * i))) * s;
        }
        return dev::pack8(f);
      }
      const uint8_t* rope = tok + C + ((C + 127) / 128) * 4 + (c - C) * 2;
      return make_uint4(ld32(rope), ld32(rope + 4), ld32(rope + 8), ld32(rope + 12));
    }
  };
  __device__ __forceinline__ Row bind(int b) const {
    return {arena, bt + int64_t(req ? req[b] : b) * bt_stride, P, C, tb};
  }
};

// Partial results per (request, split, head): m, l (FP32) and the unnormalised ô (C floats).
template <class Rows>
__global__ void __launch_bounds__(kDecThreads)
    mla_decode_split_kernel(MlaDims d, const float* __restrict__ qt /* [B, Hm, C] */,
                            const uint16_t* __restrict__ q /* [B, Hm, N+R] for q_pe */,
                            Rows rows, const int32_t* __restrict__ lens,
                            const int32_t* __restrict__ sel, int64_t Ksel, int chunk, int n_splits,
                            float* __restrict__ part_ml /* [B, splits, Hm, 2] */,
                            float* __restrict__ part_acc /* [B, splits, Hm, C] */) {
  extern __shared__ __align__(16) unsigned char dsm[];
  const int Hm = int(d.Hm), C = int(d.C), R = int(d.R), N = int(d.N), CW = C + R, CWP = CW + 2;
  float* qs = reinterpret_cast<float*>(dsm);                          // [Hm, CW]
  uint16_t* tile = reinterpret_cast<uint16_t*>(qs + Hm * CW);         // [kTile, CWP]
  float* ps = reinterpret_cast<float*>(tile + kTile * CWP + 2);       // [kMaxHeads, kTile] (+2: 4-byte align)
  ps = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ps) + 15) & ~uintptr_t(15));
  float* ms = ps + kMaxHeads * kTile;  // running max [kMaxHeads]
  float* ls = ms + kMaxHeads;          // running sum
  float* cs = ls + kMaxHeads;          // correction of this tile
  const int b = blockIdx.y, split = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t* sel_row = sel ? sel + int64_t(b) * Ksel : nullptr;
  int nk;
  if (sel_row) {
    __shared__ float scratch[32];
    nk = count_keys(sel_row, Ksel, 0, scratch);
  } else {
    nk = lens[b];
  }
  const auto cache = rows.bind(b);
  const int begin = split * chunk, end = min(nk, begin + chunk);
  const float scale = 1.0f / sqrtf(float(N + R));

  for (int i = tid; i < Hm * CW; i += kDecThreads) {
    const int h = i / CW, c = i % CW;
    qs[i] = c < C ? qt[(int64_t(b) * Hm + h) * C + c] : bf16_to_f32(q[(int64_t(b) * Hm + h) * (N + R) + N + (c - C)]);
  }
  if (tid < kMaxHeads) ms[tid] = -INFINITY, ls[tid] = 0.0f;
  float acc[kMaxHeads][kColsPerThread];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h)
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) acc[h][j] = 0.0f;
  __syncthreads();

  const int vec_per_row = CW / 8;
  for (int k0 = begin; k0 < end; k0 += kTile) {
    const int nt = min(kTile, end - k0);
    for (int i = tid; i < kTile * vec_per_row; i += kDecThreads) {
      const int r = i / vec_per_row, c8 = i % vec_per_row;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < nt) {
        const int64_t j = sel_row ? sel_row[k0 + r] : k0 + r;
        v = cache.load8(j, c8);
      }
      uint32_t* dst = reinterpret_cast<uint32_t*>(tile + r * CWP + c8 * 8);
      dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    }
    __syncthreads();
    // Scores: one thread per (head, key).
    for (int pi = tid; pi < Hm * kTile; pi += kDecThreads) {
      const int h = pi / kTile, k = pi % kTile;
      float s = -INFINITY;
      if (k < nt) {
        const float* qh = qs + h * CW;
        const uint32_t* row = reinterpret_cast<const uint32_t*>(tile + k * CWP);
        float a0 = 0.0f, a1 = 0.0f;
        for (int c2 = 0; c2 < CW / 2; ++c2) {
          const uint32_t w = row[c2];
          a0 += qh[2 * c2] * __uint_as_float(w << 16);
          a1 += qh[2 * c2 + 1] * __uint_as_float(w & 0xffff0000u);
        }
        s = (a0 + a1) * scale;
      }
      ps[h * kTile + k] = s;
    }
    __syncthreads();
    // Online softmax per head (one warp per head, lane = key).
    for (int h = warp; h < Hm; h += kDecThreads / 32) {
      const float x = ps[h * kTile + lane];
      float mt = x;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float m_old = ms[h], m_new = fmaxf(m_old, mt);
      const float p = lane < nt ? expf(x - m_new) : 0.0f;
      const float sum = dev::warp_sum(p);
      ps[h * kTile + lane] = p;
      __syncwarp();
      if (lane == 0) {
        const float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        cs[h] = corr;
        ls[h] = ls[h] * corr + sum;
        ms[h] = m_new;
      }
    }
    __syncthreads();
    // ô_h[c] = ô_h[c]·corr_h + Σ_k p_h,k ĉ_k[c] for this thread's columns c = tid + 128·j.
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      if (h < Hm) {
        const float corr = cs[h];
#pragma unroll
        for (int j = 0; j < kColsPerThread; ++j) acc[h][j] *= corr;
      }
    }
    for (int k = 0; k < nt; ++k) {
      float v[kColsPerThread];
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        const int c = tid + kDecThreads * j;
        v[j] = c < C ? bf16_to_f32(tile[k * CWP + c]) : 0.0f;
      }
#pragma unroll
      for (int h = 0; h < kMaxHeads; ++h) {
        if (h < Hm) {
          const float p = ps[h * kTile + k];
#pragma unroll
          for (int j = 0; j < kColsPerThread; ++j) acc[h][j] += p * v[j];
        }
      }
    }
    __syncthreads();
  }
  const int64_t base = (int64_t(b) * n_splits + split) * Hm;
  if (tid < Hm) {
    part_ml[(base + tid) * 2] = ms[tid];
    part_ml[(base + tid) * 2 + 1] = ls[tid];
  }
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    if (h < Hm) {
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        const int c = tid + kDecThreads * j;
        if (c < C) part_acc[(base + h) * C + c] = acc[h][j];
      }
    }
  }
}

// ô[b, h] = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s, then o_h = bf16(W_UV,h ô_h). One block per (b, h).
__global__ void mla_decode_combine_uv_kernel(MlaDims d, int n_splits, const float* __restrict__ part_ml,
                                             const float* __restrict__ part_acc, const uint16_t* __restrict__ kv_b,
                                             uint16_t* __restrict__ o) {
  __shared__ __align__(16) float oh[512];
  __shared__ float wts[1024];
  const int b = blockIdx.x, h = blockIdx.y, Hm = int(d.Hm), C = int(d.C), N = int(d.N), Dv = int(d.Dv);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  float M = -INFINITY;
  for (int s = 0; s < n_splits; ++s) M = fmaxf(M, part_ml[((int64_t(b) * n_splits + s) * Hm + h) * 2]);
  float L = 0.0f;
  for (int s = tid; s < n_splits; s += blockDim.x) {
    const float* ml = part_ml + ((int64_t(b) * n_splits + s) * Hm + h) * 2;
    wts[s] = ml[0] == -INFINITY ? 0.0f : expf(ml[0] - M);
  }
  __syncthreads();
  for (int s = 0; s < n_splits; ++s) L += wts[s] * part_ml[((int64_t(b) * n_splits + s) * Hm + h) * 2 + 1];
  const float invL = 1.0f / L;
  for (int c = tid; c < C; c += blockDim.x) {
    float a = 0.0f;
    for (int s = 0; s < n_splits; ++s)
      if (wts[s] != 0.0f) a += wts[s] * part_acc[((int64_t(b) * n_splits + s) * Hm + h) * C + c];
    oh[c] = a * invL;
  }
  __syncthreads();
  const uint16_t* wuv = kv_b + (int64_t(h) * (N + Dv) + N) * C;  // bf16 [Dv, C]
  for (int e = warp; e < Dv; e += nw) {
    const uint16_t* row = wuv + int64_t(e) * C;
    float s = 0.0f;
    for (int c8 = lane; c8 < C / 8; c8 += 32) {
      float w8[8];
      dev::unpack8(dev::ld16(row + c8 * 8), w8);
#pragma unroll
      for (int i = 0; i < 8; ++i) s += w8[i] * oh[c8 * 8 + i];
    }
    s = dev::warp_sum(s);
    if (lane == 0) o[(int64_t(b) * Hm + h) * Dv + e] = f32_to_bf16(s);
  }
}

struct DecodePlan {
  int n_splits, chunk;
};
DecodePlan decode_plan(int64_t B, int64_t max_keys) {
  const int64_t target_blocks = 2 * 132;
  const int64_t tiles = std::max<int64_t>(1, (max_keys + kTile - 1) / kTile);
  const int64_t want = std::max<int64_t>(1, (target_blocks + B - 1) / B);
  const int64_t splits0 = std::min(tiles, want);
  const int64_t chunk = ((tiles + splits0 - 1) / splits0) * kTile;
  const int64_t splits = std::max<int64_t>(1, (max_keys + chunk - 1) / chunk);
  return {int(splits), int(chunk)};
}

// ---- indexer -------------------------------------------------------------------------------------------------
__global__ void indexer_key_norm_kernel(const uint16_t* __restrict__ kraw, const uint16_t* __restrict__ w,
                                        const uint16_t* __restrict__ bias, int64_t Di, uint16_t* __restrict__ out) {
  __shared__ double scratch[32];
  const int64_t t = blockIdx.x;
  const uint16_t* k = kraw + t * Di;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < Di; i += blockDim.x) s += double(bf16_to_f32(k[i]));
  const double mean = block_sum_d(s, scratch) / double(Di);
  double v = 0.0;
  for (int64_t i = threadIdx.x; i < Di; i += blockDim.x) {
    const double dd = double(bf16_to_f32(k[i])) - mean;
    v += dd * dd;
  }
  const double var = block_sum_d(v, scratch);
  const float rstd = float(1.0 / sqrt(var / double(Di) + 1e-6));
  const float meanf = float(mean);
  for (int64_t i = threadIdx.x; i < Di; i += blockDim.x) {
    const float b = bias ? bf16_to_f32(bias[i]) : 0.0f;
    const float y = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(bf16_to_f32(k[i]), meanf), rstd), bf16_to_f32(w[i])), b);
    out[t * Di + i] = f32_to_bf16(y);
  }
}

// Where index keys come from: bind(t) gives query t's cursor, load(s, k) writes key s's DI values
// (as the exact bf16 values the CPU reads back) to k.
template <int DI>
struct ContigKeys {
  const uint16_t* keys;
  struct Row {
    const uint16_t* keys;
    __device__ __forceinline__ void load(int64_t s, float* k) const {
#pragma unroll
      for (int i = 0; i < DI / 8; ++i) dev::unpack8(dev::ld16(keys + s * DI + i * 8), k + i * 8);
    }
  };
  __device__ __forceinline__ Row bind(int64_t) const { return {keys}; }
};

// Paged keys in 64-token kernel pages (or one kernel page of P tokens when P % 64 != 0), values then scales.
template <int DI, IndexKeyFormat F>
struct PagedKeys {
  const uint8_t* arena;
  const int32_t* bt;
  int64_t bt_stride;
  const int32_t* req;
  int P;
  int64_t tb;
  struct Row {
    const uint8_t* arena;
    const int32_t* table;
    int P;
    int64_t tb;
    __device__ __forceinline__ void load(int64_t s, float* k) const {
      const int64_t K = P % 64 == 0 ? 64 : P, prow = s % P, r = prow % K;
      const uint8_t* kpage = arena + int64_t(table[s / P]) * P * tb + (prow / K) * K * tb;
      if (F == IndexKeyFormat::bf16) {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(kpage + r * tb);
#pragma unroll
        for (int i = 0; i < DI; ++i) k[i] = dev::bf16_to_f32(p[i]);
      } else if (F == IndexKeyFormat::fp8) {
        const uint8_t* vals = kpage + r * DI;
        const float sc = __ldg(reinterpret_cast<const float*>(kpage + K * DI + r * 4));
#pragma unroll
        for (int i = 0; i < DI / 4; ++i) {
          const uint32_t w = ld32(vals + 4 * i);
#pragma unroll
          for (int j = 0; j < 4; ++j) k[4 * i + j] = dev::round_bf16(dev::e4m3_to_f32(uint8_t(w >> (8 * j))) * sc);
        }
      } else {
        const uint8_t* vals = kpage + r * (DI / 2);
        const uint8_t* scl = kpage + K * (DI / 2) + r * (DI / 32);
#pragma unroll
        for (int b = 0; b < DI / 32; ++b) {
          const float sc = dev::e8m0_to_f32(scl[b]);
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const uint8_t byte = vals[b * 16 + i];
            k[b * 32 + 2 * i] = dev::round_bf16(dev::e2m1_to_f32(byte & 0xFu) * sc);
            k[b * 32 + 2 * i + 1] = dev::round_bf16(dev::e2m1_to_f32(byte >> 4) * sc);
          }
        }
      }
    }
  };
  __device__ __forceinline__ Row bind(int64_t t) const {
    return {arena, bt + int64_t(req ? req[t] : t) * bt_stride, P, tb};
  }
};

// One thread per visible key s of query t; the CPU twin's loop order with round-to-nearest ops only.
// Query t sees lens[t] keys (lens null: pos0 + t + 1).
template <int DI, class Keys>
__global__ void __launch_bounds__(128)
    indexer_scores_kernel(const uint16_t* __restrict__ qi, Keys keys_src, const int32_t* __restrict__ lens,
                          const float* __restrict__ hw, int64_t pos0, int Hi, int64_t Ki, float scale,
                          float* __restrict__ scores, int64_t ld) {
  extern __shared__ float qsm[];  // [Hi*DI] then [Hi] weights
  const int64_t t = blockIdx.y, visible = lens ? int64_t(lens[t]) : pos0 + t + 1;
  if (visible <= Ki) return;
  const int64_t s0 = int64_t(blockIdx.x) * blockDim.x;
  if (s0 >= visible) return;
  for (int i = threadIdx.x; i < Hi * DI; i += blockDim.x) qsm[i] = bf16_to_f32(qi[t * Hi * DI + i]);
  float* wsm = qsm + Hi * DI;
  for (int i = threadIdx.x; i < Hi; i += blockDim.x) wsm[i] = __fmul_rn(hw[t * Hi + i], scale);
  __syncthreads();
  const int64_t s = s0 + threadIdx.x;
  if (s >= visible) return;
  float k[DI];
  keys_src.bind(t).load(s, k);
  float acc = 0.0f;
  for (int h = 0; h < Hi; ++h) {
    const float* qh = qsm + h * DI;
    float dd = 0.0f;
#pragma unroll
    for (int i = 0; i < DI; ++i) dd = __fadd_rn(dd, __fmul_rn(qh[i], k[i]));
    const float r = dd < 0.0f ? 0.0f : dd;  // std::max(dd, 0.0f): keeps NaN and −0 like the CPU
    acc = __fadd_rn(acc, __fmul_rn(wsm[h], r));
  }
  scores[t * ld + s] = acc;
}

// Order-preserving image: larger float ⇒ larger integer; NaN ranks as −inf and −0 as +0, the CPU's
// cpu::topk key (NaN → −inf, and −0 == +0 compare equal there, so they tie and go by position).
__device__ __forceinline__ uint32_t order_key(float x) {
  if (isnan(x)) x = -INFINITY;
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kTopkThreads = 512;

__global__ void __launch_bounds__(kTopkThreads)
    indexer_topk_kernel(const float* __restrict__ scores, int64_t ld, const int32_t* __restrict__ lens, int64_t pos0,
                        int64_t Ki, int32_t* __restrict__ sel) {
  using Scan = cub::BlockScan<int, kTopkThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ int s_digit, s_remaining, s_base_take, s_base_eq;
  const int64_t t = blockIdx.x, visible = lens ? int64_t(lens[t]) : pos0 + t + 1;
  int32_t* out = sel + t * Ki;
  if (visible <= Ki) {
    for (int64_t i = threadIdx.x; i < Ki; i += blockDim.x) out[i] = i < visible ? int32_t(i) : -1;
    return;
  }
  const float* row = scores + t * ld;
  uint32_t prefix = 0, mask = 0;
  int remaining = int(Ki);  // how many of the keys matching prefix still to take
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int64_t s = threadIdx.x; s < visible; s += blockDim.x) {
      const uint32_t u = order_key(row[s]);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xFF], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0, dgt = 0;
      for (dgt = 255; dgt >= 0; --dgt) {
        if (above + hist[dgt] >= remaining) break;
        above += hist[dgt];
      }
      s_digit = dgt;
      s_remaining = remaining - above;
    }
    __syncthreads();
    prefix |= uint32_t(s_digit) << shift;
    mask |= 0xFFu << shift;
    remaining = s_remaining;
    __syncthreads();
  }
  // prefix is the Ki-th largest key; take every key above it and the `remaining` lowest-position ties.
  if (threadIdx.x == 0) s_base_take = 0, s_base_eq = 0;
  __syncthreads();
  for (int64_t c0 = 0; c0 < visible; c0 += blockDim.x) {
    const int64_t s = c0 + threadIdx.x;
    uint32_t u = 0;
    bool valid = s < visible;
    if (valid) u = order_key(row[s]);
    const int eq = valid && u == prefix ? 1 : 0;
    int eq_rank, eq_total;
    Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    const int base_eq = s_base_eq;
    const int take = valid && (u > prefix || (eq && base_eq + eq_rank < remaining)) ? 1 : 0;
    int pos, total;
    Scan(scan_tmp).ExclusiveSum(take, pos, total);
    const int base_take = s_base_take;
    if (take) out[base_take + pos] = int32_t(s);
    __syncthreads();
    if (threadIdx.x == 0) s_base_take = base_take + total, s_base_eq = base_eq + eq_total;
    __syncthreads();
  }
}

}  // namespace

int64_t mla_naive_max_keys() { return (kNaiveMaxSmem / 4) - 64; }

void mla_attn_naive(const MlaDims& d, const uint16_t* q, const uint16_t* kv, const uint16_t* latent, const int32_t* sel,
                    int64_t Ksel, int64_t T, int64_t pos0, uint16_t* o, cudaStream_t stream) {
  if (T == 0) return;
  KCUDA_REQUIRE(d.N + d.R <= 1024 && d.Dv <= 1024, std::string("mla_attn_naive: head too wide"));
  const int64_t max_keys = sel ? Ksel : pos0 + T;
  KCUDA_REQUIRE(max_keys <= mla_naive_max_keys(),
                "mla_attn_naive: " + std::to_string(max_keys) + " keys exceed the shared-memory score buffer");
  const size_t smem = size_t(max_keys) * 4;
  KCUDA_CHECK(cudaFuncSetAttribute(mla_naive_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kNaiveMaxSmem)));
  mla_naive_kernel<<<dim3(unsigned(T), unsigned(d.Hm)), kNaiveThreads, smem, stream>>>(d, q, kv, latent, sel, Ksel,
                                                                                        pos0, o);
  KCUDA_CHECK_LAUNCH();
}

size_t mla_decode_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys) {
  const DecodePlan p = decode_plan(B, max_keys);
  const size_t qt = size_t(B * d.Hm * d.C) * 4;
  const size_t parts = size_t(B * p.n_splits * d.Hm) * size_t(d.C + 2) * 4;
  return ((qt + 255) / 256) * 256 + parts + 256;
}

namespace {
template <class Rows>
void decode_run(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b, Rows rows,
                const int32_t* lens, const int32_t* sel, int64_t Ksel, int64_t B, int64_t max_keys, void* workspace,
                uint16_t* o, cudaStream_t stream) {
  KCUDA_REQUIRE(d.Hm <= kMaxHeads && d.C <= kColsPerThread * kDecThreads && d.C % 8 == 0 && d.R % 8 == 0 &&
                    max_keys > 0 && B < 65536,
                std::string("mla decode: unsupported shape"));
  KCUDA_REQUIRE(q && kv_b && (lens || sel) && workspace && o && (!sel || Ksel > 0), std::string("mla decode: null pointer"));
  const DecodePlan p = decode_plan(B, max_keys);
  const int64_t Hm = d.Hm, N = d.N, R = d.R, Dv = d.Dv, C = d.C, QK = N + R;
  float* qt = static_cast<float*>(workspace);  // f32 [B, Hm, C]
  char* rest = static_cast<char*>(workspace) + ((size_t(B * Hm * C) * 4 + 255) / 256) * 256;
  float* part_ml = reinterpret_cast<float*>(rest);  // f32 [B, splits, Hm, 2]
  float* part_acc = part_ml + B * p.n_splits * Hm * 2;
  // q̃_h[B, C] = q_nope,h[B, N] · W_UK,h[N, C], batched over heads.
  lt.batched_xw_f32(q, Hm * QK, QK, kv_b, C, (N + Dv) * C, qt, Hm * C, C, B, N, C, Hm, stream);
  const size_t smem = DecodeSmem::bytes(Hm, C + R);
  KCUDA_CHECK(
      cudaFuncSetAttribute(mla_decode_split_kernel<Rows>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  mla_decode_split_kernel<Rows><<<dim3(unsigned(p.n_splits), unsigned(B)), kDecThreads, smem, stream>>>(
      d, qt, q, rows, lens, sel, Ksel, p.chunk, p.n_splits, part_ml, part_acc);
  KCUDA_CHECK_LAUNCH();
  KCUDA_REQUIRE(p.n_splits <= 1024 && C <= 512, std::string("mla decode combine: too many splits"));
  mla_decode_combine_uv_kernel<<<dim3(unsigned(B), unsigned(Hm)), 256, 0, stream>>>(d, p.n_splits, part_ml, part_acc,
                                                                                    kv_b, o);
  KCUDA_CHECK_LAUNCH();
}
}  // namespace

void mla_decode_absorbed(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b,
                         const MlaDecodeBatch& bt, void* workspace, uint16_t* o, cudaStream_t stream) {
  if (bt.B == 0) return;
  KCUDA_REQUIRE(bt.caches, std::string("mla_decode_absorbed: null caches"));
  decode_run(lt, d, q, kv_b, ContigRows{bt.caches, int(d.C + d.R)}, bt.lens, bt.sel, bt.Ksel, bt.B, bt.max_keys,
             workspace, o, stream);
}

size_t mla_decode_paged_simple_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys) {
  return mla_decode_workspace_bytes(d, B, max_keys);
}

void mla_decode_paged_simple(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b,
                             const PagedMlaCache& c, const MlaPagedBatch& bt, void* workspace, uint16_t* o,
                             cudaStream_t stream) {
  if (bt.B == 0) return;
  KCUDA_REQUIRE(c.latent && c.block_tables && c.block_size > 0 && c.bt_stride > 0,
                std::string("mla_decode_paged_simple: null cache or block table"));
  KCUDA_REQUIRE(c.C == d.C && c.R == d.R, std::string("mla_decode_paged_simple: cache C/R differ from the layer's"));
  if (c.latent_format == LatentFormat::bf16) {
    const PagedRows<LatentFormat::bf16> rows{c.latent, c.block_tables, c.bt_stride, bt.req, c.block_size,
                                                  int(c.C), c.latent_token_bytes()};
    decode_run(lt, d, q, kv_b, rows, bt.lens, bt.sel, bt.Ksel, bt.B, bt.max_keys, workspace, o, stream);
  } else {
    const PagedRows<LatentFormat::fp8> rows{c.latent, c.block_tables, c.bt_stride, bt.req, c.block_size,
                                                 int(c.C), c.latent_token_bytes()};
    decode_run(lt, d, q, kv_b, rows, bt.lens, bt.sel, bt.Ksel, bt.B, bt.max_keys, workspace, o, stream);
  }
}

void indexer_key_norm(const uint16_t* kraw, const uint16_t* w, const uint16_t* b, int64_t T, int64_t Di, uint16_t* out,
                      cudaStream_t stream) {
  if (T == 0) return;
  KCUDA_REQUIRE(Di <= 1024, std::string("indexer_key_norm: Di > 1024"));
  indexer_key_norm_kernel<<<unsigned(T), 128, 0, stream>>>(kraw, w, b, Di, out);
  KCUDA_CHECK_LAUNCH();
}

namespace {
template <int DI, class Keys>
void launch_scores(const uint16_t* qi, Keys keys, const int32_t* lens, const float* hw, int64_t T, int64_t pos0,
                   int64_t max_len, int64_t Hi, int64_t Ki, float scale, float* scores, int64_t ld,
                   cudaStream_t stream) {
  const dim3 grid(unsigned((max_len + 127) / 128), unsigned(T));
  const size_t smem = size_t(Hi * DI + Hi) * 4;
  KCUDA_CHECK(cudaFuncSetAttribute(indexer_scores_kernel<DI, Keys>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   int(smem)));
  indexer_scores_kernel<DI, Keys><<<grid, 128, smem, stream>>>(qi, keys, lens, hw, pos0, int(Hi), Ki, scale, scores, ld);
  KCUDA_CHECK_LAUNCH();
}

template <int DI>
void launch_paged_scores(const uint16_t* qi, const PagedMlaCache& c, const int32_t* req, const int32_t* lens,
                         const float* hw, int64_t T, int64_t max_len, int64_t Hi, int64_t Ki, float scale,
                         float* scores, int64_t ld, cudaStream_t stream) {
  const int64_t tb = c.key_token_bytes();
  switch (c.key_format) {
    case IndexKeyFormat::bf16:
      launch_scores<DI>(qi, PagedKeys<DI, IndexKeyFormat::bf16>{c.keys, c.block_tables, c.bt_stride, req, c.block_size, tb},
                        lens, hw, T, 0, max_len, Hi, Ki, scale, scores, ld, stream);
      break;
    case IndexKeyFormat::fp8:
      launch_scores<DI>(qi, PagedKeys<DI, IndexKeyFormat::fp8>{c.keys, c.block_tables, c.bt_stride, req, c.block_size, tb},
                        lens, hw, T, 0, max_len, Hi, Ki, scale, scores, ld, stream);
      break;
    case IndexKeyFormat::mxfp4:
      launch_scores<DI>(qi, PagedKeys<DI, IndexKeyFormat::mxfp4>{c.keys, c.block_tables, c.bt_stride, req, c.block_size, tb},
                        lens, hw, T, 0, max_len, Hi, Ki, scale, scores, ld, stream);
      break;
  }
}
}  // namespace

void indexer_select(const uint16_t* qi, const uint16_t* keys, const float* hw, int64_t T, int64_t pos0, int64_t Hi,
                    int64_t Di, int64_t Ki, float* scores, int64_t ld, int32_t* sel, cudaStream_t stream) {
  if (T == 0) return;
  KCUDA_REQUIRE(Ki > 0 && ld >= pos0 + T && Hi * Di <= 8192, std::string("indexer_select: bad arguments"));
  const float scale = 1.0f / sqrtf(float(Hi) * float(Di));
  const int64_t S = pos0 + T;
  if (S > Ki) {
    switch (Di) {
      case 32: launch_scores<32>(qi, ContigKeys<32>{keys}, nullptr, hw, T, pos0, S, Hi, Ki, scale, scores, ld, stream); break;
      case 64: launch_scores<64>(qi, ContigKeys<64>{keys}, nullptr, hw, T, pos0, S, Hi, Ki, scale, scores, ld, stream); break;
      case 128:
        launch_scores<128>(qi, ContigKeys<128>{keys}, nullptr, hw, T, pos0, S, Hi, Ki, scale, scores, ld, stream);
        break;
      default:
        KCUDA_REQUIRE(false, "indexer_select: Di " + std::to_string(Di) + " not in {32, 64, 128}");
    }
  }
  indexer_topk_kernel<<<unsigned(T), kTopkThreads, 0, stream>>>(scores, ld, nullptr, pos0, Ki, sel);
  KCUDA_CHECK_LAUNCH();
}

void indexer_select_paged(const uint16_t* qi, const float* hw, const PagedMlaCache& c, const int32_t* lens,
                          const int32_t* req, int64_t T, int64_t max_len, int64_t Hi, int64_t Ki, float* scores,
                          int64_t ld, int32_t* sel, cudaStream_t stream) {
  if (T == 0) return;
  KCUDA_REQUIRE(qi && hw && lens && scores && sel && c.keys && c.block_tables && c.block_size > 0 && c.bt_stride > 0,
                std::string("indexer_select_paged: null pointer"));
  KCUDA_REQUIRE(Ki > 0 && max_len > 0 && ld >= max_len && Hi * c.Di <= 8192 && T < 65536,
                std::string("indexer_select_paged: bad arguments"));
  const float scale = 1.0f / sqrtf(float(Hi) * float(c.Di));
  if (max_len > Ki) {
    switch (c.Di) {
      case 32: launch_paged_scores<32>(qi, c, req, lens, hw, T, max_len, Hi, Ki, scale, scores, ld, stream); break;
      case 64: launch_paged_scores<64>(qi, c, req, lens, hw, T, max_len, Hi, Ki, scale, scores, ld, stream); break;
      case 128: launch_paged_scores<128>(qi, c, req, lens, hw, T, max_len, Hi, Ki, scale, scores, ld, stream); break;
      default:
        KCUDA_REQUIRE(false, "indexer_select_paged: Di " + std::to_string(c.Di) + " not in {32, 64, 128}");
    }
  }
  indexer_topk_kernel<<<unsigned(T), kTopkThreads, 0, stream>>>(scores, ld, lens, 0, Ki, sel);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
