// The exact-order DSA indexer (see gpu_ref.h), moved here from src/kernels/cuda/mla.cu unchanged: one thread
// per (query, key) runs the CPU twin's sequential FP32 dot products with __fmul_rn/__fadd_rn (bit-identical
// scores); top-k is a 4-pass 8-bit radix select per query on an order-preserving integer image of the score,
// then an ordered compaction (ascending positions). Templates over where a key comes from (ContigKeys /
// PagedKeys): a paged source looks the page up in the request's block table and dequantises FP8/MXFP4 to the
// exact bf16 values the CPU reads back, so everything after the load is shared with the contiguous path.
// The engine's indexer is kernels/cuda/indexer.cu (tensor cores, chunked top-k).
#include <cub/block/block_scan.cuh>

#include <cfloat>
#include <string>

#include "gpu_ref.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

using dev::bf16_to_f32;

__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return __ldg(reinterpret_cast<const uint32_t*>(p)); }

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
