// The DSA indexer's chunked top-k merge (indexer_topk.h; MODEL.md §3.5 step 6, ties §0.8), split from the scores
// kernel (indexer.cu) because it shares nothing with it but the launch sequence.
//
// One CTA of 512 threads per row, after each key chunk: the row's candidates are the running top
// Ki of the earlier chunks (order keys + positions, ascending) followed by the chunk's scores; a 4-pass 8-bit
// radix select on the order-preserving integer image of the score (NaN → −inf, −0 → +0: the twin's
// cpu::topk order) finds the Ki-th key (histograms by warp-aggregated shared atomics; the candidates' keys
// stay in shared memory after the first pass when ≤ 48K), and an in-order compaction keeps everything above
// it plus the lowest-position ties (§0.8), ascending. In place: an entry is written at an index ≤ its own,
// after it was read.
//
// Resources (ptxas, sm_90a): 107 registers, up to 192 KB + 3.3 KB shared.
#include <cub/block/block_scan.cuh>

#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/indexer_topk.h"

namespace kestrel::cuda::indexer_detail {
namespace {

constexpr int kSelThreads = 512, kSelPer = 16;

// Order-preserving image: larger float ⇒ larger integer; NaN ranks as −inf and −0 as +0 (cpu::topk).
__device__ __forceinline__ uint32_t order_key(float x) {
  if (isnan(x)) x = -INFINITY;
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kSelThreads)
    indexer_select_merge(const float* __restrict__ scores, int64_t ldc, uint32_t* skeys, int32_t* sel,
                         const int32_t* __restrict__ lens, int chunk0, int Ki, int max_len, int cache_cap) {
  using Scan = cub::BlockScan<int, kSelThreads>;
  extern __shared__ uint32_t cache[];  // u32 [cache_cap]: the row's order keys, kept after pass 1 when they fit
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ int s_digit, s_remaining;
  const int t = blockIdx.x, tid = threadIdx.x;
  const int len = min(max(lens[t], 0), max_len);
  int32_t* out = sel + int64_t(t) * Ki;
  uint32_t* sk = skeys + int64_t(t) * Ki;
  if (len <= Ki) {
    if (chunk0 == 0)
      for (int i = tid; i < Ki; i += kSelThreads) out[i] = i < len ? i : -1;
    return;
  }
  if (len <= chunk0) return;
  const int n_s = chunk0 == 0 ? 0 : Ki, n = n_s + min(len - chunk0, int(ldc));
  const float* row = scores + int64_t(t) * ldc - n_s;  // entry v ≥ n_s is row[v]
  auto key_g = [&](int v) { return v < n_s ? sk[v] : order_key(row[v]); };
  const bool cached = n <= cache_cap;
  auto key = [&](int v) { return cached ? cache[v] : key_g(v); };

  uint32_t prefix = 0, mask = 0;
  int remaining = Ki;  // how many keys matching prefix are still to take
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kSelThreads) hist[i] = 0;
    __syncthreads();
    constexpr int U = 8;  // loads in flight per thread
    for (int v0 = 0; v0 < n; v0 += U * kSelThreads) {
      uint32_t u[U];
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int v = v0 + i * kSelThreads + tid;
        u[i] = 0u;
        if (v < n) {
          if (shift == 24) {  // first pass: from global, and into the cache
            u[i] = key_g(v);
            if (cached) cache[v] = u[i];
          } else {
            u[i] = key(v);
          }
        }
      }
      // Warp-aggregated: lanes with the same bin add once (scores crowd into few bins; same-address shared
      // atomics would serialise). Bin 256 = not matching the prefix.
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int v = v0 + i * kSelThreads + tid;
        const int bin = v < n && (u[i] & mask) == prefix ? int((u[i] >> shift) & 0xFF) : 256;
        const unsigned peers = __match_any_sync(0xffffffffu, bin);
        if (bin < 256 && (tid & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
      }
    }
    __syncthreads();
    if (tid < 32) {
      // Lane l holds bins 8l..8l+7; above = entries in higher bins; the lane where `remaining` falls
      // finds the digit.
      int c[8], tot = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) c[i] = hist[tid * 8 + i], tot += c[i];
      int suf = tot;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_down_sync(0xffffffffu, suf, o);
        if (tid + o < 32) suf += y;
      }
      int above = suf - tot;
      if (above < remaining && remaining <= suf) {
        for (int i = 7; i >= 0; --i) {
          if (above + c[i] >= remaining) {
            s_digit = tid * 8 + i, s_remaining = remaining - above;
            break;
          }
          above += c[i];
        }
      }
    }
    __syncthreads();
    prefix |= uint32_t(s_digit) << shift;
    mask |= 0xFFu << shift;
    remaining = s_remaining;
  }
  // prefix is the Ki-th largest key: take every key above it and the `remaining` first ties, in order.
  int base_take = 0, base_eq = 0;
  for (int c0 = 0; c0 < n; c0 += kSelThreads * kSelPer) {
    uint32_t u[kSelPer];
    int32_t p[kSelPer];
    int n_eq = 0;
    const int v0 = c0 + tid * kSelPer;  // this thread's entries v0 .. v0 + kSelPer − 1, in order
#pragma unroll
    for (int i = 0; i < kSelPer; ++i) {
      const int v = v0 + i;
      u[i] = 0, p[i] = -1;
      if (v < n) u[i] = key(v), p[i] = v < n_s ? out[v] : chunk0 + (v - n_s);
      n_eq += (v < n && u[i] == prefix) ? 1 : 0;
    }
    int eq_rank, eq_total;
    __syncthreads();  // every entry of this block is read before anyone writes; scan_tmp reuse
    Scan(scan_tmp).ExclusiveSum(n_eq, eq_rank, eq_total);
    bool take[kSelPer];
    int n_take = 0, e = base_eq + eq_rank;  // ties before entry i (all threads, this block included)
#pragma unroll
    for (int i = 0; i < kSelPer; ++i) {
      const bool in = v0 + i < n, eq = in && u[i] == prefix;
      take[i] = in && (u[i] > prefix || (eq && e < remaining));
      e += eq ? 1 : 0;
      n_take += take[i] ? 1 : 0;
    }
    int pos, total;
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(n_take, pos, total);
    pos += base_take;
#pragma unroll
    for (int i = 0; i < kSelPer; ++i)
      if (take[i]) out[pos] = p[i], sk[pos] = u[i], ++pos;
    base_take += total, base_eq += eq_total;
  }
}

}  // namespace

void select_merge(const float* scores, int64_t ldc, uint32_t* skeys, int32_t* sel, const int32_t* lens, int chunk0,
                  int Ki, int max_len, int cache_cap, int64_t T, cudaStream_t stream) {
  const size_t smem = size_t(cache_cap) * 4;
  if (smem > 0)
    KCUDA_CHECK(cudaFuncSetAttribute(indexer_select_merge, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  indexer_select_merge<<<unsigned(T), kSelThreads, smem, stream>>>(scores, ldc, skeys, sel, lens, chunk0, Ki, max_len,
                                                                   cache_cap);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::indexer_detail
