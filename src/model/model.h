// The K3.1 text model on the CPU: embedding → layers with AttnRes → final Mix → final norm → lm_head
// (MODEL.md §3.1–§3.8), reference precision (BF16 activations, FP32 accumulation, FP32 logits).
//
// Layers touch cross-step state only through a SeqCacheView: per KDA layer a state view (an engine
// slot or a State's own buffer), per MLA layer a paged cache view (an engine block table over shared
// arenas, or a State's own pages). forward() is the one path; State is a single-request owner of
// its caches for the CLI-free callers and tests. Requests never share state, so interleaving two
// requests' steps gives each exactly the logits it gets alone. decode() is prefill() of one token.
// forward_batch() runs several sequences in one pass (their rows stacked, every token-local op once
// over all of them); with the default forms (absorbed MLA, recurrent KDA) every op computes a token
// exactly as it would alone, so a sequence's logits are bit-identical whether it runs alone, chunked
// or batched with others (tests/unit/test_model_cpu.cpp checks). A call that throws may leave some
// layers advanced: reset() the State before reusing it.
//
// Observer captures (all bf16 unless noted), T = tokens of the call:
//   embed [T, D]; L{L}.attn_in [T, D] (AttnRes Mix output before input_layernorm); L{L}.attn_out
//   [T, D] (attention output a); L{L}.mlp_in [T, D] (Mix before post_attention_layernorm);
//   L{L}.mlp_out [T, D] (MLP/MoE output m); L{L}.index_topk i32 [T, Ki] (selected key positions,
//   ascending, −1 padded; MLA layers with an indexer); L{L}.router_ids i32 [T, K] and
//   L{L}.router_weights f32 [T, K] (best first; MoE layers); final_hidden [T, D] (final Mix output,
//   before model.norm); logits f32 [T or 1, V]. In forward_batch T is all sequences' rows, stacked.
//
// Tensor parallelism (docs/parallel.md §8): with options.comm set, `w` is one rank's shard
// (loader/shard.h, strided views packed by model::pack_strided) and `c` its rank_config (model/tp.h);
// every rank of the group calls forward (or forward_batch) with the same tokens and caches of its own,
// and the layers all-reduce at their sublayer ends, so every rank ends each sublayer with the whole
// hidden state and all of them write the same whole logits. Observer captures are then the whole
// tensors too. The collectives are called on the calling thread, never inside a thread-pool task, so
// every rank issues them in the same order whichever rank holds the pool (kernels/cpu/thread_pool.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/common.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/tp.h"

namespace kestrel::model {

struct State {
  std::vector<KdaState> kda;  // per layer index; empty for MLA layers
  std::vector<MlaCache> mla;  // per layer index; empty for KDA layers
  int64_t pos = 0;            // tokens consumed so far

  explicit State(const ModelConfig& c);
  void reset(const ModelConfig& c);
};

// One sequence's caches for a forward call: positions [0, pos) are already in them.
struct SeqCacheView {
  std::vector<KdaStateView> kda;  // per layer index; unused for MLA layers
  std::vector<MlaCacheView> mla;  // per layer index; unused for KDA layers; block tables cover pos + T
  int64_t pos = 0;
};

// A row that replaces a token's embedding (§3.1: image positions receive the vision tower's rows, §6):
// position `pos` of the call's tokens (0-based within the sequence's tokens of this call) starts the
// stream as `row` instead of embed_tokens[id].
struct EmbedOverride {
  int64_t pos = 0;
  const uint16_t* row = nullptr;  // bf16 [D]
};

struct ForwardOptions {
  Observer observer;                       // optional activation captures (see above)
  // forward()/prefill() (one sequence): embedding rows to replace (forward_batch: SeqInput's own).
  std::span<const EmbedOverride> embed_override;
  MlaForm mla_form_prefill = MlaForm::absorbed;
  MlaForm mla_form_decode = MlaForm::absorbed;  // used when the call has exactly one token (forward)
  bool last_logits_only = false;           // forward/prefill: write only the last position's logits (f32 [1, V])
  KdaForm kda_form = KdaForm::automatic;
  // This rank's tensor-parallel group; null = one rank. Every rank must ask for logits alike.
  parallel::Comm* comm = nullptr;
  // Decode context parallelism: 1, or comm's size (each MLA cache then holds the tokens t with
  // t mod size == rank at row ⌊t/size⌋; model/mla_dcp.cpp; MLA runs the absorbed form).
  int dcp = 1;
  // DSpark taps (MODEL.md §5): the AttnRes partial sum P after each listed layer (pre-norm), copied into
  // taps_out as bf16 [T, n·D] in list order (forward_batch: T = all sequences' rows, stacked). Empty
  // list: nothing is copied.
  std::span<const int> tap_layers;
  uint16_t* taps_out = nullptr;  // bf16 [T, tap_layers.size()·D]
};

// What logits a sequence of forward_batch wants: none, its last position's, or every position's.
enum class Logits : uint8_t { none, last, all };

// One sequence of forward_batch: `tokens` at positions [view.pos, view.pos + T) through its caches.
struct SeqInput {
  SeqCacheView view;
  std::span<const int32_t> tokens;
  Logits logits = Logits::last;
  std::span<const EmbedOverride> embed_override;  // positions within `tokens`, any order, each at most once
};

// Runs `tokens` at positions [v.pos, v.pos + T) through the caches of `v` (which it updates; v.pos
// is the caller's to advance) and writes logits as prefill() does.
void forward(const ModelWeights& w, const ModelConfig& c, const SeqCacheView& v, std::span<const int32_t> tokens,
             float* logits_out /* f32 [T, V] or [1, V] */, const ForwardOptions& options = {});

// Runs every sequence's tokens in one pass and writes the logits they want to logits_out, f32
// [Σ rows, V] with the sequences in order (none: 0 rows, last: 1, all: T). The MLA form is
// mla_form_prefill for every sequence. The views are updated as forward() does (v.pos is the caller's).
void forward_batch(const ModelWeights& w, const ModelConfig& c, std::span<const SeqInput> seqs, float* logits_out,
                   const ForwardOptions& options = {});

// Runs `tokens` (ids in [0, V)) after whatever `state` holds and writes FP32 logits for every token
// (f32 [T, V]) or only the last (f32 [1, V], options.last_logits_only); logits_out may be null.
void prefill(const ModelWeights& w, const ModelConfig& c, State& state, std::span<const int32_t> tokens,
             float* logits_out /* f32 [T, V] or [1, V] */, const ForwardOptions& options = {});

// One token: prefill of length 1.
void decode(const ModelWeights& w, const ModelConfig& c, State& state, int32_t token, float* logits_out /* f32 [V] */,
            const ForwardOptions& options = {});

}  // namespace kestrel::model
