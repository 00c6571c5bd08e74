// PagedEngine (src/server/paged_engine.h) on the nano checkpoint, held to engine_api.h's contract:
// exactly one final event per accepted request with the prompt length on the first event; cancel
// frees the request's pages and slot at once (stats back to zero) and is a no-op for unknown ids;
// a repeated prompt reports its prefix-cache hit as cached prompt tokens and in the counters; the
// bounded queue answers kQueueFull; a request beyond max_model_len is refused with kestrel::Error;
// an explicit max_model_len beyond what the memory plan holds fails the load.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "core/check.h"
#include "server/paged_engine.h"

namespace kestrel::server {
namespace {

std::string nano_dir() {
  const char* dir = std::getenv("KESTREL_NANO_DIR");
  if (!dir)
    throw std::runtime_error(
        "KESTREL_NANO_DIR is not set (python3 reference/make_checkpoint.py --config nano --out DIR --seed 1)");
  return dir;
}

PagedEngineOptions small_options() {
  PagedEngineOptions o;
  o.model_dir = nano_dir();
  o.engine.memory_budget = int64_t(64) << 20;
  o.engine.max_running = 4;
  o.engine.formats.block_size = 16;
  o.max_queue = 16;
  return o;
}

// Events per request id, from the engine thread; the test thread waits for final events.
class Events {
 public:
  TokenSink sink(uint64_t id) {
    return [this, id](TokenEvent&& ev) {
      std::lock_guard lk(mu_);
      if (ev.finish != Finish::kNone) ++finals_[id];
      got_[id].push_back(std::move(ev));
      cv_.notify_all();
    };
  }
  std::vector<TokenEvent> wait_final(uint64_t id) {
    std::unique_lock lk(mu_);
    EXPECT_TRUE(cv_.wait_for(lk, std::chrono::seconds(60), [&] { return finals_[id] > 0; })) << "request " << id;
    return got_[id];
  }
  void wait_tokens(uint64_t id, size_t n) {
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, std::chrono::seconds(60), [&] { return got_[id].size() >= n; });
  }
  int finals(uint64_t id) {
    std::lock_guard lk(mu_);
    return finals_[id];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::vector<TokenEvent>> got_;
  std::map<uint64_t, int> finals_;
};

EngineRequest request(uint64_t id, std::vector<int32_t> prompt, int max_tokens) {
  EngineRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  return r;
}

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 7 + salt) % 700 + 3);
  return p;
}

TEST(PagedEngine, EventsCancelPrefixHitsAndLimits) {
  PagedEngine e(small_options());
  ASSERT_TRUE(e.wait_loaded()) << e.load_error();
  ASSERT_TRUE(e.ready());
  EXPECT_EQ(e.max_model_len(), e.memory_plan().longest_request);  // nano's context is far longer
  EXPECT_EQ(e.vocab_size(), 1024);
  Events ev;

  // Three at once, each exactly max_tokens tokens then one final event; logprobs come through.
  for (uint64_t id = 1; id <= 3; ++id) {
    EngineRequest r = request(id, prompt_of(5 + int(id), int(id)), 4 + int(id));
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 2;
    ASSERT_EQ(e.submit(std::move(r), ev.sink(id)), SubmitResult::kAccepted);
  }
  for (uint64_t id = 1; id <= 3; ++id) {
    const std::vector<TokenEvent> got = ev.wait_final(id);
    ASSERT_EQ(got.size(), size_t(4 + id));
    EXPECT_EQ(got[0].prompt_tokens, int32_t(5 + id));
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_GE(got[i].token, 0);
      EXPECT_LE(got[i].logprob, 0.0f);
      EXPECT_EQ(got[i].top_logprobs.size(), 2u);
      EXPECT_EQ(got[i].finish, i + 1 == got.size() ? Finish::kLength : Finish::kNone);
    }
    EXPECT_EQ(ev.finals(id), 1);
  }

  // Cancel mid-generation: one kAbort, and the pages and slot are free when it arrives.
  ASSERT_EQ(e.submit(request(10, prompt_of(40, 9), 1000), ev.sink(10)), SubmitResult::kAccepted);
  ev.wait_tokens(10, 3);
  EXPECT_EQ(e.stats().running, 1);
  EXPECT_GT(e.stats().kv_pages_used, 0);
  e.cancel(10);
  const std::vector<TokenEvent> got = ev.wait_final(10);
  EXPECT_EQ(got.back().finish, Finish::kAbort);
  EXPECT_EQ(got.back().token, -1);
  const EngineStats idle = e.stats();
  EXPECT_EQ(idle.running, 0);
  EXPECT_EQ(idle.waiting, 0);
  EXPECT_EQ(idle.kv_pages_used, 0);
  EXPECT_EQ(idle.kv_cache_usage, 0.0);
  e.cancel(10);    // finished: a no-op
  e.cancel(9999);  // unknown: a no-op
  EXPECT_EQ(ev.finals(10), 1);

  // The same 40-token prompt twice: the second run reuses two full 16-token blocks.
  const EngineStats before = e.stats();
  const std::vector<int32_t> p = prompt_of(40, 77);
  ASSERT_EQ(e.submit(request(20, p, 3), ev.sink(20)), SubmitResult::kAccepted);
  const std::vector<TokenEvent> first = ev.wait_final(20);
  ASSERT_EQ(e.submit(request(21, p, 3), ev.sink(21)), SubmitResult::kAccepted);
  const std::vector<TokenEvent> second = ev.wait_final(21);
  EXPECT_EQ(first[0].cached_prompt_tokens, 0);
  EXPECT_EQ(second[0].cached_prompt_tokens, 32);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first[i].token, second[i].token);
  const EngineStats after = e.stats();
  EXPECT_EQ(after.prefix_cache_queries - before.prefix_cache_queries, 80u);
  EXPECT_EQ(after.prefix_cache_hits - before.prefix_cache_hits, 32u);
  EXPECT_EQ(after.kv_pages_used, 0);  // cached prefix pages are reclaimable, not in use

  // Beyond max_model_len: refused with kestrel::Error, nothing held.
  EXPECT_THROW(e.submit(request(30, {1, 2, 3}, int(e.max_model_len())), ev.sink(30)), Error);
  EXPECT_EQ(e.stats().waiting, 0);

  e.shutdown();
  EXPECT_FALSE(e.ready());
  EXPECT_EQ(e.submit(request(40, {1, 2}, 2), ev.sink(40)), SubmitResult::kNotReady);
}

TEST(PagedEngine, BoundedQueueAndShutdownAbortsEverything) {
  PagedEngineOptions o = small_options();
  o.engine.max_running = 1;
  o.max_queue = 1;
  PagedEngine e(o);
  ASSERT_TRUE(e.wait_loaded()) << e.load_error();
  Events ev;
  ASSERT_EQ(e.submit(request(1, prompt_of(8, 1), 1000), ev.sink(1)), SubmitResult::kAccepted);
  ev.wait_tokens(1, 1);  // running now, so the queue is empty
  ASSERT_EQ(e.submit(request(2, prompt_of(8, 2), 5), ev.sink(2)), SubmitResult::kAccepted);  // waits
  EXPECT_EQ(e.submit(request(3, prompt_of(8, 3), 5), ev.sink(3)), SubmitResult::kQueueFull);
  e.shutdown();  // both end with one kAbort each
  for (uint64_t id : {1, 2}) {
    const std::vector<TokenEvent> got = ev.wait_final(id);
    EXPECT_EQ(got.back().finish, Finish::kAbort);
    EXPECT_EQ(ev.finals(id), 1);
  }
  EXPECT_EQ(ev.finals(3), 0);
}

TEST(PagedEngine, MaxModelLenBeyondThePlanFailsTheLoad) {
  PagedEngineOptions o = small_options();
  o.max_model_len = int64_t(1) << 19;  // within nano's context, far beyond 64 MiB of cache
  PagedEngine e(o);
  EXPECT_FALSE(e.wait_loaded());
  EXPECT_NE(e.load_error().find("raise --memory-budget"), std::string::npos) << e.load_error();
  EXPECT_FALSE(e.ready());
}

}  // namespace
}  // namespace kestrel::server
