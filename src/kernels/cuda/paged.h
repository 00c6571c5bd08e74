// Paged MLA caches on the GPU (MODEL.md §0.3, §3.4 absorbed decode, §3.5 indexer): quantise-on-write
// into the page arenas, and batched (varlen) reads through per-request block tables for the absorbed
// MLA decode and prefill (dense or sparse); the indexer's scores + top-k over the key pages are indexer.h's.
// CPU twins: model::MlaCacheView::write_latent / write_key (byte-identical writes) and read_latent /
// read_keys followed by cpu::mla_attn_absorbed / cpu::indexer_select_topk (the reads dequantise exactly
// to the BF16 values the CPU reads back; the contiguous reference kernels the tests compare against are
// tests/gpu/ref/gpu_ref.h's).
//
// Formats and byte layouts are core/cache_format.h's (one per-layer arena per cache, indexed by page id;
// a page holds P = block_size tokens; index keys in 64-token kernel pages, values then scales).
// Token at position pos of request r lives in page block_tables[r·bt_stride + pos/P], row pos % P.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/cache_format.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cuda/gemm.h"

namespace kestrel::cuda {

using cpu::MlaDims;

// One MLA layer's paged caches plus the block tables of the requests in a launch.
struct PagedMlaCache {
  LatentFormat latent_format = LatentFormat::bf16;
  IndexKeyFormat key_format = IndexKeyFormat::fp8;
  int block_size = 128;              // P
  int64_t C = 0, R = 0, Di = 0;      // kv_lora_rank, qk_rope_head_dim, index_head_dim (0: no indexer)
  uint8_t* latent = nullptr;         // device u8 [pages, P · latent_token_bytes]
  uint8_t* keys = nullptr;           // device u8 [pages, P · key_token_bytes] (null without an indexer)
  const int32_t* block_tables = nullptr;  // device i32 [n_requests, bt_stride]: page of each P-token block
  int64_t bt_stride = 0;

  int64_t latent_token_bytes() const { return kestrel::latent_token_bytes(latent_format, C, R); }
  int64_t key_token_bytes() const { return index_key_token_bytes(key_format, Di); }
};

// ---- writes (quantise on write, byte-identical to MlaCacheView) -------------------------------------------
// Row t goes to slot slots[t] = page·P + row (vLLM's slot mapping); slots[t] < 0 skips the row.
// Block tables are not read. C and R multiples of 8; Di a multiple of 32 (mxfp4) or 8.
void paged_write_latent(const PagedMlaCache& c, const uint16_t* rows /* bf16 [T, C+R], row stride ld */, int64_t ld,
                        const int64_t* slots /* i64 [T] */, int64_t T, cudaStream_t stream);
void paged_write_latent(const PagedMlaCache& c, const uint16_t* rows /* bf16 [T, C+R], row stride ld */, int64_t ld,
                        const int32_t* slots /* i32 [T] */, int64_t T, cudaStream_t stream);
void paged_write_keys(const PagedMlaCache& c, const uint16_t* keys /* bf16 [T, Di], row stride ld */, int64_t ld,
                      const int64_t* slots /* i64 [T] */, int64_t T, cudaStream_t stream);
// The i32-slot overloads serve the GPU engine, whose step metadata is i32.
void paged_write_keys(const PagedMlaCache& c, const uint16_t* keys /* bf16 [T, Di], row stride ld */, int64_t ld,
                      const int32_t* slots /* i32 [T] */, int64_t T, cudaStream_t stream);

// MLA's norms and cache writes after its stacked input projection (MODEL.md §3.4 steps 1–2, §3.5 step 2), one
// launch whose CTAs take the tasks side by side: cq = RMSNorm_{q_a_norm}(qa); ĉ = RMSNorm_{kv_a_norm}(c) in place in
// rows = [c | k_pe] and the row into its latent slot; with an indexer (kraw non-null) knew = LayerNorm(kraw) and
// into its key slot. The same values and bytes as rmsnorm_bf16 (twice), paged_write_latent, indexer_key_norm and
// paged_write_keys one after the other (four or five launches). Rows contiguous; slots as above.
struct MlaProjNorms {
  const uint16_t* qa = nullptr;         // bf16 [T, Q]
  uint16_t* cq = nullptr;               // bf16 [T, Q]
  const uint16_t* q_a_norm = nullptr;   // bf16 [Q]
  int64_t Q = 0;
  uint16_t* rows = nullptr;             // bf16 [T, C+R], normalised in place
  const uint16_t* kv_a_norm = nullptr;  // bf16 [C]
  const uint16_t* kraw = nullptr;       // bf16 [T, Di] (null: no indexer)
  uint16_t* knew = nullptr;             // bf16 [T, Di]
  const uint16_t* k_norm = nullptr;     // bf16 [Di]
  const uint16_t* k_norm_bias = nullptr;  // bf16 [Di] or null (bias 0)
  float eps = 0.0f;                     // the RMSNorms' (the key LayerNorm's is 1e-6)
};
void mla_norms_and_writes(const PagedMlaCache& c, const MlaProjNorms& a, const int32_t* slots /* i32 [T] */,
                          int64_t T, cudaStream_t stream);

// ---- absorbed MLA decode over the paged latent cache ------------------------------------------------------
// B query rows (one query each; several rows may share a request, e.g. speculative tokens). Row b uses
// block-table row req[b] (req null: b) and attends to positions 0..lens[b]−1, or (sparse) to sel[b, ..]
// (ascending positions, −1 ends the list). max_keys ≥ every row's key count (host side; sizes the
// split over keys). Hm ≤ 16, C ≤ 512, C and R multiples of 8; FP8 rows are read raw by the MMAs,
// whose operands are still exactly the BF16 values MlaCacheView::read_latent returns (mla_tc.cu).
// mla_decode_paged runs on tensor cores (mla_tc.cu: all heads of a row as the MMA's M side, split-KV,
// log-sum-exp combine fused with o_h = W_UV,h ô_h) for (C, R) ∈ {(512, 64), (64, 16)}, and otherwise falls
// back to mla_decode_paged_simple, the CUDA-core kernel (FP32 scores; kept as the fallback and as the
// benchmark's baseline). The tensor-core path rounds q̃ (to bf16; FP8 pages: f16) and p (bf16) for the MMA:
// relative L2 error vs cpu::mla_attn_absorbed ≲ 3e-3 (tested at 1e-2).
struct MlaPagedBatch {
  const int32_t* lens = nullptr;  // device i32 [B]
  const int32_t* req = nullptr;   // device i32 [B] or null
  const int32_t* sel = nullptr;   // device i32 [B, Ksel] or null (dense)
  int64_t Ksel = 0;
  int64_t B = 0;
  int64_t max_keys = 0;
};
size_t mla_decode_paged_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys);
// gate (optional): MODEL.md §3.4 step 5's σ(g) applied to o in the last launch, o = bf16(o · σ(g)) exactly as
// sigmoid_gate_bf16 would after it (one launch fewer on the decode chain).
void mla_decode_paged(GemmLt& lt, const MlaDims& d, const uint16_t* q /* bf16 [B, Hm, N+R] */,
                      const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */, const PagedMlaCache& cache,
                      const MlaPagedBatch& batch, void* workspace /* mla_decode_paged_workspace_bytes */,
                      uint16_t* o /* bf16 [B, Hm*Dv] */, cudaStream_t stream,
                      const uint16_t* gate = nullptr /* bf16 [B, Hm*Dv] or null */);
size_t mla_decode_paged_simple_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys);
void mla_decode_paged_simple(GemmLt& lt, const MlaDims& d, const uint16_t* q /* bf16 [B, Hm, N+R] */,
                             const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */, const PagedMlaCache& cache,
                             const MlaPagedBatch& batch, void* workspace /* ..._simple_workspace_bytes */,
                             uint16_t* o /* bf16 [B, Hm*Dv] */, cudaStream_t stream);

// ---- MLA prefill over the paged latent cache (absorbed, flash form) ---------------------------------------
// T query rows of a step's prefill chunks, several sequences in one launch (varlen): row t uses block-table
// row req[t] (null: t) and attends causally to positions 0..lens[t]−1 (lens[t] = its position + 1; the
// chunk's own latent rows must already be in their pages), or to its indexer selection sel[t, ..]
// (ascending, −1 ends it) — the same row description as the decode and indexer_select_paged_tc, so the
// engine's per-row arrays (row lengths, row requests) serve all three. No gather: keys are read from the
// pages through the block tables. Absorbed (MQA over the shared latent, MODEL.md §3.4): q̃ = W_UKᵀ q_nope
// by one batched GEMM, the tensor-core core of the decode (online softmax, one CTA per row and key chunk,
// all heads as M), ô rounded to bf16, then o_h = ô_h·W_UV,hᵀ by cuBLASLt per head. CPU twin:
// cpu::mla_attn_absorbed over MlaCacheView::read_latent (equal to cpu::mla_attn_naive in exact
// arithmetic); relative L2 error ≲ 4e-3 (q̃, p and ô rounded to bf16), tested at 1e-2. Shapes without a
// tensor-core instantiation run mla_decode_paged_simple over the same rows.
// Workspace (mla_prefill_paged_workspace_bytes): q̃ f32 [T, Hm, C] + ô bf16 [T, Hm, C] (+ split partials
// when fewer rows than SMs are split over keys): 36 KB per row at the TP8 shape (Hm 12, C 512), 302 MB
// for an 8K-token chunk; callers bound it by the number of rows per launch.
size_t mla_prefill_paged_workspace_bytes(const MlaDims& d, int64_t T, int64_t max_keys);
void mla_prefill_paged(GemmLt& lt, const MlaDims& d, const uint16_t* q /* bf16 [T, Hm, N+R] */,
                       const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */, const PagedMlaCache& cache,
                       const MlaPagedBatch& rows /* B = T rows */, void* workspace /* ..._workspace_bytes */,
                       uint16_t* o /* bf16 [T, Hm*Dv] */, cudaStream_t stream);

}  // namespace kestrel::cuda
