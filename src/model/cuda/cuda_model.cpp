// The GPU model's façade (see cuda_model.h): owns the allocator, stream, cuBLASLt handle, weights and
// the last step's logits; a step is described (batch.h), run eagerly or through a graph bucket
// (graphs.h) over the layer stack (forward.cpp), and its logits stay on the device for greedy / sample.
#include "model/cuda/cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_alloc.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/rows.h"
#include "kernels/cuda/token_mask.h"
#include "model/cuda/ahead.h"
#include "model/cuda/batch.h"
#include "model/cuda/cache.h"
#include "model/cuda/context.h"
#include "model/cuda/layers.h"
#include "model/cuda/weights.h"
#include "parallel/comm.h"

namespace kestrel::model {

namespace {
struct Stream {  // the model's non-blocking stream
  cudaStream_t s = nullptr;
  Stream() { KCUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};
// Page-locked host memory for the ids a step hands back (greedy, sample): a copy into pageable memory goes
// through the driver's staging buffer, one more host copy on every step's critical path. (Session 33, H200: the
// graph step's host share, 17–24 µs, did not move measurably with it.) The memory is also mapped into the device's
// address space, so the argmax / sampler kernels write the ids straight into it (dev()) instead of a device buffer
// and a copy-engine transfer after them (KESTREL_IDS_MAPPED=0: the device buffer and the copy, for A/B).
struct PinnedIds {
  int32_t* p = nullptr;
  int32_t* d = nullptr;  // p as the device addresses it
  int64_t cap = 0;
  PinnedIds() = default;
  ~PinnedIds() {
    if (p) cudaFreeHost(p);
  }
  PinnedIds(const PinnedIds&) = delete;
  PinnedIds& operator=(const PinnedIds&) = delete;
  int32_t* get(int64_t n) {  // i32 [n], valid until the next get
    if (n > cap) {
      if (p) KCUDA_CHECK(cudaFreeHost(p));
      p = d = nullptr, cap = 0;
      KCUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p), size_t(std::max<int64_t>(n, 64)) * 4, cudaHostAllocMapped));
      cap = std::max<int64_t>(n, 64);
      KCUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d), p, 0));
    }
    return p;
  }
  int32_t* dev() const { return d; }  // after get()
  static bool mapped() {
    static const bool on = [] {
      const char* e = std::getenv("KESTREL_IDS_MAPPED");
      return !(e && e[0] == '0');
    }();
    return on;
  }
};
}  // namespace

struct CudaModel::Impl {
  ModelConfig cfg;
  cuda::CachingAllocator alloc;
  cuda::DeviceArena arena{alloc};
  cuda::GemmLt lt;
  Stream stream;
  gpu::WeightsDev w;
  gpu::Context x;
  bool graphs = false;
  int64_t graph_steps = 0;
  float* logits_dev = nullptr;  // f32 [logits_cap, V]: the eager steps' logits
  int64_t logits_cap = 0, logits_rows = 0;
  const float* logits_cur = nullptr;  // the last step's logits (logits_dev or a graph bucket's), read by
                                      // copy_logits / greedy / sample until the next forward

  // Structured outputs: the device mask table u32 [mask_rows, mask_words] and the entries' rows i32
  // [mask_rows], allocated once for a table shape (fixed addresses).
  uint32_t* mask_dev = nullptr;
  int32_t* mask_idx_dev = nullptr;
  int64_t mask_rows = 0, mask_words = 0;
  // stage_masks: the copies on their own stream while the forward runs, the event the sampler waits for, and
  // what was staged (sample() copies again unless it is handed the same masks).
  Stream mask_stream;
  cudaEvent_t mask_ready = nullptr;
  const uint32_t* staged_table = nullptr;
  int64_t staged_rows = -1, staged_n = -1;
  const int32_t* staged_row_of = nullptr;

  // DSpark taps (set_taps): the layers, the eager steps' taps bf16 [taps_cap, n·D], and the last forward's
  // (taps_dev or a graph bucket's) bf16 [taps_rows, n·D].
  std::vector<int> tap_layers;
  uint16_t* taps_dev = nullptr;
  const uint16_t* taps_cur = nullptr;
  int64_t taps_cap = 0, taps_rows = 0;

  PinnedIds ids_host;  // the last greedy / sample ids on their way to the caller
  void* argmax_ws = nullptr;  // cuda::argmax_rows' split workspace: zeroed once, left zeroed by every call
  gpu::AheadIds ahead;        // run-ahead sampling's ids (sample_ahead, CudaSeq::prev_id)

  int tp_size = 1, tp_rank = 0;
  int64_t vocab_lo = 0, vocab_rows = 0;  // this rank's embedding rows [vocab_lo, vocab_lo + vocab_rows)

  Impl(const ModelConfig& c, const ModelWeights& mw, const CudaModelOptions& o)
      : cfg(c),
        w(gpu::upload_weights(cfg, mw, arena, o.quant == WeightQuant::ptpc_fp8, o.tp_size > 1)),
        x{cfg.text, alloc, lt, stream.s, {}, {}, {}, gpu::DecodeOptions::from_env(), o.quant == WeightQuant::ptpc_fp8,
          {}, {}, {}} {
    // The skinny GEMM's split-K scratch: partials and zeroed counters (every launch leaves them zero).
    x.skinny.part_bytes = cuda::kSkinnyPartBytes;
    x.skinny.part = static_cast<float*>(alloc.alloc(x.skinny.part_bytes));
    x.skinny.n_counters = cuda::kSkinnyCounters;
    x.skinny.counters = static_cast<unsigned*>(alloc.alloc(size_t(x.skinny.n_counters) * 4));
    KCUDA_CHECK(cudaMemsetAsync(x.skinny.counters, 0, size_t(x.skinny.n_counters) * 4, x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
    KCHECK(o.tp_size >= 1 && o.tp_rank >= 0 && o.tp_rank < o.tp_size, "CudaModel: rank {} of TP{}", o.tp_rank,
           o.tp_size);
    tp_size = o.tp_size, tp_rank = o.tp_rank;
    vocab_rows = mw.embed.shape[0];
    vocab_lo = int64_t(o.tp_rank) * vocab_rows;
    KCHECK(vocab_rows * o.tp_size == c.text.vocab_size, "CudaModel: {} embedding rows on each of {} ranks for V = {}",
           vocab_rows, o.tp_size, c.text.vocab_size);
  }

  void attach(parallel::Comm* comm) {
    KCHECK(comm != nullptr && comm->size() == tp_size && comm->rank() == tp_rank,
           "CudaModel::attach_comm: a comm of rank {} of {} for a model built as rank {} of TP{}",
           comm ? comm->rank() : -1, comm ? comm->size() : 0, tp_rank, tp_size);
    KCHECK(comm->device() == Device::cuda, "CudaModel::attach_comm: the {} comm moves host buffers",
           comm->backend());
    x.tp = {comm, tp_size, tp_rank};
    if (tp_size == 1) return;
    graphs = false;
    // Every rank routes over all X experts and normalises the whole ũ: their slices of the selection bias
    // and of the latent norm weight, gathered once (rank-major = expert-/column-major: the whole vectors).
    const TextConfig& tc = cfg.text;
    for (gpu::LayerWeightsDev& L : w.layers) {
      if (L.mlp != MlpKind::moe) continue;
      gpu::MoeWeightsDev& m = L.moe;
      auto* bias = static_cast<float*>(arena.alloc(size_t(tc.num_experts) * 4));  // f32 [X]
      comm->all_gather(m.router_bias, bias, size_t(m.Xl), DType::f32);
      m.router_bias = bias;
      if (m.latent_norm) {
        auto* norm = static_cast<uint16_t*>(arena.alloc(size_t(tc.routed_expert_hidden_size) * 2));  // bf16 [Lt]
        comm->all_gather(m.latent_norm, norm, size_t(m.Ll), DType::bf16);
        m.latent_norm = norm;
      }
    }
    comm->barrier();
  }
  ~Impl() {
    alloc.free(logits_dev);
    alloc.free(x.skinny.part);
    alloc.free(x.skinny.counters);
    alloc.free(mask_dev);
    alloc.free(argmax_ws);
    alloc.free(mask_idx_dev);
    alloc.free(taps_dev);
    ahead.release(alloc);
    if (mask_ready) cudaEventDestroy(mask_ready);
  }

  // Whether the device table has this shape already (allocating it is stream-ordered on x.stream).
  bool mask_table_fits(const CudaModel::TokenMasks& mk) const {
    return mask_dev && mk.table_rows == mask_rows && mk.words == mask_words;
  }
  // Copies this step's masks to the device table on `s` (x.stream, or mask_stream once the table exists).
  void copy_masks(const CudaModel::TokenMasks& mk, cudaStream_t s) {
    if (mk.rows > 0)
      KCUDA_CHECK(cudaMemcpyAsync(mask_dev, mk.table, size_t(mk.rows * mk.words) * 4, cudaMemcpyHostToDevice, s));
    KCUDA_CHECK(cudaMemcpyAsync(mask_idx_dev, mk.row_of.data(), mk.row_of.size() * 4, cudaMemcpyHostToDevice, s));
  }
  void check_masks(const CudaModel::TokenMasks& mk, int64_t n) const {
    const int64_t V = cfg.text.vocab_size;
    KCHECK(mk.table != nullptr && mk.words * 32 >= V && mk.table_rows >= 1 && mk.rows >= 0 &&
               mk.rows <= mk.table_rows && int64_t(mk.row_of.size()) == n && n <= mk.table_rows,
           "sample: bad token masks (table {} x {} words, {} rows, {} entries for {} rows)", mk.table_rows, mk.words,
           mk.rows, mk.row_of.size(), n);
    for (int32_t r : mk.row_of) KCHECK(r >= -1 && r < mk.rows, "sample: mask row {} outside the step's {}", r, mk.rows);
  }
  // CudaModel::stage_masks: the copies on mask_stream, beside the forward on x.stream. The device table must
  // exist already: allocating it here could hand out memory the forward is still using (the allocator is
  // ordered on x.stream); the first step's masks are copied by sample() instead.
  void stage_masks(const CudaModel::TokenMasks& mk) {
    const int64_t n = int64_t(mk.row_of.size());
    check_masks(mk, n);
    if (!mask_table_fits(mk)) return;
    if (!mask_ready) KCUDA_CHECK(cudaEventCreateWithFlags(&mask_ready, cudaEventDisableTiming));
    copy_masks(mk, mask_stream.s);
    KCUDA_CHECK(cudaEventRecord(mask_ready, mask_stream.s));
    staged_table = mk.table, staged_rows = mk.rows, staged_n = n, staged_row_of = mk.row_of.data();
  }

  // This step's mask rows and the entries' row indices on the device (waiting for what stage_masks copied,
  // or copying now on x.stream); returns the device row indices.
  const int32_t* upload_masks(const CudaModel::TokenMasks& mk, int64_t n) {
    const bool staged = staged_table == mk.table && staged_rows == mk.rows && staged_n == n &&
                        staged_row_of == mk.row_of.data() && mask_table_fits(mk);
    staged_table = nullptr, staged_rows = staged_n = -1, staged_row_of = nullptr;
    if (staged) {
      KCUDA_CHECK(cudaStreamWaitEvent(x.stream, mask_ready, 0));
      return mask_idx_dev;
    }
    return upload_masks_now(mk, n);
  }
  const int32_t* upload_masks_now(const CudaModel::TokenMasks& mk, int64_t n) {
    check_masks(mk, n);
    if (mk.table_rows != mask_rows || mk.words != mask_words) {
      alloc.free(mask_dev);
      alloc.free(mask_idx_dev);
      mask_dev = static_cast<uint32_t*>(alloc.alloc(size_t(mk.table_rows * mk.words) * 4));
      mask_idx_dev = static_cast<int32_t*>(alloc.alloc(size_t(mk.table_rows) * 4));
      mask_rows = mk.table_rows, mask_words = mk.words;
    }
    copy_masks(mk, x.stream);
    return mask_idx_dev;
  }

  int64_t forward_batch(CudaCache& cc, std::span<const CudaSeq> seqs, std::span<const CudaEmbedRows> embed) {
    const TextConfig& tc = cfg.text;
    const int64_t V = tc.vocab_size;
    staged_table = nullptr, staged_rows = staged_n = -1, staged_row_of = nullptr;  // masks staged for the last forward
    gpu::BatchInputs in;
    gpu::BatchStep s = gpu::describe_batch(seqs, cc, V, in, embed, ahead.latest_n());
    KCHECK(!in.pending || tp_size == 1, "forward_batch: run-ahead sequences (prev_id) run on one rank only");
    if (tp_size > 1) {
      KCHECK(x.split(), "CudaModel: rank {} of TP{} has no communicator (attach_comm)", tp_rank, tp_size);
      // The rank's embedding rows: its own ids, shifted; every other id reads the zero row after them.
      for (int32_t& id : in.ids)
        id = id >= vocab_lo && id < vocab_lo + vocab_rows ? int32_t(id - vocab_lo) : int32_t(vocab_rows);
    }
    x.timer.begin_step();
    x.mark("start");
    // Image rows (CudaEmbedRows) come only with prefill chunks; a graph bucket has no place for them. Pure
    // decode steps and pure verify steps (§5: one length 1 + γ for all) run through graph buckets, taps
    // included (graphs.h; KESTREL_SPEC_GRAPHS=0: only decode steps without taps); mixed steps run eagerly.
    const bool graph_ok = graphs && !x.timer.on && !x.caps.on && in.embed_dst.empty() && s.n <= gpu::kMaxGraphBatch &&
                          (tap_layers.empty() || x.opt.spec_graphs);
    const bool use_graph =
        graph_ok && ((s.nd == s.n && in.all_last) || gpu::verify_graph_step(x, s, cc.kda_state_f16()));
    gpu::upload_verify(x, cc, s);
    // A whole-step graph carries the context inputs in its bucket (graphs.h); every other step uploads them.
    if (!use_graph || !gpu::whole_graph_step(x, s)) gpu::upload_context(x, s, in);
    const int64_t width = int64_t(tap_layers.size()) * tc.hidden_size;  // the taps' row: n·D
    if (!use_graph) {
      const int32_t* d_ids = gpu::upload_inputs(x, s, in);
      if (in.pending) cuda::resolve_pending_ids(const_cast<int32_t*>(d_ids), s.T, ahead.latest(), x.stream);
      gpu::upload_embed_rows(x, s, in);
      const int64_t nr = int64_t(in.lrows.size());
      if (nr > logits_cap) {
        alloc.free(logits_dev);
        logits_dev = static_cast<float*>(alloc.alloc(size_t(nr * V) * 4));
        logits_cap = nr;
      }
      bool identity = nr == s.T;
      for (int64_t i = 0; identity && i < nr; ++i) identity = in.lrows[size_t(i)] == int32_t(i);
      gpu::TapsDev td;
      if (!tap_layers.empty()) {
        if (s.T > taps_cap) {
          alloc.free(taps_dev);
          taps_dev = static_cast<uint16_t*>(alloc.alloc(size_t(s.T * width) * 2));
          taps_cap = s.T;
        }
        td = {tap_layers.data(), int64_t(tap_layers.size()), taps_dev};
      }
      taps_cur = taps_dev;
      taps_rows = tap_layers.empty() ? 0 : s.T;
      gpu::forward_layers(x, w, cc, s, d_ids, s.d_pool_rows + s.T, nr, identity, logits_dev,
                          tap_layers.empty() ? nullptr : &td);
      logits_cur = logits_dev;
      logits_rows = nr;
    } else {
      const int64_t real_rows = s.T;  // the real sequences' rows come first in the bucket
      const gpu::GraphOut go = gpu::run_graph_step(
          x, cc, s, in, tap_layers, tap_layers.empty() ? 0 : width,
          [&](const int32_t* ids, const int32_t* lrows, int64_t nr, float* lg, uint16_t* taps) {
            gpu::TapsDev td{tap_layers.data(), int64_t(tap_layers.size()), taps};
            gpu::forward_layers(x, w, cc, s, ids, lrows, nr, true, lg, taps ? &td : nullptr);
          },
          ahead.latest());
      ++graph_steps;
      logits_cur = go.logits;
      logits_rows = real_rows;
      taps_cur = go.taps;
      taps_rows = go.taps ? real_rows : 0;
    }
    x.mark("final+lm_head");
    // No host wait here: everything that reads the step's results (copy_logits, greedy, sample) is on this
    // stream and synchronises itself, and the scratch given back below is only handed out again to later
    // work on the same stream (stream order), so the host prepares the next call while the GPU runs this one.
    if (x.timer.on) KCUDA_CHECK(cudaStreamSynchronize(x.stream));
    x.release_scratch();
    if (x.timer.on) x.timer.end_step();
    return logits_rows;
  }

  void copy_logits_rows(int64_t first, int64_t n, float* host) const {
    KCHECK(first >= 0 && n >= 0 && first + n <= logits_rows, "logits rows [{}, {}) outside the {} of the last forward",
           first, first + n, logits_rows);
    const int64_t V = cfg.text.vocab_size;
    if (n == 0) return;
    KCUDA_CHECK(cudaMemcpyAsync(host, logits_cur + first * V, size_t(n * V) * 4, cudaMemcpyDeviceToHost, x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
  }

  void copy_taps(int64_t first, int64_t n, uint16_t* host) const {
    KCHECK(!tap_layers.empty() && first >= 0 && n >= 0 && first + n <= taps_rows,
           "taps rows [{}, {}) outside the {} of the last forward (taps set: {})", first, first + n, taps_rows,
           !tap_layers.empty());
    if (n == 0) return;
    const int64_t width = int64_t(tap_layers.size()) * cfg.text.hidden_size;
    KCUDA_CHECK(cudaMemcpyAsync(host, taps_cur + first * width, size_t(n * width) * 2, cudaMemcpyDeviceToHost,
                                x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
  }

  void greedy_rows(int64_t first, int64_t n, int32_t* host) {
    KCHECK(first >= 0 && n >= 0 && first + n <= logits_rows, "greedy rows [{}, {}) outside the {} of the last forward",
           first, first + n, logits_rows);
    if (n == 0) return;
    const int64_t V = cfg.text.vocab_size;
    if (!argmax_ws) {  // ordered before the argmax by the stream
      argmax_ws = alloc.alloc(cuda::argmax_workspace_bytes());
      KCUDA_CHECK(cudaMemsetAsync(argmax_ws, 0, cuda::argmax_workspace_bytes(), x.stream));
    }
    ids_to_host(n, host,
                [&](int32_t* d) { cuda::argmax_rows(logits_cur + first * V, V, n, V, d, x.stream, argmax_ws); });
  }

  // Enqueues launch(d), a kernel writing n ids to the device address d, waits for it and copies the ids to host:
  // d is the mapped page-locked buffer itself, or (KESTREL_IDS_MAPPED=0) a device buffer copied into it.
  template <class Launch>
  void ids_to_host(int64_t n, int32_t* host, Launch&& launch) {
    int32_t* pin = ids_host.get(n);
    const bool mapped = PinnedIds::mapped();
    int32_t* d = mapped ? ids_host.dev() : static_cast<int32_t*>(alloc.alloc(size_t(n) * 4));  // i32 [n]
    launch(d);
    if (!mapped) KCUDA_CHECK(cudaMemcpyAsync(pin, d, size_t(n) * 4, cudaMemcpyDeviceToHost, x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));  // the kernel's stores to mapped memory are visible after it
    std::copy(pin, pin + n, host);
    if (!mapped) alloc.free(d);
  }

  void sample(std::span<const cuda::SampleParams> params, std::span<const cuda::PenaltyEntry> pen, int32_t* host,
              const CudaModel::TokenMasks* masks) {
    const int64_t V = cfg.text.vocab_size, n = int64_t(params.size()), m = int64_t(pen.size());
    if (n == 0) return;
    for (const auto& p : params)
      KCHECK(p.row >= 0 && p.row < logits_rows, "sample: logits row {} outside the {} of the last forward", p.row,
             logits_rows);
    for (const auto& e : pen)
      KCHECK(e.row >= 0 && e.row < logits_rows && e.token >= 0 && e.token < V && e.count >= 0,
             "sample: bad penalty entry (row {}, token {}, count {})", e.row, e.token, e.count);
    // Every row greedy on consecutive logits rows, nothing applied to the logits (no penalty entry, no mask): the
    // argmax alone — sample_kernel's temperature-0 branch gives the same id (the maximum, then the lowest id
    // holding it, NaN skipped) — without the parameters' upload, and split over CTAs at few rows (argmax.cu).
    bool plain_greedy = m == 0 && !(masks && masks->rows > 0);
    for (int64_t k = 0; k < n && plain_greedy; ++k)
      plain_greedy = params[size_t(k)].temperature == 0.0f && params[size_t(k)].row == params[0].row + k;
    if (plain_greedy) {
      greedy_rows(params[0].row, n, host);
      return;
    }
    auto* dp = static_cast<cuda::SampleParams*>(alloc.alloc(size_t(n) * sizeof(cuda::SampleParams)));
    auto* de = static_cast<cuda::PenaltyEntry*>(alloc.alloc(size_t(std::max<int64_t>(m, 1)) * sizeof(cuda::PenaltyEntry)));
    KCUDA_CHECK(cudaMemcpyAsync(dp, params.data(), size_t(n) * sizeof(cuda::SampleParams), cudaMemcpyHostToDevice, x.stream));
    if (m > 0)
      KCUDA_CHECK(cudaMemcpyAsync(de, pen.data(), size_t(m) * sizeof(cuda::PenaltyEntry), cudaMemcpyHostToDevice, x.stream));
    if (masks && masks->rows > 0) {
      const int32_t* idx = upload_masks(*masks, n);
      cuda::apply_token_masks(const_cast<float*>(logits_cur), V, V, dp, idx, mask_dev, mask_words, n, x.stream);
    }
    cuda::apply_penalties(const_cast<float*>(logits_cur), V, V, de, m, x.stream);
    ids_to_host(n, host, [&](int32_t* d) { cuda::sample_rows(logits_cur, V, V, dp, n, d, x.stream); });
    alloc.free(dp), alloc.free(de);
  }

  // Run-ahead: sample()'s launches for rows without penalties or masks, into the ticket's device ids, no wait.
  int64_t sample_ahead(std::span<const cuda::SampleParams> params) {
    const int64_t V = cfg.text.vocab_size, n = int64_t(params.size());
    KCHECK(tp_size == 1, "sample_ahead: one rank only");
    for (const auto& p : params)
      KCHECK(p.row >= 0 && p.row < logits_rows, "sample_ahead: logits row {} outside the {} of the last forward",
             p.row, logits_rows);
    bool plain_greedy = true;
    for (int64_t k = 0; k < n && plain_greedy; ++k)
      plain_greedy = params[size_t(k)].temperature == 0.0f && params[size_t(k)].row == params[0].row + k;
    int32_t* d = ahead.begin(alloc, n);
    if (plain_greedy) {
      if (!argmax_ws) {  // ordered before the argmax by the stream
        argmax_ws = alloc.alloc(cuda::argmax_workspace_bytes());
        KCUDA_CHECK(cudaMemsetAsync(argmax_ws, 0, cuda::argmax_workspace_bytes(), x.stream));
      }
      cuda::argmax_rows(logits_cur + params[0].row * V, V, n, V, d, x.stream, argmax_ws);
    } else {
      auto* dp = static_cast<cuda::SampleParams*>(alloc.alloc(size_t(n) * sizeof(cuda::SampleParams)));
      KCUDA_CHECK(cudaMemcpyAsync(dp, params.data(), size_t(n) * sizeof(cuda::SampleParams), cudaMemcpyHostToDevice,
                                  x.stream));
      cuda::sample_rows(logits_cur, V, V, dp, n, d, x.stream);
      alloc.free(dp);  // reused only by later work on this stream
    }
    ahead.end(x.stream);
    return ahead.ticket();
  }
};

WeightQuant parse_weight_quant(const std::string& s) {
  if (s == "bf16" || s == "none") return WeightQuant::bf16;
  if (s == "ptpc-fp8" || s == "ptpc_fp8") return WeightQuant::ptpc_fp8;
  fail("unknown --quantization '{}' (bf16 or ptpc-fp8)", s);
}

CudaModel::CudaModel(const ModelConfig& c, const ModelWeights& w, const CudaModelOptions& opt)
    : impl_(std::make_unique<Impl>(c, w, opt)) {}
CudaModel::~CudaModel() = default;
size_t CudaModel::weight_bytes() const { return impl_->arena.bytes(); }

int64_t CudaModel::cache_bytes(const TextConfig& t, int64_t pages, int64_t slots, const CacheFormats& f) {
  return gpu::cache_bytes(t, pages, slots, f);
}
CudaCachePtr CudaModel::new_cache(int32_t num_pages, int32_t num_slots, const CacheFormats& f) {
  return CudaCachePtr(gpu::new_cache(impl_->alloc, impl_->x.stream, impl_->cfg.text, num_pages, num_slots, f),
                      gpu::free_cache);
}
void CudaModel::zero_slot(CudaCache& c, int32_t slot) { gpu::zero_slot(c, slot, impl_->x.stream); }
void CudaModel::copy_slot(CudaCache& c, int32_t src, int32_t dst) { gpu::copy_slot(c, src, dst, impl_->x.stream); }

int64_t CudaModel::forward_batch(CudaCache& c, std::span<const CudaSeq> seqs, std::span<const CudaEmbedRows> embed) {
  return impl_->forward_batch(c, seqs, embed);
}
void CudaModel::copy_logits(float* host) const { impl_->copy_logits_rows(0, impl_->logits_rows, host); }
void CudaModel::copy_logits_rows(int64_t first, int64_t n, float* host) const { impl_->copy_logits_rows(first, n, host); }
void CudaModel::greedy(int32_t* host) const { impl_->greedy_rows(0, impl_->logits_rows, host); }
void CudaModel::greedy_rows(int64_t first, int64_t n, int32_t* host) const { impl_->greedy_rows(first, n, host); }
void CudaModel::sample(std::span<const cuda::SampleParams> params, std::span<const cuda::PenaltyEntry> penalties,
                       int32_t* ids_host, const TokenMasks* masks) {
  impl_->sample(params, penalties, ids_host, masks);
}
int64_t CudaModel::sample_ahead(std::span<const cuda::SampleParams> params) { return impl_->sample_ahead(params); }
void CudaModel::take_ids(int64_t ticket, int32_t* host) { impl_->ahead.take(ticket, host); }
void CudaModel::set_taps(std::span<const int> layers) {
  for (int L : layers)
    KCHECK(L >= 0 && L < impl_->cfg.text.num_hidden_layers, "set_taps: layer {} of {}", L,
           impl_->cfg.text.num_hidden_layers);
  KCHECK(layers.empty() || impl_->tp_size == 1, "set_taps: DSpark taps run on one rank only");
  impl_->tap_layers.assign(layers.begin(), layers.end());
  impl_->taps_rows = 0;
}
void CudaModel::copy_taps(int64_t first_row, int64_t n, uint16_t* host) const { impl_->copy_taps(first_row, n, host); }
void CudaModel::keep_verified(CudaCache& c, int64_t k, int64_t t) { gpu::keep_verified(c, k, t, impl_->x.stream); }
void CudaModel::keep_verified_batch(CudaCache& c, std::span<const int64_t> t) {
  gpu::keep_verified_batch(c, t, impl_->x.stream);
}
const uint16_t* CudaModel::taps_device() const { return impl_->tap_layers.empty() ? nullptr : impl_->taps_cur; }
std::unique_ptr<CudaDraft> CudaModel::new_draft(const Draft& d, int32_t num_pages, int block_size) {
  KCHECK(impl_->tp_size == 1, "new_draft: the GPU draft runs on one rank only");
  return gpu::new_cuda_draft(impl_->x, impl_->w, d, num_pages, block_size);
}
void CudaModel::stage_masks(const TokenMasks& masks) { impl_->stage_masks(masks); }
void CudaModel::enable_cuda_graphs(bool on) { impl_->graphs = on && impl_->tp_size == 1; }
void CudaModel::attach_comm(parallel::Comm* comm) { impl_->attach(comm); }
int64_t CudaModel::graph_steps() const { return impl_->graph_steps; }
void* CudaModel::stream() const { return impl_->x.stream; }

void CudaModel::enable_op_timing(bool on) { impl_->x.timer.on = on; }
std::vector<std::pair<std::string, double>> CudaModel::op_times() const { return impl_->x.timer.last_times(); }
void CudaModel::enable_captures(bool on) { impl_->x.caps.on = on; }
const std::map<std::string, std::vector<int32_t>>& CudaModel::captures() const { return impl_->x.caps.ids; }
const std::map<std::string, std::vector<float>>& CudaModel::activation_captures() const { return impl_->x.caps.acts; }

}  // namespace kestrel::model
