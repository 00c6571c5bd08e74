// CUDA graphs for decode steps (CudaModel::enable_cuda_graphs): a forward_batch whose sequences are all
// single tokens wanting their last logits is padded to a bucket B (1, 2, 4, ..., 512; larger batches, and
// every step while op timing or captures are on, run eagerly) and, the first time a bucket is seen on a
// cache, run while being captured. Two forms:
//  - whole step (the default): the attention is captured too, sized by a context bound — the longest
//    context rounded up to a power of two (≥ 512, mla.cpp attn_bound; eager steps plan their attention
//    with the same bound, so replay stays bit-identical to eager). A bucket is keyed by (B, bound) and
//    holds ONE graph: a pure decode step is one graph launch. Every replay rewrites the bucket's inputs,
//    static (token ids, cu_seqlens, slots, pool rows, logits rows) and context (decode lengths, block
//    tables at a stride of bound/P pages, per-row lengths and sequences); a step whose bound has no bucket
//    yet captures one. Padded rows see one key: their own latent row in the hidden page.
//  - piecewise (KESTREL_GRAPH_ATTN=0, or B·bound beyond kFullGraphMaxKeys: the indexer's workspace would
//    be kept per bucket): every launch between the attention islands becomes one graph segment, and the
//    islands (the indexer and the absorbed decode, whose shapes follow the contexts) stay host code,
//    recorded as closures and run eagerly between the segments on replay; keyed by (B, 0).
// Padded rows use token 0, an empty KDA range, and the cache's hidden dummy slot and page row (cache.h), so
// they never touch a real request's state; their outputs are dropped.
//
// Every scratch buffer allocated while capturing is baked into the graphs, so the bucket keeps it for
// good (Context::tmp); buckets belong to the cache whose pools they were captured against.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
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
  int64_t bound = 0;         // whole-step graphs: the context bound the attention was captured for (0: piecewise)
  int64_t bt_stride = 0;     // whole-step graphs: block-table stride (bound / P pages)
  // device i32: ids [B] | cu [B+1] | slots [B] | pool rows [B] | logits rows [B], then (whole step)
  // decode lengths [B] | block tables [B, bt_stride] | row lengths [B] | row sequences [B]
  int32_t* meta = nullptr;
  float* logits = nullptr;   // f32 [B, V]
  std::vector<cudaGraphExec_t> segments;
  std::vector<Island> islands;  // islands[k] runs after segments[k]
  std::vector<void*> kept;      // every buffer allocated while capturing (addresses baked into the graphs)
};

struct GraphBuckets {
  std::map<std::pair<int64_t, int64_t>, GraphBucket> by_size;  // by (B, bound)
  void release(cuda::CachingAllocator& a);  // destroys the graphs, frees the buffers
};

// The graph state of the running forward: eager, capturing a bucket, or replaying one.
struct GraphRecorder {
  enum class Mode { eager, capture, replay } mode = Mode::eager;
  GraphBucket* bucket = nullptr;  // while capturing
  bool whole = false;             // capturing a whole-step graph: islands are captured inline

  void begin_segment(cudaStream_t stream);
  void end_segment(cudaStream_t stream);  // instantiates the segment and launches it (capture does not run it)
  // Runs `f` now; while capturing, also closes the current segment before it, records it, and opens the next.
  void island(const BatchStep& s, Island f, cudaStream_t stream);
};

inline constexpr int64_t kMaxGraphBatch = 512;
// Whole-step graphs only while B · bound ≤ this (the indexer's chunk scores, 4·B·bound bytes, are kept).
inline constexpr int64_t kFullGraphMaxKeys = int64_t(1) << 22;

// The layer stack of one step: token ids, logits rows (device i32), their count, and the f32 [nr, V] output.
using StepBody = std::function<void(const int32_t* d_ids, const int32_t* d_lrows, int64_t nr, float* logits)>;

// The context bound of a step's attention: max_context rounded up to a power of two, at least 512. The
// attention is planned for it in every step (eager or graph), so a whole-step graph replays bit-identically.
int64_t attn_bound(int64_t max_context);

// Whether the pure-decode step `s` runs as a whole-step graph (attention captured) rather than piecewise.
bool whole_graph_step(const Context& x, const BatchStep& s);

// Runs the pure-decode step `s` (s.n ≤ kMaxGraphBatch sequences) through the bucket of `cc` for its size:
// rewrites the bucket's static inputs from `in`, pads `s` to the bucket (s.T = s.n = s.nd = B; s.n_real
// keeps the real count), then captures (first time) or replays. Returns the bucket's logits, f32 [B, V]
// (rows < s.n_real are the real sequences').
const float* run_graph_step(Context& x, CudaCache& cc, BatchStep& s, const BatchInputs& in, const StepBody& body);

}  // namespace kestrel::model::gpu
