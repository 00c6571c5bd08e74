// Bytes of the paged MLA caches and of one KDA state slot for a config: the per-layer byte counts of
// core/cache_format.h (where the formats and their byte layouts are spelled out) times the config's
// layer counts. The cache manager, the memory planner, the CPU cache store and the GPU cache all size
// their memory from a CacheLayout, so what the planner counted is what is allocated.
//
// One page = `block_size` tokens of EVERY MLA layer (one block table per request for all layers); one
// state slot = every KDA layer's recurrent state and conv history for one sequence.
//
// Under tensor/context parallelism (docs/parallel.md §4) each rank allocates its own caches, sized by
// for_rank(): the scheduler's page ids and slot ids mean the same on every rank, but the bytes behind them
// are one rank's — KDA state has H/TP heads per rank (heads are split), while the MLA latent and index-key
// rows have no head dimension and are replicated on every TP rank, unless decode context parallelism
// spreads them along tokens (a scheduler page of P tokens is P/DCP rows on each rank).
#pragma once

#include <cstdint>
#include <string>

#include "core/cache_format.h"
#include "loader/config.h"

namespace kestrel::cache {

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
  // What ONE rank of a TP-`tp` group with decode context parallelism `dcp` (1 or tp) allocates: KDA heads
  // H/tp, pages of f.block_size/dcp rows (block_size below is then the rank's rows per page). Throws
  // kestrel::Error when H or the block size does not divide. for_rank(t, f, 1, 1) == from_config(t, f).
  static CacheLayout for_rank(const TextConfig& t, const CacheFormats& f, int tp, int dcp);

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
