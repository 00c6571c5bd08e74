// FakeExecutor: the engine's executor without a model, behind the real runtime::Engine, so that
// `kestrel serve --fake-engine` (HTTP benchmarks: bench/serve_connections.py) and the server's tests
// run the real queueing, scheduling, paging, cancellation and limits, with only the forward pass
// replaced. Every sampled sequence gets logits that need no weights:
//   - a script (tests of the server's output shaping): logit 20 on script[i mod n] for output token
//     i and 0 elsewhere, so greedy sampling reproduces the script;
//   - otherwise random logits N(0, 2), seeded by the prompt and the output index, so the same prompt
//     gives the same stream whatever else runs.
// Requests that want every position's logits (prompt logprobs) get N(0, 2) rows seeded by the
// prompt up to each position. Tokens are drawn by the engine's one sampler. The caches exist as the scheduler's bookkeeping only
// (no bytes are allocated), so /metrics shows the occupancy a real engine would have.
// With FakeExecutorOptions::device_step (`kestrel serve --fake-engine --fake-step-us N`) the executor models a
// device that takes N µs a step (plus --fake-token-us per token of the step, so prefill chunks cost what they
// would: FakeExecutorOptions::device_token): a step's device time starts when it is enqueued or when the device finishes the
// step before, whichever is later, and the host waits for it (spinning, as a CUDA sync does) only when it needs
// the tokens — in run() at once, in collect() (run-ahead: runs_ahead() is true then) after the engine's own work.
// So the engine's host share between steps — what async scheduling hides — shows in the time per token.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/executor.h"

namespace kestrel::runtime {

struct FakeExecutorOptions {
  std::vector<int32_t> script;               // non-empty: greedy output repeats this
  std::chrono::microseconds step_delay{0};   // sleep per engine step (streams last long enough to measure)
  std::chrono::microseconds device_step{0};  // > 0: a modelled device's time per step (see the header)
  std::chrono::nanoseconds device_token{0};  // with device_step: its time per token of the step on top (prefill cost)
};

class FakeExecutor : public StepExecutor {
 public:
  FakeExecutor(int64_t vocab_size, FakeExecutorOptions options);
  sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) override;
  const ExecutorStats& stats() const override { return stats_; }
  // Images are accepted and ignored: the fake model has no vision tower to run them through.
  bool supports_images() const override { return true; }
  // Run-ahead with the modelled device only (without it there is nothing to overlap).
  bool runs_ahead() const override { return options_.device_step.count() > 0; }
  bool launches_async() const override { return runs_ahead(); }  // the modelled device computes after launch()
  void launch(const sched::StepPlan& plan, const StepHooks& hooks) override;
  sched::StepResult collect(const sched::StepPlan& plan, const StepHooks& hooks) override;

 private:
  using Clock = std::chrono::steady_clock;
  int64_t V_;
  FakeExecutorOptions options_;
  ExecutorStats stats_;
  std::vector<float> logits_;  // f32 [V]
  Clock::time_point device_free_{};  // when the modelled device finishes the last step enqueued
  struct Launched {
    uint64_t step = 0;
    Clock::time_point ready;
    std::vector<int32_t> tokens;  // plan order
  };
  std::vector<Launched> launched_;  // oldest first, at most two
  const std::vector<float>& fake_logits(std::span<const int32_t> prompt, uint64_t index);
  // The modelled device takes one more step of `tokens` tokens; returns when it is done.
  Clock::time_point enqueue_device(int64_t tokens);
  static void wait_until(Clock::time_point t);
};

// The factory EngineConfig::make_executor takes.
ExecutorFactory fake_executor_factory(int64_t vocab_size, FakeExecutorOptions options);

}  // namespace kestrel::runtime
