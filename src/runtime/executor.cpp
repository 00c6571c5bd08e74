// Executor: StepPlan → forward passes (see executor.h).
#include "runtime/executor.h"

#include <malloc.h>

#include <chrono>
#include <vector>

#include "core/check.h"
#include "model/model.h"

namespace kestrel::runtime {

namespace {

// A step's activations are vectors of 100 KB to a few MB, allocated and freed every step. glibc's
// defaults hand such blocks back to the kernel (mmap above 128 KB until its threshold adapts, heap
// trimming above 128 KB free at the top, both per arena) and fault them in again, zero-filled, on the
// next step: a fifth of the server's CPU time in a k3-tiny c = 16 profile (bench/RESULTS.md, issue
// #22). Keep them: blocks up to 32 MiB (glibc's largest mmap threshold) from the heap, and a heap
// that shrinks only past 256 MiB of free top. RSS then holds the step's high-water mark, which is
// flat across requests (the memory soak checks that).
void keep_step_memory() {
  static const bool once = [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    return true;
  }();
  (void)once;
}

}  // namespace

Executor::Executor(const ModelWeights& w, const ModelConfig& c, const CacheFormats& formats,
                   const cache::CacheConfig& cc, const ExecutorOptions& options)
    : w_(w), c_(c), options_(options), store_(c.text, formats, cc.num_pages, cc.num_state_slots) {
  if (cc.block_size != formats.block_size)
    fail("executor: cache config block size {} != format block size {}", cc.block_size, formats.block_size);
  keep_step_memory();
}

sched::StepResult Executor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  return run_rank(plan, hooks, nullptr);
}

sched::StepResult Executor::run_rank(const sched::StepPlan& plan, const StepHooks& hooks, parallel::Comm* comm) {
  KCHECK(bool(hooks.sample), "executor: no sampler hook");
  const cpu::PackedScope packed(&packed_);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t V = c_.text.vocab_size;
  ++stats_.steps;
  // 1. Fresh starts, 2. restores (checkpoint → running slot).
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list)
      if (x.reset_state) store_.zero_slot(x.state_slot);
  for (const cache::SlotCopy& cp : plan.copies_before) store_.copy_slot(cp.src, cp.dst);

  // 3. The forward pass: every scheduled sequence (decodes first, as listed) in one call. Under
  // tensor parallelism every rank runs the same plan with the same logits requests (executor_tp.h).
  model::ForwardOptions opt;
  opt.comm = comm;
  opt.dcp = comm ? options_.dcp : 1;
  std::vector<const sched::ScheduledSeq*> seqs;
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list) {
      const int64_t T = x.end - x.start;
      KCHECK(T > 0 && int64_t(x.tokens.size()) == T, "request {}: step range [{}, {}) with {} tokens", x.id, x.start,
             x.end, x.tokens.size());
      seqs.push_back(&x);
    }
  std::vector<model::SeqInput> in(seqs.size());
  std::vector<int64_t> first_row(seqs.size() + 1, 0);  // each sequence's first logits row
  for (size_t i = 0; i < seqs.size(); ++i) {
    const sched::ScheduledSeq& x = *seqs[i];
    const bool all = hooks.wants_all_logits && hooks.all_logits && hooks.wants_all_logits(x.id);
    in[i].view = store_.view(x.state_slot, x.block_table, x.start);
    in[i].tokens = x.tokens;
    in[i].logits = all ? model::Logits::all : x.sample ? model::Logits::last : model::Logits::none;
    const int64_t n = in[i].logits == model::Logits::all ? x.end - x.start : in[i].logits == model::Logits::last ? 1 : 0;
    first_row[i + 1] = first_row[i] + n;
  }
  std::vector<float> logits(size_t(first_row.back() * V));  // f32 [rows wanted, V]
  if (options_.batched) {
    if (!in.empty()) {
      model::forward_batch(w_, c_, in, logits.data(), opt);
      ++stats_.forwards;
    }
  } else {
    for (size_t i = 0; i < in.size(); ++i) {
      model::forward_batch(w_, c_, std::span<const model::SeqInput>(&in[i], 1), logits.data() + first_row[i] * V, opt);
      ++stats_.forwards;
    }
  }
  sched::StepResult result;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const sched::ScheduledSeq& x = *seqs[i];
    const int64_t T = x.end - x.start;
    stats_.tokens_forwarded += T;
    const float* rows = logits.data() + first_row[i] * V;
    if (in[i].logits == model::Logits::all)
      hooks.all_logits(x, std::span<const float>(rows, size_t(T * V)));
    if (x.sample) {
      const float* last = rows + (in[i].logits == model::Logits::all ? (T - 1) * V : 0);
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
