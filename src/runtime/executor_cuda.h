// CudaExecutor: the engine's steps on one GPU (docs/serving.md, "What the executor does with a
// StepPlan", on the device). Weights are uploaded once (model::CudaModel); the paged MLA caches and
// the KDA state pool live in device memory, sized exactly as the memory planner counted them
// (CacheLayout for every latent, index-key and KDA-state format of core/cache_format.h).
//
// A step: zero the fresh slots, run the restores (device copies), then ONE batched forward over every
// scheduled sequence (single-token sequences first, so all decodes share one absorbed-MLA launch and
// every GEMM sees the whole batch), then the device sampler (kernels/cuda/sampling.h: penalties,
// greedy, temperature, top-k, top-p, min-p, the per-request seed) over every sampled row (logit_bias and min_tokens included), so n ids
// come back instead of n·V logits; rows that want logprobs or every position's logits (debug dumps)
// come back raw and go through the host sampler (runtime/sampler.h, the twin), as do the rare rows the
// device sampler hands back (−1); then the snapshots. Pure decode steps go through the model's CUDA
// graph buckets unless options.cuda_graphs is off (the StepPlan → padded static inputs, then replay;
// see model/cuda/graphs.h).
//
// Images (MODEL.md §6; the CPU executor's media_rows is the twin): with options.vision, before the forward,
// every request of the step whose chunk overlaps one of its media spans and whose images are not encoded yet
// has them encoded — all such requests' images in ONE varlen call of the GPU encoder (vision/cuda/
// vision_cuda.h; up to kMaxVisionPatches patches a call, more only in further calls) into one device buffer.
// A request keeps its rows (a share of that buffer) until it finishes or is cancelled, so a chunk that cuts
// a span, a later chunk and a preempted request's re-prefill reuse them; each chunk hands the model the
// rows of its <|media_pad|> positions (model::CudaEmbedRows), which replace those embeddings.
// Which positions are computed at all is the scheduler's (a prefix-cache hit keyed by the image hash skips
// the span, and then nothing is encoded), exactly as on the CPU.
//
// Speculation (options.speculative; docs/speculative.md): a decode with num_draft > 0 is drafted on the host
// before the forward (SpecDrafter, the CPU twin's draft over host caches), runs [anchor, drafts] as a verify
// sequence of the same batched forward (model::CudaSeq::verify: decode forms row by row, every row's logits,
// KDA state traced per position), and after it the rows' logits come to the host for verify_step (a greedy
// request's: only its rows' device argmax, CudaModel::greedy_rows; KESTREL_SPEC_DEVICE_GREEDY=0: logits); the
// KDA state after the last accepted position is kept on the device (CudaModel::keep_verified) and the taps of
// every committed row (copied back from the device) go into the draft's caches. With cuda_graphs, a step of
// verify sequences only, all of one length, and a pure decode step with taps, go through graph buckets
// (model/cuda/graphs.h; KESTREL_SPEC_GRAPHS=0: eager); mixed steps run eagerly.
//
// The scheduler is unchanged: it only sees StepPlans and StepResults.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "cache/layout.h"
#include "kernels/cuda/sampling.h"
#include "loader/config.h"
#include "loader/weights.h"
#include "runtime/executor.h"
#include "runtime/spec_executor.h"

namespace kestrel::model {
class CudaModel;
struct CudaCache;
}
namespace kestrel::vision {
class VisionCuda;
}

namespace kestrel::runtime {

struct CudaExecutorOptions {
  bool cuda_graphs = true;  // decode steps through captured CUDA graphs (model/cuda/graphs.h); off: all eager
  // A tensor-parallel rank other than 0 (executor_cuda_tp.h): the same forward (so the same collectives),
  // then nothing — no sampling, no logits copied out; run() returns an empty result. The hooks' only use
  // is wants_all_logits, which must answer as rank 0's do (the logits rows, hence the gathers, must match).
  bool follower = false;
  // The GPU vision encoder (with its weights on the device), to outlive the executor; null: requests with
  // images are refused (supports_images() is false).
  vision::VisionCuda* vision = nullptr;
  // DSpark speculation (docs/speculative.md "The serving engine (GPU)"): the draft (its caches and its
  // forward on the host, SpecDrafter), the verification as verify sequences of the one GPU forward, the
  // taps of every row copied back for the draft. One rank only (not with follower).
  std::optional<SpecServing> speculative;
  // With speculative: the draft runs on this GPU (model/cuda/dspark.h: injection from the device taps, the
  // block's layers and lm_head on the device, the Markov chain on the host — on the device for greedy picks,
  // KESTREL_DRAFT_CHAIN_ON_GPU=0: on the host) instead of on the host.
  bool draft_on_gpu = false;
};

// Patches per encoder call: a step's new images are split into calls of at most this many patches (an image
// larger than that alone), which bounds the encoder's scratch (about 0.55 GB at the real vision dims: three
// 1024 × 1024 images).
inline constexpr int64_t kMaxVisionPatches = 16384;

class CudaExecutor : public StepExecutor {
 public:
  // `model` (weights already on the device) must outlive the executor.
  CudaExecutor(model::CudaModel& model, const ModelConfig& c, const CacheFormats& formats,
               const cache::CacheConfig& cache_config, const CudaExecutorOptions& options = {});
  ~CudaExecutor() override;

  sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) override;
  const ExecutorStats& stats() const override { return stats_; }
  bool supports_images() const override { return vision_ != nullptr; }
  bool announces_forward() const override { return !follower_; }
  // Run-ahead (async scheduling; executor_cuda_ahead.cpp): a step of plain decodes is enqueued with its
  // sampling (CudaModel::sample_ahead) and launch() returns; the pending tokens come from the previous launched
  // step's ids on the device (CudaSeq::prev_id), so step N+1 is queued behind step N before the host has N's ids.
  // collect() waits for the oldest step's ids only and hands them to take_token. Not under speculation or as a
  // tensor-parallel follower.
  bool runs_ahead() const override;
  bool launches_async() const override { return true; }  // launch() enqueues the forward and the sampling
  // Every row: the device sampler hands none back to the host (kernels/cuda/sampling.h), so greedy and sampled
  // rows alike run ahead (the engine's plain() still keeps penalties, bias, logprobs and masks out).
  bool samples_ahead(const SamplingParams&) const override { return true; }
  void launch(const sched::StepPlan& plan, const StepHooks& hooks) override;
  sched::StepResult collect(const sched::StepPlan& plan, const StepHooks& hooks) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  ExecutorStats stats_;
  bool follower_ = false;
  vision::VisionCuda* vision_ = nullptr;
  // Run-ahead state: the launched steps not yet collected (oldest first), and each request's row in the latest
  // launched step's ids (where the next step's pending token is). A run() step ends the chain.
  struct Launched {
    uint64_t step = 0;
    int64_t ticket = -1;  // CudaModel::sample_ahead's
    size_t rows = 0;
  };
  std::deque<Launched> launched_;
  std::unordered_map<cache::RequestId, int32_t> prev_rows_;
  std::vector<int32_t> ahead_ids_;  // collect()'s ids, reused
  model::CudaModel* model_ = nullptr;  // impl_'s model and cache, for executor_cuda_ahead.cpp
  model::CudaCache* cache_ = nullptr;
  void forget_media(const sched::StepPlan& plan);  // the finished and cancelled requests' image rows
};

// The device sampler's logit adjustments for one row (kernels/cuda/sampling.h PenaltyEntry), appended
// to `out`: logit_bias, the min_tokens mask of the stop ids while the output is shorter, and the
// penalties over prompt ∪ output — what the twin (runtime/sampler.h) applies on the host.
void append_logit_adjustments(int32_t row, const StepHooks::SamplingInputs& in, int64_t V,
                              std::vector<cuda::PenaltyEntry>& out);

// Cache budget for --gpu-memory-utilization F on the current device: F × total memory − what is in use
// now (the weights, once uploaded) − `reserve` bytes for activations and cuBLASLt workspace.
int64_t cuda_cache_budget(double utilization, int64_t reserve);

}  // namespace kestrel::runtime
