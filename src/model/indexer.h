// DSA lightning indexer, MODEL.md §3.5 (NoPE, §0.1): picks the keys each MLA query attends to.
//
// The index key k_I of every token is cached per request through the paged view (one Di vector per
// token, MQA; BF16, FP8 or MXFP4, cache_view.h). Scores use the keys as read back from the cache.
// Selection for query position p: when p+1 ≤ index_topk every visible key is selected (exactly dense
// causal MLA, no scores computed); otherwise the top index_topk scores, ties to the lower position.
// Selected positions are handed back sorted ascending, so the attention sum runs in position order
// and "all keys selected" is bit-identical to dense attention.
#pragma once

#include <cstdint>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"
#include "model/cache_view.h"
#include "model/common.h"
#include "model/tp.h"

namespace kestrel::model {

// Writes the T new index keys at positions [pos0, pos0+T) of `cache` and fills
// `sel` (i32 [T, Ki], Ki = index_topk) with each query's selected key positions, ascending, padded
// with −1 (§3.5 step 6). Under tensor parallelism `w` and `c` hold this rank's Hi/N heads of wq_b
// and weights_proj; their outputs are all-gathered so every rank scores all heads over the whole key
// cache and selects the same keys (docs/parallel.md §3, "Indexer heads split, scores not").
void indexer_select(const IndexerWeights& w, const TextConfig& c, const MlaCacheView& cache,
                    const uint16_t* x /* bf16 [T, D], normed hidden */,
                    const uint16_t* c_q /* bf16 [T, Q], q_a_layernorm output */, int64_t T, int64_t pos0,
                    std::vector<int32_t>& sel /* i32 [T, Ki] */, const Shard& sh = {});

}  // namespace kestrel::model
