// Device caches of the GPU model (CudaCache): what the engine's cache bookkeeping (src/cache) hands out
// by id, in device memory. Formats and byte layouts are core/cache_format.h's and sizes come from
// cache::CacheLayout, so the memory plan is what is allocated (plus one hidden page and slot, below).
//
// Per MLA layer: a paged latent arena u8 [pages·P, latent_token_bytes] and, with an indexer, a paged
// index-key arena u8 [pages, P · key_token_bytes] (kernels/cuda/paged.h reads and writes both through
// block tables); token t of a request is pool row block_table[t/P]·P + t%P, one block table for all
// layers. Per KDA layer a state pool indexed by slot: recurrent f32|f16 [slots, H, Dk, Dk] and conv
// history bf16 [slots, W−1, 3·H·Dk] (q|k|v side by side: one conv launch covers all three).
// One page and one slot beyond the planned ones are hidden: the padded rows of a CUDA-graph bucket
// write there (never read), so padding never touches a real request. The graph buckets captured
// against this cache's pools live here too and are freed with it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cache/layout.h"
#include "core/cache_format.h"
#include "kernels/cuda/device_alloc.h"
#include "kernels/cuda/paged.h"
#include "loader/config.h"
#include "model/cuda/graphs.h"

namespace kestrel::model {

struct CudaCache {
  cuda::CachingAllocator* alloc = nullptr;
  int32_t num_pages = 0, num_slots = 0;  // planned; the hidden page and slot are num_pages, num_slots
  int P = 0;                             // tokens per page
  CacheFormats formats;
  cache::CacheLayout layout;
  int64_t C = 0, R = 0, Di = 0;          // kv_lora_rank, qk_rope_head_dim, index_head_dim (0: no indexer)
  std::vector<uint8_t*> kda_S;           // per KDA layer: f32|f16 [slots+1, H, Dk, Dk] (null for MLA layers)
  std::vector<uint16_t*> kda_conv;       // per KDA layer: bf16 [slots+1, W−1, 3·H·Dk]
  std::vector<uint8_t*> latent;          // per MLA layer: u8 [(pages+1)·P, latent_token_bytes]
  std::vector<uint8_t*> index_k;         // per MLA layer with an indexer: u8 [pages+1, P · key_token_bytes]
  std::vector<void*> owned;
  gpu::GraphBuckets graphs;              // by (bucket batch size, rows per sequence, context bound)
  // DSpark verification trace (speculative.cpp): per KDA layer, the slot's recurrent and conv bytes after
  // each verify row of the last forward — u8 [trace_cap, kda_recurrent_bytes] and u8 [trace_cap,
  // kda_conv_bytes] — and each verify sequence's slot, first trace row and length (keep_verified).
  std::vector<uint8_t*> trace_S, trace_conv;
  int64_t trace_cap = 0;
  struct VerifySeq {
    int32_t slot = 0;
    int64_t row0 = 0, len = 0;
  };
  std::vector<VerifySeq> verify;
  // keep_verified_batch's launch table: per KDA layer {trace_S → kda_S, sb} and {trace_conv → kda_conv, cb}
  // (device cuda::RowArrays [keep_arrays]; built on first use, dropped when the trace is reallocated) and its
  // index map device i32 [2, keep_idx_cap]: each verify sequence's trace row, then its slot.
  void* keep_tab = nullptr;
  int64_t keep_arrays = 0;
  int32_t* keep_idx = nullptr;
  int64_t keep_idx_cap = 0;

  bool kda_state_f16() const { return formats.kda_state == KdaStateDtype::f16; }
  // One MLA layer's pools with the block tables of a launch (device i32 [n, bt_stride]; null for writes).
  cuda::PagedMlaCache mla_view(int layer, const int32_t* block_tables, int64_t bt_stride) const;
};

namespace gpu {

// Device bytes of a cache of `pages` pages and `slots` slots (the hidden page and slot included).
int64_t cache_bytes(const TextConfig& t, int64_t pages, int64_t slots, const CacheFormats& f);
// Allocates and zeroes (on `stream`, synchronised) a cache; throws kestrel::Error for bad sizes or
// formats that do not fit the config.
CudaCache* new_cache(cuda::CachingAllocator& alloc, cudaStream_t stream, const TextConfig& t, int32_t pages,
                     int32_t slots, const CacheFormats& f);
void free_cache(CudaCache* c);
void zero_slot(CudaCache& c, int32_t slot, cudaStream_t stream);  // a fresh start: S = 0, empty conv history
void copy_slot(CudaCache& c, int32_t src, int32_t dst, cudaStream_t stream);

}  // namespace gpu
}  // namespace kestrel::model
