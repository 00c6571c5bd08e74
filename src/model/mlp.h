// Gated SiTU MLP: the dense layer-0 MLP (MODEL.md §3.7) and the fused shared experts (§3.6 step 6).
#pragma once

#include <cstdint>

#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel::model {

// out = Lin(down)(SiTU(Lin(gate)(x), Lin(up)(x))), intermediate width from the weights.
void mlp_forward(const MlpWeights& w, const TextConfig& c, const uint16_t* x /* bf16 [T, D] */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */);

}  // namespace kestrel::model
