// The DSA lightning indexer's scores and top-k (MODEL.md §3.5 steps 5–6) over the paged index-key cache, on
// tensor cores, for every query row of a step in one launch sequence (decode rows and prefill rows of many
// requests together). CPU twin: cpu::indexer_select_topk over model::MlaCacheView::read_keys (the exact
// dequantised keys). Design, numerics and costs: the header of indexer.cu.
//
// Contract (§0.8, §0.12): sel[t] = the Ki positions of the largest I[t, s] = Σ_h w'[t,h]·ReLU(q[t,h]·k[s]),
// w' = w·(Hi·Di)^−½ (FP32), over s < lens[t]; ascending, −1 padded; every visible position when
// lens[t] ≤ Ki. Scores are FP32 with tensor-core (BF16 × BF16 → FP32) dot products, so they differ from the
// twin's sequential FP32 scores by FP32 rounding only: a key whose exact score is farther than
// β = (4·Di + 2·Hi + 8)·2^−24 · max_s Σ_h |w'_h| Σ_i |q_h,i·k_s,i| from the row's threshold has the twin's
// selection; only keys inside that band may swap. Exact ties (equal FP32 scores on the GPU; ReLU zeros
// above all) go to the lower position, as in the twin.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/paged.h"

namespace kestrel::cuda {

// Bytes of workspace that indexer_select_paged_tc wants for T rows of at most max_len visible keys: the
// scores of one key chunk per row (f32 [T, chunk]) plus the running top-k keys (u32 [T, Ki]), exactly
// 4·T·(chunk + Ki), where chunk = max_len rounded up to 128 when T·chunk scores fit a 256 MiB budget, else
// the largest multiple of 128 that does (never below max(Ki, 8192) rounded up to 128): never T·max_len.
size_t indexer_select_paged_tc_workspace_bytes(int64_t T, int64_t max_len, int64_t Ki);

// Selection for T query rows: row t reads block-table row req[t] (req null: row t) and sees positions
// 0..lens[t]−1 (lens[t] ≤ max_len, the host-side bound that sizes the launches; larger lens count as
// max_len). Keys are scored in chunks of `chunk` positions (the largest multiple of 128 that the given
// workspace holds, capped at max_len rounded up to 128; at least max(Ki, 128)); after each chunk a
// per-row radix select merges the chunk's scores with the running top Ki, so no [T, max_len] score
// matrix is ever held. 2·ceil(max_len / chunk) launches, no host reads of device data: CUDA-graph
// capturable with fixed (T, max_len, workspace_bytes).
// Limits: Hi ≤ 32, Di ∈ {32, 64, 128}, block_size a multiple of 64 or one of 16, 32; keys and the
// workspace 16-byte aligned; T ≤ 8·65535.
void indexer_select_paged_tc(const uint16_t* qi /* bf16 [T, Hi*Di] */, const float* hw /* f32 [T, Hi] */,
                             const PagedMlaCache& cache, const int32_t* lens /* i32 [T] */,
                             const int32_t* req /* i32 [T] or null */, int64_t T, int64_t max_len, int64_t Hi,
                             int64_t Ki, void* workspace /* indexer_select_paged_tc_workspace_bytes */,
                             size_t workspace_bytes, int32_t* sel /* i32 [T, Ki] */, cudaStream_t stream);

// The key-chunk length the launcher uses for these sizes and this workspace (tests and benchmarks).
int64_t indexer_select_paged_tc_chunk(int64_t T, int64_t max_len, int64_t Ki, size_t workspace_bytes);

}  // namespace kestrel::cuda
