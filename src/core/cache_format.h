// Cache formats: how the serving caches store each token of an MLA layer (latent, index key) and each
// sequence's KDA state, and how many bytes that takes. The one home of the format enums, of the byte
// layouts and of the bytes-per-token arithmetic: the cache manager (cache/layout.h), the memory planner
// (sched/memory_plan.h), the CPU views (model/cache_view.h), the CUDA kernels (kernels/cuda/paged.h)
// and the CUDA model's device caches all use what is here. Header-only arithmetic (constexpr, no fmt),
// so nvcc-compiled kernels include it too.
//
// Paged MLA caches (MODEL.md §0.3, §3.4, §3.5): per MLA layer one latent arena and one index-key arena,
// both indexed by page id; a page holds P = block_size tokens (128 by default) of EVERY MLA layer, so a
// request has one block table for all layers. Token at position pos lives in page block_table[pos / P],
// row pos % P. Per token and layer (release sizes C = 512, R = 64, Di = 128 in parentheses):
//   latent bf16   [ĉ | k_pe] bf16                                         (C+R)·2 B       (1152 B)
//   latent fp8    [ĉ e4m3 (C) | f32 scale per 128 of ĉ | k_pe bf16 (R)]   C + ⌈C/128⌉·4 + 2R (656 B)
//                 (FlashMLA's fp8_ds_mla order); scale s = 2^⌈log2(max(amax, 1e-4) / 448)⌉ (the §3.5
//                 FP8 rule), so e4m3·s is exact in bf16 and a read gives back bf16 values
//   keys bf16     Di bf16                                                 2·Di B          (256 B; the
//                 CPU reference format: exact, the baseline the quantised formats are measured against)
//   keys fp8      Di e4m3 + one f32 scale (same rule)                     Di + 4 B        (132 B)
//   keys mxfp4    Di/2 packed e2m1 + Di/32 e8m0 (§0.9)                    Di/2 + Di/32 B  (68 B)
// Index keys are grouped in kernel pages of 64 tokens (§3.5; a P that is not a multiple of 64, as in
// small test pages, is one kernel page of P tokens): fp8 [64 × Di e4m3 | 64 × f32 scale], mxfp4
// [64 × Di/2 packed | 64 × Di/32 e8m0] ("values then scales"); bf16 keys are plain rows. A 128-token
// manager page holds two kernel pages, which readers derive from the page id: the bookkeeping never
// sees kernel pages. Latents are plain rows of latent_token_bytes.
//
// KDA state slot (MODEL.md §3.3): per KDA layer the recurrent state S [H, Dk(key), Dk(value)] in f32, or
// f16 opt-in (each step widens it to f32 and rounds it back once), and the conv history bf16 [3, W−1, H·Dk]
// (q | k | v, the activation dtype). Zero is a fresh start (S_0 = 0, empty history).
#pragma once

#include <cstdint>
#include <string>

namespace kestrel {

enum class LatentFormat : uint8_t { bf16, fp8 };
enum class IndexKeyFormat : uint8_t { fp8, mxfp4, bf16 };
enum class KdaStateDtype : uint8_t { f32, f16 };

// What the caches of one engine store.
struct CacheFormats {
  int block_size = 128;  // tokens per page (MODEL.md §0.3)
  LatentFormat latent = LatentFormat::bf16;
  IndexKeyFormat index_keys = IndexKeyFormat::fp8;
  KdaStateDtype kda_state = KdaStateDtype::f32;
};

// ---- bytes (the layouts above) -----------------------------------------------------------------------------
// One token of one MLA layer's latent cache; C = kv_lora_rank, R = qk_rope_head_dim.
constexpr int64_t latent_token_bytes(LatentFormat f, int64_t C, int64_t R) {
  return f == LatentFormat::bf16 ? (C + R) * 2 : C + (C + 127) / 128 * 4 + R * 2;
}
// One token of one MLA layer's index-key cache; Di = index_head_dim (0: no indexer, 0 bytes).
constexpr int64_t index_key_token_bytes(IndexKeyFormat f, int64_t Di) {
  return f == IndexKeyFormat::bf16 ? Di * 2 : f == IndexKeyFormat::fp8 ? Di + 4 : Di / 2 + Di / 32;
}
// Tokens per kernel page of the index-key cache for manager pages of P tokens (in P's integer type).
template <typename Int>
constexpr Int index_key_kernel_page(Int P) {
  return P % 64 == 0 ? Int(64) : P;
}
// One KDA layer's recurrent state [H, Dk, Dk] and conv history [3, W−1, H·Dk] of one slot.
constexpr int64_t kda_recurrent_bytes(KdaStateDtype f, int64_t H, int64_t Dk) {
  return H * Dk * Dk * (f == KdaStateDtype::f32 ? 4 : 2);
}
constexpr int64_t kda_conv_bytes(int64_t H, int64_t Dk, int64_t W) { return 3 * (W - 1) * H * Dk * 2; }

// ---- checks and names (cache_format.cpp) -------------------------------------------------------------------
// Throws kestrel::Error when keys in `f` cannot hold Di-wide keys (MXFP4 needs Di % 32 == 0).
void check_index_key_format(IndexKeyFormat f, int64_t Di);
// "bf16"/"fp8" and "bf16"/"fp8"/"mxfp4" (CLI spellings); each parser throws kestrel::Error for anything else.
LatentFormat parse_latent_format(const std::string& s);
IndexKeyFormat parse_index_key_format(const std::string& s);
// "f32"/"f16" (also "fp32"/"fp16", "float32"/"float16"), for --kda-state-dtype.
KdaStateDtype parse_kda_state_dtype(const std::string& s);
const char* format_name(LatentFormat f);
const char* format_name(IndexKeyFormat f);
const char* format_name(KdaStateDtype f);

}  // namespace kestrel
