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
#include "model/tp.h"

namespace kestrel::model {

void moe_forward(const MoeWeights& w, const TextConfig& c, const uint16_t* x /* bf16 [T, D], normed */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, const Probe& probe, const Shard& sh = {});

// One rank of a split MoE layer (docs/parallel.md §3 and §8; called by moe_forward when sh.split()):
// router and latent-down rows → one all-gather of the router logits (+ bias) and z; routing on every
// rank (identical inputs, identical choice); experts on this rank's I/N columns, or its whole experts
// under expert parallelism → partial ũ, all-reduced in f32; routed_expert_norm over the whole ũ; the
// latent-up columns of this rank's Lt/N slice plus the shared experts' partial → one all-reduce.
void moe_forward_split(const MoeWeights& w, const TextConfig& c, const uint16_t* x /* bf16 [T, D], normed */,
                       int64_t T, uint16_t* out /* bf16 [T, D] */, const Probe& probe, const Shard& sh);

}  // namespace kestrel::model
