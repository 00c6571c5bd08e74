// Timing a captured CUDA graph for the standalone .cu benchmarks (bench_sync, bench_overlap; printf-only, no fmt):
// 3 warm-up replays, then the median of `reps` replays, each bracketed by events on the graph's stream. The graph
// and its instance are destroyed before returning.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace kestrel::bench {

// The median replay of `graph` on stream s, µs.
inline double median_replay_us(cudaGraph_t graph, cudaStream_t s, int reps) {
  cudaGraphExec_t exec;
  KCUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  KCUDA_CHECK(cudaEventCreate(&e0));
  KCUDA_CHECK(cudaEventCreate(&e1));
  for (int w = 0; w < 3; ++w) KCUDA_CHECK(cudaGraphLaunch(exec, s));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    KCUDA_CHECK(cudaEventRecord(e0, s));
    KCUDA_CHECK(cudaGraphLaunch(exec, s));
    KCUDA_CHECK(cudaEventRecord(e1, s));
    KCUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(double(ms) * 1e3);
  }
  std::sort(t.begin(), t.end());
  KCUDA_CHECK(cudaEventDestroy(e0));
  KCUDA_CHECK(cudaEventDestroy(e1));
  KCUDA_CHECK(cudaGraphExecDestroy(exec));
  KCUDA_CHECK(cudaGraphDestroy(graph));
  return t[t.size() / 2];
}

}  // namespace kestrel::bench
