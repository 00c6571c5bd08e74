// The K3.1 text model on one GPU: the layer loop of model/model.cpp with the CUDA ops of
// src/kernels/cuda, at the same rounding points (BF16 activations, FP32 accumulation, FP32 logits).
//
// Why here (src/model, library kestrel_model_cuda) and not src/runtime: this is the model's math,
// one forward per call over one request, mirroring model.cpp line by line so the two can be read (and
// diffed) side by side; scheduling, paging and batching many requests belong to the runtime, which
// will drive these same ops with its own state. Built only when nvcc is found.
//
// Weights: uploaded once from the mmapped checkpoint into a DeviceArena over a CachingAllocator;
// q|k|v (KDA), gate|up (MLPs) and the three conv kernels are concatenated so each is one GEMM/launch;
// routed experts stay MXFP4, each layer's X experts packed back to back in the layout
// moe_experts_mxfp4 reads (cuda::MoeExpertWeights).
// Caches (CudaCache, for many requests): per MLA layer a paged latent pool bf16 [pages·P, C+R] and
// index-key pool bf16 [pages·P, Di] (token t of a request at row block_table[t/P]·P + t%P, one block
// table for all layers, as in src/cache), and per KDA layer a state pool indexed by slot: FP32
// recurrent state [slots, H, Dk, Dk] and conv history bf16 [slots, W−1, 3·H·Dk]. Latents BF16 or FP8 and
// index keys BF16, FP8 or MXFP4 (§0.3, §3.5; quantised on write by paged_write_latent/keys, read by the
// paged decode and indexer, and dequantised by paged_gather_latent for the naive prefill); KDA state FP32
// or FP16 (widened and rounded back by kda_recurrent once per launch, as the CPU does per layer call).
// Batches (forward_batch): the tokens of every sequence of a step are stacked into one [T, D]
// activation, so every GEMM, norm, router and MoE launch runs over the whole batch; KDA runs one
// varlen recurrent scan over all sequences (conv: one decode launch for the T = 1 rows, one prefill
// launch per longer sequence); MLA writes the new latent/key rows into their pages (copy_rows), scores
// the indexer for every row in one launch and runs the absorbed decode for all T = 1 sequences in one
// launch, both through the block tables, and the naive prefill per longer sequence over a contiguous
// gather of its context. Logits: the rows asked for are gathered and go through lm_head at once;
// greedy ids are taken on the device.
// The BF16 pools have kernels/cuda/paged.h's layout (a per-layer arena indexed by page, token row
// page·P + pos % P, (C+R)·2 and Di·2 bytes per token), so by default (use_paged_attention) the
// indexer and the absorbed decode read them through block tables with no gather (Impl::mla_attend);
// quantised rows are written with paged_write_latent/keys (BF16 ones with copy_rows, the same bytes).
// CudaState (one request, the original API) is a CudaCache of its own with one slot and an identity
// block table, so the single-request path and the batched path are the same code.
// Forms: prefill (T > 1) runs the naive MLA form, decode (T = 1) the absorbed one, like the CPU
// defaults; KDA always runs the recurrent scan (the CPU prefill uses the chunked form, equal in exact
// arithmetic, different in FP32 rounding).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/cache_format.h"
#include "kernels/cuda/paged.h"
#include "kernels/cuda/sampling.h"
#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel::model {

struct CudaState;
struct CudaWeights;
struct CudaCache;

// One sequence of a batched forward: positions [pos0, pos0 + T) from `tokens`, KDA state in `slot`,
// MLA rows through `block_table` (covering [0, pos0 + T)).
struct CudaSeq {
  std::span<const int32_t> tokens;
  int64_t pos0 = 0;
  int32_t slot = 0;
  std::span<const int32_t> block_table;
  enum class Logits : uint8_t { none, last, all } logits = Logits::last;
};

// What a CudaCache stores (the executor maps cache::CacheFormats onto it).
struct CudaCacheFormats {
  LatentFormat latent = LatentFormat::bf16;
  IndexKeyFormat keys = IndexKeyFormat::bf16;
  bool kda_state_f16 = false;  // the recurrent state in FP16 (--kda-state-dtype f16); conv history stays bf16
};

class CudaModel {
 public:
  CudaModel(const ModelConfig& c, const ModelWeights& w);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  std::unique_ptr<CudaState, void (*)(CudaState*)> new_state(int64_t max_context);
  void reset(CudaState& st);

  // Runs `tokens` after what `st` holds; writes FP32 logits of every token (f32 [T, V]) or of the last
  // (f32 [1, V]) to host memory (null: none).
  void forward(CudaState& st, std::span<const int32_t> tokens, float* logits_host, bool last_only);

  // Per-op timing of the last forward (CUDA events around each op group), µs; empty unless enabled.
  void enable_op_timing(bool on);
  std::vector<std::pair<std::string, double>> op_times() const;

  size_t weight_bytes() const;

  // ---- many requests ----------------------------------------------------------------------------------
  // Device bytes of a cache with `pages` pages of `block_size` tokens and `slots` KDA slots (plus the
  // hidden dummy page and slot of the graph buckets).
  static int64_t cache_bytes(const TextConfig& t, int64_t pages, int64_t slots, int block_size,
                             const CudaCacheFormats& f = {});
  std::unique_ptr<CudaCache, void (*)(CudaCache*)> new_cache(int32_t num_pages, int32_t num_slots, int block_size,
                                                             const CudaCacheFormats& f = {});
  void zero_slot(CudaCache& c, int32_t slot);  // a fresh start: S = 0, empty conv history
  void copy_slot(CudaCache& c, int32_t src, int32_t dst);
  // One forward over `seqs` (every sequence with T = 1 first, slots distinct). Returns the number of
  // logits rows produced (f32 [rows, V] on the device, in sequence order: all rows of an `all`
  // sequence, the last of a `last` one), which copy_logits / greedy read until the next forward.
  int64_t forward_batch(CudaCache& c, std::span<const CudaSeq> seqs);
  void copy_logits(float* host /* f32 [rows, V] */) const;
  void copy_logits_rows(int64_t first, int64_t n, float* host /* f32 [n, V] */) const;
  void greedy(int32_t* host /* i32 [rows] */) const;  // argmax per row, ties to the lower id
  // The full sampler on the device (kernels/cuda/sampling.h) over rows of the last forward's logits:
  // penalties first, in place (so once per forward; copy_logits afterwards sees penalised rows), then
  // ids_host[i] = the token for params[i], or −1 where the host must sample that row.
  void sample(std::span<const cuda::SampleParams> params, std::span<const cuda::PenaltyEntry> penalties,
              int32_t* ids_host /* i32 [params.size()] */);
  // CUDA graphs for decode steps (off by default): a forward_batch whose sequences are all single
  // tokens wanting their last logits is padded to a bucket B (1, 2, 4, ..., 512; larger batches run
  // eagerly) and, the first time a bucket is seen on a cache, run while being captured: every launch
  // between the attention islands (context-length-dependent work: the indexer and the
  // absorbed decode) becomes one graph segment, the islands stay host code. Later steps of that bucket
  // rewrite the bucket's static inputs (token ids, cu_seqlens, slot ids, pool rows, logits rows) and
  // replay the segments around the islands. Padded rows use token 0, an empty KDA range, and a hidden
  // dummy slot and page row, so they never touch a real request's state; their outputs are dropped.
  void enable_cuda_graphs(bool on);
  // Attention reads (default on): the indexer and the absorbed decode read the pools through the
  // block tables (kernels/cuda/paged.h), one launch each per layer for the whole batch; off: every
  // context is gathered into a contiguous scratch and the indexer runs per sequence (the first path,
  // kept for comparison). The naive prefill gathers its context either way.
  void use_paged_attention(bool on);
  int64_t graph_steps() const;  // forwards that ran through a graph bucket (captured or replayed)
  // The device stream every launch of this model goes to (for callers adding their own work).
  void* stream() const;

  // Debug captures for tests: when on, every forward appends each MoE layer's router ids (i32 [T, K],
  // "L{L}.router_ids") and each MLA layer's indexer selection (i32 [T, Ki], "L{L}.index_topk"), the
  // names of model.h's observer. Costs a device sync per capture.
  void enable_captures(bool on);
  const std::map<std::string, std::vector<int32_t>>& captures() const;
  // Also per layer "L{L}.attn_out", "L{L}.mlp_out" and "final_hidden" (bf16 [T, D] as f32), appended.
  const std::map<std::string, std::vector<float>>& activation_captures() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::model
