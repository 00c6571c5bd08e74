// One-shot all-reduce kernel; protocol, ordering argument and CPU twin in allreduce.h.
//
// Layout: 256 threads per block, 16-byte vectors (4 f32 or 8 bf16). Block b owns vectors
// [b·V/G, (b+1)·V/G) of the message (V = bytes / 16). Peer data is read with ld.global.cg (L2, never
// a possibly stale L1 line); flags with ld.acquire.sys / st.release.sys. Resources: no shared memory,
// a handful of registers (16 f32 accumulators at most).
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/allreduce.h"
#include "kernels/cuda/cuda_check.h"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned long long kTimeoutNs = 10ull * 1000 * 1000 * 1000;

struct Args {
  OneShotBuffers b;
  const void* in[kOneShotMaxRanks];
  void* out[kOneShotMaxRanks];
  int rank;          // >= 0: real mode (gridDim.y == 1); -1: emulation, rank = blockIdx.y
  size_t vectors;    // 16-byte vectors in the message
};

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The CPU twin's f32 -> bf16 (core/dtype.h f32_to_bf16): RNE on the bits, NaN kept quiet with its sign.
__device__ __forceinline__ uint32_t bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x0040u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

template <bool kBf16>
__global__ void __launch_bounds__(kThreads) one_shot_kernel(const Args a) {
  const int n = a.b.n;
  const int rank = a.rank >= 0 ? a.rank : int(blockIdx.y);
  const int blk = int(blockIdx.x), G = int(gridDim.x);
  const size_t v0 = a.vectors * size_t(blk) / size_t(G), v1 = a.vectors * size_t(blk + 1) / size_t(G);
  const int slot = a.rank >= 0 ? 0 : rank;  // in/out index: real mode passes this rank's buffers in [0]
  // This call's epoch: every block of every rank has made the same number of calls, so all agree.
  uint32_t* epoch_word = a.b.flags[rank] + size_t(kOneShotMaxBlocks) * kOneShotMaxRanks + blk;
  const uint32_t epoch = *epoch_word + 1u;
  const size_t half = (epoch & 1u) ? a.b.half_bytes : 0;

  // 1. Publish this block's part of the input in this rank's exchange buffer.
  const int4* in = static_cast<const int4*>(a.in[slot]);
  int4* mine = reinterpret_cast<int4*>(static_cast<char*>(a.b.data[rank]) + half);
  for (size_t v = v0 + threadIdx.x; v < v1; v += kThreads) mine[v] = in[v];
  __syncthreads();

  // 2. Tell every rank (thread p signals rank p) that part blk of rank `rank` is ready for epoch e.
  const int p = int(threadIdx.x);
  if (p < n) {
    __threadfence_system();
    st_release_sys(a.b.flags[p] + blk * kOneShotMaxRanks + rank, epoch);
  }
  // 3. Wait for part blk of every rank (thread p watches rank p).
  if (p < n) {
    const uint32_t* f = a.b.flags[rank] + blk * kOneShotMaxRanks + p;
    const unsigned long long start = global_ns();
    while (int32_t(ld_acquire_sys(f) - epoch) < 0) {
      if (global_ns() - start > kTimeoutNs) __trap();  // a peer never came: fail the launch, do not hang
    }
  }
  __syncthreads();

  // 4. Sum part blk over ranks 0..n-1 in order, f32 accumulation, one rounding.
  int4* out = static_cast<int4*>(a.out[slot]);
  for (size_t v = v0 + threadIdx.x; v < v1; v += kThreads) {
    constexpr int kLanes = kBf16 ? 8 : 4;
    float acc[kLanes];
    for (int q = 0; q < n; ++q) {
      const int4 x = __ldcg(reinterpret_cast<const int4*>(static_cast<const char*>(a.b.data[q]) + half) + v);
      const uint32_t w[4] = {uint32_t(x.x), uint32_t(x.y), uint32_t(x.z), uint32_t(x.w)};
#pragma unroll
      for (int l = 0; l < kLanes; ++l) {
        float e;
        if constexpr (kBf16)
          e = __uint_as_float(((w[l / 2] >> (16 * (l % 2))) & 0xffffu) << 16);
        else
          e = __uint_as_float(w[l]);
        acc[l] = q == 0 ? e : acc[l] + e;
      }
    }
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kBf16)
        w[k] = bf16_bits(acc[2 * k]) | (bf16_bits(acc[2 * k + 1]) << 16);
      else
        w[k] = __float_as_uint(acc[k]);
    }
    out[v] = make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
  }
  // Only this block reads its counter; the next call (a later kernel on the stream) sees the new value.
  if (threadIdx.x == 0) *epoch_word = epoch;
}

void check_common(const OneShotBuffers& b, size_t count, bool bf16) {
  KCUDA_REQUIRE(b.n >= 1 && b.n <= kOneShotMaxRanks, "one-shot all-reduce: ranks " + std::to_string(b.n));
  KCUDA_REQUIRE(b.blocks >= 1 && b.blocks <= kOneShotMaxBlocks, "one-shot all-reduce: blocks " + std::to_string(b.blocks));
  const size_t bytes = count * (bf16 ? 2 : 4);
  KCUDA_REQUIRE(bytes % 16 == 0, "one-shot all-reduce: message of " + std::to_string(bytes) +
                                     " bytes is not a multiple of 16");
  KCUDA_REQUIRE(bytes <= b.half_bytes, "one-shot all-reduce: message of " + std::to_string(bytes) +
                                           " bytes exceeds the buffer's " + std::to_string(b.half_bytes));
  for (int p = 0; p < b.n; ++p) {
    KCUDA_REQUIRE(b.data[p] && b.flags[p], "one-shot all-reduce: rank " + std::to_string(p) + " has no buffers");
    KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(b.data[p]) % 16 == 0 && b.half_bytes % 16 == 0,
                  "one-shot all-reduce: exchange buffers must be 16-byte aligned");
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int one_shot_blocks(size_t bytes) {
  return int(std::clamp<size_t>((bytes + 16383) / 16384, 4, size_t(kOneShotMaxBlocks)));
}

void one_shot_all_reduce(const OneShotBuffers& b, int rank, const void* in, void* out, size_t count, bool bf16,
                         cudaStream_t stream) {
  check_common(b, count, bf16);
  KCUDA_REQUIRE(rank >= 0 && rank < b.n, "one-shot all-reduce: rank " + std::to_string(rank));
  KCUDA_REQUIRE(aligned16(in) && aligned16(out), "one-shot all-reduce: in/out must be 16-byte aligned");
  if (count == 0) return;
  Args a{};
  a.b = b;
  a.in[0] = in;
  a.out[0] = out;
  a.rank = rank;
  a.vectors = count * (bf16 ? 2 : 4) / 16;
  const dim3 grid(unsigned(b.blocks), 1);
  if (bf16)
    one_shot_kernel<true><<<grid, kThreads, 0, stream>>>(a);
  else
    one_shot_kernel<false><<<grid, kThreads, 0, stream>>>(a);
  KCUDA_CHECK_LAUNCH();
}

void one_shot_all_reduce_emulated(const OneShotBuffers& b, const void* const* in, void* const* out, size_t count,
                                  bool bf16, cudaStream_t stream) {
  check_common(b, count, bf16);
  if (count == 0) return;
  Args a{};
  a.b = b;
  for (int p = 0; p < b.n; ++p) {
    KCUDA_REQUIRE(aligned16(in[p]) && aligned16(out[p]), "one-shot all-reduce: in/out must be 16-byte aligned");
    a.in[p] = in[p];
    a.out[p] = out[p];
  }
  a.rank = -1;
  a.vectors = count * (bf16 ? 2 : 4) / 16;
  // Every block of every emulated rank must be resident at once (they wait on each other): a
  // cooperative launch guarantees it or fails.
  int device = 0, sms = 0, per_sm = 0;
  KCUDA_CHECK(cudaGetDevice(&device));
  KCUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const void* fn = bf16 ? reinterpret_cast<const void*>(&one_shot_kernel<true>)
                        : reinterpret_cast<const void*>(&one_shot_kernel<false>);
  KCUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, 0));
  KCUDA_REQUIRE(b.n * b.blocks <= sms * per_sm, "one-shot emulation: " + std::to_string(b.n * b.blocks) +
                                                   " blocks cannot be resident at once");
  const dim3 grid(unsigned(b.blocks), unsigned(b.n));
  void* params[] = {&a};
  KCUDA_CHECK(cudaLaunchCooperativeKernel(fn, grid, dim3(kThreads), params, 0, stream));
}

}  // namespace kestrel::cuda
