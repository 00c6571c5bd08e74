// Executor: StepPlan → forward passes (see executor.h).
#include "runtime/executor.h"

#include <chrono>
#include <vector>

#include "core/check.h"
#include "model/model.h"

namespace kestrel::runtime {

Executor::Executor(const ModelWeights& w, const ModelConfig& c, const CacheFormats& formats,
                   const cache::CacheConfig& cc, const ExecutorOptions& options)
    : w_(w), c_(c), options_(options), store_(c.text, formats, cc.num_pages, cc.num_state_slots) {
  if (cc.block_size != formats.block_size)
    fail("executor: cache config block size {} != format block size {}", cc.block_size, formats.block_size);
}

sched::StepResult Executor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  return run_rank(plan, hooks, nullptr);
}

sched::StepResult Executor::run_rank(const sched::StepPlan& plan, const StepHooks& hooks, parallel::Comm* comm) {
  KCHECK(bool(hooks.sample), "executor: no sampler hook");
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t V = c_.text.vocab_size;
  ++stats_.steps;
  // 1. Fresh starts, 2. restores (checkpoint → running slot).
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list)
      if (x.reset_state) store_.zero_slot(x.state_slot);
  for (const cache::SlotCopy& cp : plan.copies_before) store_.copy_slot(cp.src, cp.dst);

  // 3. One forward per sequence (decodes first, as listed).
  model::ForwardOptions opt;
  opt.comm = comm;
  opt.dcp = comm ? options_.dcp : 1;
  if (options_.batch_invariant) {
    opt.row_invariant = true;
    opt.kda_form = model::KdaForm::recurrent;
    opt.mla_form_prefill = model::MlaForm::absorbed;
    opt.mla_form_decode = model::MlaForm::absorbed;
  }
  sched::StepResult result;
  std::vector<float> logits;  // f32 [T or 1, V]
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list) {
      const int64_t T = x.end - x.start;
      KCHECK(T > 0 && int64_t(x.tokens.size()) == T, "request {}: step range [{}, {}) with {} tokens", x.id, x.start,
             x.end, x.tokens.size());
      const bool all = hooks.wants_all_logits && hooks.all_logits && hooks.wants_all_logits(x.id);
      opt.last_logits_only = !all;
      const bool need_logits = all || x.sample;
      logits.resize(size_t((all ? T : 1) * V));
      const model::SeqCacheView v = store_.view(x.state_slot, x.block_table, x.start);
      model::forward(w_, c_, v, x.tokens, need_logits ? logits.data() : nullptr, opt);
      ++stats_.forwards;
      stats_.tokens_forwarded += T;
      if (all) hooks.all_logits(x, logits);
      if (x.sample) {
        const float* last = logits.data() + (all ? (T - 1) * V : 0);
        sched::SeqResult r = hooks.sample(x, std::span<const float>(last, size_t(V)));
        r.id = x.id;
        result.seqs.push_back(r);
        ++stats_.samples;
      }
    }
  // 4. Snapshots (running → checkpoint slot) of the state at the end of this step's chunks.
  for (const cache::SlotCopy& cp : plan.copies_after) store_.copy_slot(cp.src, cp.dst);
  stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace kestrel::runtime
