// Byte layout of the paged MLA caches and of one KDA state slot, from the config alone
// (MODEL.md §0.3-§0.4, §3.3-§3.5).
//
// One page = `block_size` tokens (128 by default) of EVERY MLA layer: page id p names slot p of each
// layer's latent cache and of each layer's index-key cache, so a request needs one block table for
// all 24 layers (vLLM's layout). Per token and layer:
//   latent   bf16: (C + R) * 2                       = 1152 B (release)
//            fp8 : C e4m3 + ceil(C/128) f32 scales + R bf16 = 512 + 16 + 128 = 656 B
//   index key fp8 : Di e4m3 + 1 f32 scale              = 132 B
//            mxfp4: Di/2 packed e2m1 + Di/32 e8m0       = 68 B
//            bf16 : Di * 2                              = 256 B (the CPU reference format: exact, and
//                   the baseline the quantised formats are measured against)
// The indexer kernels use 64-token pages (§3.5); a 128-token manager page holds two of them, which the
// executor derives from the page id, so the bookkeeping here never sees kernel pages.
// A KDA state slot holds, for every KDA layer, the recurrent state H·Dk·Dk (f32, or f16 opt-in) and
// the conv state 3·(W−1)·H·Dk in the activation dtype (bf16).
#pragma once

#include <cstdint>
#include <string>

#include "loader/config.h"

namespace kestrel::cache {

enum class LatentFormat : uint8_t { bf16, fp8 };
enum class IndexKeyFormat : uint8_t { fp8, mxfp4, bf16 };
enum class KdaStateDtype : uint8_t { f32, f16 };

struct CacheFormats {
  int block_size = 128;  // tokens per page (MODEL.md §0.3)
  LatentFormat latent = LatentFormat::bf16;
  IndexKeyFormat index_keys = IndexKeyFormat::fp8;
  KdaStateDtype kda_state = KdaStateDtype::f32;
};

// "bf16"/"fp8" and "bf16"/"fp8"/"mxfp4" (CLI spellings); each parser throws kestrel::Error for anything else.
LatentFormat parse_latent_format(const std::string& s);
IndexKeyFormat parse_index_key_format(const std::string& s);
// "f32"/"f16" (also "fp32"/"fp16", "float32"/"float16"), for --kda-state-dtype.
KdaStateDtype parse_kda_state_dtype(const std::string& s);
const char* format_name(LatentFormat f);
const char* format_name(IndexKeyFormat f);
const char* format_name(KdaStateDtype f);

struct CacheLayout {
  int block_size = 0;
  int num_mla_layers = 0;
  int num_kda_layers = 0;
  int64_t latent_bytes_per_token = 0;     // one layer
  int64_t index_key_bytes_per_token = 0;  // one layer; 0 without an indexer
  int64_t kda_recurrent_bytes = 0;        // one layer
  int64_t kda_conv_bytes = 0;             // one layer

  // Throws kestrel::Error when a format does not fit the config (e.g. MXFP4 keys with Di % 32 != 0).
  static CacheLayout from_config(const TextConfig& t, const CacheFormats& f = {});

  int64_t bytes_per_token_per_layer() const { return latent_bytes_per_token + index_key_bytes_per_token; }
  int64_t bytes_per_token() const { return bytes_per_token_per_layer() * num_mla_layers; }
  int64_t latent_bytes_per_page_per_layer() const { return latent_bytes_per_token * block_size; }
  int64_t index_key_bytes_per_page_per_layer() const { return index_key_bytes_per_token * block_size; }
  int64_t bytes_per_page() const { return bytes_per_token() * block_size; }  // all MLA layers
  int64_t total_page_bytes(int64_t num_pages) const { return bytes_per_page() * num_pages; }
  int64_t state_bytes_per_slot() const { return (kda_recurrent_bytes + kda_conv_bytes) * num_kda_layers; }
  int64_t total_state_bytes(int64_t num_slots) const { return state_bytes_per_slot() * num_slots; }
  int64_t pages_for_tokens(int64_t tokens) const { return (tokens + block_size - 1) / block_size; }

  std::string describe() const;
};

}  // namespace kestrel::cache
