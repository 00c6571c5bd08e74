// PrefixCache: full blocks of already-computed prompts, shareable by later requests, for a hybrid
// (KDA + MLA) model.
//
// Entries form a tree: an entry is one full block (block_size token ids + an optional extra key,
// e.g. the content hash of an image whose placeholder tokens fall in the block) under its parent
// entry (the previous block; 0 = the root). The lookup key is a hash chain, hash(parent hash, tokens,
// extra), but a hit is only declared after comparing the parent id, the token ids and the extra key,
// so a hash collision can cost a miss, never a wrong answer (`hash_bits` < 64 forces collisions in
// tests). Each entry owns one reference to its page; the caller (CacheManager) does the refcounting,
// this class only records who owns what.
//
// Why checkpoints: MLA pages can be shared at any block, but KDA has no per-token cache, only the
// recurrent state after the last token. Resuming after a shared prefix of n tokens needs the KDA
// state at exactly n, so an entry may carry a checkpoint (a KdaStatePool slot frozen at its end).
// A usable hit ends at an entry with a checkpoint.
//
// Eviction is LRU over a list ordered by last use (touch moves to the back). Only leaves are evicted
// whole, so every entry's parent is always present and chains never have holes; a checkpoint alone
// may be dropped from any entry. `restore_pins` protects a checkpoint that a restore copy of the
// step being planned still has to read.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache/page_pool.h"
#include "cache/state_pool.h"

namespace kestrel::cache {

using EntryId = uint64_t;  // never reused; 0 = the root (no entry)

class PrefixCache {
 public:
  struct Entry {
    EntryId id = 0;
    EntryId parent = 0;
    uint64_t hash = 0;  // full 64-bit chain hash
    int32_t block_index = 0;  // depth: the entry covers tokens [block_index·P, (block_index+1)·P)
    std::vector<int32_t> tokens;
    uint64_t extra = 0;
    PageId page = -1;
    SlotId checkpoint = -1;
    int32_t children = 0;
    int32_t restore_pins = 0;
    std::list<EntryId>::iterator lru;
  };

  explicit PrefixCache(int block_size, int hash_bits = 64);

  static uint64_t chain_hash(uint64_t parent_hash, std::span<const int32_t> tokens, uint64_t extra);
  int block_size() const { return block_size_; }
  size_t size() const { return entries_.size(); }
  int32_t num_checkpoints() const { return num_checkpoints_; }

  // The child of `parent` holding exactly these tokens and extra key; 0 when absent.
  EntryId find(EntryId parent, std::span<const int32_t> tokens, uint64_t extra) const;
  const Entry& get(EntryId id) const;
  bool contains(EntryId id) const { return entries_.count(id) != 0; }

  // A new entry owning `page` (the caller already took the reference for it). The parent must
  // exist and the block must not be cached yet.
  EntryId insert(EntryId parent, std::span<const int32_t> tokens, uint64_t extra, PageId page);
  void set_checkpoint(EntryId id, SlotId slot);
  SlotId take_checkpoint(EntryId id);  // the entry keeps its page
  void touch(EntryId id);
  void pin_restore(EntryId id);
  void unpin_restore(EntryId id);

  // Oldest entry satisfying `pred` (least recently used first); 0 when none.
  EntryId oldest(const std::function<bool(const Entry&)>& pred) const;
  // Removes a leaf entry; returns the page reference and checkpoint slot (or -1) it owned.
  std::pair<PageId, SlotId> remove(EntryId id);

  // Calls f(entry) for every entry.
  void for_each(const std::function<void(const Entry&)>& f) const;
  // Tree, hash index, LRU list and counters agree.
  void check_integrity() const;

 private:
  Entry& get_mut(EntryId id);
  uint64_t bucket_key(uint64_t hash) const { return hash & hash_mask_; }

  int block_size_;
  uint64_t hash_mask_;
  EntryId next_id_ = 1;
  int32_t num_checkpoints_ = 0;
  std::unordered_map<EntryId, Entry> entries_;
  std::unordered_multimap<uint64_t, EntryId> index_;  // masked chain hash -> entries
  std::list<EntryId> lru_;                             // front = least recently used
};

}  // namespace kestrel::cache
