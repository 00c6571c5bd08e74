// Tensor parallelism on the GPU engine (docs/parallel.md §1, §3, §8): N ranks as threads of this process,
// each rank on its own GPU (cudaSetDevice on its threads), each holding only its shard of the weights and
// its own caches, talking through a device communicator — NCCL across GPUs, or, for tests on one GPU, the
// same-device comm (parallel/device_comm.h, `--debug-tp-on-one-gpu`: NCCL refuses two ranks on one GPU).
//
// CudaTpGroup: the ranks' models. Each rank binds its shard straight from the mapped checkpoint with the CPU
// twin's rules (loader/shard.h bind_shard, model::rank_config; column slices packed contiguous by
// model::pack_strided, a host copy of 1/N of the row-parallel tensors of the rank being uploaded — ranks
// upload one after another, so at most one rank's packed slices are in host memory), uploads it
// (model::CudaModel with tp_size/tp_rank), and gets its comm (NCCL's unique id goes over an in-process
// bootstrap group); then every rank attaches the comm (a few small gathers).
//
// CudaTpExecutor: one CudaExecutor per rank over the rank's own CudaCache (KDA state H/N heads per slot;
// MLA latent and index-key pages whole per rank — the memory plan counts exactly that, sched/memory_plan.h).
// A step runs the same StepPlan on N threads (one per rank, its device current): zero/restore slots, one
// batched forward with one all-reduce per sublayer and the logits all-gather; rank 0 samples with the
// engine's hooks (device sampler) and its result is the step's; the others are followers (forward only).
// Which sequences want every position's logits is asked once, on the caller's thread, and given to all
// ranks, so every rank computes the same logits rows. CUDA graphs are off under TP (for now: the
// collectives are not captured).
//
// Failure: the first rank to throw aborts the same-device group (every waiting rank throws) and its error
// is rethrown once all threads have joined. Under NCCL a rank that fails before a collective its peers are
// in would leave them waiting: the step's inputs are validated identically on every rank before any
// collective (model/cuda/batch.h), so bad input fails on all ranks at the same point.
//
// Expert parallelism (--enable-expert-parallel): each rank binds and uploads only its X/N whole experts
// (bind_shard leaves the others empty; model/cuda/weights.cpp uploads the rank's range) and the MoE forward
// maps the router's ids to its own (model/cuda/moe.cpp); the collectives are the I split's.
//
// Custom all-reduce (--enable-custom-all-reduce, CudaTpOptions::custom_all_reduce): each rank's comm is
// wrapped by parallel::PeerAllReduceGroup — all-reduces of at most 1 MB (decode sizes) run the one-shot
// kernel over buffers the ranks' GPUs reach by peer access (or that share the one device), the rest go
// through NCCL / the same-device comm; no peer access between two ranks' GPUs is an error at start. The
// kernel keeps its epoch in device memory, so it would replay inside a CUDA graph, but graphs stay off
// under TP (the other collectives are not captured).
//
// Not built on the GPU yet: --decode-context-parallel-size > 1 (the CPU twin has it; docs/parallel.md §8
// lists what the GPU needs) and the engine across processes (mpirun).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/cache_format.h"
#include "loader/config.h"
#include "loader/shard.h"
#include "model/cuda/cuda_model.h"
#include "runtime/executor.h"

namespace kestrel {
class Checkpoint;
}
namespace kestrel::parallel {
class SameDeviceGroup;
class PeerAllReduceGroup;
}

namespace kestrel::runtime {

class CudaExecutor;

struct CudaTpOptions {
  bool one_device = false;        // every rank on the current GPU through the same-device comm (tests, debug)
  model::CudaModelOptions model;  // quantisation (tp_size / tp_rank are set per rank)
  // --enable-custom-all-reduce: all-reduces of at most parallel::kCustomAllReduceMaxBytes through the
  // one-shot kernel over peer-accessible buffers (parallel/peer_allreduce.h), the rest through the comm.
  bool custom_all_reduce = false;
};

// Everything that stops the GPU engine from running `c` as layout `p`: layout_problems() (counts that do
// not divide) and the GPU's own limits (expert kernels need I/N a multiple of 64 unless experts are whole
// under EP, gate/up stacks F/N and Is/N a multiple of 8; DCP not built on the GPU). Empty: it can.
std::vector<std::string> cuda_tp_problems(const ModelConfig& c, const ParallelLayout& p);

class CudaTpGroup {
 public:
  // Throws one Error listing cuda_tp_problems(), or when fewer GPUs than ranks exist (without one_device).
  // `c` and `ckpt` are only read during construction.
  CudaTpGroup(const ModelConfig& c, const Checkpoint& ckpt, const ParallelLayout& layout, const CudaTpOptions& o);
  ~CudaTpGroup();
  CudaTpGroup(const CudaTpGroup&) = delete;
  CudaTpGroup& operator=(const CudaTpGroup&) = delete;

  int size() const { return int(ranks_.size()); }
  int device(int r) const;
  const ModelConfig& rank_config(int r) const;
  model::CudaModel& model(int r);
  // Runs fn(r) for every rank on a thread of its own with the rank's device current; the first exception
  // aborts the group's comms where they can be (same-device) and is rethrown after every thread joined.
  void run(const std::function<void(int rank)>& fn);
  // The cache budget of one rank for --gpu-memory-utilization F (runtime::cuda_cache_budget on each device,
  // shared by the ranks on that device), the smallest over the ranks.
  int64_t cache_budget(double utilization, int64_t reserve);
  // One-shot all-reduces launched so far over all ranks (0 without --enable-custom-all-reduce).
  int64_t custom_all_reduces() const;

 private:
  struct Rank;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<parallel::SameDeviceGroup> same_;
  std::unique_ptr<parallel::PeerAllReduceGroup> peer_;  // --enable-custom-all-reduce; outlives the ranks' comms
};

class CudaTpExecutor : public StepExecutor {
 public:
  // One rank's caches per rank (`f`, `cc` as the memory plan made them: the scheduler's pages and slots).
  CudaTpExecutor(CudaTpGroup& group, const CacheFormats& f, const cache::CacheConfig& cc);
  ~CudaTpExecutor() override;

  sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) override;
  const ExecutorStats& stats() const override;

 private:
  CudaTpGroup& g_;
  std::vector<std::unique_ptr<CudaExecutor>> execs_;
};

}  // namespace kestrel::runtime
