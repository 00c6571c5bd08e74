// The CPU ops' thread pool: one process-wide team (the calling thread + workers) that every CPU kernel
// and layer forward splits its work over, sized once by `--threads` (set_num_threads).
//
// Why not OpenMP: the team size must be a run-time flag that covers the whole step, and on a busy
// shared machine a team that spins for milliseconds after each region (libgomp's default) steals the
// cores the next region needs. Workers here spin briefly (~30 µs: back-to-back regions of one step
// hand over in well under a microsecond) and then sleep on a futex (std::atomic::wait).
//
// Determinism: work is split into index ranges; a kernel computes every output element the same way
// whichever thread runs it, so results never depend on the thread count (tests check this).
// Nesting: parallel_for inside a task runs inline. A second thread that calls in while the team is
// busy (tests drive engines from several threads) runs its loop inline rather than waiting.
#pragma once

#include <cstdint>
#include <utility>

namespace kestrel::cpu {

// Threads the ops use, the caller included; n <= 0 = std::thread::hardware_concurrency().
void set_num_threads(int n);
int num_threads();

// Multiply-adds (or comparable element operations) below which a loop runs on the calling thread
// alone: waking a worker costs ~1–5 µs, and on a loaded 2-core box much more.
inline constexpr int64_t kParallelMinWork = int64_t(1) << 18;

namespace detail {
using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);
// Runs call(ctx, b, e) over [0, n) on `threads` threads: static = contiguous ranges, a few per thread
// (at most n), claimed in order; dynamic = single items handed out in order (uneven items). Rethrows
// the first exception.
void run(int64_t n, int threads, bool dynamic, RangeFn call, void* ctx);
int threads_for(int64_t n, int64_t work);
}  // namespace detail

// fn(begin, end) over contiguous ranges of [0, n) (a few per thread, fixed by n and the thread count,
// so fn must not assume one range per thread), when the total `work` (about n × cost per item) is
// worth the team; else fn(0, n) here.
template <class F>
void parallel_for(int64_t n, int64_t work, F&& fn) {
  if (n <= 0) return;
  const int t = detail::threads_for(n, work);
  if (t <= 1) return fn(int64_t(0), n);
  auto call = [](void* ctx, int64_t b, int64_t e) { (*static_cast<F*>(ctx))(b, e); };
  detail::run(n, t, false, call, &fn);
}

// fn(i) for each i in [0, n), items handed out one at a time (for items of uneven cost).
template <class F>
void parallel_for_each(int64_t n, int64_t work, F&& fn) {
  if (n <= 0) return;
  const int t = detail::threads_for(n, work);
  if (t <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto call = [](void* ctx, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) (*static_cast<F*>(ctx))(i);
  };
  detail::run(n, t, true, call, &fn);
}

}  // namespace kestrel::cpu
