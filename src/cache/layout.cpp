// CacheLayout arithmetic; the formulas are spelled out in layout.h.
#include "cache/layout.h"

#include <fmt/format.h>

#include "core/check.h"

namespace kestrel::cache {

CacheLayout CacheLayout::from_config(const TextConfig& t, const CacheFormats& f) {
  if (f.block_size <= 0) fail("cache: block_size must be positive, got {}", f.block_size);
  if (t.kv_lora_rank <= 0 || t.qk_rope_head_dim < 0)
    fail("cache: config has kv_lora_rank {} / qk_rope_head_dim {}", t.kv_lora_rank, t.qk_rope_head_dim);
  CacheLayout l;
  l.block_size = f.block_size;
  l.num_mla_layers = t.num_layers_of(AttnKind::mla);
  l.num_kda_layers = t.num_layers_of(AttnKind::kda);
  const int64_t C = t.kv_lora_rank, R = t.qk_rope_head_dim;
  if (f.latent == LatentFormat::bf16) {
    l.latent_bytes_per_token = (C + R) * 2;
  } else {
    l.latent_bytes_per_token = C + (C + 127) / 128 * 4 + R * 2;  // values, f32 scale per 128, bf16 rope
  }
  if (t.has_indexer()) {
    const int64_t Di = t.index_head_dim;
    if (f.index_keys == IndexKeyFormat::fp8) {
      l.index_key_bytes_per_token = Di + 4;
    } else if (f.index_keys == IndexKeyFormat::bf16) {
      l.index_key_bytes_per_token = Di * 2;
    } else {
      if (Di % 32 != 0) fail("cache: MXFP4 index keys need index_head_dim % 32 == 0, got {}", Di);
      l.index_key_bytes_per_token = Di / 2 + Di / 32;
    }
  }
  const int64_t H = t.kda.num_heads, Dk = t.kda.head_dim;
  l.kda_recurrent_bytes = H * Dk * Dk * (f.kda_state == KdaStateDtype::f32 ? 4 : 2);
  l.kda_conv_bytes = 3 * (t.kda.conv_size - 1) * H * Dk * 2;
  return l;
}

LatentFormat parse_latent_format(const std::string& s) {
  if (s == "bf16") return LatentFormat::bf16;
  if (s == "fp8") return LatentFormat::fp8;
  fail("latent cache dtype must be bf16 or fp8, got '{}'", s);
}

IndexKeyFormat parse_index_key_format(const std::string& s) {
  if (s == "bf16") return IndexKeyFormat::bf16;
  if (s == "fp8") return IndexKeyFormat::fp8;
  if (s == "mxfp4") return IndexKeyFormat::mxfp4;
  fail("index-key cache dtype must be bf16, fp8 or mxfp4, got '{}'", s);
}

KdaStateDtype parse_kda_state_dtype(const std::string& s) {
  if (s == "f32" || s == "fp32" || s == "float32") return KdaStateDtype::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return KdaStateDtype::f16;
  fail("KDA state dtype must be f32 or f16, got '{}'", s);
}

const char* format_name(LatentFormat f) { return f == LatentFormat::bf16 ? "bf16" : "fp8"; }
const char* format_name(IndexKeyFormat f) {
  return f == IndexKeyFormat::bf16 ? "bf16" : f == IndexKeyFormat::fp8 ? "fp8" : "mxfp4";
}

const char* format_name(KdaStateDtype f) { return f == KdaStateDtype::f32 ? "f32" : "f16"; }

std::string CacheLayout::describe() const {
  return fmt::format(
      "page = {} tokens x {} MLA layers x ({} B latent + {} B index key) = {} B; "
      "KDA slot = {} layers x ({} B recurrent + {} B conv) = {} B",
      block_size, num_mla_layers, latent_bytes_per_token, index_key_bytes_per_token, bytes_per_page(),
      num_kda_layers, kda_recurrent_bytes, kda_conv_bytes, state_bytes_per_slot());
}

}  // namespace kestrel::cache
