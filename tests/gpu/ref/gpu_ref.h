// Reference GPU kernels, kept for the GPU tests and as the benchmarks' baselines, not used by the engine:
// the earlier, straightforward CUDA-core forms of MLA attention and of the DSA indexer, each exact to its
// CPU twin where it says so. The tests check them against the CPU twins and check the engine's kernels
// (paged.h, indexer.h) against them; the benchmarks time the engine's kernels against them. Built as the
// library kestrel_gpu_ref (tests/gpu/ref/CMakeLists.txt), linked by kestrel_gpu_tests and bench/gpu.
//  - mla_ref.cu: the naive prefill (one block per query and head) and the absorbed decode over contiguous
//    per-request caches (the CUDA-core kernel of kernels/cuda/mla_decode_simple.cuh over contiguous rows);
//  - indexer_ref.cu: the exact-order indexer (bit-identical FP32 scores + a radix top-k), contiguous and
//    paged;
//  - paged_ref.cu: the latent gather (pool rows → contiguous bf16 rows).
//
// Cache: per request a contiguous latent cache bf16 [S, C+R] (row = [ĉ | k_pe], 576 wide at full size)
// and an index-key cache bf16 [S, Di]; a batch of requests is described by device arrays of base
// pointers and lengths (varlen), so requests of different lengths decode in one launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/mla_ops.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/paged.h"

namespace kestrel::cuda {

// ---- MLA (mla_ref.cu; CPU twins cpu::mla_attn_naive, cpu::mla_attn_absorbed) ---------------------------------
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

// ---- indexer (indexer_ref.cu; CPU twin cpu::indexer_select_topk) ----------------------------------------------
// Steps 5–6 for T queries of one request at positions pos0.. : scores into `scores` (f32 [T, ld_scores],
// ld_scores ≥ pos0+T), then sel = top Ki, ties to the lower position, ascending, −1 padded (all visible
// keys when pos0+t+1 ≤ Ki). The scores repeat the CPU twin's FP32 operation order exactly (sequential
// dot products, no fused multiply-add), so the selection equals the CPU's bit for bit on equal inputs.
// Di ∈ {32, 64, 128}; Hi·Di ≤ 8192.
void indexer_select(const uint16_t* qi /* bf16 [T, Hi*Di] */, const uint16_t* keys /* bf16 [S, Di] */,
                    const float* hw /* f32 [T, Hi] */, int64_t T, int64_t pos0, int64_t Hi, int64_t Di, int64_t Ki,
                    float* scores /* f32 scratch [T, ld_scores] */, int64_t ld_scores, int32_t* sel /* i32 [T, Ki] */,
                    cudaStream_t stream);

// T query rows (prefill and decode alike): row t uses block-table row req[t] (null: t) and sees keys
// 0..lens[t]−1 (lens[t] = its position + 1). sel[t] = top Ki by I = Σ_h (w·(Hi·Di)^−½)·ReLU(q_h·k), ties
// to the lower position, ascending, −1 padded; all visible keys when lens[t] ≤ Ki. Keys are dequantised
// exactly (FP8: e4m3·2^k, MXFP4: e2m1·2^k are BF16 values) and scored with the CPU twin's sequential FP32
// order, so the selection equals cpu::indexer_select_topk over MlaCacheView::read_keys bit for bit.
// Di ∈ {32, 64, 128}; Hi·Di ≤ 8192; scores is scratch f32 [T, ld_scores] with ld_scores ≥ max_len.
void indexer_select_paged(const uint16_t* qi /* bf16 [T, Hi*Di] */, const float* hw /* f32 [T, Hi] */,
                          const PagedMlaCache& cache, const int32_t* lens /* i32 [T] */,
                          const int32_t* req /* i32 [T] or null */, int64_t T, int64_t max_len, int64_t Hi, int64_t Ki,
                          float* scores /* f32 [T, ld_scores] */, int64_t ld_scores, int32_t* sel /* i32 [T, Ki] */,
                          cudaStream_t stream);

// ---- paged latent gather (paged_ref.cu) ------------------------------------------------------------------------
// out[n] = the latent of pool row rows[n] (= page·P + row), dequantised to BF16 exactly as
// MlaCacheView::read_latent does (FP8: e4m3 · scale is exact in BF16), for the naive prefill's contiguous
// context. Block tables are not read.
void paged_gather_latent(const PagedMlaCache& c, const int32_t* rows /* i32 [n] */, int64_t n,
                         uint16_t* out /* bf16 [n, C+R] */, cudaStream_t stream);

}  // namespace kestrel::cuda
