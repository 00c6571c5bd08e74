// What a kernel boundary costs on this GPU, against a grid-wide barrier inside one resident kernel: the number
// that decides whether the batch-1 decode step (issue #14: ~50 kernels a step, most of the ~250 µs above its
// floor spent in chains of small dependent kernels, bench/RESULTS.md session 32) should become a persistent
// kernel. Every variant runs the same chain of N dependent phases: in phase i, thread 0 of CTA c reads what CTA
// (c + 1) mod G wrote in phase i − 1 (so the value crosses SMs, through L2) and writes it plus one; the last
// phase's values are checked (N for every CTA).
//   plain       one kernel a phase, ordinary stream order
//   pdl         one kernel a phase, programmatic dependent launch (launch.h): each triggers its dependents at
//               once and waits (griddepcontrol) before reading — how the decode step's kernels are launched
//   persistent  one kernel of G resident CTAs, phases separated by a grid barrier (an arrival counter bumped
//               with release semantics, polled with acquire loads by thread 0 of every CTA, then __syncthreads)
// The chains are captured in CUDA graphs (as the decode step is) and replayed; µs a phase = replay time / N.
//
//   bench_sync [--phases N] [--reps R]      (packed by bench/gpu/run.sh pack; there: .gpu-carry/bench_sync)
//
// Measured (H200, session 32, bench/RESULTS.md): PDL 0.71 / 0.85 / 0.90 / 0.95 µs a phase at 1 / 8 / 132 / 264
// CTAs, plain launches 0.93–1.21, the grid barrier 0.69 / 0.87 / 1.17 / 1.49 — a persistent kernel saves nothing
// per boundary over PDL at the decode step's grid sizes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "graph_replay.h"

namespace kestrel::bench {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_acquire_u(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One phase: buf i32 [N, G].
__global__ void __launch_bounds__(kThreads) phase_kernel(int* buf, int i, int G) {
  cuda::dev::pdl_trigger();
  cuda::dev::pdl_wait();  // a no-op without a programmatic dependency (the plain chain)
  if (threadIdx.x == 0) {
    const int v = i == 0 ? 0 : __ldcg(buf + int64_t(i - 1) * G + (blockIdx.x + 1) % G);
    buf[int64_t(i) * G + blockIdx.x] = v + 1;
  }
}

// All N phases in one launch of G co-resident CTAs; bar u32 [1] zero at launch.
__global__ void __launch_bounds__(kThreads) persistent_kernel(int* buf, unsigned* bar, int N, int G) {
  for (int i = 0; i < N; ++i) {
    if (threadIdx.x == 0) {
      const int v = i == 0 ? 0 : ld_acquire(buf + int64_t(i - 1) * G + (blockIdx.x + 1) % G);
      buf[int64_t(i) * G + blockIdx.x] = v + 1;
      add_release(bar, 1u);  // orders the write above before the arrival
      const unsigned target = unsigned(i + 1) * unsigned(G);
      while (ld_acquire_u(bar) < target) {
      }
    }
    __syncthreads();
  }
}

enum class Kind { plain, pdl, persistent };
const char* name(Kind k) { return k == Kind::plain ? "plain" : k == Kind::pdl ? "pdl" : "persistent"; }

// µs a phase (median of `reps` graph replays), and whether every CTA's last value is N.
struct Res {
  double us_phase;
  bool ok;
};
Res run(Kind kind, int G, int N, int reps, cudaStream_t s) {
  int* buf = nullptr;
  unsigned* bar = nullptr;
  KCUDA_CHECK(cudaMalloc(&buf, size_t(N) * G * 4));
  KCUDA_CHECK(cudaMalloc(&bar, 4));
  KCUDA_CHECK(cudaMemsetAsync(buf, 0, size_t(N) * G * 4, s));
  cudaGraph_t graph;
  KCUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  if (kind == Kind::persistent) {
    KCUDA_CHECK(cudaMemsetAsync(bar, 0, 4, s));
    persistent_kernel<<<unsigned(G), kThreads, 0, s>>>(buf, bar, N, G);
    KCUDA_CHECK(cudaGetLastError());
  } else {
    KCUDA_CHECK(cudaMemsetAsync(bar, 0, 4, s));  // the same first node as the persistent graph
    for (int i = 0; i < N; ++i) {
      if (kind == Kind::pdl) {
        cuda::launch_pdl(phase_kernel, dim3(unsigned(G)), dim3(kThreads), 0, s, buf, i, G);
      } else {
        phase_kernel<<<unsigned(G), kThreads, 0, s>>>(buf, i, G);
        KCUDA_CHECK(cudaGetLastError());
      }
    }
  }
  KCUDA_CHECK(cudaStreamEndCapture(s, &graph));
  const double us = median_replay_us(graph, s, reps) / N;
  std::vector<int> last(static_cast<size_t>(G));
  KCUDA_CHECK(cudaMemcpy(last.data(), buf + int64_t(N - 1) * G, size_t(G) * 4, cudaMemcpyDeviceToHost));
  const bool ok = std::all_of(last.begin(), last.end(), [&](int v) { return v == N; });
  KCUDA_CHECK(cudaFree(buf));
  KCUDA_CHECK(cudaFree(bar));
  return {us, ok};
}

}  // namespace
}  // namespace kestrel::bench

int main(int argc, char** argv) {
  using namespace kestrel::bench;
  int N = 64, reps = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--phases" && i + 1 < argc) N = std::max(2, std::atoi(argv[++i]));
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: bench_sync [--phases N] [--reps R]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  KCUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  KCUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // (printf, not fmt: fmt's compile-time format checks do not build under nvcc here)
  std::printf("## A kernel boundary vs a grid barrier — %s (%d SMs), %d dependent phases, median of %d graph replays\n\n",
              prop.name, prop.multiProcessorCount, N, reps);
  std::printf("| CTAs | plain µs a phase | pdl | persistent (grid barrier) |\n|---|---|---|---|\n");
  bool all_ok = true;
  const int sms = prop.multiProcessorCount;
  for (int G : {1, 8, sms, 2 * sms}) {
    std::printf("| %d |", G);
    for (Kind k : {Kind::plain, Kind::pdl, Kind::persistent}) {
      const Res r = run(k, G, N, reps, s);
      all_ok &= r.ok;
      std::printf(" %.2f%s |", r.us_phase, r.ok ? "" : " (WRONG)");
      std::fprintf(stderr, "SYNC %s_us_g%d %.3f\n", name(k), G, r.us_phase);
    }
    std::printf("\n");
  }
  KCUDA_CHECK(cudaStreamDestroy(s));
  if (!all_ok) {
    std::printf("a chain's last values were wrong\n");
    return 1;
  }
  return 0;
}
