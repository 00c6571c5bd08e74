// Greedy argmax per row (the API in sampling.h: argmax_rows): ids[r] = argmax_v x[r, v], ties to the lower id,
// NaN never chosen (an all-NaN row gives 0). CPU twin: the host argmax of runtime::sample_token at temperature 0.
//
// Two kernels, the same ids (argmax.cuh's order is total, so the reduction tree cannot change the winner):
// - row: one CTA of 1024 threads per row, each thread a strided slice, then warp shuffles and a shared pass.
// - split (few rows and a workspace): the row cut into S chunks of ≥ kSplitChunk logits, one 256-thread CTA
//   each, every thread's float4 loads of a round issued together; each CTA publishes its winner, and the last
//   CTA of the row to finish (a counter per row, which that CTA resets to 0) reduces the S winners in one warp.
//   Why: at batch 1 the row kernel streams the 163,840 logits (640 KB, in L2 after the lm_head) through one
//   SM — 6.3 µs of every greedy step on the H200 (session 17's timeline), after the step's graph and before the
//   ids' copy, so all of it is on the step's critical path. Split, the row is 40 CTAs of one load round each.
// The split kernel's counters must start at zero (the caller zeroes the workspace once) and are zero again
// after every launch; one workspace serves one stream at a time.
//
// Emulation: tests/emu compiles this file against simt.h (the launcher, which needs CUDA, is left out there).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#ifndef KESTREL_SIMT_EMU
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sampling.h"
#endif
#include "kernels/cuda/argmax.cuh"

namespace kestrel::cuda {
namespace argmax_detail {

constexpr int kRowThreads = 1024;
constexpr int kSplitThreads = 256;
constexpr int kSplitUnroll = 4;                                   // float4 loads in flight a thread
constexpr int64_t kSplitChunk = 4 * kSplitThreads * kSplitUnroll;  // 4,096 logits: one load round a CTA
constexpr int kSplitMaxRows = 128;                                // rows the split kernel takes (its counters)
constexpr int kSplitMaxCtas = 1024;                               // n·S at most (its candidate slots)

// The split kernel's workspace: a counter per row, a candidate (value, id) per CTA.
struct SplitWs {
  unsigned counters[kSplitMaxRows];
  float val[kSplitMaxCtas];
  int idx[kSplitMaxCtas];
};

// Warp, then CTA: every thread ends with the CTA's winner (scratch: 32 floats, 32 ints).
__device__ __forceinline__ void reduce_cta(float& bv, int& bi, float* sv, int* si) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  bv = lane < nw ? sv[lane] : 0.0f;
  bi = lane < nw ? si[lane] : -1;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
}

__global__ void __launch_bounds__(kRowThreads) argmax_row_kernel(const float* __restrict__ x, int64_t ld, int64_t V,
                                                                 int32_t* __restrict__ ids) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* row = x + int64_t(blockIdx.x) * ld;
  float bv = 0.0f;
  int bi = -1;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float f = row[v];
    if (better(f, int(v), bv, bi)) bv = f, bi = int(v);
  }
  reduce_cta(bv, bi, sv, si);
  if (threadIdx.x == 0) ids[blockIdx.x] = bi < 0 ? 0 : bi;
}

// Grid (S, n): CTA (s, r) takes logits [s·chunk, min(V, (s + 1)·chunk)) of row r. vec: every row starts
// 16-byte aligned (x aligned, ld % 4 == 0), and chunk % 4 == 0, so each chunk's whole float4s load as such.
__global__ void __launch_bounds__(kSplitThreads) argmax_split_kernel(const float* __restrict__ x, int64_t ld,
                                                                     int64_t V, int64_t chunk, bool vec,
                                                                     SplitWs* __restrict__ ws,
                                                                     int32_t* __restrict__ ids) {
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ bool s_last;
  const int S = int(gridDim.x), s = int(blockIdx.x), r = int(blockIdx.y);
  const float* row = x + int64_t(r) * ld;
  const int64_t v0 = int64_t(s) * chunk, v1 = v0 + chunk < V ? v0 + chunk : V;
  float bv = 0.0f;
  int bi = -1;
  int64_t tail = v0;  // the first logit the float4 loop leaves to the scalar one
  if (vec) {
    const int64_t n4 = (v1 - v0) / 4;
    const float4* row4 = reinterpret_cast<const float4*>(row + v0);
    for (int64_t i = threadIdx.x; i < n4; i += int64_t(kSplitThreads) * kSplitUnroll) {
      float4 q[kSplitUnroll];
#pragma unroll
      for (int u = 0; u < kSplitUnroll; ++u) {
        const int64_t j = i + int64_t(u) * kSplitThreads;
        q[u] = j < n4 ? row4[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kSplitUnroll; ++u) {
        const int64_t j = i + int64_t(u) * kSplitThreads;
        if (j >= n4) break;
        const int id = int(v0 + 4 * j);
        if (better(q[u].x, id, bv, bi)) bv = q[u].x, bi = id;
        if (better(q[u].y, id + 1, bv, bi)) bv = q[u].y, bi = id + 1;
        if (better(q[u].z, id + 2, bv, bi)) bv = q[u].z, bi = id + 2;
        if (better(q[u].w, id + 3, bv, bi)) bv = q[u].w, bi = id + 3;
      }
    }
    tail = v0 + 4 * n4;
  }
  for (int64_t v = tail + threadIdx.x; v < v1; v += kSplitThreads) {
    const float f = row[v];
    if (better(f, int(v), bv, bi)) bv = f, bi = int(v);
  }
  reduce_cta(bv, bi, sv, si);
  // Publish, then count: the CTA that brings the row's counter to S sees every candidate (fence, then L2 loads).
  if (threadIdx.x == 0) {
    ws->val[r * S + s] = bv;
    ws->idx[r * S + s] = bi;
    __threadfence();
    s_last = atomicAdd(&ws->counters[r], 1u) == unsigned(S - 1);
  }
  __syncthreads();
  if (!s_last || threadIdx.x >= 32) return;
  __threadfence();
  bv = 0.0f, bi = -1;
  for (int j = int(threadIdx.x); j < S; j += 32) {
    const float ov = __ldcg(ws->val + r * S + j);
    const int oi = __ldcg(ws->idx + r * S + j);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  if (threadIdx.x == 0) {
    ids[r] = bi < 0 ? 0 : bi;
    ws->counters[r] = 0u;  // for the next launch (ordered after it by the stream)
  }
}

// The split geometry for n rows of V logits: S chunks of `chunk` logits (a multiple of 4), S = 1 where the
// row kernel is the better choice (many rows: already one CTA per SM or more) or the workspace cannot hold it.
struct SplitPlan {
  int S = 1;
  int64_t chunk = 0;
};
inline SplitPlan split_plan(int64_t n, int64_t V) {
  SplitPlan p;
  if (n < 1 || n > kSplitMaxRows) return p;
  const int64_t want = (V + kSplitChunk - 1) / kSplitChunk;
  const int64_t S = std::min<int64_t>(want, kSplitMaxCtas / n);
  if (S < 2) return p;
  p.chunk = ((V + S - 1) / S + 3) / 4 * 4;
  p.S = int((V + p.chunk - 1) / p.chunk);
  return p;
}

}  // namespace argmax_detail

#ifndef KESTREL_SIMT_EMU
namespace {
bool split_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_ARGMAX_SPLIT");
    return !(e && e[0] == '0');
  }();
  return on;
}
}  // namespace

size_t argmax_workspace_bytes() { return sizeof(argmax_detail::SplitWs); }

void argmax_rows(const float* x, int64_t ld, int64_t n, int64_t V, int32_t* ids, cudaStream_t stream,
                 void* workspace) {
  using namespace argmax_detail;
  KCUDA_REQUIRE(n >= 0 && V >= 1 && V < (int64_t(1) << 31) && ld >= V && n < (int64_t(1) << 31),
                "argmax_rows: n " + std::to_string(n) + ", V " + std::to_string(V) + ", ld " + std::to_string(ld));
  if (n == 0) return;
  const SplitPlan p = workspace && split_enabled() ? split_plan(n, V) : SplitPlan{};
  if (p.S > 1) {
    const bool vec = ld % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
    argmax_split_kernel<<<dim3(unsigned(p.S), unsigned(n)), kSplitThreads, 0, stream>>>(
        x, ld, V, p.chunk, vec, static_cast<SplitWs*>(workspace), ids);
  } else {
    argmax_row_kernel<<<unsigned(n), kRowThreads, 0, stream>>>(x, ld, V, ids);
  }
  KCUDA_CHECK_LAUNCH();
}
#endif  // KESTREL_SIMT_EMU

}  // namespace kestrel::cuda
