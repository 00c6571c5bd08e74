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
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "runtime/executor.h"

namespace kestrel::runtime {

struct FakeExecutorOptions {
  std::vector<int32_t> script;               // non-empty: greedy output repeats this
  std::chrono::microseconds step_delay{0};   // sleep per engine step (streams last long enough to measure)
};

class FakeExecutor : public StepExecutor {
 public:
  FakeExecutor(int64_t vocab_size, FakeExecutorOptions options);
  sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) override;
  const ExecutorStats& stats() const override { return stats_; }
  // Images are accepted and ignored: the fake model has no vision tower to run them through.
  bool supports_images() const override { return true; }

 private:
  int64_t V_;
  FakeExecutorOptions options_;
  ExecutorStats stats_;
  std::vector<float> logits_;  // f32 [V]
};

// The factory EngineConfig::make_executor takes.
ExecutorFactory fake_executor_factory(int64_t vocab_size, FakeExecutorOptions options);

}  // namespace kestrel::runtime
