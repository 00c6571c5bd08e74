// The DSpark draft on the GPU (MODEL.md §5; CPU twin model/dspark.h, the same steps at the same rounding
// points): context projection of the target's taps and KV injection into the draft's own paged latent pools
// (one per draft layer, indexed by the target's page ids like the host SpecDrafter's arenas), and the block
// [anchor, mask × (Nb−1)] through the draft layers — naive non-causal MLA over context + block rows, SwiGLU
// MLP — then the final norm and the target's lm_head, on the device; the block's base logits f32 [Nb, V] come
// back for the sequential Markov chain on the host (Draft::draft_from_base), or, for greedy picks, the chain
// runs on the device and only the draft tokens come back (greedy_tokens). Built by CudaModel::new_draft,
// which lends it the model's stream, scratch, cuBLASLt handle and the target's embedding and lm_head.
// Two forms: one request per call (inject, base_logits, greedy_tokens), and the batched draft (inject_batch,
// greedy_tokens_batch, base_logits_batch): every request of a step in one launch sequence — index arrays
// uploaded once, RoPE at per-row positions, the attention varlen over requests — with at most one host sync
// (the copy of the results). The per-request calls are the batched ones with B = 1 (one code path). The executor uses the batched form unless KESTREL_DRAFT_BATCHED=0; its greedy
// draft runs as one CUDA graph per step shape (set_graphs) when CUDA graphs are on, unless
// KESTREL_DRAFT_GRAPHS=0.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>

namespace kestrel::model {

class CudaModel;
struct Draft;

class CudaDraft {
 public:
  ~CudaDraft();
  CudaDraft(const CudaDraft&) = delete;
  CudaDraft& operator=(const CudaDraft&) = delete;

  // Taps of positions [pos0, pos0 + T) of the request whose pages are `table` (device bf16 [T, n·Dt], e.g.
  // CudaModel::taps_device() rows) → H_ctx → each draft layer's latent row [ĉ | RoPE(k_pe)] at its pool row.
  // Queued on the stream, no sync: taps_dev must stay valid until the stream has passed it.
  void inject(std::span<const int32_t> table, int64_t pos0, const uint16_t* taps_dev, int64_t T);
  // The same from host taps (tests).
  void inject_host(std::span<const int32_t> table, int64_t pos0, const uint16_t* taps_host, int64_t T);
  // The block `tokens` (Nb ids, the §5 block [anchor, mask × (Nb−1)]; anything else is an error) at
  // ctx .. ctx+Nb−1 over the pools holding [0, ctx): lm_head of the final-normed states, host f32 [Nb, V].
  void base_logits(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens,
                   float* host /* f32 [Nb, V] */);

  // Greedy picks (argmax, no top-k): the same block, its base logits kept on the device, and the Markov chain
  // there too (kernels/cuda/dspark.h dspark_markov_greedy: Draft::markov_logits' bits, the first maximum as
  // the host's argmax); the first `steps` draft tokens into host i32 [steps] — what Draft::draft_from_base
  // gives with argmax picks, without the f32 [Nb, V] copy and the host chain.
  void greedy_tokens(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens, int64_t steps,
                     int32_t* host /* i32 [steps] */);

  // The batched draft. A sequence's committed rows to inject: the taps rows [tap_row, tap_row + n) of the
  // step's device taps go to positions [pos0, pos0 + n) of the sequence whose pages are `table`.
  struct InjectSeq {
    std::span<const int32_t> table;
    int64_t pos0 = 0, tap_row = 0, n = 0;
  };
  // inject() for all of them in one launch sequence, no host sync (taps_dev: device bf16 [step rows, n·Dt]).
  void inject_batch(std::span<const InjectSeq> seqs, const uint16_t* taps_dev);
  // A request's block [anchor, mask × (Nb−1)] at ctx .. ctx+Nb−1 over its pools holding [0, ctx).
  struct BlockSeq {
    std::span<const int32_t> table;
    int64_t ctx = 0;
    int32_t anchor = 0;
  };
  // greedy_tokens() of every request at once: the blocks through the draft layers together, the Markov chains
  // in one launch, the first `steps` tokens of each into host i32 [B, steps] with one copy and one sync.
  void greedy_tokens_batch(std::span<const BlockSeq> reqs, int64_t steps, int32_t* host /* i32 [B, steps] */);
  // base_logits() of every request at once: host f32 [B, Nb, V], one copy and one sync (the executor's sampled
  // blocks; their Markov chains run on the host).
  void base_logits_batch(std::span<const BlockSeq> reqs, float* host /* f32 [B, Nb, V] */);
  // greedy_tokens_batch through CUDA graphs, one per (B, steps, latent-row bound, key bound), captured on
  // first use (off until set: the executor turns it on with CUDA graphs unless KESTREL_DRAFT_GRAPHS=0). Off
  // drops them.
  void set_graphs(bool on);
  // The draft's attention in the latent space (the target's absorbed MLA decode, kernels/cuda/paged.h
  // mla_decode_paged, over the gathered latent rows) instead of expanding every context row through kv_b each
  // step (naive, the CPU twin's form and the default). Equal in exact arithmetic; q̃ and p rounded to bf16 (rel
  // L2 of the base logits ≲ 1e-2 on nano, GpuSpec.AbsorbedDraftMatchesNaive). The executor turns it on with
  // KESTREL_DRAFT_ATTN=absorbed. Switching drops the draft's graphs.
  void set_absorbed(bool on);
  // Phase marks for the executor's profile (runtime/spec_profile.h, KESTREL_SPEC_PROFILE): called with a
  // string literal at the end of each phase of the batched calls (upload, layers, chain, copy + sync);
  // empty (the default): none.
  void set_marker(std::function<void(const char*)> mark);

  struct Impl;  // model/cuda/dspark.cpp; only CudaModel::new_draft makes one
  explicit CudaDraft(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::model
