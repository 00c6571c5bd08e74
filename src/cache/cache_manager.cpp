// CacheManager (see cache_manager.h). Every refcount change in the cache subsystem happens in this
// file, next to the holder it adds or removes.
#include "cache/cache_manager.h"

#include <algorithm>
#include <unordered_set>

#include "core/check.h"

namespace kestrel::cache {

std::vector<uint64_t> block_extra_keys(int64_t num_tokens, int block_size, std::span<const MediaSpan> media) {
  std::vector<uint64_t> keys(size_t(num_tokens / block_size), 0);
  for (const MediaSpan& m : media) {
    if (m.start < 0 || m.end <= m.start) fail("media span [{}, {}) is empty or negative", m.start, m.end);
    for (int64_t b = m.start / block_size; b < int64_t(keys.size()) && b * block_size < m.end; ++b) {
      const int32_t where[2] = {int32_t(m.start - b * block_size), int32_t(m.end - b * block_size)};
      keys[size_t(b)] = PrefixCache::chain_hash(keys[size_t(b)] ^ m.content_hash, where, 1);
    }
  }
  return keys;
}

CacheManager::CacheManager(const CacheConfig& c)
    : config_(c), pages_(c.num_pages, c.block_size), slots_(c.num_state_slots), cache_(c.block_size, c.hash_bits) {}

CacheManager::Seq& CacheManager::seq(RequestId id) {
  auto it = seqs_.find(id);
  KCHECK(it != seqs_.end(), "request {} holds no cache", id);
  return it->second;
}

const CacheManager::Seq& CacheManager::seq(RequestId id) const {
  auto it = seqs_.find(id);
  KCHECK(it != seqs_.end(), "request {} holds no cache", id);
  return it->second;
}

const BlockTable& CacheManager::block_table(RequestId id) const { return seq(id).table; }
SlotId CacheManager::state_slot(RequestId id) const { return seq(id).slot; }

PrefixHit CacheManager::lookup(std::span<const int32_t> tokens, std::span<const uint64_t> block_extras,
                               int64_t max_tokens) const {
  PrefixHit hit;
  if (!config_.enable_prefix_cache) return hit;
  const int P = config_.block_size;
  max_tokens = std::min<int64_t>(max_tokens, int64_t(tokens.size()));
  EntryId parent = 0;
  std::vector<EntryId> chain;
  for (int64_t b = 0; (b + 1) * P <= max_tokens; ++b) {
    const uint64_t extra = size_t(b) < block_extras.size() ? block_extras[size_t(b)] : 0;
    const EntryId e = cache_.find(parent, tokens.subspan(size_t(b * P), size_t(P)), extra);
    if (e == 0) break;
    chain.push_back(e);
    parent = e;
    if (cache_.get(e).checkpoint >= 0) {
      hit.entries = chain;
      hit.num_tokens = (b + 1) * P;
      hit.checkpoint = cache_.get(e).checkpoint;
    }
  }
  hit.matched_tokens = int64_t(chain.size()) * P;
  for (EntryId e : hit.entries) hit.pages.push_back(cache_.get(e).page);
  return hit;
}

bool CacheManager::page_evictable(const PrefixCache::Entry& e) const {
  return e.children == 0 && e.restore_pins == 0 && pages_.refcount(e.page) == 1;
}

int32_t CacheManager::available_pages(const PrefixHit* keep) const {
  // An entry's page comes back only if its whole subtree can go (leaves first): mark every entry
  // that cannot go on its own, and all its ancestors, then count the rest.
  std::unordered_set<EntryId> stuck;
  auto mark = [&](EntryId from) {
    for (EntryId id = from; id != 0 && stuck.insert(id).second; id = cache_.get(id).parent) {
    }
  };
  cache_.for_each([&](const PrefixCache::Entry& e) {
    if (e.restore_pins != 0 || pages_.refcount(e.page) != 1) mark(e.id);
  });
  if (keep && !keep->entries.empty()) mark(keep->entries.back());
  return pages_.num_free() + int32_t(cache_.size() - stuck.size());
}

int32_t CacheManager::available_slots() const {
  int32_t n = slots_.num_free();
  cache_.for_each([&](const PrefixCache::Entry& e) { n += e.checkpoint >= 0 && e.restore_pins == 0; });
  return n;
}

bool CacheManager::evict_one_page() {
  const EntryId victim = cache_.oldest([&](const PrefixCache::Entry& e) { return page_evictable(e); });
  if (victim == 0) return false;
  const auto [page, slot] = cache_.remove(victim);
  pages_.unref(page);
  if (slot >= 0) slots_.release(slot);
  return true;
}

SlotId CacheManager::acquire_slot(SlotRole role) {
  SlotId s = slots_.acquire(role);
  if (s >= 0) return s;
  const EntryId victim =
      cache_.oldest([](const PrefixCache::Entry& e) { return e.checkpoint >= 0 && e.restore_pins == 0; });
  if (victim == 0) return -1;
  slots_.release(cache_.take_checkpoint(victim));
  return slots_.acquire(role);
}

int32_t CacheManager::pages_to_grow(RequestId id, int64_t num_tokens) const {
  const int64_t need = (num_tokens + config_.block_size - 1) / config_.block_size;
  return int32_t(std::max<int64_t>(0, need - int64_t(seq(id).table.pages.size())));
}

bool CacheManager::admit(RequestId id, const PrefixHit& hit) {
  KCHECK(!seqs_.count(id), "request {} admitted twice", id);
  KCHECK(hit.pages.size() == hit.entries.size() && hit.num_tokens == int64_t(hit.pages.size()) * config_.block_size,
         "inconsistent prefix hit for request {}", id);
  for (size_t i = 0; i < hit.entries.size(); ++i)
    KCHECK(cache_.contains(hit.entries[i]) && cache_.get(hit.entries[i]).page == hit.pages[i],
           "stale prefix hit for request {}", id);
  // Pin before taking a slot: the slot search may evict checkpoints, never the one we restore.
  EntryId pin = 0;
  if (!hit.entries.empty()) {
    pin = hit.entries.back();
    KCHECK(cache_.get(pin).checkpoint == hit.checkpoint && hit.checkpoint >= 0, "stale prefix hit for request {}", id);
    cache_.pin_restore(pin);
  }
  const SlotId slot = acquire_slot(SlotRole::running);
  if (slot < 0) {
    if (pin != 0) cache_.unpin_restore(pin);
    return false;
  }
  Seq s;
  s.slot = slot;
  s.restore_pin = pin;
  s.chain = hit.entries;
  for (size_t i = 0; i < hit.entries.size(); ++i) {
    pages_.ref(hit.pages[i]);
    cache_.touch(hit.entries[i]);
  }
  s.table.pages = hit.pages;
  s.table.num_tokens = hit.num_tokens;
  if (pin != 0) slots_.copy(hit.checkpoint, slot, CopyPhase::before_forward);
  seqs_.emplace(id, std::move(s));
  return true;
}

bool CacheManager::grow(RequestId id, int64_t num_tokens) {
  Seq& s = seq(id);
  const int32_t n = pages_to_grow(id, num_tokens);
  if (n > 0) {
    if (n > available_pages()) return false;
    while (pages_.num_free() < n)
      KCHECK(evict_one_page(), "available_pages promised {} pages for request {}", n, id);
    KCHECK(pages_.allocate(n, s.table.pages), "allocation of {} pages failed", n);
  }
  s.table.num_tokens = std::max(s.table.num_tokens, num_tokens);
  return true;
}

void CacheManager::shrink(RequestId id, int64_t num_tokens) {
  Seq& s = seq(id);
  const int P = config_.block_size;
  KCHECK(num_tokens >= int64_t(s.chain.size()) * P && num_tokens <= s.table.num_tokens,
         "request {}: shrink to {} tokens outside [{}, {}]", id, num_tokens, int64_t(s.chain.size()) * P,
         s.table.num_tokens);
  const size_t keep = size_t((num_tokens + P - 1) / P);
  while (s.table.pages.size() > keep) {
    pages_.unref(s.table.pages.back());
    s.table.pages.pop_back();
  }
  s.table.num_tokens = num_tokens;
}

SlotId CacheManager::snapshot(RequestId id, int32_t block_index) {
  if (!config_.enable_prefix_cache) return -1;
  Seq& s = seq(id);
  if (size_t(block_index) < s.chain.size() && cache_.contains(s.chain[size_t(block_index)]) &&
      cache_.get(s.chain[size_t(block_index)]).checkpoint >= 0)
    return -1;
  for (const auto& [b, slot] : s.snapshots)
    if (b == block_index) return -1;
  const SlotId slot = acquire_slot(SlotRole::checkpoint);
  if (slot < 0) return -1;
  slots_.copy(s.slot, slot, CopyPhase::after_forward);
  s.snapshots.emplace_back(block_index, slot);
  return slot;
}

void CacheManager::commit(RequestId id, std::span<const int32_t> tokens, std::span<const uint64_t> block_extras,
                          int64_t computed, int64_t cacheable) {
  Seq& s = seq(id);
  const int P = config_.block_size;
  const int64_t limit = std::min({computed, cacheable, int64_t(tokens.size()), s.table.num_tokens});
  if (config_.enable_prefix_cache) {
    for (EntryId e : s.chain) s.chain_broken |= !cache_.contains(e);
    for (int64_t b = int64_t(s.chain.size()); !s.chain_broken && (b + 1) * P <= limit; ++b) {
      const EntryId parent = s.chain.empty() ? 0 : s.chain.back();
      const auto block = tokens.subspan(size_t(b * P), size_t(P));
      const uint64_t extra = size_t(b) < block_extras.size() ? block_extras[size_t(b)] : 0;
      EntryId e = cache_.find(parent, block, extra);
      if (e == 0) {
        // Computed by us: the entry becomes a second holder of our page.
        const PageId page = s.table.pages[size_t(b)];
        pages_.ref(page);
        e = cache_.insert(parent, block, extra, page);
      }
      // Otherwise someone cached the same block meanwhile; ours stays private, the chain goes on.
      cache_.touch(e);
      s.chain.push_back(e);
    }
  }
  // Snapshots whose block is now an entry of our chain move there; the rest are given up.
  std::vector<std::pair<int32_t, SlotId>> keep;
  for (const auto& [b, slot] : s.snapshots) {
    if (int64_t(b + 1) * P > computed) {
      keep.emplace_back(b, slot);  // its step has not run yet
      continue;
    }
    const bool attach = !s.chain_broken && size_t(b) < s.chain.size() && cache_.get(s.chain[size_t(b)]).checkpoint < 0;
    if (attach)
      cache_.set_checkpoint(s.chain[size_t(b)], slot);
    else
      slots_.release(slot);
  }
  s.snapshots = std::move(keep);
}

void CacheManager::end_step() {
  for (auto& [id, s] : seqs_)
    if (s.restore_pin != 0) {
      cache_.unpin_restore(s.restore_pin);
      s.restore_pin = 0;
    }
}

void CacheManager::free(RequestId id) {
  Seq& s = seq(id);
  for (PageId p : s.table.pages) pages_.unref(p);
  slots_.release(s.slot);
  for (const auto& [b, slot] : s.snapshots) slots_.release(slot);
  if (s.restore_pin != 0) cache_.unpin_restore(s.restore_pin);
  seqs_.erase(id);
}

int32_t CacheManager::evict_all() {
  int32_t n = 0;
  while (evict_one_page()) ++n;
  return n;
}

void CacheManager::check_integrity() const {
  pages_.check_integrity();
  slots_.check_integrity();
  cache_.check_integrity();
  const int P = config_.block_size;
  std::vector<int32_t> holders(size_t(pages_.num_pages()), 0);
  std::vector<int32_t> owners(size_t(pages_.num_pages()), 0);
  std::vector<int32_t> slot_holders(size_t(slots_.num_slots()), 0);
  std::vector<SlotRole> slot_role(size_t(slots_.num_slots()), SlotRole::free);
  auto hold_slot = [&](SlotId s, SlotRole r, const char* who) {
    KCHECK(s >= 0 && s < slots_.num_slots(), "{} holds bad slot {}", who, s);
    ++slot_holders[size_t(s)];
    slot_role[size_t(s)] = r;
  };
  std::unordered_map<EntryId, int32_t> pins;
  for (const auto& [id, s] : seqs_) {
    const int64_t need = (s.table.num_tokens + P - 1) / P;
    KCHECK(int64_t(s.table.pages.size()) == need, "request {} has {} pages for {} tokens", id, s.table.pages.size(),
           s.table.num_tokens);
    std::unordered_set<PageId> mine;
    for (PageId p : s.table.pages) {
      KCHECK(p >= 0 && p < pages_.num_pages(), "request {} lists bad page {}", id, p);
      KCHECK(mine.insert(p).second, "request {} lists page {} twice", id, p);
      ++holders[size_t(p)];
    }
    hold_slot(s.slot, SlotRole::running, "a request");
    for (const auto& [b, slot] : s.snapshots) hold_slot(slot, SlotRole::checkpoint, "a pending snapshot");
    if (s.restore_pin != 0) ++pins[s.restore_pin];
  }
  cache_.for_each([&](const PrefixCache::Entry& e) {
    ++holders[size_t(e.page)];
    ++owners[size_t(e.page)];
    if (e.checkpoint >= 0) hold_slot(e.checkpoint, SlotRole::checkpoint, "a cache entry");
    KCHECK(e.restore_pins == (pins.count(e.id) ? pins[e.id] : 0), "entry {} pinned {} times, {} restores pending",
           e.id, e.restore_pins, pins.count(e.id) ? pins[e.id] : 0);
  });
  for (PageId p = 0; p < pages_.num_pages(); ++p) {
    KCHECK(pages_.refcount(p) == holders[size_t(p)], "page {} refcount {} but {} holders", p, pages_.refcount(p),
           holders[size_t(p)]);
    KCHECK(owners[size_t(p)] <= 1, "page {} owned by {} cache entries", p, owners[size_t(p)]);
  }
  for (SlotId s = 0; s < slots_.num_slots(); ++s) {
    KCHECK(slot_holders[size_t(s)] <= 1, "slot {} has {} holders", s, slot_holders[size_t(s)]);
    KCHECK(slots_.role(s) == slot_role[size_t(s)], "slot {} role disagrees with its holder", s);
  }
}

}  // namespace kestrel::cache
