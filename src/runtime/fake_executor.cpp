// FakeExecutor: see fake_executor.h.
#include "runtime/fake_executor.h"

#include <algorithm>
#include <random>
#include <thread>

#include "core/check.h"
#include "runtime/sampler.h"

namespace kestrel::runtime {

FakeExecutor::FakeExecutor(int64_t vocab_size, FakeExecutorOptions options)
    : V_(vocab_size), options_(std::move(options)), logits_(size_t(vocab_size)) {
  KCHECK(V_ > 0, "fake executor: empty vocabulary");
  for (int32_t t : options_.script) KCHECK(t >= 0 && t < V_, "fake executor: script token {} outside [0, {})", t, V_);
}

sched::StepResult FakeExecutor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  KCHECK(bool(hooks.sample) && bool(hooks.sampling_inputs), "fake executor: needs the sample and sampling_inputs hooks");
  const auto t0 = std::chrono::steady_clock::now();
  // The modelled device's step starts now: drawing the tokens below stands for its sampling (on a GPU it is in the
  // step), so only what the engine does around run() stays outside it.
  const bool device = plan.has_work() && options_.device_step.count() > 0;
  KCHECK(!device || launched_.empty(), "fake executor: run() with {} launched steps not collected", launched_.size());
  const Clock::time_point ready = device ? enqueue_device(plan.num_tokens) : t0;
  ++stats_.steps;
  sched::StepResult result;
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list) {
      ++stats_.forwards;
      stats_.tokens_forwarded += x.end - x.start;
      if (hooks.wants_all_logits && hooks.all_logits && hooks.wants_all_logits(x.id)) {
        // Every position's logits (prompt logprobs, dumps): N(0, 2) seeded by the tokens up to it.
        const StepHooks::SamplingInputs in = hooks.sampling_inputs(x);
        std::vector<float> rows(size_t((x.end - x.start) * V_));
        for (int64_t p = x.start; p < x.end; ++p) {
          uint64_t h = 1469598103934665603ull;
          for (int64_t k = 0; k <= p && k < int64_t(in.prompt.size()); ++k)
            h = (h ^ uint64_t(uint32_t(in.prompt[size_t(k)]))) * 1099511628211ull;
          std::mt19937_64 rng(h ^ uint64_t(p));
          std::normal_distribution<float> n(0.0f, 2.0f);
          for (int64_t v = 0; v < V_; ++v) rows[size_t((p - x.start) * V_ + v)] = n(rng);
        }
        hooks.all_logits(x, rows);
      }
      if (!x.sample) continue;
      const StepHooks::SamplingInputs in = hooks.sampling_inputs(x);
      sched::SeqResult r = hooks.sample(x, fake_logits(in.prompt, in.output.size()));
      r.id = x.id;
      result.seqs.push_back(r);
      ++stats_.samples;
    }
  if (plan.has_work() && options_.step_delay.count() > 0) std::this_thread::sleep_for(options_.step_delay);
  if (device) wait_until(ready);
  stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

// Output token `index`'s logits: the script's, or N(0, 2) seeded by the prompt and the index.
const std::vector<float>& FakeExecutor::fake_logits(std::span<const int32_t> prompt, uint64_t index) {
  if (!options_.script.empty()) {
    std::fill(logits_.begin(), logits_.end(), 0.0f);
    logits_[size_t(options_.script[index % options_.script.size()])] = 20.0f;
  } else {
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the prompt, then the output index
    for (int32_t t : prompt) h = (h ^ uint64_t(uint32_t(t))) * 1099511628211ull;
    std::mt19937_64 rng(h ^ (index * 0x9e3779b97f4a7c15ull));
    std::normal_distribution<float> n(0.0f, 2.0f);
    for (float& v : logits_) v = n(rng);
  }
  return logits_;
}

FakeExecutor::Clock::time_point FakeExecutor::enqueue_device(int64_t tokens) {
  device_free_ = std::max(Clock::now(), device_free_) + options_.device_step + tokens * options_.device_token;
  return device_free_;
}

// Sleeps to within ~200 µs of t, then spins: a plain sleep overshoots by tens of µs, more than what is measured.
void FakeExecutor::wait_until(Clock::time_point t) {
  if (t - Clock::now() > std::chrono::microseconds(300)) std::this_thread::sleep_until(t - std::chrono::microseconds(200));
  while (Clock::now() < t) std::this_thread::yield();
}

// Run-ahead (executor.h): the tokens are drawn now from the same logits run() would give (a pending row's output
// index one further: the engine's output lacks its pending token), and are ready when the modelled device is done.
void FakeExecutor::launch(const sched::StepPlan& plan, const StepHooks& hooks) {
  KCHECK(runs_ahead(), "fake executor: launch() without a modelled device (--fake-step-us)");
  KCHECK(launched_.size() < 2, "fake executor: a third step launched before the first was collected");
  KCHECK(plan.prefills.empty() && !plan.decodes.empty(), "fake executor: a run-ahead step holds decodes only");
  const auto t0 = Clock::now();
  Launched l;
  l.step = plan.step;
  l.ready = enqueue_device(plan.num_tokens);  // as in run(): the token draws below stand for the device's sampling
  for (const sched::ScheduledSeq& x : plan.decodes) {
    KCHECK(x.sample && x.num_draft == 0 && x.end - x.start == 1, "fake executor: request {} is no plain decode", x.id);
    const StepHooks::SamplingInputs in = hooks.sampling_inputs(x);
    const uint64_t index = uint64_t(in.output.size()) + (x.token_pending ? 1 : 0);
    l.tokens.push_back(sample_token(*in.params, fake_logits(in.prompt, index), in.prompt, in.output, index,
                                    in.stop_ids).token);
    ++stats_.forwards, ++stats_.tokens_forwarded;
  }
  ++stats_.steps;
  launched_.push_back(std::move(l));
  stats_.launch_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
}

sched::StepResult FakeExecutor::collect(const sched::StepPlan& plan, const StepHooks& hooks) {
  KCHECK(!launched_.empty() && launched_.front().step == plan.step, "fake executor: collect() of step {} out of order",
         plan.step);
  const auto t0 = Clock::now();
  const Launched l = std::move(launched_.front());
  launched_.erase(launched_.begin());
  KCHECK(l.tokens.size() == plan.decodes.size(), "fake executor: step {} collected with another plan", plan.step);
  wait_until(l.ready);
  sched::StepResult result;
  for (size_t i = 0; i < plan.decodes.size(); ++i) {
    sched::SeqResult r = hooks.take_token(plan.decodes[i], l.tokens[i]);
    r.id = plan.decodes[i].id;
    result.seqs.push_back(r);
    ++stats_.samples;
  }
  stats_.forward_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  return result;
}

ExecutorFactory fake_executor_factory(int64_t vocab_size, FakeExecutorOptions options) {
  return [vocab_size, options](const CacheFormats&, const cache::CacheConfig&) {
    return std::unique_ptr<StepExecutor>(std::make_unique<FakeExecutor>(vocab_size, options));
  };
}

}  // namespace kestrel::runtime
