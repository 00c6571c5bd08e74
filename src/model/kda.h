// KDA (Kimi Delta Attention) layer, MODEL.md §3.3, recurrent token-by-token form.
//
// Per-request state: the FP32 recurrent matrix S per head (key index = row) and, per projection
// q/k/v, the last W−1 pre-conv inputs in BF16 (MODEL.md §0.4). Prefill and decode run the same
// per-token recurrence, so prefill(N) followed by decode(M) sees exactly the recurrence of
// prefill(N+M); only the BLAS vs GEMV summation order of the projections differs.
#pragma once

#include <cstdint>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/common.h"

namespace kestrel::model {

struct KdaState {
  std::vector<float> S;  // f32 [H, Dk, Dk], S[h][key][value]
  Bf16Vec conv;          // bf16 [3, W-1, H*Dk]: q, k, v pre-conv inputs, oldest first

  void reset(const TextConfig& c);
};

void kda_forward(const KdaWeights& w, const TextConfig& c, KdaState& st,
                 const uint16_t* x /* bf16 [T, D], input_layernorm output */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */);

}  // namespace kestrel::model
