// CUDA graphs for decode and DSpark verify steps (CudaModel::enable_cuda_graphs). Two kinds of step:
//  - decode: a forward_batch whose sequences are all single tokens wanting their last logits is padded to a
//    bucket B (1, 2, 4, ..., 512; larger batches, and every step while op timing or captures are on, run
//    eagerly);
//  - verify (MODEL.md §5, docs/speculative.md): a forward_batch whose sequences are all DSpark verify
//    sequences of one length R = 1 + γ (every row's logits, the KDA state traced per position) runs through a
//    bucket of B sequences — exactly its own count by default, so replay runs the eager step's very launches
//    with the same row counts (bit-identical by construction); with KESTREL_SPEC_GRAPH_PAD=1, padded to a
//    power of two while the padded rows stay within the skinny GEMM (linear.h: row invariant there). Whole-step
//    form only, the traced KDA kernels only (KESTREL_SPEC_TRACE=launches and FP16 states stay eager), no
//    decodes mixed in (a mixed step runs eagerly). KESTREL_SPEC_GRAPHS=0: every step with taps or verify
//    sequences eager, as before.
// A bucket is keyed by (B, R, bound) (R = 1 for decodes) and, the first time it is seen on a cache, run while
// being captured. Two forms:
//  - whole step (the default): the attention is captured too, sized by a context bound — the longest
//    context rounded up to a power of two (≥ 512, mla.cpp attn_bound; eager steps plan their attention
//    with the same bound, so replay stays bit-identical to eager). A bucket holds ONE graph: a step is one
//    graph launch. Every replay rewrites the bucket's inputs, static (token ids, cu_seqlens, slots, pool
//    rows, logits rows) and context (decode lengths, block tables at a stride of bound/P pages, per-row
//    lengths and sequences); a step whose bound has no bucket yet captures one. Padded rows see one key:
//    their own latent row in the hidden page.
//  - piecewise (decodes only: KESTREL_GRAPH_ATTN=0, or B·bound beyond kFullGraphMaxKeys: the indexer's
//    workspace would be kept per bucket): every launch between the attention islands becomes one graph
//    segment, and the islands (the indexer and the absorbed decode, whose shapes follow the contexts) stay
//    host code, recorded as closures and run eagerly between the segments on replay; keyed by (B, 1, 0).
// Padded sequences use token 0, an empty KDA range, and the cache's hidden dummy slot and page row (cache.h),
// so they never touch a real request's state; their outputs are dropped.
// What a verify bucket's graph writes at fixed addresses: its own logits f32 [B·R, V] and taps bf16 [B·R, n·D]
// (DSpark taps, CudaModel::set_taps: a bucket is recaptured when the tap layers change) and the cache's KDA
// trace (CudaCache::trace_*): when the trace is reallocated (a larger verify step), every verify bucket of
// the cache is dropped first (release_verify) and recaptured on its next use.
//
// Every scratch buffer allocated while capturing is baked into the graphs, so the bucket keeps it for
// good (Context::tmp); buckets belong to the cache whose pools they were captured against.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <tuple>
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

// One captured bucket: the graph segments, the islands between them, and the fixed-address buffers the
// graphs read and write.
struct GraphBucket {
  int64_t B = 0;
  int64_t R = 1;             // rows per sequence: 1 (decode) or 1 + γ (verify)
  bool verify = false;       // DSpark verify sequences (reads and writes the cache's KDA trace)
  int64_t bound = 0;         // whole-step graphs: the context bound the attention was captured for (0: piecewise)
  int64_t bt_stride = 0;     // whole-step graphs: block-table stride (bound / P pages)
  // device i32, T = B·R rows: ids [T] | cu [B+1] | slots [B] | pool rows [T] | logits rows [T], then (whole
  // step) decode lengths [B] | block tables [B, bt_stride] | row lengths [T] | row sequences [T]
  int32_t* meta = nullptr;
  float* logits = nullptr;   // f32 [T, V]
  uint16_t* taps = nullptr;  // bf16 [T, n·D]: the DSpark taps (null without taps)
  std::vector<int> tap_layers;  // the tap layers the graphs copy (set_taps at capture)
  std::vector<cudaGraphExec_t> segments;
  std::vector<Island> islands;  // islands[k] runs after segments[k]
  std::vector<void*> kept;      // every buffer allocated while capturing (addresses baked into the graphs)
};

struct GraphBuckets {
  std::map<std::tuple<int64_t, int64_t, int64_t>, GraphBucket> by_size;  // by (B, R, bound)
  void release(cuda::CachingAllocator& a);  // destroys the graphs, frees the buffers
  void release_verify(cuda::CachingAllocator& a);  // the same for the verify buckets only (the trace moved)
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

// The layer stack of one step: token ids, logits rows (device i32), their count, the f32 [nr, V] output and
// the taps' bf16 [T, n·D] output (null: no taps).
using StepBody = std::function<void(const int32_t* d_ids, const int32_t* d_lrows, int64_t nr, float* logits,
                                    uint16_t* taps)>;

// The context bound of a step's attention: max_context rounded up to a power of two, at least 512. The
// attention is planned for it in every step (eager or graph), so a whole-step graph replays bit-identically.
int64_t attn_bound(int64_t max_context);

// Whether the pure-decode or pure-verify step `s` runs as a whole-step graph (attention captured) rather than
// piecewise (a verify step that does not is not run through a graph at all).
bool whole_graph_step(const Context& x, const BatchStep& s);

// Whether `s` is a pure-verify step a verify bucket can take: every sequence a verify sequence of one length
// (≥ 2), the traced KDA kernels on an FP32 state, the whole-step form.
bool verify_graph_step(const Context& x, const BatchStep& s, bool kda_state_f16);

// The fixed-address outputs of a graph step.
struct GraphOut {
  const float* logits = nullptr;  // f32 [B·R, V]: rows < s.n_real·R are the real sequences'
  const uint16_t* taps = nullptr;  // bf16 [B·R, n·D] (null without taps)
};

// Runs the pure-decode or pure-verify step `s` (s.n ≤ kMaxGraphBatch sequences) through the bucket of `cc`
// for its size: rewrites the bucket's static inputs from `in`, pads `s` to the bucket (s.n = B, s.T = B·R,
// s.nd = B or s.nv = B; s.n_real keeps the real count), then captures (first time, or the tap layers
// changed) or replays. `tap_layers`, `tap_width` (n·D): the taps the body copies (none: empty, 0). With
// in.pending, the run-ahead rows' ids are resolved from `prev_ids` (the latest sample_ahead's device ids) in the
// bucket after its inputs are rewritten, before the graph runs.
GraphOut run_graph_step(Context& x, CudaCache& cc, BatchStep& s, const BatchInputs& in,
                        std::span<const int> tap_layers, int64_t tap_width, const StepBody& body,
                        const int32_t* prev_ids = nullptr);

}  // namespace kestrel::model::gpu
