// Executor: turns a scheduler StepPlan into CPU forward work over the CacheStore (docs/serving.md,
// "What the executor does with a StepPlan"): zero the slots of fresh starts, run the restores, ONE
// forward over every scheduled sequence (model::forward_batch: the rows of all decodes and prefill
// chunks stacked, so each projection is one GEMM for the whole step and each MoE expert is decoded
// once for all its tokens), hand each sampled sequence's last logits to the caller's sampler, then
// the snapshots.
//
// Batch invariance is exact: every op computes a token the same way whatever else shares the step
// (row-invariant GEMMs, recurrent KDA, absorbed MLA, per-query indexer and attention), so chunked
// prefill, preemption + re-prefill and any batch composition give a request bit-identical logits,
// hence identical tokens for a deterministic sampler. options.batched = false runs one forward per
// sequence instead (the same arithmetic; tests use it to show batching changes no bit).
//
// Speculation (options.speculative, spec_executor.h): a decode with num_draft > 0 is drafted before the
// forward, runs its anchor + drafts as rows of the same batched forward (all logits, KDA states traced per
// position), and is verified after it; the KDA state after the last kept position is kept and the engine's
// take_tokens hook emits the step's tokens. Every sequence's committed rows feed the draft's caches.
//
// Run-ahead (StepExecutor::launch/collect, the engine's async scheduling): the CPU executor is the GPU's
// twin in sequencing, not in overlap — launch() runs the forward and samples every row itself (a pending
// token taken from the previous launch's tokens), collect() hands the tokens over.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/cache_format.h"
#include "kernels/cpu/cpu_ops.h"
#include "loader/config.h"
#include "loader/weights.h"
#include "model/model.h"
#include "request/request.h"
#include "runtime/cache_store.h"
#include "runtime/sampler.h"
#include "runtime/spec_executor.h"
#include "sched/scheduler.h"

namespace kestrel::parallel {
class Comm;
}

namespace kestrel::runtime {

struct ExecutorOptions {
  bool batched = true;  // one forward for all sequences of a step (false: one per sequence)
  int dcp = 1;          // decode-context-parallel ranks of run_rank's group: 1 or its size (executor_tp.h)
  const SpecServing* speculative = nullptr;  // DSpark speculation (spec_executor.h); run() only, not run_rank
};

struct ExecutorStats {
  int64_t steps = 0;
  int64_t forwards = 0;          // forward calls (one per step; batched = false: one per sequence)
  int64_t tokens_forwarded = 0;  // positions run through the model: the prefill work actually done
  int64_t samples = 0;
  int64_t device_samples = 0;         // device executors: tokens sampled on the device
  int64_t host_fallback_samples = 0;  // device-sampled rows redrawn on the host (a grammar refused the device's token)
  double forward_seconds = 0.0;
  int64_t images_encoded = 0;    // images run through the vision tower (once per request)
  int64_t vision_calls = 0;      // encoder calls (CPU: one per request; GPU: a step's new images in one)
  double vision_seconds = 0.0;   // of which encoding (inside forward_seconds)
  // Speculation (vLLM's spec_decode counters): verified drafts, draft tokens proposed, draft tokens the
  // rule accepted (what a step emits may stop earlier at a stop id or max_tokens).
  int64_t spec_drafts = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
  double draft_seconds = 0.0;  // drafting and draft-cache injection
  // Device executors, per step summed (where each step's time goes; the GPU executor measures them with two
  // events, the first recorded on the idle stream as the step begins): the host's time from the step's start
  // to the forward enqueued, and to the device's forward done; forward_seconds less the latter is the step's
  // tail (sampling, token masks applied, tokens taken). mask_late: steps whose token masks were ready only
  // after the device's forward was done, and by how long in all (the only part of a mask wait on the critical
  // path; a few µs of event timing error).
  double launch_seconds = 0.0, forward_done_seconds = 0.0;
  double mask_late_seconds = 0.0;
  int64_t mask_late_steps = 0;
};

struct StepHooks {
  // The sampled token (and stop flag) for a sequence with `sample` set, from its last logits.
  std::function<sched::SeqResult(const sched::ScheduledSeq&, std::span<const float> logits /* f32 [V] */)> sample;
  // Optional (device executors): what the sampler of a sequence needs (its parameters, prompt and
  // output so far, stop ids; the draw index is output.size(), + 1 for a run-ahead row with its token
  // pending: StepExecutor::launch), and the hook that takes a token sampled on the device by the same
  // rules, so the logits never come back to the host. An executor may ignore these and call `sample`
  // instead (not in launch(), which has no `sample`).
  struct SamplingInputs {
    const SamplingParams* params = nullptr;
    std::span<const int32_t> prompt, output;
    // What min_tokens holds back (sample_token's stop_ids): none for a row whose mask this step allows
    // only them (the grammar's end wins; Engine::held_stops).
    std::span<const int32_t> stop_ids;
  };
  std::function<SamplingInputs(const sched::ScheduledSeq&)> sampling_inputs;
  std::function<sched::SeqResult(const sched::ScheduledSeq&, int32_t token)> take_token;
  // Speculative decodes (ScheduledSeq::num_draft > 0): the tokens a verified step emits, in order (the
  // accepted draft tokens, then the correction or bonus token); the result's `accepted` and `token`
  // are what the engine kept (it may stop early at a stop id). Needs sampling_inputs.
  std::function<sched::SeqResult(const sched::ScheduledSeq&, std::span<const int32_t> tokens)> take_tokens;
  // Optional (device executors): like `sample`, for a row the device already penalised (and masked):
  // penalties are not applied again. For the rows the device sampler hands back, and for tokens the
  // grammar refused (check_token below), which are drawn again here under the mask.
  std::function<sched::SeqResult(const sched::ScheduledSeq&, std::span<const float> logits)> sample_penalised;
  // Structured outputs (runtime/constraints.h), optional. `sample` masks by itself; a device executor
  // masks on the device: token_mask(x) waits for x's mask row of this step (filled by the engine's
  // worker while the forward runs) and returns its row in `mask_table` and the number of ids it
  // allows (row −1: no mask this step — unconstrained, or free text). When allowed ≤ top-k's
  // candidates, the row's top_k may be cut to `allowed` (the kept set is then exactly the allowed
  // ids). check_token(x, token) must pass before take_token for a device-sampled token: false means
  // the grammar refuses it (free text drew a special token it does not take there; or rounding drew
  // a masked id) and the row goes to sample_penalised instead. mask_table is fixed for the engine's
  // lifetime (a device executor may register it as pinned memory once).
  struct TokenMask {
    int32_t row = -1;
    int64_t allowed = 0;
  };
  struct MaskTable {
    const uint32_t* data = nullptr;  // host u32 [rows, words]
    int64_t rows = 0, words = 0;
  };
  std::function<TokenMask(const sched::ScheduledSeq&)> token_mask;
  std::function<bool(const sched::ScheduledSeq&, int32_t token)> check_token;
  MaskTable mask_table;
  // Optional: called once per step by an executor whose StepExecutor::announces_forward() is true, as soon
  // as the step's forward is enqueued on the device (before the first token_mask): the engine starts the
  // step's mask jobs then, so their start is not on the path to the launch while the device idles. Other
  // executors never call it; the engine then starts the jobs before run(). Idempotent.
  std::function<void()> forward_launched;
#define KESTREL_FORWARD_LAUNCHED 1  // this hook, announces_forward() and ExecutorStats' launch/late times exist
  // Optional: requests for which every position's logits are wanted (debug dumps), and the sink
  // that receives them, rows of positions [start, end).
  std::function<bool(cache::RequestId)> wants_all_logits;
  std::function<void(const sched::ScheduledSeq&, std::span<const float> rows /* f32 [end-start, V] */)> all_logits;
  // Optional: a request's images (request.h) for the prefill chunks that cover its <|media_pad|>
  // positions (MODEL.md §6). The executor encodes a request's images once, at its first chunk that
  // overlaps a media span, keeps the rows until the request finishes or is cancelled (a preempted
  // request's re-prefill reuses them) and puts them in place of those positions' embeddings; image i's
  // rows go to the media_pad ids inside media[i], in order. Empty `images`: a text-only request.
  struct MediaInputs {
    std::span<const int32_t> prompt;
    std::span<const MediaSpan> media;
    std::span<const std::shared_ptr<const ImageInput>> images;
  };
  std::function<MediaInputs(const sched::ScheduledSeq&)> media_inputs;
};

// Images, shared by the executors: whether x's positions [start, end) overlap one of its request's media
// spans (so the chunk needs the image rows), and the request's <|media_pad|> positions image by image (where
// the encoder's rows go, in order), checked against its images (one span per image, as many pads as rows).
bool overlaps_media(const sched::ScheduledSeq& x, const StepHooks::MediaInputs& mi);
std::vector<int64_t> media_pad_positions(cache::RequestId id, const StepHooks::MediaInputs& mi, int32_t pad);

// What the engine drives: the CPU Executor below, or a device executor (runtime/executor_cuda.h).
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) = 0;
  virtual const ExecutorStats& stats() const = 0;
  // Whether requests with images can run (StepHooks::media_inputs); the engine refuses them otherwise.
  virtual bool supports_images() const { return false; }
  // Whether run() calls StepHooks::forward_launched once it has enqueued the forward (device executors).
  virtual bool announces_forward() const { return false; }

  // Run-ahead (sched/scheduler.h schedule_ahead; docs/serving.md "Async scheduling"): whether launch() and
  // collect() exist. The engine calls them only then; the defaults fail.
  virtual bool runs_ahead() const { return false; }
  // Whether launch() returns while its step still computes (a device: the GPU, the fake executor's modelled one).
  // The engine then plans and launches the next continuation only shortly before the step in flight ends
  // (Engine::run_ahead, "late launch"); the CPU executor's launch() does the whole step, so it launches at once.
  virtual bool launches_async() const { return false; }
  // Whether launch() draws a row with these parameters by itself, never handing it back to the host — whose
  // logits the next launched step has overwritten by collect() time. The engine's plain() asks it; a request it
  // refuses keeps its batch synchronous. The CPU executor samples on the host, the GPU's device sampler never
  // hands a row back: every row, for both.
  virtual bool samples_ahead(const SamplingParams& p) const {
    (void)p;
    return true;
  }
  // Enqueues the step and may return before its forward is done. At most two steps are launched and not
  // yet collected. The plan holds only single-token decodes (sample set, no drafts; no prefills, no
  // copies) of requests the engine found plain (no constraint, logprobs, penalties, bias, held stop ids,
  // logits hook), so the executor samples every row itself, from hooks.sampling_inputs(x) (its spans valid
  // during that call only), and calls no other hook here. A row with token_pending takes as its input the
  // token that the previously launched step sampled for the same request, and its draw index is
  // output.size() + 1 (the engine's output does not hold that token yet); any other row's is output.size().
  // So seeded sampling draws exactly what run() would. The plan's finished, cancelled and preempted lists mean
  // what they mean to run() (a chain's first step, from schedule(), may carry them; continuations never do).
  virtual void launch(const sched::StepPlan& plan, const StepHooks& hooks);
  // Finishes the oldest launched step (`plan` is it; collects come in launch order) and returns its result,
  // calling hooks.take_token for every row, in plan order, now. The step is forgotten before the first
  // hook, so a hook that throws leaves nothing to collect.
  virtual sched::StepResult collect(const sched::StepPlan& plan, const StepHooks& hooks);
};

// Builds an engine's executor once the memory plan has sized its caches.
using ExecutorFactory =
    std::function<std::unique_ptr<StepExecutor>(const CacheFormats&, const cache::CacheConfig&)>;

class Executor : public StepExecutor {
 public:
  Executor(const ModelWeights& w, const ModelConfig& c, const CacheFormats& formats,
           const cache::CacheConfig& cache_config, const ExecutorOptions& options = {});

  sched::StepResult run(const sched::StepPlan& plan, const StepHooks& hooks) override;
  const ExecutorStats& stats() const override { return stats_; }
  bool supports_images() const override { return w_.has_vision && c_.vision.present; }
  // Run-ahead: launch() does the whole step (forward and sampling, as run() does), collect() hands it over.
  bool runs_ahead() const override { return true; }
  void launch(const sched::StepPlan& plan, const StepHooks& hooks) override;
  sched::StepResult collect(const sched::StepPlan& plan, const StepHooks& hooks) override;
  // One rank's part of a tensor-parallel step (executor_tp.h): the same work, every forward passing
  // `comm` to the model (`w` and `c` are then this rank's shard and rank_config). Null = run().
  sched::StepResult run_rank(const sched::StepPlan& plan, const StepHooks& hooks, parallel::Comm* comm);
  const CacheStore& store() const { return store_; }

 private:
  const ModelWeights& w_;
  const ModelConfig& c_;
  ExecutorOptions options_;
  CacheStore store_;
  ExecutorStats stats_;
  cpu::PackedWeights packed_;  // the model's bf16 weights in GEMM panels, packed on first use
  // Image rows of running requests (StepHooks::media_inputs), encoded once per request.
  struct EncodedMedia {
    std::vector<uint16_t> rows;  // bf16 [Σ tokens, D], images in order
    std::vector<int64_t> pos;    // prompt position of each row, ascending
  };
  std::unordered_map<cache::RequestId, EncodedMedia> media_;
  // The embedding overrides of x's positions [start, end) (encoding its images first if needed).
  std::vector<model::EmbedOverride> media_rows(const sched::ScheduledSeq& x, const StepHooks& hooks);
  std::unique_ptr<SpecDrafter> spec_;  // set with options.speculative
  // Run-ahead: launched steps not yet collected (oldest first), each row's sampled token in plan order; and
  // the tokens of the latest launch by request, which the next launch's pending rows take.
  struct Launched {
    uint64_t step = 0;
    std::vector<int32_t> tokens;
  };
  std::deque<Launched> launched_;
  std::unordered_map<cache::RequestId, int32_t> last_launch_tokens_;
};

}  // namespace kestrel::runtime
