// The DSA indexer's chunked top-k merge, internal to kernels/cuda: indexer_select_paged_tc (indexer.cu) runs it
// after each key chunk's scores (and alone when every row selects all its visible keys). Design: the header of
// indexer_topk.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::indexer_detail {

constexpr int64_t kSelCacheMax = 48 * 1024;  // order keys cached in shared memory per row, at most (192 KiB)

// One CTA per row t < T. Row t's candidates are the running top Ki of the earlier chunks (skeys u32 [T, Ki]
// order keys, sel i32 [T, Ki] positions; absent when chunk0 == 0) followed by the chunk's scores (f32 [T, ldc],
// entry j = position chunk0 + j, up to lens[t] (clamped to max_len)); sel and skeys receive the new running top
// Ki, ascending. Rows with lens[t] ≤ Ki get 0..lens[t]−1, −1 padded, at chunk0 == 0 (scores not read).
// cache_cap: order keys a CTA may keep in shared memory (≤ kSelCacheMax; 0 with no scores).
void select_merge(const float* scores /* f32 [T, ldc] or null */, int64_t ldc, uint32_t* skeys /* u32 [T, Ki] */,
                  int32_t* sel /* i32 [T, Ki] */, const int32_t* lens /* i32 [T] */, int chunk0, int Ki, int max_len,
                  int cache_cap, int64_t T, cudaStream_t stream);

}  // namespace kestrel::cuda::indexer_detail
