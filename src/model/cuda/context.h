// What every piece of the GPU forward gets: the config, the model's stream and cuBLASLt handle, step
// scratch, the graph recorder, the instruments, the decode switches (linear.h) and the skinny GEMM's
// split-K workspace. One Context per CudaModel, alive as long as it: the
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
#include "kernels/cuda/gemm_skinny.h"
#include "loader/config.h"
#include "model/cuda/graphs.h"
#include "model/cuda/instruments.h"
#include "model/cuda/linear.h"

namespace kestrel::parallel {
class Comm;
}

namespace kestrel::model::gpu {

// This model's place in a tensor-parallel group (tp.cpp; docs/parallel.md §3): the config above holds the
// rank's head counts (model::rank_config), the weights are the rank's shard, and the sublayer ends call
// the collectives of tp.cpp. comm == nullptr: one rank, every helper is the identity.
struct TpDev {
  parallel::Comm* comm = nullptr;
  int size = 1, rank = 0;
};

struct Context {
  const TextConfig& c;
  cuda::CachingAllocator& alloc;
  cuda::GemmLt& lt;
  cudaStream_t stream;
  GraphRecorder graph;
  OpTimer timer;
  Captures caps;
  DecodeOptions opt;
  bool fp8 = false;              // --quantization ptpc-fp8: the dense projections are FP8 (weights.h)
  cuda::SkinnyWorkspace skinny;  // the skinny GEMM's split-K scratch (owned by the model)
  std::vector<void*> scratch;
  TpDev tp;

  bool split() const { return tp.size > 1; }
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
  // Fused decode kernels apply (DecodeOptions::fuse) and the op-timing / debug-capture instruments, which
  // need the intermediate tensors, are off.
  bool fused() const { return opt.fuse && !caps.on; }
  // An op-timing mark (eager forwards only: graphs hold no events).
  void mark(const char* name) {
    if (timer.on && graph.mode == GraphRecorder::Mode::eager) timer.mark(name, stream);
  }
  void island(const BatchStep& s, Island f) { graph.island(s, std::move(f), stream); }
};

}  // namespace kestrel::model::gpu
