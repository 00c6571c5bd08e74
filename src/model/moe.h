// Latent MoE layer, MODEL.md §3.6: sigmoid router with a selection-only bias, latent down-projection,
// MXFP4 experts (w1 gate, w3 up, w2 down) with SiTU-GLU, late routing weights, routed_expert_norm,
// up-projection, plus the fused shared experts.
//
// Tokens are grouped by expert so each selected expert's MXFP4 blocks are decoded once per call for
// all of its tokens (cpu::mxfp4_gemm). The weighted combine still runs per token in its own top-k
// order, so a token's result does not depend on which other tokens share the step.
#pragma once

#include <cstdint>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/common.h"

namespace kestrel::model {

void moe_forward(const MoeWeights& w, const TextConfig& c, const uint16_t* x /* bf16 [T, D], normed */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, const Probe& probe);

}  // namespace kestrel::model
