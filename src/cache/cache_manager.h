// CacheManager: the one owner and the only mutator of the page pool, the KDA state pool, the prefix
// cache and every request's block table. The scheduler asks it for memory in request terms (admit,
// grow to n tokens, snapshot, commit computed blocks, free) and it keeps the refcounts right.
//
// Holders and invariants (check_integrity() verifies all of them):
//  - a page's refcount = number of block tables listing it + number of cache entries owning it;
//    every page is exactly one of free (refcount 0), cached (owned by one entry, possibly also read
//    by requests) or private (held only by requests);
//  - a state slot is free, running (exactly one admitted request) or checkpoint (exactly one cache
//    entry or one snapshot pending until the step that writes it completes);
//  - a block table has exactly ceil(num_tokens / P) pages.
// Memory pressure evicts least-recently-used cache entries that nobody else holds: whole leaf
// entries for pages, bare checkpoints for slots. A checkpoint that a restore of the current step
// still reads is pinned until end_step().
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/page_pool.h"
#include "cache/prefix_cache.h"
#include "cache/state_pool.h"
#include "request/request.h"

namespace kestrel::cache {

using RequestId = kestrel::RequestId;

struct CacheConfig {
  int32_t num_pages = 0;
  int32_t num_state_slots = 0;  // running requests + checkpoints together
  int block_size = 128;
  bool enable_prefix_cache = true;
  int hash_bits = 64;  // < 64 only to force hash collisions in tests
};

// Tokens [start, end) of a request carry media (e.g. an image's placeholders) with this content hash
// (the request vocabulary's type).
using MediaSpan = kestrel::MediaSpan;

// The extra key of each full block of a `num_tokens`-token sequence: 0 for text-only blocks, else a
// hash of the media spans overlapping it (content and offset), so equal placeholder tokens with
// different images never share a block.
std::vector<uint64_t> block_extra_keys(int64_t num_tokens, int block_size, std::span<const MediaSpan> media);

struct PrefixHit {
  int64_t num_tokens = 0;           // usable prefix: ends at an entry with a KDA checkpoint
  std::vector<EntryId> entries;     // the chain of that prefix, block 0 first
  std::vector<PageId> pages;        // their pages
  SlotId checkpoint = -1;           // KDA state at num_tokens
  int64_t matched_tokens = 0;       // longest chain of cached pages, checkpoint or not (≥ num_tokens)
};

class CacheManager {
 public:
  explicit CacheManager(const CacheConfig& c);

  const CacheConfig& config() const { return config_; }
  const PagePool& pages() const { return pages_; }
  const KdaStatePool& slots() const { return slots_; }
  const PrefixCache& prefix_cache() const { return cache_; }
  bool has(RequestId id) const { return seqs_.count(id) != 0; }
  const BlockTable& block_table(RequestId id) const;
  SlotId state_slot(RequestId id) const;

  // Longest usable cached prefix of `tokens` no longer than max_tokens (read-only).
  PrefixHit lookup(std::span<const int32_t> tokens, std::span<const uint64_t> block_extras, int64_t max_tokens) const;
  // Pages reclaimable now: free ones plus those that evicting unshared cache entries would free.
  // With `keep`, the entries of that hit count as held (admitting it will share them).
  int32_t available_pages(const PrefixHit* keep = nullptr) const;
  // Slots obtainable now: free plus unpinned checkpoints.
  int32_t available_slots() const;
  int32_t pages_to_grow(RequestId id, int64_t num_tokens) const;

  // Starts `id` on a running slot with the hit's pages shared and its checkpoint restored (a
  // before-forward copy). False, with nothing changed, when no slot can be had.
  bool admit(RequestId id, const PrefixHit& hit);
  // Grows the block table to cover num_tokens, evicting cache entries if needed; all-or-nothing.
  bool grow(RequestId id, int64_t num_tokens);
  // Cuts the block table back to num_tokens (≥ the cached chain), releasing the pages wholly past it:
  // the positions of rejected speculative tokens. A partly used last page stays.
  void shrink(RequestId id, int64_t num_tokens);
  // A checkpoint slot that will hold `id`'s state after this step's forward pass, at the end of its
  // block `block_index` (an after-forward copy). -1 when no slot can be had or the block already has
  // one; snapshots are an optimisation, so the caller simply goes on.
  SlotId snapshot(RequestId id, int32_t block_index);
  // Registers `id`'s full blocks below min(computed, cacheable) tokens in the prefix cache and hands
  // its pending snapshots to their entries. `tokens` and `block_extras` describe the sequence.
  void commit(RequestId id, std::span<const int32_t> tokens, std::span<const uint64_t> block_extras,
              int64_t computed, int64_t cacheable);
  // The step's copies have run: unpin restored checkpoints.
  void end_step();
  // Releases everything `id` holds (pages, slot, pending snapshots).
  void free(RequestId id);
  // Evicts every cache entry nobody else holds; returns how many went.
  int32_t evict_all();
  std::vector<SlotCopy> drain_copies() { return slots_.drain_copies(); }

  void check_integrity() const;

 private:
  struct Seq {
    BlockTable table;
    SlotId slot = -1;
    std::vector<EntryId> chain;  // cache entry of each leading block known to be cached
    bool chain_broken = false;   // an entry of `chain` was evicted: stop extending it
    EntryId restore_pin = 0;
    std::vector<std::pair<int32_t, SlotId>> snapshots;  // (block index, slot) pending until commit
  };
  Seq& seq(RequestId id);
  const Seq& seq(RequestId id) const;
  bool page_evictable(const PrefixCache::Entry& e) const;
  bool evict_one_page();
  SlotId acquire_slot(SlotRole role);

  CacheConfig config_;
  PagePool pages_;
  KdaStatePool slots_;
  PrefixCache cache_;
  std::unordered_map<RequestId, Seq> seqs_;
};

}  // namespace kestrel::cache
