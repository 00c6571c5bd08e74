// EngineHost (runtime/engine_host.h) on the nano checkpoint, held to request/engine.h's contract as
// the server sees it: not ready while loading; exactly one final event per accepted request with the
// prompt length on the first event; cancel frees the request's pages and slot at once (stats back
// to zero) and is a no-op for unknown ids; a repeated prompt reports its prefix-cache hit as cached
// prompt tokens and in the counters; the bounded queue answers queue_full; a request beyond
// max_model_len is refused with a RequestError; an explicit max_model_len beyond what the memory plan
// holds fails the load; the fake engine is the same engine over a fake executor.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "core/check.h"
#include "runtime/engine_host.h"

namespace kestrel::runtime {
namespace {

std::string nano_dir() {
  const char* dir = std::getenv("KESTREL_NANO_DIR");
  if (!dir)
    throw std::runtime_error(
        "KESTREL_NANO_DIR is not set (python3 reference/make_checkpoint.py --config nano --out DIR --seed 1)");
  return dir;
}

EngineOptions small_options() {
  EngineOptions o;
  o.model_dir = nano_dir();
  o.memory_budget = int64_t(64) << 20;
  o.engine.max_running = 4;
  o.engine.formats.block_size = 16;
  o.engine.max_queue = 16;
  return o;
}

// Events per test key, from the engine thread; the test thread waits for final events.
class Events {
 public:
  TokenSink sink(uint64_t id) {
    return [this, id](TokenEvent&& ev) {
      std::lock_guard lk(mu_);
      if (ev.finished()) ++finals_[id];
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
  bool none(uint64_t id) {
    std::lock_guard lk(mu_);
    return got_[id].empty();
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

Request request(std::vector<int32_t> prompt, int max_tokens) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 7 + salt) % 700 + 3);
  return p;
}

TEST(EngineHost, EventsCancelPrefixHitsAndLimits) {
  EngineHost e(small_options());
  ASSERT_TRUE(e.wait_loaded()) << e.load_error();
  ASSERT_TRUE(e.ready());
  EXPECT_EQ(e.max_model_len(), e.engine().memory_plan().longest_request);  // nano's context is far longer
  EXPECT_EQ(e.vocab_size(), 1024);
  Events ev;

  // Three at once, each exactly max_tokens tokens then one final event; logprobs come through.
  for (uint64_t k = 1; k <= 3; ++k) {
    Request r = request(prompt_of(5 + int(k), int(k)), 4 + int(k));
    r.sampling.logprobs = 2;
    ASSERT_TRUE(e.submit(std::move(r), ev.sink(k)).accepted());
  }
  for (uint64_t k = 1; k <= 3; ++k) {
    const std::vector<TokenEvent> got = ev.wait_final(k);
    ASSERT_EQ(got.size(), size_t(4 + k));
    EXPECT_EQ(got[0].prompt_tokens, int32_t(5 + k));
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_GE(got[i].token, 0);
      EXPECT_EQ(got[i].index, int32_t(i));
      EXPECT_EQ(got[i].id, got[0].id);
      EXPECT_LE(got[i].logprob, 0.0f);
      EXPECT_EQ(got[i].top_logprobs.size(), 2u);
      EXPECT_EQ(got[i].finish, i + 1 == got.size() ? FinishReason::length : FinishReason::none);
      if (i > 0) {
        EXPECT_EQ(got[i].prompt_tokens, 0);  // the first event only
      }
    }
    EXPECT_EQ(ev.finals(k), 1);
  }

  // Cancel mid-generation: one cancelled event, and the pages and slot are free when it arrives.
  const Submission c = e.submit(request(prompt_of(40, 9), 1000), ev.sink(10));
  ASSERT_TRUE(c.accepted());
  ev.wait_tokens(10, 3);
  EXPECT_EQ(e.stats().running, 1);
  EXPECT_GT(e.stats().pages_held, 0);
  EXPECT_TRUE(e.cancel(c.id));
  const std::vector<TokenEvent> got = ev.wait_final(10);
  EXPECT_EQ(got.back().finish, FinishReason::cancelled);
  EXPECT_EQ(got.back().token, -1);
  const EngineStats idle = e.stats();
  EXPECT_EQ(idle.running, 0);
  EXPECT_EQ(idle.waiting, 0);
  EXPECT_EQ(idle.pages_held, 0);
  EXPECT_EQ(idle.kv_usage(), 0.0);
  EXPECT_FALSE(e.cancel(c.id));  // finished: a no-op
  EXPECT_FALSE(e.cancel(9999));  // unknown: a no-op
  EXPECT_EQ(ev.finals(10), 1);

  // The same 40-token prompt twice: the second run reuses two full 16-token blocks.
  const EngineStats before = e.stats();
  const std::vector<int32_t> p = prompt_of(40, 77);
  ASSERT_TRUE(e.submit(request(p, 3), ev.sink(20)).accepted());
  const std::vector<TokenEvent> first = ev.wait_final(20);
  ASSERT_TRUE(e.submit(request(p, 3), ev.sink(21)).accepted());
  const std::vector<TokenEvent> second = ev.wait_final(21);
  EXPECT_EQ(first[0].cached_prompt_tokens, 0);
  EXPECT_EQ(second[0].cached_prompt_tokens, 32);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first[i].token, second[i].token);
  const EngineStats after = e.stats();
  EXPECT_EQ(after.prefix_query_tokens - before.prefix_query_tokens, 80);
  EXPECT_EQ(after.prefix_hit_tokens - before.prefix_hit_tokens, 32);
  EXPECT_EQ(after.pages_held, 0);  // cached prefix pages are reclaimable, not in use

  // Beyond max_model_len: refused with a RequestError, nothing held.
  EXPECT_THROW(e.submit(request({1, 2, 3}, int(e.max_model_len())), ev.sink(30)), RequestError);
  EXPECT_EQ(e.stats().waiting, 0);

  e.shutdown();
  EXPECT_FALSE(e.ready());
  EXPECT_EQ(e.submit(request({1, 2}, 2), ev.sink(40)).status, SubmitStatus::not_ready);
}

TEST(EngineHost, BoundedQueueAndShutdownAbortsEverything) {
  EngineOptions o = small_options();
  o.engine.max_running = 1;
  o.engine.max_queue = 1;
  EngineHost e(o);
  ASSERT_TRUE(e.wait_loaded()) << e.load_error();
  Events ev;
  ASSERT_TRUE(e.submit(request(prompt_of(8, 1), 1000), ev.sink(1)).accepted());
  ev.wait_tokens(1, 1);  // running now, so the queue is empty
  ASSERT_TRUE(e.submit(request(prompt_of(8, 2), 5), ev.sink(2)).accepted());  // waits
  EXPECT_EQ(e.submit(request(prompt_of(8, 3), 5), ev.sink(3)).status, SubmitStatus::queue_full);
  e.shutdown();  // both end with one cancelled event each
  for (uint64_t k : {1, 2}) {
    const std::vector<TokenEvent> got = ev.wait_final(k);
    EXPECT_EQ(got.back().finish, FinishReason::cancelled);
    EXPECT_EQ(ev.finals(k), 1);
  }
  EXPECT_TRUE(ev.none(3));
}

TEST(EngineHost, MaxModelLenBeyondThePlanFailsTheLoad) {
  EngineOptions o = small_options();
  o.engine.max_model_len = int64_t(1) << 19;  // within nano's context, far beyond 64 MiB of cache
  EngineHost e(o);
  EXPECT_FALSE(e.wait_loaded());
  EXPECT_NE(e.load_error().find("raise --memory-budget"), std::string::npos) << e.load_error();
  EXPECT_FALSE(e.ready());
  Events ev;
  EXPECT_EQ(e.submit(request({1, 2}, 2), ev.sink(1)).status, SubmitStatus::not_ready);
}

// The fake engine: not ready while "loading", then the real engine over random tokens — the same
// prompt gives the same tokens, limits and cancellation are the real ones, and no weights are read.
TEST(EngineHost, FakeEngineIsTheRealEngineOverAFakeExecutor) {
  EngineOptions o = small_options();
  o.fake = true;
  o.fake_load_delay = std::chrono::milliseconds(300);
  o.engine.max_model_len = 64;
  Events ev;  // outlives the engine
  EngineHost e(o);
  EXPECT_FALSE(e.ready());  // still "loading"
  EXPECT_EQ(e.submit(request({1, 2}, 2), ev.sink(1)).status, SubmitStatus::not_ready);
  ASSERT_TRUE(e.wait_loaded()) << e.load_error();
  EXPECT_EQ(e.max_model_len(), 64);
  Request r = request(prompt_of(10, 5), 6);
  r.sampling.temperature = 1.0f;
  ASSERT_TRUE(e.submit(r, ev.sink(2)).accepted());
  ASSERT_TRUE(e.submit(r, ev.sink(3)).accepted());
  const auto a = ev.wait_final(2), b = ev.wait_final(3);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(a[i].token, b[i].token);
  EXPECT_THROW(e.submit(request(prompt_of(10, 5), 60), ev.sink(4)), RequestError);  // 70 > 64
  EXPECT_EQ(e.stats().pages_held, 0);
}

}  // namespace
}  // namespace kestrel::runtime
