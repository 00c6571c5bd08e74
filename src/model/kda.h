// KDA (Kimi Delta Attention) layer, MODEL.md §3.3, for a batch of sequences in one call.
//
// Per-request state: the FP32 recurrent matrix S per head (key index = row) and, per projection
// q/k/v, the last W−1 pre-conv inputs in BF16 (MODEL.md §0.4). The rows of all sequences are stacked:
// projections and the per-token norms run once over the stack; the conv and the scan walk each
// sequence's own rows through its own state. The recurrent scan (the default) is token by token, so
// a token's output is the same whether its sequence runs alone, chunked or batched, bit for bit; the
// chunked WY/UT form (KdaForm::chunked, the scalar twin) reorders the f32 sums (measured against the
// recurrent form in tests/unit/test_kda_scan.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/cache_view.h"
#include "model/common.h"
#include "model/tp.h"

namespace kestrel::model {

struct KdaState {
  std::vector<float> S;  // f32 [H, Dk, Dk], S[h][key][value]
  Bf16Vec conv;          // bf16 [3, W-1, H*Dk]: q, k, v pre-conv inputs, oldest first

  void reset(const TextConfig& c);
  KdaStateView view() { return {S.data(), false, conv.data()}; }
};

// Which form of the step-6 scan to run; `automatic` = recurrent (vectorised).
enum class KdaForm { automatic, recurrent, chunked };

// One sequence of a batched call: rows [row0, row0 + T) of the stacked activations and its state.
struct KdaSeq {
  int64_t row0 = 0, T = 0;
  KdaStateView state;
};

// Reads and updates each sequence's state in place: an engine state slot or a KdaState. An f16
// recurrent state is widened to f32 for the scan and rounded back once per call (MODEL.md §0.4 opt-in).
// Under tensor parallelism (sh.split()) `w` and `c` are one rank's (its H heads, tp.h) and o_proj's
// partial sums are all-reduced before the one BF16 rounding; `out` is then the whole layer's output.
void kda_forward(const KdaWeights& w, const TextConfig& c, std::span<const KdaSeq> seqs,
                 const uint16_t* x /* bf16 [rows, D], input_layernorm output */, int64_t rows,
                 uint16_t* out /* bf16 [rows, D] */, KdaForm form = KdaForm::automatic, const Shard& sh = {});
// One sequence (T rows).
void kda_forward(const KdaWeights& w, const TextConfig& c, const KdaStateView& st,
                 const uint16_t* x /* bf16 [T, D], input_layernorm output */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, KdaForm form = KdaForm::automatic, const Shard& sh = {});
void kda_forward(const KdaWeights& w, const TextConfig& c, KdaState& st,
                 const uint16_t* x /* bf16 [T, D], input_layernorm output */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, KdaForm form = KdaForm::automatic);

// Speculative rollback without recompute: copies the traced state after token t of the last traced call
// (st.trace_recurrent / st.trace_conv hold T positions, t < T) into st's state. Keeping token t of a
// recurrent call is bit-identical to a call that stopped after token t.
void kda_keep_position(const TextConfig& c, const KdaStateView& st, int64_t t);

}  // namespace kestrel::model
