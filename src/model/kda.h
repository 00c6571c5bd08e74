// KDA (Kimi Delta Attention) layer, MODEL.md §3.3: chunked WY/UT scan for prefill, recurrent for decode.
//
// Per-request state: the FP32 recurrent matrix S per head (key index = row) and, per projection
// q/k/v, the last W−1 pre-conv inputs in BF16 (MODEL.md §0.4). Prefill and decode run the same
// recurrence in exact arithmetic; the chunked form reorders the f32 sums (measured against the
// recurrent form in tests/unit/test_kda_scan.cpp), and BLAS vs GEMV reorder the projections.
#pragma once

#include <cstdint>
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

// Which form of the step-6 scan to run; `automatic` = chunked for T > 1, recurrent for one token.
enum class KdaForm { automatic, recurrent, chunked };

// Reads and updates the state in place: an engine state slot or a KdaState. An f16 recurrent state
// is widened to f32 for the scan and rounded back once per call (MODEL.md §0.4 opt-in).
// Under tensor parallelism (sh.split()) `w` and `c` are one rank's (its H heads, tp.h) and o_proj's
// partial sums are all-reduced before the one BF16 rounding; `out` is then the whole layer's output.
void kda_forward(const KdaWeights& w, const TextConfig& c, const KdaStateView& st,
                 const uint16_t* x /* bf16 [T, D], input_layernorm output */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, KdaForm form = KdaForm::automatic, const Shard& sh = {});
void kda_forward(const KdaWeights& w, const TextConfig& c, KdaState& st,
                 const uint16_t* x /* bf16 [T, D], input_layernorm output */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, KdaForm form = KdaForm::automatic);

}  // namespace kestrel::model
