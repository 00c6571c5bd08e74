// Cache bookkeeping: byte layout from the full K3.1 Pro config, page pool refcounts, state-pool
// roles and recorded copies, the prefix cache's hash chain (determinism, collisions resolved by
// comparing token ids), LRU eviction order, and checkpoint-aware lookups through CacheManager.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "cache/cache_manager.h"
#include "cache/layout.h"
#include "core/check.h"
#include "loader/config.h"
#include "loader/inventory.h"
#include "sched/memory_plan.h"

namespace kestrel::cache {
namespace {

TextConfig full_text_config() {
  std::ifstream in(std::string(KESTREL_SOURCE_DIR) + "/tests/data/k31_pro_config.json");
  return parse_config(nlohmann::json::parse(in), "full").text;
}

std::vector<int32_t> iota_tokens(int n, int32_t first) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(CacheLayout, FullModelBytes) {
  const TextConfig t = full_text_config();
  const CacheLayout bf16 = CacheLayout::from_config(t);
  EXPECT_EQ(bf16.block_size, 128);
  EXPECT_EQ(bf16.num_mla_layers, 24);
  EXPECT_EQ(bf16.num_kda_layers, 69);
  EXPECT_EQ(bf16.latent_bytes_per_token, 1152);
  EXPECT_EQ(bf16.index_key_bytes_per_token, 132);
  EXPECT_EQ(bf16.bytes_per_page(), int64_t(1152 + 132) * 24 * 128);
  EXPECT_EQ(bf16.total_page_bytes(10), bf16.bytes_per_page() * 10);
  // MODEL.md §3.3: 6 MiB recurrent + 3·12288·3·2 B conv per layer, 428.6 MiB over 69 layers.
  EXPECT_EQ(bf16.kda_recurrent_bytes, 6 << 20);
  EXPECT_EQ(bf16.kda_conv_bytes, 3 * 12288 * 3 * 2);
  EXPECT_NEAR(double(bf16.state_bytes_per_slot()) / (1 << 20), 428.6, 0.05);

  const CacheLayout small = CacheLayout::from_config(
      t, {128, LatentFormat::fp8, IndexKeyFormat::mxfp4, KdaStateDtype::f16});
  EXPECT_EQ(small.latent_bytes_per_token, 656);
  EXPECT_EQ(small.index_key_bytes_per_token, 68);
  EXPECT_EQ(small.kda_recurrent_bytes, 3 << 20);
  // BF16 keys: the exact reference format, 2·Di.
  EXPECT_EQ(CacheLayout::from_config(t, {128, LatentFormat::bf16, IndexKeyFormat::bf16}).index_key_bytes_per_token, 256);
  // Index keys live in 64-token kernel pages; a page of P tokens with P % 64 != 0 is one kernel page.
  EXPECT_EQ(index_key_kernel_page(128), 64);
  EXPECT_EQ(index_key_kernel_page(16), 16);
}

TEST(CacheFormats, ParsesCliSpellings) {
  EXPECT_EQ(parse_latent_format("fp8"), LatentFormat::fp8);
  EXPECT_EQ(parse_index_key_format("mxfp4"), IndexKeyFormat::mxfp4);
  EXPECT_EQ(parse_kda_state_dtype("float16"), KdaStateDtype::f16);
  EXPECT_THROW(parse_latent_format("fp4"), Error);
  EXPECT_THROW(parse_index_key_format("f16"), Error);
  EXPECT_THROW(parse_kda_state_dtype("bf16"), Error);
  EXPECT_STREQ(format_name(IndexKeyFormat::bf16), "bf16");
  EXPECT_STREQ(format_name(LatentFormat::fp8), "fp8");
  EXPECT_STREQ(format_name(KdaStateDtype::f32), "f32");
}

TEST(CacheLayout, RejectsBadFormats) {
  TextConfig t = full_text_config();
  EXPECT_THROW(CacheLayout::from_config(t, {0}), Error);
  t.index_head_dim = 100;
  EXPECT_THROW(CacheLayout::from_config(t, {128, LatentFormat::bf16, IndexKeyFormat::mxfp4}), Error);
}

TEST(CacheMemoryPlan, SplitsBudgetIntoSlotsAndPages) {
  const TextConfig t = full_text_config();
  const int64_t gib = int64_t(1) << 30;
  sched::MemoryPlanOptions o;
  o.max_running = 8;
  o.checkpoint_slots = 4;
  const sched::MemoryPlan p = sched::plan_memory(t, 40 * gib, o);
  EXPECT_EQ(p.num_state_slots, 12);
  EXPECT_EQ(p.state_bytes, 12 * p.layout.state_bytes_per_slot());
  EXPECT_EQ(p.state_bytes + p.page_bytes + p.unused_bytes, 40 * gib);
  EXPECT_LT(p.unused_bytes, p.layout.bytes_per_page());
  EXPECT_EQ(p.token_capacity, int64_t(p.num_pages) * 128);
  EXPECT_NE(p.describe().find("longest single request"), std::string::npos);
  EXPECT_THROW(sched::plan_memory(t, 1 * gib, o), Error);  // 12 slots alone need ~5 GiB
}

// One rank's caches under tensor / decode-context parallelism (docs/parallel.md §4), every number worked
// out by hand from the K3.1 Pro config: H = 96 KDA heads of Dk = 128, conv width 4, 69 KDA layers; 24 MLA
// layers of C + R = 512 + 64 latent (bf16: 1,152 B) and Di = 128 index keys (fp8: 128 + 4 B).
TEST(CacheLayout, FullModelPerRankBytes) {
  const TextConfig t = full_text_config();
  const CacheFormats f{128, LatentFormat::bf16, IndexKeyFormat::fp8, KdaStateDtype::f32};
  // TP8: 12 heads per rank. Recurrent 12·128·128·4 = 786,432 B, conv 3·3·12·128·2 = 27,648 B per layer;
  // × 69 = 56,171,520 B per slot. Pages whole: 1,284 B × 24 layers × 128 tokens = 3,944,448 B.
  const CacheLayout tp8 = CacheLayout::for_rank(t, f, 8, 1);
  EXPECT_EQ(tp8.kda_recurrent_bytes, 786432);
  EXPECT_EQ(tp8.kda_conv_bytes, 27648);
  EXPECT_EQ(tp8.state_bytes_per_slot(), 56171520);
  EXPECT_EQ(tp8.block_size, 128);
  EXPECT_EQ(tp8.bytes_per_page(), 3944448);
  // TP8 + DCP8: the same slot, a 128-token page is 16 rows per rank: 1,284 × 24 × 16 = 493,056 B.
  const CacheLayout dcp8 = CacheLayout::for_rank(t, f, 8, 8);
  EXPECT_EQ(dcp8.state_bytes_per_slot(), 56171520);
  EXPECT_EQ(dcp8.block_size, 16);
  EXPECT_EQ(dcp8.bytes_per_page(), 493056);
  // TP16: 6 heads, (393,216 + 13,824) × 69 = 28,085,760 B.
  EXPECT_EQ(CacheLayout::for_rank(t, f, 16, 1).state_bytes_per_slot(), 28085760);
  // One rank of TP1 is the unsharded layout.
  const CacheLayout one = CacheLayout::for_rank(t, f, 1, 1), whole = CacheLayout::from_config(t, f);
  EXPECT_EQ(one.state_bytes_per_slot(), whole.state_bytes_per_slot());
  EXPECT_EQ(one.bytes_per_page(), whole.bytes_per_page());
  // `kestrel inspect` (loader/inventory.h) reports the same per-GPU caches.
  std::ifstream in(std::string(KESTREL_SOURCE_DIR) + "/tests/data/k31_pro_config.json");
  const ModelConfig mc = parse_config(nlohmann::json::parse(in), "full");
  EXPECT_EQ(layout_memory(mc, {8, 0, true, 8}).cache_bytes_per_token, 493056 / 128);
  EXPECT_EQ(layout_memory(mc, {8, 0, true, 8}).kda_state_bytes, 56171520);
  EXPECT_EQ(layout_memory(mc, {16, 0, true, 1}).kda_state_bytes, 28085760);
  // Heads that do not split, a block size DCP does not divide, a DCP group other than 1 or TP.
  EXPECT_THROW(CacheLayout::for_rank(t, f, 5, 1), Error);
  EXPECT_THROW(CacheLayout::for_rank(t, {96, LatentFormat::bf16, IndexKeyFormat::fp8, KdaStateDtype::f32}, 64, 64),
               Error);
  EXPECT_THROW(CacheLayout::for_rank(t, f, 4, 2), Error);
}

// The engine's memory plan counts one rank's bytes out of one rank's budget (40 GiB here, 8 running +
// 4 checkpoint slots): TP1 12 × 449,372,160 B = 5,392,465,920 B of slots leave 9,521 pages; TP8
// 12 × 56,171,520 = 674,058,240 B leave 42,275,614,720 B = 10,717 pages of 3,944,448 B (2,965,504 B
// over); TP8 + DCP8 85,742 pages of 493,056 B (7,168 B over), each still 128 scheduler tokens.
TEST(CacheMemoryPlan, CountsOneRanksBytesUnderTpAndDcp) {
  const TextConfig t = full_text_config();
  const int64_t budget = int64_t(40) << 30;
  sched::MemoryPlanOptions o;
  o.max_running = 8;
  o.checkpoint_slots = 4;
  o.formats = {128, LatentFormat::bf16, IndexKeyFormat::fp8, KdaStateDtype::f32};
  EXPECT_EQ(sched::plan_memory(t, budget, o).num_pages, 9521);
  o.tp = 8;
  const sched::MemoryPlan tp8 = sched::plan_memory(t, budget, o);
  EXPECT_EQ(tp8.state_bytes, 674058240);
  EXPECT_EQ(tp8.num_pages, 10717);
  EXPECT_EQ(tp8.unused_bytes, 2965504);
  EXPECT_EQ(tp8.block_size, 128);
  EXPECT_EQ(tp8.token_capacity, int64_t(10717) * 128);
  EXPECT_EQ(tp8.cache_config().block_size, 128);
  EXPECT_NE(tp8.describe().find("per rank of TP8"), std::string::npos);
  o.dcp = 8;
  const sched::MemoryPlan dcp8 = sched::plan_memory(t, budget, o);
  EXPECT_EQ(dcp8.num_pages, 85742);
  EXPECT_EQ(dcp8.unused_bytes, 7168);
  EXPECT_EQ(dcp8.token_capacity, int64_t(85742) * 128);
  EXPECT_EQ(dcp8.cache_config().block_size, 128);
  EXPECT_EQ(dcp8.layout.block_size, 16);
}

TEST(CachePagePool, AllocateRefUnref) {
  PagePool pool(4);
  std::vector<PageId> a;
  ASSERT_TRUE(pool.allocate(3, a));
  EXPECT_EQ(a, (std::vector<PageId>{0, 1, 2}));
  EXPECT_EQ(pool.num_free(), 1);
  std::vector<PageId> b;
  EXPECT_FALSE(pool.allocate(2, b));  // all-or-nothing
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(pool.num_free(), 1);
  pool.ref(1);
  EXPECT_EQ(pool.refcount(1), 2);
  pool.unref(1);
  EXPECT_EQ(pool.num_free(), 1);
  pool.unref(1);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_THROW(pool.unref(1), Error);  // double free
  EXPECT_THROW(pool.ref(3), Error);    // free page
  EXPECT_THROW(pool.ref(4), Error);    // out of range
  pool.check_integrity();
  for (PageId p : {0, 2}) pool.unref(p);
  EXPECT_EQ(pool.num_free(), 4);
  pool.check_integrity();
  EXPECT_THROW(PagePool(0), Error);
}

TEST(CacheStatePool, RolesAndRecordedCopies) {
  KdaStatePool pool(3);
  const SlotId r = pool.acquire(SlotRole::running);
  const SlotId c = pool.acquire(SlotRole::checkpoint);
  EXPECT_EQ(pool.count(SlotRole::running), 1);
  EXPECT_EQ(pool.count(SlotRole::checkpoint), 1);
  pool.copy(c, r, CopyPhase::before_forward);
  pool.copy(r, c, CopyPhase::after_forward);
  EXPECT_THROW(pool.copy(r, 2, CopyPhase::after_forward), Error);  // slot 2 is free
  const auto copies = pool.drain_copies();
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].src, c);
  EXPECT_EQ(copies[0].dst, r);
  EXPECT_TRUE(pool.drain_copies().empty());
  EXPECT_GE(pool.acquire(SlotRole::running), 0);
  EXPECT_EQ(pool.acquire(SlotRole::running), -1);
  pool.release(r);
  EXPECT_THROW(pool.release(r), Error);
  pool.check_integrity();
}

TEST(PrefixCacheChain, HashIsDeterministicAndChained) {
  const auto a = iota_tokens(4, 10), b = iota_tokens(4, 20);
  EXPECT_EQ(PrefixCache::chain_hash(0, a, 0), PrefixCache::chain_hash(0, a, 0));
  EXPECT_NE(PrefixCache::chain_hash(0, a, 0), PrefixCache::chain_hash(0, b, 0));
  EXPECT_NE(PrefixCache::chain_hash(0, a, 0), PrefixCache::chain_hash(1, a, 0));  // parent matters
  EXPECT_NE(PrefixCache::chain_hash(0, a, 0), PrefixCache::chain_hash(0, a, 7));  // image key matters

  PrefixCache pc(4);
  const EntryId e0 = pc.insert(0, a, 0, 5);
  const EntryId e1 = pc.insert(e0, b, 0, 6);
  EXPECT_EQ(pc.find(0, a, 0), e0);
  EXPECT_EQ(pc.find(e0, b, 0), e1);
  EXPECT_EQ(pc.find(0, b, 0), 0u);   // same block under another parent is another entry
  EXPECT_EQ(pc.find(e0, b, 1), 0u);  // another image
  EXPECT_EQ(pc.get(e1).block_index, 1);
  EXPECT_THROW(pc.insert(0, a, 0, 7), Error);  // already cached
  EXPECT_THROW(pc.remove(e0), Error);          // has a child
  pc.check_integrity();
}

TEST(PrefixCacheChain, CollisionsAreResolvedByTokens) {
  // One hash bit: every block lands in one of two buckets, so most lookups collide.
  PrefixCache pc(2, 1);
  std::vector<EntryId> ids;
  for (int i = 0; i < 16; ++i) ids.push_back(pc.insert(0, iota_tokens(2, 100 * i), 0, PageId(i)));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(pc.find(0, iota_tokens(2, 100 * i), 0), ids[size_t(i)]);
  EXPECT_EQ(pc.find(0, iota_tokens(2, 5), 0), 0u);
  pc.check_integrity();
  pc.remove(ids[3]);
  EXPECT_EQ(pc.find(0, iota_tokens(2, 300), 0), 0u);
  EXPECT_EQ(pc.find(0, iota_tokens(2, 400), 0), ids[4]);
  pc.check_integrity();
}

TEST(PrefixCacheLru, OldestFirstAndTouchRefreshes) {
  PrefixCache pc(2);
  const EntryId a = pc.insert(0, iota_tokens(2, 0), 0, 0);
  const EntryId b = pc.insert(0, iota_tokens(2, 10), 0, 1);
  const EntryId c = pc.insert(0, iota_tokens(2, 20), 0, 2);
  auto any = [](const PrefixCache::Entry&) { return true; };
  EXPECT_EQ(pc.oldest(any), a);
  pc.touch(a);
  EXPECT_EQ(pc.oldest(any), b);
  pc.remove(b);
  EXPECT_EQ(pc.oldest(any), c);
  pc.check_integrity();
}

// CacheManager with 2-token blocks: a request's blocks become entries after commit, and a lookup
// only counts a prefix that ends at a KDA checkpoint.
struct CacheManagerTest : ::testing::Test {
  CacheManager m{CacheConfig{8, 4, 2, true, 64}};
  const std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7};

  // Runs request `id` through `seq`, snapshotting at the end of the given blocks.
  void run_request(RequestId id, std::vector<int32_t> snapshot_blocks) {
    ASSERT_TRUE(m.admit(id, {}));
    ASSERT_TRUE(m.grow(id, 7));
    for (int32_t b : snapshot_blocks) EXPECT_GE(m.snapshot(id, b), 0);
    m.drain_copies();
    m.commit(id, seq, {}, 7, 7);
    m.end_step();
    m.check_integrity();
  }
};

TEST_F(CacheManagerTest, PrefixLookupStopsAtLastCheckpoint) {
  run_request(1, {0});  // checkpoint after block 0 only
  EXPECT_EQ(m.prefix_cache().size(), 3u);  // blocks [1 2] [3 4] [5 6]; 7 is partial
  const PrefixHit hit = m.lookup(seq, {}, 6);
  EXPECT_EQ(hit.num_tokens, 2);
  EXPECT_EQ(hit.matched_tokens, 6);
  ASSERT_EQ(hit.pages.size(), 1u);
  EXPECT_EQ(hit.pages[0], m.block_table(1).pages[0]);
  EXPECT_GE(hit.checkpoint, 0);
  // A different second block still shares the first.
  EXPECT_EQ(m.lookup(std::vector<int32_t>{1, 2, 9, 9, 9}, {}, 4).num_tokens, 2);
  // No checkpoint, no hit, even if pages match.
  EXPECT_EQ(m.lookup(std::vector<int32_t>{1, 9}, {}, 2).num_tokens, 0);
  m.free(1);
  m.check_integrity();
}

TEST_F(CacheManagerTest, HitSharesPagesAndRestoresCheckpoint) {
  run_request(1, {0, 2});
  m.free(1);
  const PrefixHit hit = m.lookup(seq, {}, 6);
  EXPECT_EQ(hit.num_tokens, 6);
  ASSERT_TRUE(m.admit(2, hit));
  const auto copies = m.drain_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, hit.checkpoint);
  EXPECT_EQ(copies[0].dst, m.state_slot(2));
  EXPECT_EQ(copies[0].phase, CopyPhase::before_forward);
  for (PageId p : hit.pages) EXPECT_EQ(m.pages().refcount(p), 2);  // entry + request
  m.check_integrity();
  // The pinned checkpoint survives slot pressure: of 4 slots, 1 runs, 2 are checkpoints, 1 is free;
  // request 3 takes the free one, 4 evicts the unpinned checkpoint, 5 finds only the pinned one.
  EXPECT_TRUE(m.admit(3, {}));
  EXPECT_TRUE(m.admit(4, {}));
  EXPECT_FALSE(m.admit(5, {}));
  EXPECT_EQ(m.prefix_cache().get(hit.entries.back()).checkpoint, hit.checkpoint);
  m.end_step();
  EXPECT_TRUE(m.admit(5, {}));  // unpinned now: evicted for a running slot
  EXPECT_EQ(m.prefix_cache().num_checkpoints(), 0);
  m.check_integrity();
  for (RequestId id : {2, 3, 4, 5}) m.free(id);
  m.evict_all();
  EXPECT_EQ(m.pages().num_free(), 8);
  EXPECT_EQ(m.slots().num_free(), 4);
  m.check_integrity();
}

TEST_F(CacheManagerTest, EvictionFreesLeastRecentlyUsedUnsharedPagesFirst) {
  run_request(1, {2});
  m.free(1);  // 3 cached pages, 5 free
  EXPECT_EQ(m.available_pages(), 8);
  ASSERT_TRUE(m.admit(2, {}));
  ASSERT_TRUE(m.grow(2, 12));  // 6 pages: evicts the leaf [5 6] first
  EXPECT_EQ(m.prefix_cache().size(), 2u);
  EXPECT_NE(m.lookup(seq, {}, 6).matched_tokens, 6);
  EXPECT_EQ(m.lookup(seq, {}, 6).matched_tokens, 4);
  EXPECT_FALSE(m.grow(2, 18));  // 9 pages > 8: nothing changes
  EXPECT_EQ(m.prefix_cache().size(), 2u);
  m.check_integrity();
  m.free(2);
  EXPECT_EQ(m.evict_all(), 2);
  m.check_integrity();
}

TEST_F(CacheManagerTest, ImageKeysSeparateEqualPlaceholders) {
  const std::vector<MediaSpan> cat = {{0, 2, 111}}, dog = {{0, 2, 222}};
  const auto cat_keys = block_extra_keys(7, 2, cat);
  ASSERT_TRUE(m.admit(1, {}));
  ASSERT_TRUE(m.grow(1, 7));
  m.snapshot(1, 0);
  m.commit(1, seq, cat_keys, 7, 7);
  m.end_step();
  EXPECT_EQ(m.lookup(seq, cat_keys, 6).num_tokens, 2);
  EXPECT_EQ(m.lookup(seq, block_extra_keys(7, 2, dog), 6).num_tokens, 0);
  EXPECT_EQ(m.lookup(seq, {}, 6).num_tokens, 0);
  m.free(1);
  m.check_integrity();
}

TEST_F(CacheManagerTest, IntegrityCatchesAnInconsistentHit) {
  run_request(1, {0});
  PrefixHit hit = m.lookup(seq, {}, 6);
  hit.pages[0] = (hit.pages[0] + 1) % 8;
  EXPECT_THROW(m.admit(2, hit), Error);
  m.check_integrity();
}

}  // namespace
}  // namespace kestrel::cache
