// The CPU twin's engine across processes (docs/parallel.md §1, issue #16 point 4): under
// `mpirun -np N kestrel generate|serve --device cpu --tensor-parallel-size N`, process r is TP rank r.
// Rank 0 runs the whole front end — server or generate, scheduler, sampler — with an MpiTpExecutor: every
// step it broadcasts the StepPlan (plain data, serialised below) over the MPI world communicator, then runs
// its own rank's forward; ranks 1..N−1 run run_mpi_follower(): receive a plan, run the same forward on
// their shard (the collectives inside it meet rank 0's), repeat, until rank 0's executor says stop.
//
// Messages (all broadcast from rank 0): a 16-byte header (kind, payload bytes) then the payload:
//   setup — the cache formats and the memory plan's cache config (pages, slots, block size), sent when rank
//           0's engine builds its executor, so every rank allocates the same caches;
//   step  — one StepPlan and, per scheduled sequence, whether rank 0's hooks want every position's logits;
//   stop  — rank 0's executor is gone (or rank 0 failed before building it): followers return.
// Each rank is the same TpRank as the in-process twin (executor_tp.h); the forward is Executor::run_rank
// over the MpiComm, whose reductions equal the in-process ones byte for byte, so an mpirun TP2 run gives
// the in-process TP2 tokens and logits exactly.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_set>
#include <vector>

#include "core/cache_format.h"
#include "loader/config.h"
#include "loader/shard.h"
#include "runtime/executor.h"

namespace kestrel {
class Checkpoint;
}
namespace kestrel::parallel {
class Comm;
}

namespace kestrel::runtime {

// Plain-data form of a step: the plan and the sequences wanting every position's logits.
std::vector<uint8_t> encode_step(const sched::StepPlan& plan, const std::unordered_set<cache::RequestId>& all_logits);
// The inverse; throws kestrel::Error on a malformed message.
sched::StepPlan decode_step(std::span<const uint8_t> bytes, std::unordered_set<cache::RequestId>& all_logits);

// Rank 0's side of the world communicator: sends the messages above. stop() is idempotent (the executor's
// destructor and a failed load both call it).
class MpiLead {
 public:
  explicit MpiLead(parallel::Comm& world) : world_(world) {}
  void setup(const kestrel::CacheFormats& f, const cache::CacheConfig& cc);
  void step(const sched::StepPlan& plan, const std::unordered_set<cache::RequestId>& all_logits);
  void stop();
  parallel::Comm& world() { return world_; }

 private:
  parallel::Comm& world_;
  bool stopped_ = false;
};

// The engine's executor factory on rank 0 (the layout's tp must equal the world size; rank 0's shard).
ExecutorFactory mpi_tp_executor_factory(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                                        std::shared_ptr<MpiLead> lead, const ExecutorOptions& options = {});

// Ranks 1..N−1: waits for rank 0's setup, builds this rank's shard and caches, runs every step rank 0
// broadcasts, returns at stop (or throws on an error, which also ends the rank's part in the job).
void run_mpi_follower(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout,
                      parallel::Comm& world, const ExecutorOptions& options = {});

}  // namespace kestrel::runtime
