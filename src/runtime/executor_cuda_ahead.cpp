// CudaExecutor's run-ahead steps (async scheduling; executor_cuda.h, executor.h StepExecutor::launch / collect,
// docs/serving.md "Async scheduling"). The engine hands launch() only plans of plain greedy single-token decodes (no
// logprobs, penalties, bias, masks or min_tokens hold; nothing to copy or snapshot), so a step is: the forward
// (through its graph bucket when graphs are on), then CudaModel::sample_ahead — the argmax, or the sampler for rows
// with a temperature — and launch() returns with both queued. The device sampler never hands a row back to the host
// (kernels/cuda/sampling.h): by the time collect() could see that, the next step has overwritten the row's logits. A
// decode whose token is pending
// (ScheduledSeq::token_pending) reads it from the previous launched step's ids on the device (CudaSeq::prev_id =
// its row there), so the two forwards follow each other on the stream without the host between them. collect()
// waits for that step's ids only (a side-stream copy, model/cuda/ahead.h) — the next step keeps the GPU busy
// meanwhile — and hands them to take_token in plan order, as run() does for device-sampled rows.
//
// The draw index of a pending row is output.size() + 1: at launch the engine's output list does not hold the
// pending token yet, and the sampler draws token k with index k (runtime/sampler.h), as in run().
#include <chrono>

#include "core/check.h"
#include "kernels/cuda/sampling.h"
#include "model/cuda/cuda_model.h"
#include "runtime/executor_cuda.h"

namespace kestrel::runtime {

void CudaExecutor::launch(const sched::StepPlan& plan, const StepHooks& hooks) {
  KCHECK(runs_ahead(), "executor: launch() on an executor that does not run ahead (speculation or a TP follower)");
  KCHECK(launched_.size() < 2, "executor: a third step launched before the first was collected");
  KCHECK(bool(hooks.sampling_inputs) && bool(hooks.take_token), "executor: launch() needs sampling_inputs and take_token");
  KCHECK(plan.prefills.empty() && plan.copies_before.empty() && plan.copies_after.empty() && !plan.decodes.empty(),
         "executor: a run-ahead step holds decodes only ({} prefills, {} copies)", plan.prefills.size(),
         plan.copies_before.size() + plan.copies_after.size());
  const auto t0 = std::chrono::steady_clock::now();
  forget_media(plan);
  std::vector<model::CudaSeq> seqs;
  std::vector<cuda::SampleParams> params;
  seqs.reserve(plan.decodes.size()), params.reserve(plan.decodes.size());
  std::unordered_map<cache::RequestId, int32_t> rows;
  for (size_t i = 0; i < plan.decodes.size(); ++i) {
    const sched::ScheduledSeq& x = plan.decodes[i];
    KCHECK(x.sample && x.num_draft == 0 && !x.reset_state && x.end - x.start == 1 && x.tokens.size() == 1,
           "executor: run-ahead request {} is not a plain single-token decode", x.id);
    model::CudaSeq q;
    q.tokens = x.tokens;
    q.pos0 = x.start;
    q.slot = x.state_slot;
    q.block_table = std::span<const int32_t>(x.block_table.data(), x.block_table.size());
    q.logits = model::CudaSeq::Logits::last;
    if (x.token_pending) {
      auto it = prev_rows_.find(x.id);
      KCHECK(it != prev_rows_.end(), "executor: request {}'s pending token is in no launched step", x.id);
      q.prev_id = it->second;
    }
    seqs.push_back(q);
    const StepHooks::SamplingInputs in = hooks.sampling_inputs(x);
    KCHECK(in.params != nullptr, "executor: no sampling parameters for request {}", x.id);
    const SamplingParams& sp = *in.params;
    const uint64_t index = uint64_t(in.output.size()) + (x.token_pending ? 1 : 0);
    params.push_back({int32_t(i), sp.top_k, sp.temperature, sp.top_p, sp.min_p, sp.seed, index});
    rows[x.id] = int32_t(i);
  }
  const int64_t got = model_->forward_batch(*cache_, seqs);
  KCHECK(got == int64_t(seqs.size()), "executor: {} logits rows, expected {}", got, seqs.size());
  launched_.push_back({plan.step, model_->sample_ahead(params), seqs.size()});
  prev_rows_ = std::move(rows);
  ++stats_.steps;
  stats_.forwards += int64_t(seqs.size());
  stats_.tokens_forwarded += int64_t(seqs.size());
  stats_.launch_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

sched::StepResult CudaExecutor::collect(const sched::StepPlan& plan, const StepHooks& hooks) {
  KCHECK(!launched_.empty() && launched_.front().step == plan.step,
         "executor: collect() of step {}, but the oldest launched step is {}", plan.step,
         launched_.empty() ? std::string("none") : std::to_string(launched_.front().step));
  const auto t0 = std::chrono::steady_clock::now();
  const Launched l = launched_.front();
  launched_.pop_front();
  KCHECK(l.rows == plan.decodes.size(), "executor: step {} launched {} rows, collected with {}", plan.step, l.rows,
         plan.decodes.size());
  ahead_ids_.resize(l.rows);
  model_->take_ids(l.ticket, ahead_ids_.data());
  sched::StepResult result;
  for (size_t i = 0; i < plan.decodes.size(); ++i) {
    const sched::ScheduledSeq& x = plan.decodes[i];
    // Neither the argmax nor the sampler hands a row back (−1), whose logits the next step has overwritten by now.
    KCHECK(ahead_ids_[i] >= 0, "executor: run-ahead request {} got no device token", x.id);
    sched::SeqResult r = hooks.take_token(x, ahead_ids_[i]);
    r.id = x.id;
    result.seqs.push_back(r);
    ++stats_.samples, ++stats_.device_samples;
  }
  stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace kestrel::runtime
