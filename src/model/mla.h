// MLA layer (NoPE, gated; MODEL.md §3.4) with the K3.1 indexer (§3.5) choosing the keys.
//
// Cache: per token the latent row [ĉ (C) | k_pe (R)], the 576-wide row of the paged GPU cache, plus
// the indexer key, both read and written through a paged MlaCacheView (cache_view.h) in the chosen
// format; the new tokens' rows are written first and every row is read back through the cache, so a
// quantised cache affects the current token exactly as it would on the GPU. Two attention forms:
//  - naive: k_nope, v = kv_b_proj(ĉ) for every cached token (BF16 Lin outputs), per-head attention
//    over [k_nope | k_pe]; the spec's equations literally, used for prefill;
//  - absorbed: q̃_h = W_UKᵀ q_nope,h and o_h = W_UV ô_h in FP32, attention over the 576-wide cache
//    directly (MQA, one KV head); the decode form. It skips the BF16 rounding of k_nope and v, so the
//    two forms agree to BF16 noise, not bit for bit (tests state the bound).
#pragma once

#include <cstdint>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/cache_view.h"
#include "model/common.h"
#include "model/tp.h"

namespace kestrel::model {

enum class MlaForm : uint8_t { naive, absorbed };

// Positions [pos0, pos0+T) are written; the view's block table must cover pos0 + T tokens.
// Under tensor parallelism `w` and `c` are one rank's (its Hm and Hi heads, tp.h); the latent and
// index-key caches are whole on every rank; o_proj's partial sums are all-reduced (one rounding).
void mla_forward(const MlaWeights& w, const TextConfig& c, const MlaCacheView& cache, int64_t pos0,
                 const uint16_t* x /* bf16 [T, D], input_layernorm output */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, MlaForm form, const Probe& probe, const Shard& sh = {});

// Decode context parallelism (sh.dcp > 1, docs/parallel.md §5): the cache holds only this rank's
// tokens; attention and the indexer's top-k run over the whole context through the group (absorbed
// form only). Called by mla_forward when sh.dcp > 1.
void mla_forward_dcp(const MlaWeights& w, const TextConfig& c, const MlaCacheView& cache, int64_t pos0,
                     const uint16_t* x /* bf16 [T, D] */, int64_t T, uint16_t* out /* bf16 [T, D] */,
                     const Probe& probe, const Shard& sh);

// The same on a self-owned cache (grows it, advances cache.len).
void mla_forward(const MlaWeights& w, const TextConfig& c, MlaCache& cache,
                 const uint16_t* x /* bf16 [T, D], input_layernorm output */, int64_t T,
                 uint16_t* out /* bf16 [T, D] */, MlaForm form, const Probe& probe);

}  // namespace kestrel::model
