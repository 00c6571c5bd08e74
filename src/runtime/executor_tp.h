// TpExecutor: the CPU twin of a tensor-parallel engine (docs/parallel.md §1 and §8) — N ranks as threads
// of this process, each a CPU Executor over its own shard of the weights (bind_shard straight from the
// mapped checkpoint, column slices packed once), its own rank_config and its own CacheStore (H/N KDA
// heads per state slot; the MLA latent and index-key pages whole on every rank), talking through an
// in-process communicator (parallel/inproc_comm.h).
//
// A step: every rank runs the same StepPlan (zero/restore slots, one batched forward, snapshots)
// on a thread of its own, in one fresh InProcessGroup (run_ranks: the first error aborts the group and
// is rethrown here, so a failing step never leaves a rank waiting). After the logits all-gather every
// rank holds the same whole logits; rank 0 alone calls the caller's hooks (sampling, all-logits dumps)
// and its results are the step's. The other ranks get stand-in hooks that answer the same questions
// (whether a sequence wants every position's logits: asked once, on the calling thread), so all ranks
// run the same collectives. Scheduling, prefix caching and preemption are the engine's and unchanged:
// page and slot ids mean the same on every rank.
//
// Memory: the engine's memory plan counts one rank's caches (sched/memory_plan.h with EngineConfig::tp_size
// and dcp_size: KDA state for H/N heads per slot, MLA pages whole per rank or P/DCP rows under DCP), out of
// a per-rank budget; each rank's CacheStore allocates exactly that (cache::CacheLayout::for_rank).
#pragma once

#include <memory>
#include <unordered_set>
#include <vector>

#include "core/cache_format.h"
#include "core/tensor.h"
#include "loader/config.h"
#include "loader/shard.h"
#include "runtime/executor.h"

namespace kestrel {
class Checkpoint;
}

namespace kestrel::runtime {

// One rank of the CPU twin: its shard (views into the mapping, column slices packed), its rank_config and
// its CPU Executor over its own CacheStore (pages of f.block_size/dcp rows). Shared by TpExecutor (ranks as
// threads) and MpiTpExecutor (ranks as processes, executor_mpi.h). Declared in this order so the executor
// (which refers to cfg and w) goes first.
struct TpRank {
  ModelConfig cfg;
  ModelWeights w;
  std::vector<HostBuffer> packed;
  std::unique_ptr<Executor> exec;
};
// Rank `rank` of `layout` (checked: check_layout, DCP 1 or TP, the block size divisible by DCP).
std::unique_ptr<TpRank> make_tp_rank(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                                     int rank, const kestrel::CacheFormats& formats, const cache::CacheConfig& cc,
                                     const ExecutorOptions& options);

// The hooks of a tensor-parallel step: rank 0 gets the caller's sampler and dumps, the others stand-ins
// that take nothing; both answer wants_all_logits from `all` (asked once, on the caller's thread, so every
// rank computes the same logits rows and runs the same collectives). `all` must outlive the hooks.
struct TpHooks {
  StepHooks lead, follow;
};
TpHooks tp_hooks(const StepHooks& hooks, const std::unordered_set<cache::RequestId>& all);
// The sequences of `plan` that want every position's logits (hooks.wants_all_logits).
std::unordered_set<cache::RequestId> tp_all_logits(const sched::StepPlan& plan, const StepHooks& hooks);

class TpExecutor : public StepExecutor {
 public:
  // layout.tp ranks (layout.rank is ignored); throws the layout's problems (check_layout) first.
  // `c` and `ckpt` must outlive the executor.
  TpExecutor(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
             const kestrel::CacheFormats& formats, const cache::CacheConfig& cache_config,
             const ExecutorOptions& options = {});
  ~TpExecutor() override;

  sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) override;
  const ExecutorStats& stats() const override;
  int size() const { return int(ranks_.size()); }

 private:
  std::vector<std::unique_ptr<TpRank>> ranks_;
};

// The engine's executor factory for `--device cpu --tensor-parallel-size N`.
ExecutorFactory tp_executor_factory(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                                    const ExecutorOptions& options = {});

}  // namespace kestrel::runtime
