// TpExecutor: N CPU executors as the ranks of one in-process group (see executor_tp.h).
#include "runtime/executor_tp.h"

#include <unordered_set>

#include "core/check.h"
#include "model/tp.h"
#include "parallel/inproc_comm.h"

namespace kestrel::runtime {

std::unique_ptr<TpRank> make_tp_rank(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                                     int r, const kestrel::CacheFormats& formats, const cache::CacheConfig& cc,
                                     const ExecutorOptions& options) {
  check_layout(c, layout);
  KCHECK(layout.dcp == 1 || layout.dcp == layout.tp,
         "--decode-context-parallel-size {}: the CPU twin spreads the context over the whole TP group (1 or {})",
         layout.dcp, layout.tp);
  KCHECK(formats.block_size % layout.dcp == 0, "--block-size {} must divide by --decode-context-parallel-size {}",
         formats.block_size, layout.dcp);
  // Under DCP a scheduler page of P tokens is P/dcp rows on each rank (the same page id everywhere).
  kestrel::CacheFormats rank_formats = formats;
  cache::CacheConfig rank_cc = cc;
  rank_formats.block_size = rank_cc.block_size = formats.block_size / layout.dcp;
  ExecutorOptions rank_options = options;
  rank_options.dcp = layout.dcp;
  ParallelLayout p = layout;
  p.rank = r;
  auto rank = std::make_unique<TpRank>();
  rank->w = bind_shard(c, ckpt, p);
  rank->packed = model::pack_strided(c, rank->w);
  rank->cfg = model::rank_config(c, p);
  rank->exec = std::make_unique<Executor>(rank->w, rank->cfg, rank_formats, rank_cc, rank_options);
  return rank;
}

std::unordered_set<cache::RequestId> tp_all_logits(const sched::StepPlan& plan, const StepHooks& hooks) {
  std::unordered_set<cache::RequestId> all;
  if (hooks.wants_all_logits && hooks.all_logits)
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const sched::ScheduledSeq& x : *list)
        if (hooks.wants_all_logits(x.id)) all.insert(x.id);
  return all;
}

TpHooks tp_hooks(const StepHooks& hooks, const std::unordered_set<cache::RequestId>& all) {
  const auto wants = [&all](cache::RequestId id) { return all.count(id) > 0; };
  TpHooks h;
  h.lead.sample = hooks.sample;  // rank 0: the caller's sampler and dumps; logits never leave the host
  h.lead.wants_all_logits = wants;
  h.lead.all_logits = hooks.all_logits;
  // Other ranks: the same logits are computed, nothing is taken from them.
  h.follow.sample = [](const sched::ScheduledSeq&, std::span<const float>) { return sched::SeqResult{}; };
  h.follow.wants_all_logits = wants;
  h.follow.all_logits = [](const sched::ScheduledSeq&, std::span<const float>) {};
  return h;
}

TpExecutor::TpExecutor(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                       const kestrel::CacheFormats& formats, const cache::CacheConfig& cc, const ExecutorOptions& options) {
  for (int r = 0; r < layout.tp; ++r) ranks_.push_back(make_tp_rank(c, ckpt, layout, r, formats, cc, options));
}

TpExecutor::~TpExecutor() = default;

const ExecutorStats& TpExecutor::stats() const { return ranks_.front()->exec->stats(); }

sched::StepResult TpExecutor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  const std::unordered_set<cache::RequestId> all = tp_all_logits(plan, hooks);
  const TpHooks h = tp_hooks(hooks, all);
  sched::StepResult result;
  parallel::run_ranks(size(), [&](parallel::Comm& comm) {
    const int r = comm.rank();
    sched::StepResult mine = ranks_[size_t(r)]->exec->run_rank(plan, r == 0 ? h.lead : h.follow, &comm);
    if (r == 0) result = std::move(mine);
  });
  return result;
}

ExecutorFactory tp_executor_factory(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                                    const ExecutorOptions& options) {
  check_layout(c, layout);  // at start, before any memory is planned
  if (layout.dcp != 1 && layout.dcp != layout.tp)
    fail("--decode-context-parallel-size {}: the CPU twin spreads the context over the whole TP group (1 or {})",
         layout.dcp, layout.tp);
  return [&c, &ckpt, layout, options](const kestrel::CacheFormats& f, const cache::CacheConfig& cc) {
    return std::unique_ptr<StepExecutor>(std::make_unique<TpExecutor>(c, ckpt, layout, f, cc, options));
  };
}

}  // namespace kestrel::runtime
