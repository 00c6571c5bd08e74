// TpExecutor: N CPU executors as the ranks of one in-process group (see executor_tp.h).
#include "runtime/executor_tp.h"

#include <unordered_set>

#include "core/check.h"
#include "model/tp.h"
#include "parallel/inproc_comm.h"

namespace kestrel::runtime {

// Declared in this order so the executor (which refers to cfg and w) goes first.
struct TpExecutor::Rank {
  ModelConfig cfg;                 // rank_config: this rank's head counts
  ModelWeights w;                  // views into the mapping, column slices in `packed`
  std::vector<HostBuffer> packed;
  std::unique_ptr<Executor> exec;
};

TpExecutor::TpExecutor(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                       const kestrel::CacheFormats& formats, const cache::CacheConfig& cc, const ExecutorOptions& options) {
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
  for (int r = 0; r < layout.tp; ++r) {
    ParallelLayout p = layout;
    p.rank = r;
    auto rank = std::make_unique<Rank>();
    rank->w = bind_shard(c, ckpt, p);
    rank->packed = model::pack_strided(c, rank->w);
    rank->cfg = model::rank_config(c, p);
    rank->exec = std::make_unique<Executor>(rank->w, rank->cfg, rank_formats, rank_cc, rank_options);
    ranks_.push_back(std::move(rank));
  }
}

TpExecutor::~TpExecutor() = default;

const ExecutorStats& TpExecutor::stats() const { return ranks_.front()->exec->stats(); }

sched::StepResult TpExecutor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  // Which sequences want every position's logits, asked here on the caller's thread, once.
  std::unordered_set<cache::RequestId> all;
  if (hooks.wants_all_logits && hooks.all_logits)
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const sched::ScheduledSeq& x : *list)
        if (hooks.wants_all_logits(x.id)) all.insert(x.id);
  const auto wants = [&all](cache::RequestId id) { return all.count(id) > 0; };

  StepHooks lead;  // rank 0: the caller's sampler and dumps; logits never leave the host
  lead.sample = hooks.sample;
  lead.wants_all_logits = wants;
  lead.all_logits = hooks.all_logits;
  StepHooks follow;  // other ranks: the same logits are computed, nothing is taken from them
  follow.sample = [](const sched::ScheduledSeq&, std::span<const float>) { return sched::SeqResult{}; };
  follow.wants_all_logits = wants;
  follow.all_logits = [](const sched::ScheduledSeq&, std::span<const float>) {};

  sched::StepResult result;
  parallel::run_ranks(size(), [&](parallel::Comm& comm) {
    const int r = comm.rank();
    sched::StepResult mine = ranks_[size_t(r)]->exec->run_rank(plan, r == 0 ? lead : follow, &comm);
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
