// The CUDA-core absorbed MLA decode (MODEL.md §3.4, MQA view), generic over where a key's latent row comes
// from, so that one text serves the engine's paged fallback (mla_decode_simple.cu: PagedRows over the page
// arena) and the GPU tests' contiguous reference (tests/gpu/ref/mla_ref.cu: one bf16 [S, C+R] buffer per
// request). Internal to kernels/cuda and tests/gpu/ref; the public launchers are in paged.h and the reference
// header.
//
// Blocks over (key split, request); each block keeps all Hm heads' queries in shared memory and streams
// 32-key tiles of the C+R-wide latent rows through shared memory once for every head (the MQA saving);
// online FP32 softmax; a second kernel merges the splits and applies W_UV. FP32 scores, BF16 storage.
//
// A Rows type has bind(b) → a cursor for request b whose load8(j, c8) returns values 8·c8 .. 8·c8+7 of key
// position j as 8 packed bf16 (the exact bf16 values the CPU reads back), so everything after the load is
// shared. Everything here has internal linkage on purpose (one copy per including .cu file: the kernels
// library and the reference library are linked together into the GPU tests).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cpu/mla_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemm.h"

namespace kestrel::cuda {
namespace {  // NOLINT(google-build-namespaces): internal linkage per including .cu, see above

using cpu::MlaDims;

// Number of keys of query t: entries ≥ 0 of its selection row, or pos0+t+1.
__device__ __forceinline__ int count_keys(const int32_t* sel_row, int64_t Ksel, int64_t p, float* scratch) {
  if (!sel_row) return int(p + 1);
  float c = 0;
  for (int64_t i = threadIdx.x; i < Ksel; i += blockDim.x) c += sel_row[i] >= 0 ? 1.0f : 0.0f;
  return int(dev::block_sum(c, scratch) + 0.5f);
}

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
    qs[i] = c < C ? qt[(int64_t(b) * Hm + h) * C + c]
                  : dev::bf16_to_f32(q[(int64_t(b) * Hm + h) * (N + R) + N + (c - C)]);
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
        v[j] = c < C ? dev::bf16_to_f32(tile[k * CWP + c]) : 0.0f;
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
    if (lane == 0) o[(int64_t(b) * Hm + h) * Dv + e] = dev::f32_to_bf16(s);
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

// Workspace of decode_run: q̃ f32 [B, Hm, C] (256-byte aligned), then the split partials.
size_t decode_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys) {
  const DecodePlan p = decode_plan(B, max_keys);
  const size_t qt = size_t(B * d.Hm * d.C) * 4;
  const size_t parts = size_t(B * p.n_splits * d.Hm) * size_t(d.C + 2) * 4;
  return ((qt + 255) / 256) * 256 + parts + 256;
}

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
}  // namespace kestrel::cuda
