// CUDA-graph buckets: capture, replay, and the padded static inputs (see graphs.h).
#include "model/cuda/graphs.h"

#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "model/cuda/batch.h"
#include "model/cuda/cache.h"
#include "model/cuda/context.h"

namespace kestrel::model::gpu {

void GraphBuckets::release(cuda::CachingAllocator& a) {
  for (auto& [b, g] : by_size) {
    for (cudaGraphExec_t e : g.segments) cudaGraphExecDestroy(e);
    for (void* p : g.kept) a.free(p);
    a.free(g.meta), a.free(g.logits);
  }
  by_size.clear();
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
}  // namespace

int64_t attn_bound(int64_t max_context) {
  int64_t b = 512;
  while (b < max_context) b *= 2;
  return b;
}

bool whole_graph_step(const Context& x, const BatchStep& s) {
  return x.opt.graph_attn && bucket_for(s.n) * attn_bound(s.max_S) <= kFullGraphMaxKeys;
}

const float* run_graph_step(Context& x, CudaCache& cc, BatchStep& s, const BatchInputs& in, const StepBody& body) {
  const int64_t V = x.c.vocab_size;
  const int64_t B = bucket_for(s.n);
  const int64_t bound = attn_bound(s.max_S);
  const bool whole = whole_graph_step(x, s);
  GraphBucket& g = cc.graphs.by_size[{B, whole ? bound : 0}];
  const int64_t stride = whole ? (bound + cc.P - 1) / cc.P : 0;
  if (!g.meta) {
    g.B = B, g.bound = whole ? bound : 0, g.bt_stride = stride;
    g.meta = static_cast<int32_t*>(x.alloc.alloc(size_t(5 * B + 1 + (whole ? B * (stride + 3) : 0)) * 4));
    g.logits = static_cast<float*>(x.alloc.alloc(size_t(B * V) * 4));
  }
  // The static inputs, padded to B rows: token 0, an empty KDA range, the hidden dummy slot and page row.
  const int32_t dummy_slot = cc.num_slots, dummy_row = int32_t(int64_t(cc.num_pages) * cc.P);
  std::vector<int32_t> meta;  // ids [B] | cu [B+1] | slots [B] | pool rows [B] | logits rows [B]
  for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? in.ids[size_t(b)] : 0);
  for (int64_t b = 0; b <= B; ++b) meta.push_back(int32_t(std::min(b, s.n)));
  for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? in.slots[size_t(b)] : dummy_slot);
  for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? in.pool_rows[size_t(b)] : dummy_row);
  for (int64_t b = 0; b < B; ++b) meta.push_back(int32_t(b));
  if (whole) {
    // Context inputs at the bucket's fixed stride: dec lens [B] | tables [B, stride] | row lens [B] | row seq [B].
    // Padded rows: one key, their own row 0 of the hidden page.
    for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? in.dec_lens[size_t(b)] : 1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < stride; ++j)
        meta.push_back(b < s.n ? (j < s.bt_stride ? in.tables[size_t(b * s.bt_stride + j)] : 0) : cc.num_pages);
    for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? in.row_lens[size_t(b)] : 1);
    for (int64_t b = 0; b < B; ++b) meta.push_back(int32_t(b));
  }
  KCUDA_CHECK(cudaMemcpyAsync(g.meta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, x.stream));
  s.T = s.n = s.nd = B;
  s.d_cu = g.meta + B;
  s.d_slots = s.d_cu + B + 1;
  s.d_pool_rows = s.d_slots + B;
  if (whole) {
    s.attn_padded = true;
    s.max_S = s.max_dec_S = bound;
    s.d_dec_lens = s.d_pool_rows + 2 * B;
    s.d_tables = s.d_dec_lens + B;
    s.bt_stride = stride;
    s.d_row_lens = s.d_tables + B * stride;
    s.d_row_req = s.d_row_lens + B;
  }
  GraphRecorder& r = x.graph;
  if (g.segments.empty()) {
    r.mode = GraphRecorder::Mode::capture;
    r.bucket = &g;
    r.whole = whole;
    try {
      r.begin_segment(x.stream);
      body(g.meta, s.d_pool_rows + B, B, g.logits);
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
  return g.logits;
}

}  // namespace kestrel::model::gpu
