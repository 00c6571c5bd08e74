// MoE router (MODEL.md §3.6 step 1) and the expert-parallel id map; see moe.h. The routed experts are in
// moe_experts.cu.
//
// One block per token: sigmoid scores in shared memory, then K rounds of a block-wide arg-max over the
// not-yet-chosen experts (ties to the lower index), then the un-biased weights, renormalised.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe.h"

namespace kestrel::cuda {
namespace {

constexpr int kRouteThreads = 256;
constexpr int kMaxExperts = 8192;
constexpr int kMaxTopK = 64;

// ---- router ------------------------------------------------------------------------------------------
struct Cand {
  float key;
  int idx;
};
__device__ __forceinline__ bool better(const Cand& a, const Cand& b) {
  return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}

__global__ void __launch_bounds__(kRouteThreads) route_kernel(const float* __restrict__ logits,
                                                              const float* __restrict__ bias, int X, int K,
                                                              bool renorm, float scaling, int32_t* __restrict__ ids,
                                                              float* __restrict__ wts) {
  extern __shared__ float sm[];  // s [X], sel [X]
  float* s = sm;
  float* sel = sm + X;
  __shared__ Cand warp_best[32];
  __shared__ int chosen[kMaxTopK];
  const int64_t t = blockIdx.x;
  for (int e = threadIdx.x; e < X; e += blockDim.x) {
    const float sv = dev::sigmoid(logits[t * X + e]);
    s[e] = sv;
    const float k = sv + bias[e];
    sel[e] = isnan(k) ? -INFINITY : k;  // NaN ranks below every number
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int r = 0; r < K; ++r) {
    Cand best{-INFINITY, 0x7fffffff};
    for (int e = threadIdx.x; e < X; e += blockDim.x) {
      bool taken = false;
      for (int q = 0; q < r; ++q) taken |= chosen[q] == e;
      const Cand c{sel[e], e};
      if (!taken && better(c, best)) best = c;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const Cand other{__shfl_xor_sync(0xffffffffu, best.key, o), __shfl_xor_sync(0xffffffffu, best.idx, o)};
      if (better(other, best)) best = other;
    }
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      Cand b = warp_best[0];
      for (int w = 1; w < nw; ++w)
        if (better(warp_best[w], b)) b = warp_best[w];
      chosen[r] = b.idx;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    float w[kMaxTopK];
    for (int r = 0; r < K; ++r) sum += (w[r] = s[chosen[r]]);
    for (int r = 0; r < K; ++r) {
      float v = w[r];
      if (renorm) v /= (sum + 1e-20f);
      ids[t * K + r] = chosen[r];
      wts[t * K + r] = v * scaling;
    }
  }
}

// ---- expert parallelism: global → local ids --------------------------------------------------------
__global__ void local_ids_kernel(const int32_t* __restrict__ ids, int n, int lo, int count,
                                 int32_t* __restrict__ local) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int e = ids[i] - lo;
  local[i] = unsigned(e) < unsigned(count) ? e : -1;
}

}  // namespace

void moe_local_ids(const int32_t* ids, int64_t n, int64_t lo, int64_t count, int32_t* local, cudaStream_t stream) {
  KCUDA_REQUIRE(ids && local, std::string("moe_local_ids: null pointer"));
  KCUDA_REQUIRE(n >= 0 && n < (int64_t(1) << 31) && lo >= 0 && count > 0 && lo + count <= kMaxExperts,
                "moe_local_ids: n = " + std::to_string(n) + ", experts [" + std::to_string(lo) + ", " +
                    std::to_string(lo + count) + ")");
  if (n == 0) return;
  constexpr int kThreads = 256;
  local_ids_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(ids, int(n), int(lo), int(count),
                                                                                     local);
  KCUDA_CHECK_LAUNCH();
}

void moe_route(const float* logits, const float* bias, int64_t T, int64_t X, int64_t K, bool renormalize,
               float scaling, int32_t* ids, float* weights, cudaStream_t stream) {
  KCUDA_REQUIRE(logits && bias && ids && weights, std::string("moe_route: null pointer"));
  KCUDA_REQUIRE(X > 0 && X <= kMaxExperts && K > 0 && K <= kMaxTopK && K <= X,
                "moe_route: X = " + std::to_string(X) + ", K = " + std::to_string(K));
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("moe_route: bad T"));
  if (T == 0) return;
  const size_t smem = size_t(2 * X) * 4;
  if (smem > 48 * 1024)
    KCUDA_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  route_kernel<<<unsigned(T), kRouteThreads, smem, stream>>>(logits, bias, int(X), int(K), renormalize, scaling, ids,
                                                              weights);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
