// See thread_pool.h. One job at a time: the caller publishes it (fields, then a generation bump to an
// odd value: open), every worker wakes and claims units from a shared counter (static: range i of
// up to 4 per thread; dynamic: single items), as does the caller; the caller waits until every unit is done,
// closes the job (even generation) and waits until no worker is inside it.
// Why claiming rather than "worker i runs range i": on a shared, oversubscribed machine a worker may
// not be scheduled for milliseconds; with fixed ranges every parallel region then waits for it.
#include "kernels/cpu/thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace kestrel::cpu {
namespace {

thread_local bool t_in_task = false;

// Spin this long for a change before sleeping on the futex.
constexpr auto kSpin = std::chrono::microseconds(30);
// Ranges a static job is cut into, per thread of the job (Job::count).
constexpr int64_t kRangesPerThread = 4;

template <class T>
T wait_change(const std::atomic<T>& a, T old) {
  auto deadline = std::chrono::steady_clock::time_point{};
  for (int i = 0;; ++i) {
    const T v = a.load(std::memory_order_acquire);
    if (v != old) return v;
    if ((i & 255) == 255) {
      const auto now = std::chrono::steady_clock::now();
      if (deadline == std::chrono::steady_clock::time_point{}) {
        deadline = now + kSpin;
      } else if (now > deadline) {
        a.wait(old, std::memory_order_acquire);
        deadline = {};
      }
    }
    _mm_pause();
  }
}

class Pool {
 public:
  static Pool& get() {
    static Pool p;
    return p;
  }
  ~Pool() { stop_workers(); }

  int size() const { return total_.load(std::memory_order_relaxed); }
  void resize(int n) {
    std::lock_guard lk(mu_);
    if (n == total_.load()) return;
    stop_workers();
    total_.store(n);
  }

  void run(int64_t n, int threads, bool dynamic, detail::RangeFn call, void* ctx) {
    std::unique_lock lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) return call(ctx, 0, n);  // the team is busy with another caller's loop
    if (int(workers_.size()) != total_.load() - 1) start_workers();
    threads = std::min(threads, total_.load());
    job_ = Job{call, ctx, n, threads, dynamic};
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    gen_.fetch_add(1);  // odd: open
    gen_.notify_all();
    claim_and_run();
    // Every share is claimed by now (the loop above ends only when none is left): wait for those
    // that workers are still running, then close the job and wait until no worker is inside it, so
    // none reads job_ (or the caller's ctx) after we return.
    const int64_t count = job_.count();
    for (int64_t d = done_.load(std::memory_order_acquire); d != count; d = done_.load(std::memory_order_acquire))
      wait_change(done_, d);
    gen_.fetch_add(1);  // even: closed
    for (int w = inside_.load(); w != 0; w = inside_.load()) wait_change(inside_, w);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  struct Job {
    detail::RangeFn call = nullptr;
    void* ctx = nullptr;
    int64_t n = 0;
    int threads = 1;
    bool dynamic = false;
    // Claimable units: items, or ranges. A static job is cut into up to kRangesPerThread ranges per
    // thread (never more than n): a worker that wakes late (asleep after a serial section longer
    // than kSpin, or not yet scheduled on a busy machine) then claims a small range while the caller
    // takes the rest, instead of claiming half the job late and making the caller wait for it at the
    // end (issue #22: 5.4 % of the engine thread's 2K-prefill samples were that wait).
    int64_t count() const { return dynamic ? n : std::min<int64_t>(n, int64_t(threads) * kRangesPerThread); }
  };

  // Claims units (a static job's ranges, or a dynamic job's items) from the shared counter until none
  // is left. Whoever comes first takes the next unit, so a worker the OS has not scheduled yet (a busy
  // shared machine) delays nothing: the caller runs its share too. The ranges are fixed by the job
  // alone (range i of count()), and a kernel computes each element the same way on any thread.
  void claim_and_run() {
    const int64_t count = job_.count();
    t_in_task = true;
    for (int64_t u = next_.fetch_add(1, std::memory_order_relaxed); u < count;
         u = next_.fetch_add(1, std::memory_order_relaxed)) {
      try {
        if (job_.dynamic) {
          job_.call(job_.ctx, u, u + 1);
        } else {
          const int64_t b = job_.n * u / count, e = job_.n * (u + 1) / count;
          if (b < e) job_.call(job_.ctx, b, e);
        }
      } catch (...) {
        std::lock_guard lk(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == count) done_.notify_all();
    }
    t_in_task = false;
  }

  // `seen`: the generation when the worker was created (read by the creator, so a job published
  // before this thread first runs is not missed). A worker enters a job (inside_) before it checks
  // that the job is still open; the caller closes it before it waits for inside_ to drain
  // (sequentially consistent on both sides), so a late worker either sees it closed or is waited for.
  void worker(int idx, uint32_t seen) {
    for (;;) {
      seen = wait_change(gen_, seen);
      if (stop_.load(std::memory_order_acquire)) return;
      if ((seen & 1) == 0) continue;  // a job that closed before we woke
      inside_.fetch_add(1);
      if (gen_.load() == seen) claim_and_run();
      if (inside_.fetch_sub(1) == 1) inside_.notify_all();
    }
  }

  void start_workers() {
    stop_.store(false);
    const uint32_t g = gen_.load(std::memory_order_acquire);
    for (int i = 1; i < total_.load(); ++i) workers_.emplace_back([this, i, g] { worker(i, g); });
  }
  void stop_workers() {
    if (workers_.empty()) return;
    stop_.store(true, std::memory_order_release);
    gen_.fetch_add(2);  // parity kept: even = no open job
    gen_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::mutex mu_;  // held by the caller whose job runs (and by resize)
  std::atomic<int> total_{std::max(1, int(std::thread::hardware_concurrency()))};
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<int64_t> next_{0};  // next unit to claim
  std::atomic<int64_t> done_{0};  // units finished
  std::atomic<int> inside_{0};    // workers inside the current job
  std::atomic<bool> stop_{false};
  Job job_;
  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace

void set_num_threads(int n) {
  Pool::get().resize(n > 0 ? n : std::max(1, int(std::thread::hardware_concurrency())));
}
int num_threads() { return Pool::get().size(); }

namespace detail {

int threads_for(int64_t n, int64_t work) {
  if (t_in_task || work < kParallelMinWork) return 1;
  return int(std::min<int64_t>({int64_t(num_threads()), n, work / kParallelMinWork + 1}));
}

void run(int64_t n, int threads, bool dynamic, RangeFn call, void* ctx) {
  Pool::get().run(n, threads, dynamic, call, ctx);
}

}  // namespace detail
}  // namespace kestrel::cpu
