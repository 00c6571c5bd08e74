// Memory planner arithmetic (see memory_plan.h).
#include "sched/memory_plan.h"

#include <fmt/format.h>

#include <limits>

#include "core/check.h"

namespace kestrel::sched {

MemoryPlan plan_memory(const TextConfig& t, int64_t budget_bytes, const MemoryPlanOptions& o) {
  if (budget_bytes <= 0) fail("memory plan: budget must be positive, got {} bytes", budget_bytes);
  if (o.max_running < 1) fail("memory plan: max_running must be >= 1, got {}", o.max_running);
  if (o.checkpoint_slots < 0) fail("memory plan: checkpoint_slots must be >= 0, got {}", o.checkpoint_slots);
  MemoryPlan p;
  p.layout = cache::CacheLayout::for_rank(t, o.formats, o.tp, o.dcp);
  p.block_size = o.formats.block_size;
  p.tp = o.tp, p.dcp = o.dcp;
  p.max_running = o.max_running;
  p.num_state_slots = o.max_running + o.checkpoint_slots;
  p.state_bytes = p.layout.total_state_bytes(p.num_state_slots);
  const int64_t left = budget_bytes - p.state_bytes;
  if (left < p.layout.bytes_per_page())
    fail("memory plan: {} B cannot hold {} KDA state slots ({} B each) plus one {} B cache page", budget_bytes,
         p.num_state_slots, p.layout.state_bytes_per_slot(), p.layout.bytes_per_page());
  const int64_t pages = left / p.layout.bytes_per_page();
  if (pages > std::numeric_limits<int32_t>::max()) fail("memory plan: {} pages overflow a page id", pages);
  p.num_pages = int32_t(pages);
  p.page_bytes = p.layout.total_page_bytes(pages);
  p.unused_bytes = left - p.page_bytes;
  p.token_capacity = pages * p.block_size;
  p.longest_request = p.token_capacity;
  return p;
}

cache::CacheConfig MemoryPlan::cache_config(bool prefix_cache) const {
  cache::CacheConfig c;
  c.num_pages = num_pages;
  c.num_state_slots = num_state_slots;
  c.block_size = block_size;
  c.enable_prefix_cache = prefix_cache;
  return c;
}

std::string MemoryPlan::describe() const {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const std::string rank =
      tp > 1 || dcp > 1 ? fmt::format("per rank of TP{}{} (KDA heads / {}, MLA pages of {} tokens hold {} rows "
                                      "per rank):\n",
                                      tp, dcp > 1 ? fmt::format(" + DCP{}", dcp) : "", tp, block_size, layout.block_size)
                        : "";
  return fmt::format(
      "{}{}\n"
      "state slots  {} ({} running + {} checkpoints), {:.2f} GiB\n"
      "cache pages  {} x {} tokens, {:.2f} GiB ({} B left over)\n"
      "capacity     {} tokens in total; {} concurrent requests; longest single request {} tokens",
      rank, layout.describe(), num_state_slots, max_running, num_state_slots - max_running, double(state_bytes) / gib,
      num_pages, block_size, double(page_bytes) / gib, unused_bytes, token_capacity, max_running,
      longest_request);
}

}  // namespace kestrel::sched
