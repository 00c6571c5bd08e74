// The full sampler per row (see sampling.h; the greedy argmax is argmax.cu). Its passes are block
// reductions over the row (in L2 after the first); the candidate keys pack (order-preserving logit bits << 32
// | ~id), so one descending sort gives the CPU twin's (logit desc, id asc) order.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/argmax.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sampling.h"

namespace kestrel::cuda {
namespace {

using argmax_detail::better;  // argmax.cuh: the argmax order (larger value, then lower id; NaN last)

// Block-wide reductions over 1024 threads (any multiple of 32 works); every thread gets the result.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T* scratch /* [32] */) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int i = 1; i < nw; ++i) r = op(r, scratch[i]);
  return r;
}

// Order-preserving image of a float (larger float, larger image); NaN maps to 0, below everything.
__device__ __forceinline__ uint32_t ord(float f) {
  if (f != f) return 0u;
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// runtime::sample_uniform, bit for bit.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ double uniform01(uint64_t seed, uint64_t index) {
  return double(mix64(mix64(seed) ^ index) >> 11) * 0x1.0p-53;
}

constexpr int kGather = 2 * kSampleCandidates;  // room for ties at the cut

__global__ void __launch_bounds__(1024) sample_kernel(const float* logits, int64_t ld, int64_t V,
                                                      const SampleParams* params, int32_t* ids) {
  const SampleParams p = params[blockIdx.x];
  const float* x = logits + int64_t(p.row) * ld;
  __shared__ uint64_t keys[kGather];
  __shared__ double cum[kSampleCandidates];
  __shared__ double sd[32];
  __shared__ long long si[32];
  __shared__ unsigned long long su[32];
  __shared__ float sf[32];
  __shared__ int s_count;
  const int tid = threadIdx.x, nt = blockDim.x;
  // Maximum (and greedy): the argmax with ties to the lower id, NaN skipped.
  float bv = 0.0f;
  int bi = -1;
  for (int64_t v = tid; v < V; v += nt)
    if (better(x[v], int(v), bv, bi)) bv = x[v], bi = int(v);
  // The maximum, then the lowest id holding it.
  __shared__ float s_top;
  __shared__ int s_arg;
  {
    const float m = block_reduce<float>(
        bi < 0 ? -INFINITY : bv, [](float a, float b) { return fmaxf(a, b); }, sf);
    const long long cand = (bi >= 0 && bv == m) ? (long long)bi : (long long)V;
    const long long a = block_reduce<long long>(cand, [](long long u, long long w) { return u < w ? u : w; }, si);
    if (tid == 0) s_top = m, s_arg = a >= V ? 0 : int(a);
  }
  __syncthreads();
  if (p.temperature == 0.0f) {
    if (tid == 0) ids[blockIdx.x] = s_arg;
    return;
  }
  const float topf = s_top;
  const double T = p.temperature;
  // Z over the whole vocabulary, FP64.
  double z = 0.0;
  for (int64_t v = tid; v < V; v += nt) z += exp((double(x[v]) - double(topf)) / T);
  const double Z = block_reduce<double>(z, [](double a, double b) { return a + b; }, sd);
  // The top-k cut and the candidate count (at most kSampleCandidates).
  const int64_t Kc = (p.top_k > 0 && p.top_k < V) ? p.top_k : V;
  const int64_t Kp = Kc < kSampleCandidates ? Kc : kSampleCandidates;
  // Largest u with #{ord ≥ u} ≥ Kp: the Kp-th largest logit's image.
  uint32_t lo = 0u, hi = 0xFFFFFFFFu;
  while (lo < hi) {
    const uint32_t mid = uint32_t(lo + (uint64_t(hi) - lo + 1) / 2);
    long long c = 0;
    for (int64_t v = tid; v < V; v += nt) c += ord(x[v]) >= mid;
    c = block_reduce<long long>(c, [](long long a, long long b) { return a + b; }, si);
    if (c >= Kp) lo = mid;
    else hi = mid - 1;
  }
  // The composite key of element v: (logit image, ~id), unique per element; descending key order is the
  // twin's (logit desc, id asc) order.
  auto key_of = [&](int64_t v) { return (uint64_t(ord(x[v])) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(v)); };
  // The L-th largest key (1 ≤ L ≤ V): the largest k with #{key ≥ k} ≥ L, by bisection over the 64-bit keys (64
  // counting passes; only on the rare paths below). Uniform across the block.
  auto kth_key = [&](int64_t L) -> uint64_t {
    uint64_t klo = 0, khi = ~0ull;
    while (klo < khi) {
      const uint64_t d = khi - klo, mid = klo + d / 2 + (d & 1);  // the upper middle, without overflow
      long long cntk = 0;
      for (int64_t v = tid; v < V; v += nt) cntk += key_of(v) >= mid;
      cntk = block_reduce<long long>(cntk, [](long long a, long long b) { return a + b; }, si);
      if (cntk >= L) klo = mid;
      else khi = mid - 1;
    }
    return klo;
  };
  // Gathers every element whose key is ≥ kmin, or (kmin == 0) whose logit image is ≥ lo; returns the count.
  auto gather = [&](uint64_t kmin) {
    if (tid == 0) s_count = 0;
    __syncthreads();
    for (int64_t v = tid; v < V; v += nt) {
      const uint32_t o = ord(x[v]);
      if (kmin ? key_of(v) >= kmin : o >= lo) {
        const int i = atomicAdd(&s_count, 1);
        if (i < kGather) keys[i] = (uint64_t(o) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(v));
      }
    }
    __syncthreads();
    const int r = s_count;
    __syncthreads();  // every thread read the count before a later gather resets it
    return r;
  };
  int cnt = gather(0);
  // More ties at the cut than the gather holds (e.g. a flat row): gather exactly the first Kp keys instead,
  // cut at the Kp-th key (its ties split by id, as the twin's order does).
  if (cnt > kGather) cnt = gather(kth_key(Kp));
  for (int i = cnt + tid; i < kGather; i += nt) keys[i] = 0ull;
  __syncthreads();
  // Bitonic sort, descending.
  for (int k = 2; k <= kGather; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < kGather; i += nt) {
        const int l = i ^ j;
        if (l > i) {
          const uint64_t a = keys[i], b = keys[l];
          if (((i & k) == 0) ? (a < b) : (a > b)) keys[i] = b, keys[l] = a;
        }
      }
      __syncthreads();
    }
  const int c = int(cnt < Kp ? cnt : Kp);
  // Probabilities of the candidates over the full Z, and their inclusive prefix sums.
  double prob = 0.0;
  if (tid < c) {
    const int32_t id = int32_t(0xFFFFFFFFu - uint32_t(keys[tid] & 0xFFFFFFFFull));
    prob = exp((double(x[id]) - double(topf)) / T) / Z;
  }
  if (tid < kSampleCandidates) cum[tid] = prob;
  __syncthreads();
  for (int off = 1; off < kSampleCandidates; off <<= 1) {
    const double t = (tid < kSampleCandidates && tid >= off) ? cum[tid - off] : 0.0;
    __syncthreads();
    if (tid < kSampleCandidates) cum[tid] += t;
    __syncthreads();
  }
  const double p0 = cum[0];
  // min-p: the prefix with prob ≥ min_p · p_max (at least one).
  int keep1 = c;
  if (p.min_p > 0.0f) {
    const double cut = double(p.min_p) * p0;
    const long long k1 = block_reduce<long long>(
        (long long)(tid < c && (tid == 0 || prob >= cut)), [](long long a, long long b) { return a + b; }, si);
    keep1 = int(k1);
  }
  // top-p: the first prefix whose mass reaches top_p.
  int keep = keep1;
  bool closed = c == Kc || keep1 < c;
  if (p.top_p < 1.0f) {
    const long long f = block_reduce<long long>(
        (tid < keep1 && cum[tid] >= double(p.top_p)) ? (long long)tid : (long long)kSampleCandidates,
        [](long long a, long long b) { return a < b ? a : b; }, si);
    if (f < kSampleCandidates) keep = int(f) + 1, closed = true;
  }
  if (closed) {
    const double target = uniform01(p.seed, p.index) * cum[keep - 1];
    const long long pick = block_reduce<long long>(
        (tid < keep && target < cum[tid]) ? (long long)tid : (long long)(keep - 1),
        [](long long a, long long b) { return a < b ? a : b; }, si);
    if (tid == 0) ids[blockIdx.x] = int32_t(0xFFFFFFFFu - uint32_t(keys[pick] & 0xFFFFFFFFull));
    return;
  }
  // The kept prefix runs past the candidates: walk the tail by bisection on the composite key. The token where
  // the running mass crosses M is the largest key x with cum[c−1] + mass{x ≤ key < last candidate} ≥ M (or > M
  // for the draw), 64 passes over the row each. A top-k above the candidates or a min-p that keeps all of them
  // bounds the tail from below: kb, the L-th key, L = min(top-k, #{prob ≥ min_p · p_max}) (a prefix, as
  // probabilities fall along the order) — so no row goes back to the host.
  const uint64_t klast = keys[c - 1];
  const double head = cum[c - 1];
  uint64_t kb = 0;  // smallest key the top-k and min-p cuts keep
  if (p.min_p > 0.0f || Kc != V) {
    int64_t L = Kc;
    if (p.min_p > 0.0f) {  // the twin's test, term for term: exp(·)/Z ≥ min_p · p_max
      const double cut = double(p.min_p) * p0;
      long long m = 0;
      for (int64_t v = tid; v < V; v += nt) m += exp((double(x[v]) - double(topf)) / T) / Z >= cut;
      m = block_reduce<long long>(m, [](long long a, long long b) { return a + b; }, si);
      L = L < m ? L : (m > 1 ? m : 1);
    }
    kb = L >= V ? 0 : kth_key(L);
  }
  auto tail_mass = [&](uint64_t from, uint64_t to) {  // Σ prob over keys in [from, to)
    double m = 0.0;
    for (int64_t v = tid; v < V; v += nt) {
      const uint64_t key = key_of(v);
      if (key >= from && key < to) m += exp((double(x[v]) - double(topf)) / T);
    }
    return block_reduce<double>(m, [](double a, double b) { return a + b; }, sd) / Z;
  };
  auto find = [&](double M, bool strict, uint64_t floor_key) -> uint64_t {  // ~0: not reached
    auto ok = [&](uint64_t k) {
      const double g = head + tail_mass(k, klast);
      return strict ? g > M : g >= M;
    };
    if (!ok(floor_key)) return ~0ull;
    uint64_t lo = floor_key, hi = klast - 1;
    while (lo < hi) {
      const uint64_t mid = lo + (hi - lo + 1) / 2;
      if (ok(mid)) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  };
  uint64_t boundary = kb;  // smallest kept key
  double kept;
  if (p.top_p < 1.0f) {
    const uint64_t b = find(double(p.top_p), false, kb);
    boundary = b == ~0ull ? kb : b;
    kept = head + tail_mass(boundary, klast);
  } else {
    kept = head + tail_mass(kb, klast);
  }
  const double target = uniform01(p.seed, p.index) * kept;
  if (target < head) {
    const long long pick = block_reduce<long long>(
        (tid < c && target < cum[tid]) ? (long long)tid : (long long)(c - 1),
        [](long long a, long long b) { return a < b ? a : b; }, si);
    if (tid == 0) ids[blockIdx.x] = int32_t(0xFFFFFFFFu - uint32_t(keys[pick] & 0xFFFFFFFFull));
    return;
  }
  uint64_t k = find(target, true, boundary);
  if (k == ~0ull) {  // rounding: the last kept token (the smallest kept key), as the twin does
    unsigned long long low = ~0ull;
    for (int64_t v = tid; v < V; v += nt) {
      const uint64_t key = key_of(v);
      if (key >= boundary && key < klast && key < low) low = key;
    }
    low = block_reduce<unsigned long long>(low, [](unsigned long long a, unsigned long long b) { return a < b ? a : b; },
                                           su);
    k = low == ~0ull ? klast : low;
  }
  if (tid == 0) ids[blockIdx.x] = int32_t(0xFFFFFFFFu - uint32_t(k & 0xFFFFFFFFull));
}

__global__ void penalty_kernel(float* logits, int64_t ld, const PenaltyEntry* e, int64_t m) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m; i += int64_t(gridDim.x) * blockDim.x) {
    const PenaltyEntry q = e[i];
    float& l = logits[int64_t(q.row) * ld + q.token];
    float v = l;
    // Explicit IEEE roundings: no fused multiply-add, so the result is the CPU twin's bit for bit.
    if (q.bias != 0.0f) v = __fadd_rn(v, q.bias);
    if (q.flags & kPenaltyMasked) v = -INFINITY;
    if ((q.flags & kPenaltyInContext) && q.repetition != 1.0f)
      v = v > 0.0f ? __fdiv_rn(v, q.repetition) : __fmul_rn(v, q.repetition);
    if (q.count > 0 && (q.frequency != 0.0f || q.presence != 0.0f))
      v = __fsub_rn(v, __fadd_rn(__fmul_rn(q.frequency, float(q.count)), q.presence));
    l = v;
  }
}

}  // namespace

void apply_penalties(float* logits, int64_t ld, int64_t V, const PenaltyEntry* entries, int64_t m,
                     cudaStream_t stream) {
  KCUDA_REQUIRE(m >= 0 && V >= 1 && ld >= V, "apply_penalties: m " + std::to_string(m) + ", V " + std::to_string(V));
  if (m == 0) return;
  penalty_kernel<<<unsigned(std::min<int64_t>((m + 255) / 256, 1024)), 256, 0, stream>>>(logits, ld, entries, m);
  KCUDA_CHECK_LAUNCH();
}

void sample_rows(const float* logits, int64_t ld, int64_t V, const SampleParams* params, int64_t n, int32_t* ids,
                 cudaStream_t stream) {
  KCUDA_REQUIRE(n >= 0 && V >= 1 && V < (int64_t(1) << 31) && ld >= V,
                "sample_rows: n " + std::to_string(n) + ", V " + std::to_string(V) + ", ld " + std::to_string(ld));
  if (n == 0) return;
  sample_kernel<<<unsigned(n), 1024, 0, stream>>>(logits, ld, V, params, ids);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
