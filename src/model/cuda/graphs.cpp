// CUDA-graph buckets of decode and verify steps: capture, replay, and the padded static inputs (see graphs.h).
#include "model/cuda/graphs.h"

#include <algorithm>

#include "core/check.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rows.h"
#include "model/cuda/batch.h"
#include "model/cuda/cache.h"
#include "model/cuda/context.h"

namespace kestrel::model::gpu {

namespace {
void free_bucket(GraphBucket& g, cuda::CachingAllocator& a) {
  for (cudaGraphExec_t e : g.segments) cudaGraphExecDestroy(e);
  for (void* p : g.kept) a.free(p);
  a.free(g.meta), a.free(g.logits), a.free(g.taps);
}
}  // namespace

void GraphBuckets::release(cuda::CachingAllocator& a) {
  for (auto& [b, g] : by_size) free_bucket(g, a);
  by_size.clear();
}

void GraphBuckets::release_verify(cuda::CachingAllocator& a) {
  for (auto it = by_size.begin(); it != by_size.end();) {
    if (!it->second.verify) {
      ++it;
      continue;
    }
    free_bucket(it->second, a);
    it = by_size.erase(it);
  }
}

void GraphRecorder::begin_segment(cudaStream_t stream) {
  KCUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
}

void GraphRecorder::end_segment(cudaStream_t stream) {
  cudaGraph_t g = nullptr;
  KCUDA_CHECK(cudaStreamEndCapture(stream, &g));
  cudaGraphExec_t e = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&e, g, 0);
  cudaGraphDestroy(g);
  KCUDA_CHECK(err);
  bucket->segments.push_back(e);
  KCUDA_CHECK(cudaGraphLaunch(e, stream));  // capturing did not run it
}

void GraphRecorder::island(const BatchStep& s, Island f, cudaStream_t stream) {
  if (mode != Mode::capture || whole) return f(s);
  end_segment(stream);
  f(s);
  bucket->islands.push_back(std::move(f));
  begin_segment(stream);
}

namespace {
int64_t bucket_for(int64_t n) {
  int64_t b = 1;
  while (b < n) b *= 2;
  return b;
}
// Rows per sequence of a graph step: 1 + γ for a verify step, 1 for a decode step.
int64_t rows_per_seq(const BatchStep& s) { return s.nv > 0 ? s.len[0] : 1; }
// The bucket's sequence count: decodes pad to a power of two; verify steps keep their own count (the same
// launches as the eager step) unless KESTREL_SPEC_GRAPH_PAD=1 and the padded rows stay in the skinny GEMM.
int64_t graph_batch(const Context& x, const BatchStep& s) {
  if (s.nv == 0) return bucket_for(s.n);
  const int64_t b = bucket_for(s.n), R = rows_per_seq(s);
  return x.opt.spec_graph_pad && x.opt.skinny && b * R <= x.opt.skinny_max_t ? b : s.n;
}
}  // namespace

int64_t attn_bound(int64_t max_context) {
  int64_t b = 512;
  while (b < max_context) b *= 2;
  return b;
}

bool whole_graph_step(const Context& x, const BatchStep& s) {
  return x.opt.graph_attn && graph_batch(x, s) * rows_per_seq(s) * attn_bound(s.max_S) <= kFullGraphMaxKeys;
}

bool verify_graph_step(const Context& x, const BatchStep& s, bool kda_state_f16) {
  if (!x.opt.spec_graphs || s.nv == 0 || s.nv != s.n || s.nd != 0 || !x.opt.spec_trace_kernels || kda_state_f16)
    return false;
  for (int64_t b = 0; b < s.n; ++b)
    if (s.len[size_t(b)] != s.len[0]) return false;
  return s.len[0] >= 2 && s.n <= kMaxGraphBatch && whole_graph_step(x, s);
}

GraphOut run_graph_step(Context& x, CudaCache& cc, BatchStep& s, const BatchInputs& in,
                        std::span<const int> tap_layers, int64_t tap_width, const StepBody& body,
                        const int32_t* prev_ids) {
  const int64_t V = x.c.vocab_size;
  const bool verify = s.nv > 0;
  KCHECK(verify ? s.nv == s.n && s.nd == 0 : s.nd == s.n, "run_graph_step: a step of {} decodes and {} verify "
         "sequences of {} (one kind only)", s.nd, s.nv, s.n);
  const int64_t R = rows_per_seq(s), B = graph_batch(x, s), T = B * R, n = s.n, nR = n * R;
  KCHECK(s.T == nR, "run_graph_step: {} rows for {} sequences of {}", s.T, n, R);
  const int64_t bound = attn_bound(s.max_S);
  const bool whole = whole_graph_step(x, s);
  KCHECK(whole || !verify, "run_graph_step: verify steps run as whole-step graphs only");
  GraphBucket& g = cc.graphs.by_size[{B, R, whole ? bound : 0}];
  const int64_t stride = whole ? (bound + cc.P - 1) / cc.P : 0;
  const std::vector<int> layers(tap_layers.begin(), tap_layers.end());
  if (!g.segments.empty() && g.tap_layers != layers) {
    // The graphs copy other taps (set_taps changed): capture again.
    for (cudaGraphExec_t e : g.segments) cudaGraphExecDestroy(e);
    for (void* p : g.kept) x.alloc.free(p);
    g.segments.clear(), g.islands.clear(), g.kept.clear();
  }
  if (!g.meta) {
    g.B = B, g.R = R, g.verify = verify, g.bound = whole ? bound : 0, g.bt_stride = stride;
    g.meta = static_cast<int32_t*>(x.alloc.alloc(size_t(3 * T + 2 * B + 1 + (whole ? B * (stride + 1) + 2 * T : 0)) * 4));
    g.logits = static_cast<float*>(x.alloc.alloc(size_t(T * V) * 4));
  }
  if (g.segments.empty()) {
    x.alloc.free(g.taps);
    g.taps = tap_width > 0 ? static_cast<uint16_t*>(x.alloc.alloc(size_t(T * tap_width) * 2)) : nullptr;
    g.tap_layers = layers;
  }
  // The static inputs, padded to B sequences of R rows: token 0, an empty KDA range, the hidden dummy slot and
  // page row.
  const int32_t dummy_slot = cc.num_slots, dummy_row = int32_t(int64_t(cc.num_pages) * cc.P);
  std::vector<int32_t> meta;  // ids [T] | cu [B+1] | slots [B] | pool rows [T] | logits rows [T]
  meta.reserve(size_t(3 * T + 2 * B + 1 + (whole ? B * (stride + 1) + 2 * T : 0)));
  for (int64_t r = 0; r < T; ++r) meta.push_back(r < nR ? in.ids[size_t(r)] : 0);
  for (int64_t b = 0; b <= B; ++b) meta.push_back(int32_t(std::min(b, n) * R));
  for (int64_t b = 0; b < B; ++b) meta.push_back(b < n ? in.slots[size_t(b)] : dummy_slot);
  for (int64_t r = 0; r < T; ++r) meta.push_back(r < nR ? in.pool_rows[size_t(r)] : dummy_row);
  for (int64_t r = 0; r < T; ++r) meta.push_back(int32_t(r));
  if (whole) {
    // Context inputs at the bucket's fixed stride: dec lens [B] | tables [B, stride] | row lens [T] | row seq [T].
    // Padded rows: one key, their own row 0 of the hidden page. Verify steps have no decode lengths (the
    // entries are never read).
    for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.nd ? in.dec_lens[size_t(b)] : 1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < stride; ++j)
        meta.push_back(b < n ? (j < s.bt_stride ? in.tables[size_t(b * s.bt_stride + j)] : 0) : cc.num_pages);
    for (int64_t r = 0; r < T; ++r) meta.push_back(r < nR ? in.row_lens[size_t(r)] : 1);
    for (int64_t r = 0; r < T; ++r) meta.push_back(int32_t(r / R));
  }
  KCUDA_CHECK(cudaMemcpyAsync(g.meta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, x.stream));
  // Run-ahead rows: their ids from the previous step's sampling, on the device (outside the graph: the source
  // buffer alternates between two slots, ahead.h).
  if (in.pending) cuda::resolve_pending_ids(g.meta, nR, prev_ids, x.stream);
  s.T = T, s.n = B;
  if (verify)
    s.nv = B, s.nvr = T;
  else
    s.nd = B;
  s.d_cu = g.meta + T;
  s.d_slots = s.d_cu + B + 1;
  s.d_pool_rows = s.d_slots + B;
  const int32_t* d_lrows = s.d_pool_rows + T;
  if (whole) {
    s.attn_padded = true;
    s.max_S = bound;
    if (verify)
      s.max_ver_S = bound;
    else
      s.max_dec_S = bound;
    s.d_dec_lens = d_lrows + T;
    s.d_tables = s.d_dec_lens + B;
    s.bt_stride = stride;
    s.d_row_lens = s.d_tables + B * stride;
    s.d_row_req = s.d_row_lens + T;
  }
  GraphRecorder& r = x.graph;
  if (g.segments.empty()) {
    r.mode = GraphRecorder::Mode::capture;
    r.bucket = &g;
    r.whole = whole;
    try {
      r.begin_segment(x.stream);
      body(g.meta, d_lrows, T, g.logits, g.taps);
      r.end_segment(x.stream);
    } catch (...) {
      cudaGraph_t junk = nullptr;
      if (cudaStreamEndCapture(x.stream, &junk) == cudaSuccess && junk) cudaGraphDestroy(junk);
      for (cudaGraphExec_t e : g.segments) cudaGraphExecDestroy(e);
      g.segments.clear(), g.islands.clear();
      r.mode = GraphRecorder::Mode::eager;
      r.whole = false;
      throw;
    }
    r.mode = GraphRecorder::Mode::eager;
    r.whole = false;
  } else {
    r.mode = GraphRecorder::Mode::replay;
    for (size_t k = 0; k < g.segments.size(); ++k) {
      KCUDA_CHECK(cudaGraphLaunch(g.segments[k], x.stream));
      if (k < g.islands.size()) g.islands[k](s);
    }
    r.mode = GraphRecorder::Mode::eager;
  }
  return {g.logits, g.taps};
}

}  // namespace kestrel::model::gpu
