// What every piece of the GPU forward gets: the config, the model's stream and cuBLASLt handle, step
// scratch, the graph recorder and the instruments. One Context per CudaModel, alive as long as it: the
// attention islands recorded into a CUDA-graph bucket hold a reference to it and run again on replay.
//
// Scratch (tmp) comes from the model's caching allocator and is given back at the end of each forward,
// except while capturing a graph bucket: then the bucket keeps it for good (its address is in the graph).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cuda/device_alloc.h"
#include "kernels/cuda/gemm.h"
#include "loader/config.h"
#include "model/cuda/graphs.h"
#include "model/cuda/instruments.h"

namespace kestrel::model::gpu {

struct Context {
  const TextConfig& c;
  cuda::CachingAllocator& alloc;
  cuda::GemmLt& lt;
  cudaStream_t stream;
  GraphRecorder graph;
  OpTimer timer;
  Captures caps;
  std::vector<void*> scratch;

  template <typename T>
  T* tmp(int64_t n) {
    void* p = alloc.alloc(size_t(std::max<int64_t>(n, 1)) * sizeof(T));
    if (graph.mode == GraphRecorder::Mode::capture) graph.bucket->kept.push_back(p);
    else scratch.push_back(p);
    return static_cast<T*>(p);
  }
  void release_scratch() {
    for (void* p : scratch) alloc.free(p);
    scratch.clear();
  }
  // y = bf16(x·Wᵀ) (kernels/cuda/gemm.h).
  void gemm(const uint16_t* x /* bf16 [T, K], row stride ldx */, int64_t ldx, const uint16_t* w /* bf16 [N, K] */,
            uint16_t* y /* bf16 [T, N], row stride ldy */, int64_t ldy, int64_t T, int64_t K, int64_t N) {
    lt.bf16(x, ldx, w, y, ldy, T, K, N, stream);
  }
  // An op-timing mark (eager forwards only: graphs hold no events).
  void mark(const char* name) {
    if (timer.on && graph.mode == GraphRecorder::Mode::eager) timer.mark(name, stream);
  }
  void island(const BatchStep& s, Island f) { graph.island(s, std::move(f), stream); }
};

}  // namespace kestrel::model::gpu
