// CUDA graphs for decode steps (CudaModel::enable_cuda_graphs): a forward_batch whose sequences are all
// single tokens wanting their last logits is padded to a bucket B (1, 2, 4, ..., 512; larger batches, and
// every step while op timing or captures are on, run eagerly) and, the first time a bucket is seen on a cache, run while being captured (piecewise): every
// launch between the attention islands becomes one graph segment, and the islands (context-dependent
// work: the indexer and the absorbed decode, whose shapes follow the contexts) stay host code, recorded
// as closures. Later steps of that bucket rewrite the bucket's static inputs (token ids, cu_seqlens,
// slot ids, pool rows, logits rows) and replay the segments around the islands. Padded rows use token 0,
// an empty KDA range, and the cache's hidden dummy slot and page row (cache.h), so they never touch a
// real request's state; their outputs are dropped.
//
// Every scratch buffer allocated while capturing is baked into the graphs, so the bucket keeps it for
// good (Context::tmp); buckets belong to the cache whose pools they were captured against.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "kernels/cuda/device_alloc.h"

namespace kestrel::model {
struct CudaCache;
}

namespace kestrel::model::gpu {

struct BatchStep;
struct BatchInputs;
struct Context;

using Island = std::function<void(const BatchStep&)>;

// One captured decode bucket: the graph segments, the islands between them, and the fixed-address
// buffers the graphs read and write.
struct GraphBucket {
  int64_t B = 0;
  int32_t* meta = nullptr;   // device i32: ids [B] | cu [B+1] | slots [B] | pool rows [B] | logits rows [B]
  float* logits = nullptr;   // f32 [B, V]
  std::vector<cudaGraphExec_t> segments;
  std::vector<Island> islands;  // islands[k] runs after segments[k]
  std::vector<void*> kept;      // every buffer allocated while capturing (addresses baked into the graphs)
};

struct GraphBuckets {
  std::map<int64_t, GraphBucket> by_size;
  void release(cuda::CachingAllocator& a);  // destroys the graphs, frees the buffers
};

// The graph state of the running forward: eager, capturing a bucket, or replaying one.
struct GraphRecorder {
  enum class Mode { eager, capture, replay } mode = Mode::eager;
  GraphBucket* bucket = nullptr;  // while capturing

  void begin_segment(cudaStream_t stream);
  void end_segment(cudaStream_t stream);  // instantiates the segment and launches it (capture does not run it)
  // Runs `f` now; while capturing, also closes the current segment before it, records it, and opens the next.
  void island(const BatchStep& s, Island f, cudaStream_t stream);
};

inline constexpr int64_t kMaxGraphBatch = 512;

// The layer stack of one step: token ids, logits rows (device i32), their count, and the f32 [nr, V] output.
using StepBody = std::function<void(const int32_t* d_ids, const int32_t* d_lrows, int64_t nr, float* logits)>;

// Runs the pure-decode step `s` (s.n ≤ kMaxGraphBatch sequences) through the bucket of `cc` for its size:
// rewrites the bucket's static inputs from `in`, pads `s` to the bucket (s.T = s.n = s.nd = B; s.n_real
// keeps the real count), then captures (first time) or replays. Returns the bucket's logits, f32 [B, V]
// (rows < s.n_real are the real sequences').
const float* run_graph_step(Context& x, CudaCache& cc, BatchStep& s, const BatchInputs& in, const StepBody& body);

}  // namespace kestrel::model::gpu
