// Memory planner: splits a byte budget for caches into KDA state slots and MLA cache pages.
//
// State slots come first because their count is a policy choice (how many requests may run at once,
// plus how many prefix-cache checkpoints to keep) and each is large (428.6 MiB per slot for the
// full model in FP32); every remaining byte becomes pages. Capacity follows: pages × P tokens in
// total, and one request may use all of them.
//
// Parallel layouts: the budget is ONE rank's (one GPU's) and the plan counts one rank's bytes
// (cache::CacheLayout::for_rank: KDA state H/TP heads per slot; MLA latent and index-key pages whole per
// TP rank, or P/DCP rows per page under decode context parallelism). Page and slot counts are the same on
// every rank, so the scheduler's ids mean the same everywhere. TP8 thus holds 8x the KDA slots of TP1 in
// the same per-GPU budget, and DCP8 8x the tokens.
#pragma once

#include <cstdint>
#include <string>

#include "cache/cache_manager.h"
#include "cache/layout.h"
#include "loader/config.h"

namespace kestrel::sched {

struct MemoryPlanOptions {
  int32_t max_running = 64;      // concurrent requests: one running state slot each
  int32_t checkpoint_slots = 0;  // extra slots for prefix-cache KDA checkpoints
  CacheFormats formats;  // core/cache_format.h
  int tp = 1;            // tensor-parallel ranks (KDA heads split over them)
  int dcp = 1;           // decode-context-parallel ranks: 1 or tp (MLA pages split along tokens)
};

struct MemoryPlan {
  cache::CacheLayout layout;  // one rank's bytes (layout.block_size = rows per page on a rank)
  int32_t block_size = 0;     // tokens per scheduler page (= layout.block_size · dcp)
  int tp = 1, dcp = 1;
  int32_t num_pages = 0;
  int32_t num_state_slots = 0;
  int32_t max_running = 0;
  int64_t page_bytes = 0;    // all pages, on one rank
  int64_t state_bytes = 0;   // all slots, on one rank
  int64_t unused_bytes = 0;  // budget left over (less than one page)
  int64_t token_capacity = 0;
  int64_t longest_request = 0;  // tokens one request alone can hold

  cache::CacheConfig cache_config(bool prefix_cache = true) const;
  std::string describe() const;
};

// Throws kestrel::Error when the budget cannot hold the slots and at least one page.
MemoryPlan plan_memory(const TextConfig& t, int64_t budget_bytes, const MemoryPlanOptions& options = {});

}  // namespace kestrel::sched
