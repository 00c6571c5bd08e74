// Issue #24, memory that stays flat under load: the soak report's parsers and verdict (benchclient/
// soak.h), and the engine's integrity check after a churn of requests that finish, are cancelled
// while waiting or mid-stream, share prefixes and are preempted by a small page pool — every page and
// state slot must be back with the free lists or the prefix cache, and the engine must keep nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "benchclient/soak.h"
#include "nano_checkpoint.h"
#include "runtime/engine.h"
#include "runtime/fake_executor.h"

namespace kestrel {
namespace {

using bench::ServerSample;
using bench::SoakOptions;
using bench::SoakRound;

TEST(Soak, ParsesTheGaugesOfAMetricsPage) {
  const std::string page =
      "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
      "vllm:num_requests_running{model_name=\"m\"} 3\n"
      "vllm:num_requests_waiting{model_name=\"m\"} 17\n"
      "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"
      "kestrel:kv_pages_used{model_name=\"m\"} 40\n"
      "kestrel:kv_pages_allocated{model_name=\"m\"} 120\n"
      "kestrel:kv_pages_allocated{model_name=\"other\"} 5\n"  // two series: summed
      "vllm:num_requests_running_total 99\n"                   // another name that starts the same
      "vllm:request_success_total{finished_reason=\"stop\"} 7\n";
  ServerSample s;
  bench::parse_metrics(page, s);
  EXPECT_EQ(s.running, 3.0);
  EXPECT_EQ(s.waiting, 17.0);
  EXPECT_EQ(s.kv_usage, 0.25);
  EXPECT_EQ(s.pages_used, 40.0);
  EXPECT_EQ(s.pages_allocated, 125.0);
  ServerSample none;
  bench::parse_metrics("# nothing\nvllm:other 1\n", none);
  EXPECT_FALSE(none.running || none.waiting || none.pages_used || none.pages_allocated || none.kv_usage);
}

TEST(Soak, ParsesNvidiaSmiAndProcStatus) {
  const std::string csv = "4242, 1500\n12, 77\n4242, 20\n99, [N/A]\n";
  EXPECT_EQ(bench::parse_gpu_mib(csv, 4242), 1520.0);  // a process on two lines (contexts): summed
  EXPECT_EQ(bench::parse_gpu_mib(csv, 12), 77.0);
  EXPECT_FALSE(bench::parse_gpu_mib(csv, 99));
  EXPECT_FALSE(bench::parse_gpu_mib(csv, 5));
  EXPECT_FALSE(bench::parse_gpu_mib("No running processes found\n", 5));
  const std::string status = "Name:\tkestrel\nVmPeak:\t 999 kB\nVmRSS:\t  300000 kB\nRssAnon:\t 1 kB\n";
  ASSERT_TRUE(bench::parse_vm_rss_mb(status));
  EXPECT_NEAR(*bench::parse_vm_rss_mb(status), 300000 * 1024 / 1e6, 1e-9);
  EXPECT_FALSE(bench::parse_vm_rss_mb("Name:\tkestrel\n"));
}

SoakRound row(int round, std::optional<double> rss, std::optional<double> gpu, std::string integrity = "ok") {
  SoakRound r;
  r.round = round;
  r.server.rss_mb = rss;
  r.server.gpu_mib = gpu;
  r.server.integrity = std::move(integrity);
  return r;
}

TEST(Soak, VerdictMeasuresFromTheBaselineRoundAndAppliesTheLimits) {
  SoakOptions o;
  o.baseline_round = 2;
  std::vector<SoakRound> rs = {row(0, 100, 1000), row(1, 150, 1400), row(2, 160, 1500), row(3, 162, 1510),
                               row(4, 165, 1530)};
  auto s = bench::summarize(rs, o);
  ASSERT_TRUE(s.rss_growth_mb && s.gpu_growth_mib);
  EXPECT_DOUBLE_EQ(*s.rss_growth_mb, 5.0);  // 165 − 160: round 1's warm-up does not count
  EXPECT_DOUBLE_EQ(*s.gpu_growth_mib, 30.0);
  EXPECT_TRUE(s.ok);
  o.max_rss_growth_mb = 4.9;
  s = bench::summarize(rs, o);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.verdict.find("RSS grew 5.0 MB"), std::string::npos) << s.verdict;
  o.max_rss_growth_mb = 5.0;
  o.max_gpu_growth_mib = 64;
  EXPECT_TRUE(bench::summarize(rs, o).ok);
  // A limit on what was not measured fails rather than passes.
  rs.back().server.gpu_mib.reset();
  EXPECT_FALSE(bench::summarize(rs, o).ok);
  // A failed integrity check or an undrained round fails the run whatever the memory did.
  o.max_gpu_growth_mib.reset();
  rs.back().server.gpu_mib = 1530;
  rs[3].server.integrity = "HTTP 500: page 3 refcount 2 but 1 holders";
  EXPECT_FALSE(bench::summarize(rs, o).ok);
  rs[3].server.integrity = "-";  // no debug route: not checked, not failed
  rs[3].drained = false;
  EXPECT_FALSE(bench::summarize(rs, o).ok);
  rs[3].drained = true;
  EXPECT_TRUE(bench::summarize(rs, o).ok);
  // A proper error from the server (HTTP 429, an error event) is an ending; a stream cut without a finish is not.
  rs[3].failed = 2;
  EXPECT_TRUE(bench::summarize(rs, o).ok);
  rs[3].broken = 1;
  rs[3].first_error = "the stream ended without a finish_reason";
  s = bench::summarize(rs, o);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.verdict.find("round 3: 1 stream(s) ended without a finish or an error"), std::string::npos) << s.verdict;
  rs[3].failed = rs[3].broken = 0;
  // Fewer rounds than the baseline: measured from the last round's own sample (growth 0).
  o.baseline_round = 9;
  s = bench::summarize(rs, o);
  EXPECT_EQ(s.baseline_round, 4);
  EXPECT_DOUBLE_EQ(*s.rss_growth_mb, 0.0);
}

TEST(Soak, HeapGrowthIsBoundedPerRequestSentAfterTheBaseline) {
  SoakOptions o;
  o.baseline_round = 2;
  std::vector<SoakRound> rs;
  for (int i = 0; i <= 5; ++i) {
    rs.push_back(row(i, 270, std::nullopt));
    rs.back().sent = i == 0 ? 0 : 250;
    rs.back().server.heap_bytes = 76e6 + (i >= 1 ? 300e3 : 0) + (i > 2 ? 112.0 * 250 * (i - 2) : 0);
  }
  // 112 bytes leaked by each of the 750 requests of rounds 3–5; round 1's warm-up does not count.
  bench::SoakSummary s = bench::summarize(rs, o);
  EXPECT_EQ(s.requests_after_baseline, 750);
  ASSERT_TRUE(s.heap_growth_bytes && s.heap_bytes_per_request);
  EXPECT_DOUBLE_EQ(*s.heap_growth_bytes, 112.0 * 750);
  EXPECT_DOUBLE_EQ(*s.heap_bytes_per_request, 112.0);
  EXPECT_TRUE(s.ok);  // no limit asked
  EXPECT_NE(s.verdict.find("heap +84000 bytes (+112.0 per request)"), std::string::npos) << s.verdict;
  o.max_heap_bytes_per_request = 60;
  s = bench::summarize(rs, o);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.verdict.find("112.0 per request over 750 requests (limit 60 per request)"), std::string::npos)
      << s.verdict;
  o.max_heap_bytes_per_request = 112;
  EXPECT_TRUE(bench::summarize(rs, o).ok);
  // A limit on a heap the server did not report fails rather than passes.
  rs.back().server.heap_bytes.reset();
  EXPECT_FALSE(bench::summarize(rs, o).ok);
}

TEST(Soak, TableRowsShowWhatWasMeasured) {
  SoakRound r = row(3, 512.34, std::nullopt);
  r.sent = 1000, r.completed = 700, r.dropped_queued = 150, r.dropped_stream = 140, r.failed = 10;
  r.server.running = 0, r.server.waiting = 0, r.server.pages_used = 0, r.server.pages_allocated = 5000;
  r.server.heap_bytes = 76146848;
  const std::string line = bench::soak_table_row(r);
  for (const char* part : {" 1000 ", " 700 ", " 150 ", " 140 ", " 10 ", " 512.3 ", " 76146.8 ", " 5000 ", "ok"})
    EXPECT_NE(line.find(part), std::string::npos) << part << " in " << line;
  const std::string head = bench::soak_table_header();
  // Right-aligned columns: each number ends where its heading does.
  EXPECT_EQ(head.find("RSS MB") + 6, line.find("512.3") + 5) << head << "\n" << line;
  EXPECT_EQ(head.find("heap KB") + 7, line.find("76146.8") + 7) << head << "\n" << line;
}

// ---- the engine's integrity check after churn ------------------------------------------------------------

TEST(Soak, EngineAccountsForEveryPageAfterCancellationsAndPreemption) {
  const ModelConfig& cfg = testing::nano_checkpoint().cfg;
  runtime::EngineConfig ec;
  ec.max_running = 8;
  ec.checkpoint_slots = 3;
  ec.max_num_batched_tokens = 64;  // chunked prefill: requests grow page by page, so a small pool preempts
  ec.formats.block_size = 16;
  // A pool of 40 pages of 16 tokens: 8 running requests of ~60-100 tokens need more.
  sched::MemoryPlanOptions po;
  po.max_running = ec.max_running;
  po.checkpoint_slots = ec.checkpoint_slots;
  po.formats = ec.formats;
  const sched::MemoryPlan probe = sched::plan_memory(cfg.text, int64_t(1) << 28, po);
  ec.memory_budget = probe.state_bytes + 40 * (probe.page_bytes / probe.num_pages);
  runtime::FakeExecutorOptions fo;
  fo.step_delay = std::chrono::microseconds(200);
  ec.make_executor = runtime::fake_executor_factory(cfg.text.vocab_size, fo);
  runtime::Engine e(cfg, ec);
  ASSERT_EQ(e.memory_plan().num_pages, 40);

  std::mt19937_64 rng(24);
  std::vector<std::vector<int32_t>> prefixes(3);
  for (auto& p : prefixes)
    for (int i = 0; i < 48; ++i) p.push_back(int32_t(rng() % 500) + 10);
  std::mutex mu;
  std::vector<RequestId> live;
  std::atomic<int> finals{0}, tokens{0};
  std::atomic<bool> stop_checks{false};
  std::atomic<int> checks{0};
  std::string check_error;
  // Integrity checks from another thread while steps run: consistent at any moment under the lock.
  std::thread checker([&] {
    while (!stop_checks) {
      try {
        e.check_integrity();
        ++checks;
      } catch (const std::exception& x) {
        std::lock_guard lk(mu);
        if (check_error.empty()) check_error = x.what();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });
  const int n = 300;
  for (int i = 0; i < n; ++i) {
    Request r;
    r.prompt = prefixes[size_t(i) % prefixes.size()];
    for (int k = int(rng() % 40); k >= 0; --k) r.prompt.push_back(int32_t(rng() % 500) + 10);
    r.max_tokens = 4 + int(rng() % 12);
    r.ignore_eos = true;
    const int fate = int(rng() % 10);  // 0-1: cancelled soon (often while waiting); 2: mid-stream
    Submission s = e.submit(std::move(r), [&, fate](TokenEvent&& ev) {
      if (ev.token >= 0 && ++tokens % 7 == 0 && fate == 2) e.cancel(ev.id);  // a client leaving mid-stream
      if (ev.finished()) ++finals;
    });
    ASSERT_TRUE(s.accepted());
    if (fate <= 1) {
      std::lock_guard lk(mu);
      live.push_back(s.id);
    }
    if (i % 20 == 19) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard lk(mu);
      for (RequestId id : live) e.cancel(id);
      live.clear();
    }
  }
  e.wait_idle();
  stop_checks = true;
  checker.join();
  EXPECT_EQ(check_error, "");
  EXPECT_GT(checks.load(), 0);
  EXPECT_EQ(finals.load(), n) << "every request ends with exactly one final event";
  const EngineStats st = e.stats();
  EXPECT_GT(st.cancelled, 0);
  EXPECT_GT(st.preemptions, 0) << "the pool was meant to be too small for the running requests";
  EXPECT_GT(st.prefix_hits, 0) << "the shared prefixes were meant to hit";
  const IntegrityReport r = e.check_integrity();
  EXPECT_EQ(r.requests, 0);
  EXPECT_EQ(r.running, 0);
  EXPECT_EQ(r.waiting, 0);
  EXPECT_EQ(r.pages_held, 0);
  EXPECT_EQ(r.pages_total, 40);
  EXPECT_EQ(r.pages_free + r.pages_cached, r.pages_total) << "a page is held by neither a request nor the cache";
  EXPECT_EQ(r.slots_free + r.checkpoints, r.slots_total) << "a state slot is held by neither";
  EXPECT_EQ(st.pages_used, r.pages_cached);
}

}  // namespace
}  // namespace kestrel
