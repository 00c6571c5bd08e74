// Memory planner: splits a byte budget for caches into KDA state slots and MLA cache pages.
//
// State slots come first because their count is a policy choice (how many requests may run at once,
// plus how many prefix-cache checkpoints to keep) and each is large (428.6 MiB per slot for the
// full model in FP32); every remaining byte becomes pages. Capacity follows: pages × P tokens in
// total, and one request may use all of them.
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
};

struct MemoryPlan {
  cache::CacheLayout layout;
  int32_t num_pages = 0;
  int32_t num_state_slots = 0;
  int32_t max_running = 0;
  int64_t page_bytes = 0;    // all pages
  int64_t state_bytes = 0;   // all slots
  int64_t unused_bytes = 0;  // budget left over (less than one page)
  int64_t token_capacity = 0;
  int64_t longest_request = 0;  // tokens one request alone can hold

  cache::CacheConfig cache_config(bool prefix_cache = true) const;
  std::string describe() const;
};

// Throws kestrel::Error when the budget cannot hold the slots and at least one page.
MemoryPlan plan_memory(const TextConfig& t, int64_t budget_bytes, const MemoryPlanOptions& options = {});

}  // namespace kestrel::sched
