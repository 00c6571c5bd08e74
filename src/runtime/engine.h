// Engine: requests in, token events out, one loop on its own thread: schedule (src/sched) → run the
// step on an executor (CPU: executor.h; GPU: executor_cuda.h; fake: fake_executor.h) → complete.
// It implements the front ends' engine (request/engine.h) directly: the server and `kestrel generate`
// hand it a Request and a sink, and nothing translates on the way.
//
//   Engine e(weights, config, EngineConfig{...});   // plans memory, starts the loop
//   Submission s = e.submit(Request{...}, [](TokenEvent&& ev) { ... });
//   e.cancel(s.id);  e.stats();  e.wait_idle();  e.shutdown();
//
// submit() is the one place a request is checked (validate() against the vocabulary and
// max_model_len), queued (at most max_queue waiting; beyond: queue_full) and numbered. Sinks run on
// the engine thread, never under the engine's lock, so a sink may call cancel() or submit(); a
// slow sink stalls every request. Stop ids end a request here (see request.h for what stops);
// stop strings are the consumer's text stream's, which cancels on a match.
//
// Memory: at construction plan_memory() splits `memory_budget` into KDA state slots (max_running
// running + checkpoint_slots prefix-cache checkpoints) and cache pages; under tensor parallelism the
// budget and the bytes are one rank's (EngineConfig::tp_size, dcp_size). max_model_len defaults to the
// model's context capped by the longest request the plan holds; an explicit one beyond either is
// refused at construction (as vLLM does), so an accepted request always fits.
//
// Structured outputs (request.h's OutputConstraint; runtime/constraints.h): a constrained request has a
// SeqConstraint (its Matcher). Each step, the jobs of the constrained sequences that sample (the
// matcher's step over the previous token, then the mask) run on the mask pool while the executor runs
// the forward; the sampler (host: `sample` hook; device: the executor, through token_mask/check_token)
// masks the logits, so the token is one the grammar takes, and the token is taken by a bit test (its
// matcher step deferred to the next job) unless it is special. Free text (the think section, a free response) is sampled without a mask and the
// token checked; a refused one is drawn again under the mask (draw index with bit 63 set). A
// terminated grammar ends the request (finish stop); no allowed token (the nesting limit) or a refused
// token ends it with an error event; neither touches other requests.
//
// Async scheduling (EngineConfig::async_scheduling, an executor that runs_ahead(); engine_ahead.cpp,
// docs/serving.md): in steady pure decode of plain requests the loop launches step N+1 (scheduler.h
// schedule_ahead) before it collects step N, so the device never waits for the host between them. A
// request that finishes at N while its row of N+1 is in flight gets its final event at N; its Req stays
// (`ended`, no more events) until N+1 is collected.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/cache_format.h"
#include "loader/config.h"
#include "loader/weights.h"
#include "request/engine.h"
#include "runtime/constraints.h"
#include "runtime/executor.h"
#include "runtime/sampler.h"
#include "sched/memory_plan.h"
#include "sched/scheduler.h"

namespace kestrel::runtime {

struct EngineConfig {
  int64_t memory_budget = int64_t(1) << 30;  // bytes for KDA slots + cache pages, per rank (per GPU)
  // The executor's parallel layout, for the memory plan only (sched/memory_plan.h): each rank allocates
  // KDA state for H/tp heads and MLA pages of block_size/dcp rows out of its own memory_budget.
  int tp_size = 1, dcp_size = 1;
  int32_t max_running = 16;                  // concurrent requests (one running state slot each)
  int32_t checkpoint_slots = 4;              // prefix-cache KDA checkpoints
  CacheFormats formats = {128, LatentFormat::bf16, IndexKeyFormat::bf16,
                                 KdaStateDtype::f32};
  int32_t max_num_batched_tokens = 2048;
  // Fairness between long and short prompts (sched/scheduler.h): the longest prefill chunk (0: no
  // cap), prefills at once, long prefills at once.
  int32_t long_prefill_token_threshold = 0;
  int32_t max_num_partial_prefills = 1 << 30;
  int32_t max_long_partial_prefills = 1;
  // > 0 (with a threshold): a long prompt's chunk is sized so that a step takes about this long,
  // from the measured seconds per token of recent steps (at least 16 tokens, at most the threshold),
  // so a short request's first token never waits behind a slow step whatever the device's speed.
  double prefill_step_target_s = 0.0;
  bool enable_prefix_cache = true;
  int32_t checkpoint_interval_blocks = 0;
  bool cpu_batched = true;      // CPU executor: one forward per step for all sequences (executor.h)
  int64_t max_model_len = 0;    // 0: min(model context, longest request of the memory plan)
  int32_t max_queue = std::numeric_limits<int32_t>::max();  // accepted, not yet admitted
  std::vector<int32_t> eos_token_ids;  // the end-of-sequence ids; empty: the config's eos_token_id
  // DSpark speculative decoding (docs/speculative.md): the CPU executor, or a make_executor that
  // speculates (executor_speculates: the one-GPU executor given the same SpecServing). Requests that
  // speculation cannot serve exactly (structured output, logprobs, prompt logprobs, penalties, logit
  // bias, min_tokens, a logits hook) run without it; greedy requests get exactly the tokens they get
  // without speculation.
  std::optional<SpecServing> speculative;
  // Builds the executor for the planned caches (engine_host.h: the GPU or fake executor); empty =
  // the CPU Executor over the weights given to the constructor.
  ExecutorFactory make_executor;
  bool executor_speculates = false;  // make_executor's executors run ScheduledSeq::num_draft > 0 decodes
  // Structured outputs: threads of the mask pool (runtime/constraints.h MaskPool); 0: automatic
  // (a quarter of the cores, 1 to 8).
  int32_t mask_threads = 0;
  // vLLM's --async-scheduling: pure-decode steps of plain requests run ahead (see the header). Ignored, with
  // one line on stderr, when the executor cannot (StepExecutor::runs_ahead()).
  bool async_scheduling = false;
  // Run-ahead's late launch (engine_ahead.cpp), with an executor whose launch() returns while the step computes: the
  // continuation of the step in flight is planned and launched this long before that step is expected to end (the
  // chain's recent period), so that a request arriving meanwhile ends the chain and enters the very next step, as
  // it would without run-ahead, instead of the one after. The engine adds its own planning and launch time to it.
  // < 0: launch at once (a new request then waits one whole step more). KESTREL_AHEAD_LEAD_US overrides it (µs).
  double ahead_launch_lead_s = 200e-6;
};

class Engine final : public kestrel::Engine {
 public:
  // The CPU executor over `w` unless cfg.make_executor is set. `w` and `c` must outlive the engine.
  // Throws kestrel::Error when the budget cannot hold the plan or max_model_len does not fit.
  Engine(const ModelWeights& w, const ModelConfig& c, EngineConfig cfg);
  // An engine whose executor needs no host weights: cfg.make_executor is required.
  Engine(const ModelConfig& c, EngineConfig cfg);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  bool ready() const override;  // false after shutdown() or a failed step
  std::string failure() const override;  // the failed step's error
  int64_t max_model_len() const override { return limits_.max_model_len; }
  int64_t vocab_size() const override { return limits_.vocab_size; }
  Submission submit(Request r, TokenSink sink) override;
  bool cancel(RequestId id) override;
  EngineStats stats() const override;
  IntegrityReport check_integrity() const override;  // under the lock, between or during steps
  void shutdown() override;

  // Structured-output costs so far (engine-thread time on the critical path vs. the worker's).
  struct StructuredStats {
    int64_t masked_samples = 0;   // tokens sampled under a mask
    int64_t free_samples = 0;     // constrained tokens sampled in free text (no mask)
    int64_t redraws = 0;          // free-text tokens refused and drawn again under the mask
    int64_t stolen = 0;           // mask jobs the engine thread ran itself (no pool thread had begun them)
    double fill_seconds = 0.0;    // mask jobs: deferred matcher steps + filling (the pool, overlapped with
                                  // the forward; and stolen ones)
    double wait_seconds = 0.0;    // the engine thread waiting for a mask job not yet done when first asked for
                                  // (a device executor asks right after enqueuing the forward, so this is
                                  // mostly hidden by it: ExecutorStats::mask_late_seconds is the part that is not)
    double host_seconds = 0.0;    // engine thread: starting the jobs, host masking and free-text checks (the
                                  // per-row bit tests and takes of device tokens are not timed: two clock
                                  // reads a row cost more than the take; the executor's tail measures them)
    int mask_threads = 0;         // the pool's size
  };
  StructuredStats structured_stats() const;
  // The executor's counters as of the last step (where a device step's time goes: ExecutorStats).
  ExecutorStats executor_stats() const;

  const sched::MemoryPlan& memory_plan() const { return plan_; }
  const RequestLimits& limits() const { return limits_; }
  // Blocks until no request is waiting or running (all events delivered).
  void wait_idle();

 private:
  struct Req {
    Request r;
    TokenSink sink;
    std::vector<int32_t> output;
    std::vector<int32_t> stop_ids;  // ids that end it: end-of-sequence + its own; none under ignore_eos
    int64_t logits_sent = 0;        // positions already passed to on_logits / prompt logprobs
    std::vector<PromptLogprob> prompt_lp;  // prompt positions 1.. so far (sampling.prompt_logprobs)
    int64_t cached = -1;            // prompt tokens skipped at the first admission (−1: not yet admitted)
    bool first_sent = false;        // the first event (it carries the prompt counts) is out
    std::vector<TokenEvent> pending;  // this step's events (several after a speculative step), sent after complete()
    std::unique_ptr<SeqConstraint> constraint;  // structured output, if any
    int32_t preaccepted = -1;       // token check_token already took (take_token follows)
    bool pre_terminated = false;    // ... and whether it completed the grammar
    int32_t job = -1;               // this step's mask job (= table row); −1: none
    int64_t allowed = -2;           // its result (MaskPool); −2: not waited for yet
    std::string error;              // set: this step's event ends the request with this error
    bool speculate = false;         // its decodes draft and verify (EngineConfig::speculative)
    // Run-ahead: its final event is out, but a step in flight still computes a row of it (ignored when
    // collected); erased then.
    bool ended = false;
  };
  using Outbox = std::vector<std::pair<TokenSink, TokenEvent>>;
  using InStep = std::vector<std::pair<RequestId, Req*>>;  // a plan's requests, in plan order
  void loop();
  void run_step(sched::StepPlan& plan, const InStep& in_step);
  // The tail of a step (run_step's, and each collected run-ahead step's): complete() under the lock, events
  // out, finished requests erased — or kept as `ended` when `next`, the step in flight after this one,
  // computes them — then the sinks. Waits a little when nothing ran and nothing was sent.
  void finish_step(const sched::StepPlan& plan, const InStep& in_step, const sched::StepResult& result,
                   double step_s, const sched::StepPlan* next);
  // The Req of `id` in in_step, looking from `hint` on (executors call hooks in plan order: O(1) a row).
  static Req& step_req(const InStep& in_step, RequestId id, size_t& hint);
  // Run-ahead (engine_ahead.cpp): whether a request's rows may run ahead, whether a plan may start a
  // chain of run-ahead steps, and the chain itself, from that plan until no decode can continue.
  bool plain(const Req& q) const;
  bool starts_run_ahead(const sched::StepPlan& plan, const InStep& in_step) const;
  void run_ahead(sched::StepPlan plan, InStep in_step);
  // words: the mask the token was drawn under (null: none — free text, or a device token already checked).
  sched::SeqResult emit(Req& q, const SampleResult& s, const uint32_t* words = nullptr);
  // The constrained host sampler: free text unmasked then checked, otherwise (or refused) masked.
  sched::SeqResult sample_host(Req& q, const sched::ScheduledSeq& x, std::span<const float> logits, bool penalised);
  // This step's mask job result for q (waits): allowed count > 0; −3: no mask (free text, or no job); a
  // failure (0: dead end, −1, −4) also sets q.error.
  int64_t wait_mask(Req& q);
  // The ids min_tokens holds back from this draw (sample_token's stop_ids): q.stop_ids while the output
  // is shorter than min_tokens — but none when the mask the token is drawn under (`words`, `allowed`
  // ids) allows nothing besides them: the grammar can only end there (a JSON answer complete before
  // min_tokens, a budget's last token), and the end wins, so no row reaches a sampler with every id at
  // −inf (docs/structured-outputs.md, "min_tokens").
  std::span<const int32_t> held_stops(const Req& q, const uint32_t* words, int64_t allowed) const;
  void start_masks(const sched::StepPlan& plan, const InStep& in_step);
  // Starts this step's mask jobs unless they have started (StepHooks::forward_launched, or the first hook
  // that needs a mask, whichever comes first).
  void ensure_masks();
  void stamp(Req& q, TokenEvent& ev) const;  // id and, on the first event, the prompt counts
  void end_all(FinishReason why, const std::string& error, Outbox& out);  // mu_ held

  const ModelConfig& c_;
  EngineConfig cfg_;
  sched::MemoryPlan plan_;
  RequestLimits limits_;
  sched::Scheduler sched_;
  // Structured outputs (declared before the executor: it may hold the table registered as pinned).
  int64_t mask_words_ = 0;
  MaskTable masks_;
  MaskPool worker_;
  std::vector<uint32_t> redraw_mask_;         // u32 [mask_words]: a free-text redraw's mask
  std::vector<float> masked_logits_;          // f32 [V]: scratch
  // This step's plan until its mask jobs start (engine thread; null once started).
  const sched::StepPlan* mask_plan_ = nullptr;
  const InStep* mask_in_step_ = nullptr;
  StructuredStats sstats_;                    // engine thread; copied under mu_ below
  StructuredStats sstats_copy_;
  std::unique_ptr<StepExecutor> exec_;
  bool run_ahead_ = false;  // async_scheduling and an executor that runs ahead
  // Late launch (engine_ahead.cpp; engine thread only), seconds, the latest 8 of each: the periods of run-ahead steps
  // that ran back to back (collect to collect), and the engine's own time from a continuation being due to its
  // launch's return (planning, launching, a late wake-up).
  std::vector<double> ahead_periods_;
  std::vector<double> ahead_launch_times_;

  mutable std::mutex mu_;
  std::condition_variable cv_;       // work arrived / stop
  std::condition_variable idle_cv_;  // went idle
  std::map<RequestId, std::unique_ptr<Req>> reqs_;  // guarded by mu_; Req contents: engine thread only
  RequestId next_id_ = 1;
  bool stop_ = false;
  std::string failed_;  // set when a step threw: every request ended with an error event
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  ExecutorStats exec_stats_;  // a copy taken under mu_ after each step (the executor's own runs unlocked)
  double seconds_per_token_ = 0.0;  // moving average over steps of 16+ tokens (prefill_step_target_s)
  std::mutex join_mu_;
  std::thread thread_;
};

}  // namespace kestrel::runtime
