// PrefixCache bookkeeping (see prefix_cache.h). The chain hash is a splitmix64-style mix: cheap,
// well distributed, deterministic across runs and platforms (std::hash is not).
#include "cache/prefix_cache.h"

#include <set>

#include "core/check.h"

namespace kestrel::cache {
namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 30, h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27, h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

}  // namespace

PrefixCache::PrefixCache(int block_size, int hash_bits) : block_size_(block_size) {
  if (block_size <= 0) fail("prefix cache: block size must be positive, got {}", block_size);
  if (hash_bits < 1 || hash_bits > 64) fail("prefix cache: hash_bits must be in [1, 64], got {}", hash_bits);
  hash_mask_ = hash_bits == 64 ? ~0ull : (1ull << hash_bits) - 1;
}

uint64_t PrefixCache::chain_hash(uint64_t parent_hash, std::span<const int32_t> tokens, uint64_t extra) {
  uint64_t h = mix(parent_hash, extra);
  for (int32_t t : tokens) h = mix(h, uint64_t(uint32_t(t)));
  return mix(h, tokens.size());
}

const PrefixCache::Entry& PrefixCache::get(EntryId id) const {
  auto it = entries_.find(id);
  KCHECK(it != entries_.end(), "no prefix-cache entry {}", id);
  return it->second;
}

PrefixCache::Entry& PrefixCache::get_mut(EntryId id) {
  auto it = entries_.find(id);
  KCHECK(it != entries_.end(), "no prefix-cache entry {}", id);
  return it->second;
}

EntryId PrefixCache::find(EntryId parent, std::span<const int32_t> tokens, uint64_t extra) const {
  if (int(tokens.size()) != block_size_) return 0;
  const uint64_t ph = parent == 0 ? 0 : get(parent).hash;
  const uint64_t h = chain_hash(ph, tokens, extra);
  auto [lo, hi] = index_.equal_range(bucket_key(h));
  for (auto it = lo; it != hi; ++it) {
    const Entry& e = get(it->second);
    if (e.hash == h && e.parent == parent && e.extra == extra &&
        std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end()))
      return e.id;
  }
  return 0;
}

EntryId PrefixCache::insert(EntryId parent, std::span<const int32_t> tokens, uint64_t extra, PageId page) {
  KCHECK(int(tokens.size()) == block_size_, "insert of a {}-token block, block size {}", tokens.size(), block_size_);
  KCHECK(find(parent, tokens, extra) == 0, "block already cached under entry {}", parent);
  Entry e;
  e.id = next_id_++;
  e.parent = parent;
  e.block_index = 0;
  uint64_t ph = 0;
  if (parent != 0) {
    Entry& p = get_mut(parent);
    ph = p.hash;
    e.block_index = p.block_index + 1;
    ++p.children;
  }
  e.hash = chain_hash(ph, tokens, extra);
  e.tokens.assign(tokens.begin(), tokens.end());
  e.extra = extra;
  e.page = page;
  e.lru = lru_.insert(lru_.end(), e.id);
  index_.emplace(bucket_key(e.hash), e.id);
  const EntryId id = e.id;
  entries_.emplace(id, std::move(e));
  return id;
}

void PrefixCache::set_checkpoint(EntryId id, SlotId slot) {
  Entry& e = get_mut(id);
  KCHECK(e.checkpoint < 0, "entry {} already has checkpoint {}", id, e.checkpoint);
  KCHECK(slot >= 0, "bad checkpoint slot {}", slot);
  e.checkpoint = slot;
  ++num_checkpoints_;
}

SlotId PrefixCache::take_checkpoint(EntryId id) {
  Entry& e = get_mut(id);
  KCHECK(e.checkpoint >= 0 && e.restore_pins == 0, "entry {} has no free checkpoint", id);
  const SlotId s = e.checkpoint;
  e.checkpoint = -1;
  --num_checkpoints_;
  return s;
}

void PrefixCache::touch(EntryId id) {
  Entry& e = get_mut(id);
  lru_.splice(lru_.end(), lru_, e.lru);
}

void PrefixCache::pin_restore(EntryId id) {
  Entry& e = get_mut(id);
  KCHECK(e.checkpoint >= 0, "pin of entry {} without checkpoint", id);
  ++e.restore_pins;
}

void PrefixCache::unpin_restore(EntryId id) {
  Entry& e = get_mut(id);
  KCHECK(e.restore_pins > 0, "unpin of unpinned entry {}", id);
  --e.restore_pins;
}

EntryId PrefixCache::oldest(const std::function<bool(const Entry&)>& pred) const {
  for (EntryId id : lru_)
    if (pred(get(id))) return id;
  return 0;
}

std::pair<PageId, SlotId> PrefixCache::remove(EntryId id) {
  Entry& e = get_mut(id);
  KCHECK(e.children == 0, "evicting entry {} with {} children would orphan them", id, e.children);
  KCHECK(e.restore_pins == 0, "evicting entry {} while a restore reads it", id);
  if (e.parent != 0) --get_mut(e.parent).children;
  auto [lo, hi] = index_.equal_range(bucket_key(e.hash));
  for (auto it = lo; it != hi; ++it)
    if (it->second == id) {
      index_.erase(it);
      break;
    }
  lru_.erase(e.lru);
  if (e.checkpoint >= 0) --num_checkpoints_;
  const std::pair<PageId, SlotId> owned{e.page, e.checkpoint};
  entries_.erase(id);
  return owned;
}

void PrefixCache::for_each(const std::function<void(const Entry&)>& f) const {
  for (const auto& [id, e] : entries_) f(e);
}

void PrefixCache::check_integrity() const {
  KCHECK(lru_.size() == entries_.size(), "LRU list has {} ids for {} entries", lru_.size(), entries_.size());
  KCHECK(index_.size() == entries_.size(), "hash index has {} ids for {} entries", index_.size(), entries_.size());
  std::set<EntryId> in_lru;
  for (EntryId id : lru_) {
    KCHECK(entries_.count(id), "LRU list names missing entry {}", id);
    KCHECK(in_lru.insert(id).second, "entry {} twice in the LRU list", id);
  }
  std::unordered_map<EntryId, int32_t> children;
  int32_t checkpoints = 0;
  for (const auto& [id, e] : entries_) {
    KCHECK(e.id == id && id < next_id_, "entry id {} mismatched", id);
    KCHECK(int(e.tokens.size()) == block_size_, "entry {} holds {} tokens", id, e.tokens.size());
    KCHECK(e.page >= 0, "entry {} owns no page", id);
    KCHECK(e.restore_pins >= 0 && (e.restore_pins == 0 || e.checkpoint >= 0), "entry {} pins {}", id, e.restore_pins);
    uint64_t ph = 0;
    int32_t depth = 0;
    if (e.parent != 0) {
      auto p = entries_.find(e.parent);
      KCHECK(p != entries_.end(), "entry {} has evicted parent {}", id, e.parent);
      ph = p->second.hash, depth = p->second.block_index + 1;
      ++children[e.parent];
    }
    KCHECK(e.block_index == depth, "entry {} depth {} != {}", id, e.block_index, depth);
    KCHECK(e.hash == chain_hash(ph, e.tokens, e.extra), "entry {} hash does not match its chain", id);
    bool indexed = false;
    auto [lo, hi] = index_.equal_range(bucket_key(e.hash));
    for (auto it = lo; it != hi; ++it) indexed |= it->second == id;
    KCHECK(indexed, "entry {} missing from the hash index", id);
    checkpoints += e.checkpoint >= 0;
  }
  for (const auto& [id, e] : entries_)
    KCHECK(e.children == (children.count(id) ? children[id] : 0), "entry {} child count {} is wrong", id, e.children);
  KCHECK(checkpoints == num_checkpoints_, "checkpoint count {} != {}", num_checkpoints_, checkpoints);
}

}  // namespace kestrel::cache
