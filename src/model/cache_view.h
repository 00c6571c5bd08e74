// Paged views of one sequence's caches, the only way the CPU layers touch cross-step state.
//
// MLA: per layer a latent arena and an index-key arena, both indexed by page id; token t of a
// sequence lives in page block_table[t / P] at row t % P (docs/serving.md). The formats and their byte
// layouts are core/cache_format.h's (the GPU's), quantised on write and dequantised on read, so the CPU
// path measures exactly what an FP8/MXFP4 cache costs in accuracy; a read gives back the bf16 values the
// GPU kernels read.
// KDA: a state slot holds, per KDA layer, the recurrent state (f32 or f16) and the bf16 conv state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/cache_format.h"
#include "loader/config.h"
#include "model/common.h"

namespace kestrel::model {

struct MlaCacheView {
  LatentFormat latent_format = LatentFormat::bf16;
  IndexKeyFormat key_format = IndexKeyFormat::bf16;
  int block_size = 128;                 // P
  int64_t C = 0, R = 0, Di = 0;         // kv_lora_rank, qk_rope_head_dim, index_head_dim (0: no indexer)
  uint8_t* latent = nullptr;            // u8 [pages, P · latent_token_bytes]
  uint8_t* keys = nullptr;              // u8 [pages, P · key_token_bytes]
  std::span<const int32_t> block_table; // page of each P-token block, in token order

  static MlaCacheView make(const TextConfig& c, LatentFormat lf, IndexKeyFormat kf, int block_size);
  int64_t latent_token_bytes() const { return kestrel::latent_token_bytes(latent_format, C, R); }
  int64_t key_token_bytes() const { return index_key_token_bytes(key_format, Di); }
  int64_t capacity() const { return int64_t(block_table.size()) * block_size; }

  // Quantises and stores one token's row at position pos (bf16 [C+R] / bf16 [Di]).
  void write_latent(int64_t pos, const uint16_t* row) const;
  void write_key(int64_t pos, const uint16_t* key) const;
  // Dequantised rows of positions [0, n): bf16 [n, C+R] / bf16 [n, Di].
  void read_latent(int64_t n, uint16_t* out) const;
  // The rows of the n given positions, in that order: bf16 [n, C+R].
  void read_latent_rows(const int32_t* pos, int64_t n, uint16_t* out) const;
  void read_keys(int64_t n, uint16_t* out) const;
};

struct KdaStateView {
  void* recurrent = nullptr;  // f32 or f16 [H, Dk, Dk], S[h][key][value]
  bool recurrent_f16 = false;
  uint16_t* conv = nullptr;   // bf16 [3, W-1, H*Dk]
  // Optional per-position trace (DSpark verification, docs/speculative.md): when set, a call of T tokens
  // also writes the state after each of its tokens, so the state after any accepted prefix can be kept
  // without recomputing it (model/kda.h kda_keep_position). f32 recurrent states only.
  float* trace_recurrent = nullptr;  // f32 [T, H, Dk, Dk]
  uint16_t* trace_conv = nullptr;    // bf16 [T, 3, W-1, H*Dk]
};

// Elements of one KDA layer's recurrent state [H, Dk, Dk] / conv history [3, W−1, H·Dk].
int64_t kda_recurrent_elems(const TextConfig& c);
int64_t kda_conv_elems(const TextConfig& c);

// An MLA cache that owns its pages (identity block table), for single-request use and tests: the
// same paged code path, growing one page at a time.
struct MlaCache {
  LatentFormat latent_format = LatentFormat::bf16;
  IndexKeyFormat key_format = IndexKeyFormat::bf16;
  int block_size = 128;
  std::vector<uint8_t> latent, keys;  // u8 [pages, P · bytes per token]
  std::vector<int32_t> table;         // 0, 1, 2, ...
  int64_t len = 0;                    // S: tokens written

  void reset() { latent.clear(), keys.clear(), table.clear(), len = 0; }
  // Grows to hold n tokens and returns the view over all pages.
  MlaCacheView view(const TextConfig& c, int64_t n);
};

}  // namespace kestrel::model
