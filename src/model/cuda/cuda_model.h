// The K3.1 text model on one GPU (built when nvcc is found): the façade the GPU executor
// (runtime/executor_cuda.h), the GPU tests and bench_ops use. It runs ONE forward over a whole engine
// step (many sequences, each with its own positions, KDA slot and block table) over a device cache
// (CudaCache), with the CUDA ops of src/kernels/cuda at the CPU model's rounding points (BF16
// activations, FP32 accumulation, state and logits); the scheduler, the pages and the slots are the
// runtime's business, this is the model's math.
//
// The folder, one concern per file (MODEL.md §3 sections in each layer file):
//   cuda_model.*   this façade: weights + caches + one forward per step, logits, greedy, the device sampler
//   weights.*      upload, stacking, PTPC FP8 re-quantisation and expert packing: structs of device pointers
//   linear.*       Lin(W)(x): the skinny GEMM for decode (≤ 16 rows), the wide GEMM for stacks of 17–64 rows,
//                  cuBLASLt (BF16 / FP8) otherwise; the switches
//   cache.*        CudaCache: paged latent / index-key pools, KDA state pools, zero / copy slot
//   batch.*        BatchStep: how a step's sequences are stacked, and the metadata it uploads
//   graphs.*       CUDA graphs: bucketed capture and replay of decode and DSpark verify steps
//   instruments.*  op timing and debug captures
//   context.h      what every forward gets (stream, cuBLASLt, scratch, graph mode, instruments)
//   forward.cpp    the layer stack (§3.1–3.2, §3.8); kda.cpp (§3.3), mla.cpp (§3.4 + §3.5 indexer),
//   moe.cpp (§3.6), mlp.cpp (§3.7), attn_res.cpp (§3.2), speculative.cpp (§5: taps, verify rows, KDA trace)
// Forms: prefill rows (T > 1) run the naive MLA form, decode rows (T = 1) the absorbed one, like the CPU
// defaults; KDA always runs the recurrent scan (the CPU prefill uses the chunked form, equal in exact
// arithmetic, different in FP32 rounding). Projections of T ≤ 16 rows run the skinny GEMM (linear.h), whose
// results do not depend on T (the wide GEMM's do not within 17–64 rows); beyond that the GPU path is not batch
// invariant (cuBLASLt may choose another algorithm for another row count, the expert and attention kernels plan
// by row count).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/cache_format.h"
#include "kernels/cuda/sampling.h"
#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel::parallel {
class Comm;
}

namespace kestrel::model {

struct CudaCache;  // model/cuda/cache.h
class CudaDraft;   // model/cuda/dspark.h
struct Draft;      // model/dspark.h

// One sequence of a batched forward: positions [pos0, pos0 + T) from `tokens`, KDA state in `slot`,
// MLA rows through `block_table` (covering [0, pos0 + T)).
// verify: a DSpark verification block (MODEL.md §5, docs/speculative.md): the anchor and the draft tokens.
// Its rows run the decode forms row by row — the absorbed MLA decode with each row's own key count, the
// recurrent KDA scan one position at a time — so every row gets the logits token-by-token decoding would
// (same kernels; only batch-size effects differ), and the KDA state after each position is kept in the
// cache's trace (keep_verified picks the accepted one). Needs logits = all; such sequences come after the
// single-token ones and before the prefills.
// prev_id ≥ 0 (run-ahead, a decode only): its one token is entry prev_id of the ids the latest sample_ahead
// enqueued — still on the device when this forward is enqueued; `tokens` then holds one placeholder (ignored).
struct CudaSeq {
  std::span<const int32_t> tokens;
  int64_t pos0 = 0;
  int32_t slot = 0;
  std::span<const int32_t> block_table;
  enum class Logits : uint8_t { none, last, all } logits = Logits::last;
  bool verify = false;
  int32_t prev_id = -1;
};

// Image rows of one sequence of a forward (MODEL.md §3.1, §6; the CPU's model::EmbedOverride): the positions
// `pos` of sequence `seq` (indices into its tokens, strictly ascending) start the stream as the rows of `rows`
// (device bf16 [pos.size(), D], in the same order, 16-byte aligned) instead of embed_tokens[id]. A forward
// with image rows runs eagerly (never through a graph bucket).
struct CudaEmbedRows {
  int64_t seq = 0;
  std::span<const int32_t> pos;
  const uint16_t* rows = nullptr;
};

using CudaCachePtr = std::unique_ptr<CudaCache, void (*)(CudaCache*)>;

// How the dense projections are stored on the GPU: BF16 as in the checkpoint, or re-quantised at load to
// PTPC FP8 (--quantization ptpc-fp8: e4m3 weights with per-output-channel scales, activations quantised per
// token on the fly; model/cuda/linear.h). The router, the indexer head weights, lm_head, kv_b and the
// embeddings stay BF16; the routed experts stay MXFP4.
enum class WeightQuant : uint8_t { bf16, ptpc_fp8 };
WeightQuant parse_weight_quant(const std::string& s);  // "bf16" | "ptpc-fp8"; kestrel::Error otherwise
// Tensor parallelism (docs/parallel.md §3, §8): one CudaModel per rank, on the rank's device, built from
// the rank's config (model::rank_config) and shard (loader/shard.h bind_shard, column slices packed by
// model::pack_strided), with tp_size / tp_rank set; then attach_comm() on every rank, collectively.
struct CudaModelOptions {
  WeightQuant quant = WeightQuant::bf16;
  int tp_size = 1, tp_rank = 0;
};

class CudaModel {
 public:
  // Uploads the weights (synchronous).
  CudaModel(const ModelConfig& c, const ModelWeights& w, const CudaModelOptions& opt = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  size_t weight_bytes() const;

  // Tensor parallelism: the rank's communicator (device buffers on this model's stream; NCCL, or the
  // same-device comm of the tests), to outlive the model. Collective: every rank calls it once, before its
  // first forward; it gathers the few per-rank slices every rank needs whole (each MoE layer's selection
  // bias and latent norm weight). CUDA graphs stay off under TP (enable_cuda_graphs is ignored).
  void attach_comm(parallel::Comm* comm);

  // ---- caches (cache.h) -------------------------------------------------------------------------------
  // Device bytes of a cache with `pages` pages and `slots` KDA slots in formats `f` (block_size tokens
  // per page), plus the hidden dummy page and slot of the graph buckets.
  static int64_t cache_bytes(const TextConfig& t, int64_t pages, int64_t slots, const CacheFormats& f);
  // Caches must be freed before the model (they hold memory of its allocator).
  CudaCachePtr new_cache(int32_t num_pages, int32_t num_slots, const CacheFormats& f);
  void zero_slot(CudaCache& c, int32_t slot);  // a fresh start: S = 0, empty conv history
  void copy_slot(CudaCache& c, int32_t src, int32_t dst);

  // ---- one forward per step ---------------------------------------------------------------------------
  // One forward over `seqs` (every sequence with T = 1 first, slots distinct), with the image rows `embed`
  // (at most one entry per sequence). Returns the number of logits rows produced (f32 [rows, V] on the
  // device, in sequence order: all rows of an `all` sequence, the last of a `last` one), which copy_logits /
  // greedy / sample read until the next forward.
  int64_t forward_batch(CudaCache& c, std::span<const CudaSeq> seqs, std::span<const CudaEmbedRows> embed = {});
  void copy_logits(float* host /* f32 [rows, V] */) const;
  void copy_logits_rows(int64_t first, int64_t n, float* host /* f32 [n, V] */) const;
  void greedy(int32_t* host /* i32 [rows] */) const;  // argmax per row, ties to the lower id
  // The same for rows [first, first + n) only (DSpark greedy verification: only the ids cross to the host).
  void greedy_rows(int64_t first, int64_t n, int32_t* host /* i32 [n] */) const;
  // The full sampler on the device (kernels/cuda/sampling.h) over rows of the last forward's logits:
  // penalties first, in place (so once per forward; copy_logits afterwards sees penalised rows), then
  // ids_host[i] = the token for params[i], or −1 where the host must sample that row.
  // With `masks` (structured outputs, kernels/cuda/token_mask.h), each entry's grammar mask is applied to
  // its row first (disallowed ids −inf): the caller's host table rows [0, rows) are copied into the
  // model's device table (fixed address while table_rows and words stay the same; the host table should be
  // pinned, e.g. cudaHostRegister'ed, for the copy to be a DMA).
  struct TokenMasks {
    const uint32_t* table = nullptr;   // host u32 [table_rows, words]
    int64_t table_rows = 0, words = 0;
    int64_t rows = 0;                  // rows [0, rows) hold this step's masks
    std::span<const int32_t> row_of;   // i32 [params.size()]: params[i]'s mask row, −1 = no mask
  };
  void sample(std::span<const cuda::SampleParams> params, std::span<const cuda::PenaltyEntry> penalties,
              int32_t* ids_host /* i32 [params.size()] */, const TokenMasks* masks = nullptr);
  // ---- run-ahead (async scheduling: runtime/executor_cuda.h; model/cuda/ahead.h) --------------------------
  // sample() without the host's wait, for rows with no penalty entry and no mask: enqueues the sampling of the
  // last forward's rows and returns a ticket at once. The ids (params order) stay on the device for the next
  // forward, whose sequences with CudaSeq::prev_id = k take entry k as their token, and reach the host on a side
  // stream: take_ids(ticket, host) waits for that step's ids only (not for a forward queued after them). At most
  // two tickets not yet taken; each taken once. All-greedy consecutive rows take the argmax alone, as in sample().
  int64_t sample_ahead(std::span<const cuda::SampleParams> params);
  void take_ids(int64_t ticket, int32_t* host /* i32 [n of that call] */);
  // ---- DSpark speculation (speculative.cpp; MODEL.md §5, docs/speculative.md) ----------------------------
  // Taps: with layers set (the draft's target_layer_ids, ascending or not), every forward copies the
  // AttnRes partial sum P after each listed layer into a device buffer bf16 [T, n·D] (row = step row,
  // column block k = layers[k]), read by copy_taps until the next forward (graph steps copy them too).
  void set_taps(std::span<const int> layers);
  void copy_taps(int64_t first_row, int64_t n, uint16_t* host /* bf16 [n, n_taps·D] */) const;
  // After a forward with verify sequences: the KDA state of the k-th verify sequence (in sequence order)
  // becomes the state after its position t (0 = the anchor, t < its T): copied from the trace into its slot,
  // every KDA layer, no recompute. Call before the next forward (the trace is overwritten by it).
  void keep_verified(CudaCache& c, int64_t k, int64_t t);
  // keep_verified(c, k, t[k]) for every verify sequence k of the last forward (t.size() = their count) in one
  // launch: the same bytes, without 2 copies per KDA layer and sequence (the executor's default).
  void keep_verified_batch(CudaCache& c, std::span<const int64_t> t);
  // The last forward's taps on the device (bf16 [T, n·D]; null without taps), for the GPU draft's injection.
  const uint16_t* taps_device() const;
  // The DSpark draft on this GPU (model/cuda/dspark.h): its weights uploaded, latent pools of num_pages pages
  // of block_size rows (indexed by the target's page ids), the target's embedding and lm_head shared. One rank.
  // The draft must outlive the result, which must be destroyed before this model.
  std::unique_ptr<CudaDraft> new_draft(const Draft& d, int32_t num_pages, int block_size);

  // Optional, between forward_batch and sample (the masks final, the forward still running): copies the masks
  // to the device on a second stream now, beside the forward, instead of after it; sample() with the same
  // `masks` (same table, rows and row_of array) then only waits for that copy. The host table and row_of
  // must stay unchanged until sample() returns. The first call for a table shape does nothing (the device
  // table is allocated in stream order by sample()).
  void stage_masks(const TokenMasks& masks);
  // CUDA graphs (graphs.h; off by default): all-decode steps wanting their last logits, and all-verify steps
  // of one block length (DSpark, taps included; KESTREL_SPEC_GRAPHS=0: eager), run through bucketed captured
  // graphs.
  void enable_cuda_graphs(bool on);
  int64_t graph_steps() const;  // forwards that ran through a graph bucket (captured or replayed)
  // The device stream every launch of this model goes to (for callers adding their own work).
  void* stream() const;

  // ---- instruments (instruments.h) --------------------------------------------------------------------
  // Per-op timing of the last eager forward (CUDA events around each op group), µs; empty unless enabled.
  void enable_op_timing(bool on);
  std::vector<std::pair<std::string, double>> op_times() const;
  // Debug captures for tests: when on, every forward appends each MoE layer's router ids (i32 [T, K],
  // "L{L}.router_ids") and each MLA layer's indexer selection (i32 [T, Ki], "L{L}.index_topk"), the
  // names of model.h's observer. Costs a device sync per capture.
  void enable_captures(bool on);
  const std::map<std::string, std::vector<int32_t>>& captures() const;
  // Also per layer "L{L}.attn_out" and "L{L}.mlp_out" (bf16 [T, D] as f32), appended.
  const std::map<std::string, std::vector<float>>& activation_captures() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::model
