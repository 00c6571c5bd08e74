// CacheLayout: core/cache_format.h's per-layer bytes for a config.
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
  l.latent_bytes_per_token = latent_token_bytes(f.latent, t.kv_lora_rank, t.qk_rope_head_dim);
  if (t.has_indexer()) {
    check_index_key_format(f.index_keys, t.index_head_dim);
    l.index_key_bytes_per_token = index_key_token_bytes(f.index_keys, t.index_head_dim);
  }
  l.kda_recurrent_bytes = kestrel::kda_recurrent_bytes(f.kda_state, t.kda.num_heads, t.kda.head_dim);
  l.kda_conv_bytes = kestrel::kda_conv_bytes(t.kda.num_heads, t.kda.head_dim, t.kda.conv_size);
  return l;
}

CacheLayout CacheLayout::for_rank(const TextConfig& t, const CacheFormats& f, int tp, int dcp) {
  if (tp < 1 || dcp < 1 || (dcp != 1 && dcp != tp))
    fail("cache: a rank of TP{} with DCP{} (DCP must be 1 or the TP size)", tp, dcp);
  if (t.kda.num_heads % tp != 0)
    fail("cache: {} KDA heads do not split over {} tensor-parallel ranks", t.kda.num_heads, tp);
  if (f.block_size % dcp != 0)
    fail("cache: --block-size {} must divide by --decode-context-parallel-size {}", f.block_size, dcp);
  TextConfig rt = t;
  rt.kda.num_heads = t.kda.num_heads / tp;  // KDA state: the rank's heads only
  CacheFormats rf = f;
  rf.block_size = f.block_size / dcp;  // MLA latent and index keys: replicated per TP rank, split by DCP
  return from_config(rt, rf);
}

std::string CacheLayout::describe() const {
  return fmt::format(
      "page = {} tokens x {} MLA layers x ({} B latent + {} B index key) = {} B; "
      "KDA slot = {} layers x ({} B recurrent + {} B conv) = {} B",
      block_size, num_mla_layers, latent_bytes_per_token, index_key_bytes_per_token, bytes_per_page(),
      num_kda_layers, kda_recurrent_bytes, kda_conv_bytes, state_bytes_per_slot());
}

}  // namespace kestrel::cache
