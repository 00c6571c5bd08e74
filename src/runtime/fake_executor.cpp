// FakeExecutor: see fake_executor.h.
#include "runtime/fake_executor.h"

#include <algorithm>
#include <random>
#include <thread>

#include "core/check.h"

namespace kestrel::runtime {

FakeExecutor::FakeExecutor(int64_t vocab_size, FakeExecutorOptions options)
    : V_(vocab_size), options_(std::move(options)), logits_(size_t(vocab_size)) {
  KCHECK(V_ > 0, "fake executor: empty vocabulary");
  for (int32_t t : options_.script) KCHECK(t >= 0 && t < V_, "fake executor: script token {} outside [0, {})", t, V_);
}

sched::StepResult FakeExecutor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  KCHECK(bool(hooks.sample) && bool(hooks.sampling_inputs), "fake executor: needs the sample and sampling_inputs hooks");
  const auto t0 = std::chrono::steady_clock::now();
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
      const uint64_t index = in.output.size();
      if (!options_.script.empty()) {
        std::fill(logits_.begin(), logits_.end(), 0.0f);
        logits_[size_t(options_.script[index % options_.script.size()])] = 20.0f;
      } else {
        uint64_t h = 1469598103934665603ull;  // FNV-1a of the prompt, then the output index
        for (int32_t t : in.prompt) h = (h ^ uint64_t(uint32_t(t))) * 1099511628211ull;
        std::mt19937_64 rng(h ^ (index * 0x9e3779b97f4a7c15ull));
        std::normal_distribution<float> n(0.0f, 2.0f);
        for (float& v : logits_) v = n(rng);
      }
      sched::SeqResult r = hooks.sample(x, logits_);
      r.id = x.id;
      result.seqs.push_back(r);
      ++stats_.samples;
    }
  if (plan.has_work() && options_.step_delay.count() > 0) std::this_thread::sleep_for(options_.step_delay);
  stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

ExecutorFactory fake_executor_factory(int64_t vocab_size, FakeExecutorOptions options) {
  return [vocab_size, options](const CacheFormats&, const cache::CacheConfig&) {
    return std::unique_ptr<StepExecutor>(std::make_unique<FakeExecutor>(vocab_size, options));
  };
}

}  // namespace kestrel::runtime
