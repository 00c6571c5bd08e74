// CacheStore: the bytes behind the cache bookkeeping of src/cache. Per MLA layer a latent arena and
// an index-key arena indexed by page id (page p = tokens [p·P, p·P + P) of whichever request's block
// table lists it), and one KDA state arena indexed by slot id. Formats and their byte layouts are
// core/cache_format.h's; sizes come from CacheLayout, so what the memory planner counted is exactly what
// is allocated (the CPU views, model/cache_view.h, read the same per-token bytes).
//
// Slot layout: for every KDA layer in layer order, [recurrent f32|f16 [H, Dk, Dk] | conv bf16
// [3, W-1, H·Dk]]. Zeroing a slot is a fresh start (MODEL.md §3.3: S_0 = 0, empty conv history).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cache/layout.h"
#include "cache/page_pool.h"
#include "cache/state_pool.h"
#include "loader/config.h"
#include "model/model.h"

namespace kestrel::runtime {

class CacheStore {
 public:
  // Throws kestrel::Error when the formats do not fit the config.
  CacheStore(const TextConfig& t, const CacheFormats& f, int32_t num_pages, int32_t num_slots);

  const cache::CacheLayout& layout() const { return layout_; }
  int64_t bytes() const;

  // The caches of the sequence on `slot` with pages `table`, positions [0, pos) already written.
  // Valid while `table` lives.
  model::SeqCacheView view(cache::SlotId slot, std::span<const cache::PageId> table, int64_t pos);
  void zero_slot(cache::SlotId s);
  void copy_slot(cache::SlotId src, cache::SlotId dst);

 private:
  uint8_t* slot_ptr(cache::SlotId s);

  TextConfig t_;
  CacheFormats formats_;
  cache::CacheLayout layout_;
  int32_t num_pages_, num_slots_;
  std::vector<std::vector<uint8_t>> latent_, keys_;  // per layer index (empty for KDA): u8 [pages, P·bytes/token]
  std::vector<uint8_t> slots_;                       // u8 [slots, slot bytes]
  std::vector<int64_t> kda_offset_;                  // per layer index: byte offset in a slot (−1 for MLA)
};

}  // namespace kestrel::runtime
