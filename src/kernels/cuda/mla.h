// MLA attention (MODEL.md §3.4) and the DSA lightning indexer (§3.5) on the GPU.
// CPU twins: cpu::mla_attn_naive, cpu::mla_attn_absorbed, cpu::indexer_key_norm and
// cpu::indexer_select_topk (kernels/cpu/mla_ops.h).
//
// Cache: per request a contiguous latent cache bf16 [S, C+R] (row = [ĉ | k_pe], 576 wide at full size)
// and an index-key cache bf16 [S, Di]; a batch of requests is described by device arrays of base
// pointers and lengths (varlen), so requests of different lengths decode in one launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/mla_ops.h"
#include "kernels/cuda/gemm.h"

namespace kestrel::cuda {

using cpu::MlaDims;

// Prefill (naive form), one request: query t at position pos0+t attends to 0..pos0+t, or to
// sel[t, ..] (ascending, −1 ends it) when sel is non-null. One block per (query, head); scores in
// shared memory, so a query may see at most mla_naive_max_keys() keys. N+R ≤ 1024, Dv ≤ 1024.
int64_t mla_naive_max_keys();
void mla_attn_naive(const MlaDims& d, const uint16_t* q /* bf16 [T, Hm, N+R] */,
                    const uint16_t* kv /* bf16 [S, Hm, N+Dv] */, const uint16_t* latent /* bf16 [S, C+R] */,
                    const int32_t* sel /* i32 [T, Ksel] or null */, int64_t Ksel, int64_t T, int64_t pos0,
                    uint16_t* o /* bf16 [T, Hm*Dv] */, cudaStream_t stream);

// Decode (absorbed, MQA view: one KV head of width C+R, value width C, Hm query heads), one query per
// request, B requests. Request b attends to rows 0..lens[b]−1 of its cache caches[b], or (sparse) to
// the rows sel[b, ..] (ascending, −1 ends the list). max_keys bounds every request's key count (host
// side; sizes the split over keys). Steps: q̃ = W_UKᵀ q_nope for all heads by one batched GEMM (FP32
// out); split-KV attention with an online FP32 softmax; combine; o_h = bf16(W_UV,h ô_h).
// Hm ≤ 16, C ≤ 512 and a multiple of 8, R a multiple of 8.
struct MlaDecodeBatch {
  const uint16_t* const* caches;  // device array [B] of bf16 [S_b, C+R] base pointers
  const int32_t* lens;            // device i32 [B]
  const int32_t* sel;             // device i32 [B, Ksel] or null (dense)
  int64_t Ksel;
  int64_t B;
  int64_t max_keys;
};
size_t mla_decode_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys);
void mla_decode_absorbed(GemmLt& lt, const MlaDims& d, const uint16_t* q /* bf16 [B, Hm, N+R] */,
                         const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */, const MlaDecodeBatch& batch,
                         void* workspace /* mla_decode_workspace_bytes */, uint16_t* o /* bf16 [B, Hm*Dv] */,
                         cudaStream_t stream);

// Indexer §3.5 step 2: out = bf16(LayerNorm_{1e-6}(kraw)·w + b) per row (b null = 0). Di ≤ 1024.
void indexer_key_norm(const uint16_t* kraw /* bf16 [T, Di] */, const uint16_t* w /* bf16 [Di] */,
                      const uint16_t* b /* bf16 [Di] or null */, int64_t T, int64_t Di,
                      uint16_t* out /* bf16 [T, Di], row stride Di */, cudaStream_t stream);

// Steps 5–6 for T queries of one request at positions pos0.. : scores into `scores` (f32 [T, ld_scores],
// ld_scores ≥ pos0+T), then sel = top Ki, ties to the lower position, ascending, −1 padded (all visible
// keys when pos0+t+1 ≤ Ki). The scores repeat the CPU twin's FP32 operation order exactly (sequential
// dot products, no fused multiply-add), so the selection equals the CPU's bit for bit on equal inputs.
// Di ∈ {32, 64, 128}; Hi·Di ≤ 8192.
void indexer_select(const uint16_t* qi /* bf16 [T, Hi*Di] */, const uint16_t* keys /* bf16 [S, Di] */,
                    const float* hw /* f32 [T, Hi] */, int64_t T, int64_t pos0, int64_t Hi, int64_t Di, int64_t Ki,
                    float* scores /* f32 scratch [T, ld_scores] */, int64_t ld_scores, int32_t* sel /* i32 [T, Ki] */,
                    cudaStream_t stream);

}  // namespace kestrel::cuda
