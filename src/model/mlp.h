// Gated SiTU MLP: the dense layer-0 MLP (MODEL.md §3.7) and the fused shared experts (§3.6 step 6).
#pragma once

#include <cstdint>

#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel::model {

// out = Lin(down)(SiTU(Lin(gate)(x), Lin(up)(x))), intermediate width from the weights.
void mlp_forward(const MlpWeights& w, const TextConfig& c, const uint16_t* x /* bf16 [T, D] */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */);
// The same before the final rounding: out = x·W_downᵀ in FP32. A rank holding gate/up rows and
// down_proj columns (tensor parallelism) gets its partial sum, to be all-reduced (model/tp.h).
void mlp_forward_partial(const MlpWeights& w, const TextConfig& c, const uint16_t* x /* bf16 [T, D] */, int64_t T,
                         float* out /* f32 [T, D] */);

}  // namespace kestrel::model
