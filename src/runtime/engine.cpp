// Engine loop (see engine.h). About 690 lines: the step hooks that tie the executor to the requests — sampling,
// structured-output masks, speculation, images — stay beside the loop they serve; the mask jobs' start at the
// forward's launch and min_tokens' held stops read the same per-step state as those hooks. Run-ahead steps
// (async scheduling) have their own file, engine_ahead.cpp, and share this file's step tail (finish_step).
#include "runtime/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "core/check.h"
#include "runtime/spec_decode.h"
#include "structured/matcher.h"
#include "vision/vision.h"

namespace kestrel::runtime {
namespace {

sched::MemoryPlan make_plan(const ModelConfig& c, const EngineConfig& cfg) {
  if (cfg.max_running < 1) fail("engine: max_running must be >= 1, got {}", cfg.max_running);
  sched::MemoryPlanOptions o;
  o.max_running = cfg.max_running;
  o.checkpoint_slots = cfg.enable_prefix_cache ? cfg.checkpoint_slots : 0;
  o.formats = cfg.formats;
  o.tp = cfg.tp_size;
  o.dcp = cfg.dcp_size;
  return sched::plan_memory(c.text, cfg.memory_budget, o);
}

// The request limits: the vocabulary, and max_model_len within the context and the memory plan.
RequestLimits make_limits(const ModelConfig& c, const EngineConfig& cfg, const sched::MemoryPlan& plan) {
  const int64_t ctx = c.text.max_position_embeddings;
  if (cfg.max_model_len > ctx) fail("--max-model-len {} exceeds the model's context length {}", cfg.max_model_len, ctx);
  if (cfg.max_model_len > plan.longest_request)
    fail("--max-model-len {} needs more KV cache than the memory plan holds ({} tokens for one request); "
         "raise --memory-budget or lower --max-model-len", cfg.max_model_len, plan.longest_request);
  RequestLimits l;
  l.vocab_size = c.text.vocab_size;
  l.max_model_len = cfg.max_model_len > 0 ? cfg.max_model_len : std::min(ctx, plan.longest_request);
  if (cfg.max_model_len == 0 && plan.longest_request < ctx)
    l.context_note = fmt::format(" (The memory plan holds {} tokens for one request; raise --memory-budget for more.)",
                                 plan.longest_request);
  return l;
}

sched::SchedulerConfig sched_config(const ModelConfig& c, const EngineConfig& cfg) {
  sched::SchedulerConfig s;
  s.max_num_seqs = cfg.max_running;
  s.max_num_batched_tokens = cfg.max_num_batched_tokens;
  s.checkpoint_interval_blocks = cfg.checkpoint_interval_blocks;
  s.long_prefill_token_threshold = cfg.long_prefill_token_threshold;
  s.max_num_partial_prefills = cfg.max_num_partial_prefills;
  s.max_long_partial_prefills = cfg.max_long_partial_prefills;
  s.vocab_size = int32_t(c.text.vocab_size);
  s.num_speculative_tokens = cfg.speculative ? cfg.speculative->num_speculative_tokens : 0;
  s.spec_disable_by_batch_size = cfg.speculative ? cfg.speculative->disable_by_batch_size : 0;
  return s;
}

// Adds the scope's duration to a counter (the engine thread's structured-output time).
struct Timed {
  double& to;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~Timed() { to += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

EngineConfig with_cpu_executor(const ModelWeights& w, const ModelConfig& c, EngineConfig cfg) {
  if (cfg.make_executor && cfg.speculative && !cfg.executor_speculates)
    fail("speculative decoding runs on the CPU executor and the one-GPU executor only (this executor factory does "
         "not speculate)");
  if (!cfg.make_executor) {
    cfg.make_executor = [&w, &c, bi = cfg.cpu_batched, spec = cfg.speculative](const CacheFormats& f,
                                                                               const cache::CacheConfig& cc) {
      ExecutorOptions o;
      o.batched = bi;
      o.speculative = spec ? &*spec : nullptr;
      return std::unique_ptr<StepExecutor>(std::make_unique<Executor>(w, c, f, cc, o));
    };
    cfg.executor_speculates = true;
  }
  return cfg;
}

// A request's images: the model's checks (vision::check_request_images), then an executor that runs the tower.
// Checked here so that the step never fails on them.
void check_images(const Request& r, const ModelConfig& c, const StepExecutor& exec) {
  if (r.images.empty()) return;
  vision::check_request_images(r, c);
  if (!exec.supports_images())
    throw RequestError("images", "this engine's executor cannot run the vision tower (images run on the CPU "
                                 "engine and the one-GPU engine; not yet under tensor parallelism)");
}

// Whether speculation serves this request exactly (engine.h EngineConfig::speculative).
bool speculates(const Request& r) {
  return !r.constraint && !r.on_logits && speculation_supports(r.sampling);
}

}  // namespace

Engine::Engine(const ModelWeights& w, const ModelConfig& c, EngineConfig cfg)
    : Engine(c, with_cpu_executor(w, c, std::move(cfg))) {}

Engine::Engine(const ModelConfig& c, EngineConfig cfg)
    : c_(c),
      cfg_(std::move(cfg)),
      plan_(make_plan(c, cfg_)),
      limits_(make_limits(c, cfg_, plan_)),
      sched_(sched_config(c, cfg_), plan_.cache_config(cfg_.enable_prefix_cache)),
      mask_words_((c.text.vocab_size + 31) / 32),
      masks_(std::max(cfg_.max_running, 1), mask_words_),
      worker_(MaskPool::auto_threads(cfg_.mask_threads)),
      redraw_mask_(size_t(mask_words_)) {
  KCHECK(bool(cfg_.make_executor), "engine: no executor factory");
  if (cfg_.speculative && !cfg_.executor_speculates)
    fail("speculative decoding needs an executor that speculates (the CPU or the one-GPU executor)");
  exec_ = cfg_.make_executor(cfg_.formats, plan_.cache_config(cfg_.enable_prefix_cache));
  KCHECK(exec_ != nullptr, "engine: the executor factory returned nothing");
  run_ahead_ = cfg_.async_scheduling && exec_->runs_ahead();
  if (const char* lead = std::getenv("KESTREL_AHEAD_LEAD_US"))  // the A/B of the late launch (engine.h)
    cfg_.ahead_launch_lead_s = std::atof(lead) * 1e-6;
  if (cfg_.async_scheduling && !run_ahead_)  // accepted, as vLLM accepts it for any backend; said once
    fmt::print(stderr, "kestrel: --async-scheduling: this executor cannot run steps ahead; every step runs "
                       "synchronously\n");
  if (cfg_.eos_token_ids.empty() && c.text.eos_token_id >= 0) cfg_.eos_token_ids = {c.text.eos_token_id};
  // Before any step is measured, long chunks start small; the first measurements size them.
  if (cfg_.prefill_step_target_s > 0.0 && cfg_.long_prefill_token_threshold > 0)
    sched_.set_long_prefill_chunk(std::min(cfg_.long_prefill_token_threshold, 64));
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  // From a sink (the engine thread itself) the loop ends after the sink returns; the destructor joins.
  std::lock_guard<std::mutex> lk(join_mu_);
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

Submission Engine::submit(Request r, TokenSink sink) {
  if (!sink) fail("submit: no event sink");
  validate(r, limits_);
  check_images(r, c_, *exec_);
  auto q = std::make_unique<Req>();
  if (!r.ignore_eos) {
    q->stop_ids = cfg_.eos_token_ids;
    q->stop_ids.insert(q->stop_ids.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
  }
  if (r.constraint) {
    const auto& g = r.constraint->grammar;
    if (int64_t(g->vocab().vocab_size()) != limits_.vocab_size)
      throw RequestError("response_format", fmt::format("the output constraint was compiled for {} token ids; the "
                                                        "model has {}", g->vocab().vocab_size(), limits_.vocab_size));
    // A document ends with an end-of-sequence id where it may end (ignore_eos or not: the grammar's
    // end is the request's); a chat grammar ends with its own <|end_of_msg|>.
    std::vector<int32_t> ends;
    if (!r.constraint->chat) {
      ends = cfg_.eos_token_ids;
      ends.insert(ends.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
      if (ends.empty()) throw RequestError("response_format", "a JSON document needs an end-of-sequence id; this model has none");
    }
    q->constraint = std::make_unique<SeqConstraint>(g, std::move(ends));
    if (r.constraint->complete_within_max_tokens) q->constraint->require_fits(r.max_tokens, r.max_tokens_field);
  }
  q->r = std::move(r);
  q->sink = std::move(sink);
  q->speculate = cfg_.speculative && speculates(q->r);
  Submission s;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ || !failed_.empty()) return s;  // not_ready
    if (sched_.num_waiting() >= size_t(std::max(cfg_.max_queue, 0))) {
      s.status = SubmitStatus::queue_full;
      return s;
    }
    s.id = next_id_++;
    sched_.submit(s.id, q->r, q->speculate);  // throws for a request the page pool can never hold; nothing is kept
    prompt_tokens_ += int64_t(q->r.prompt.size());
    reqs_.emplace(s.id, std::move(q));
    s.status = SubmitStatus::accepted;
  }
  cv_.notify_all();
  return s;
}

bool Engine::cancel(RequestId id) {
  bool ok;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ok = sched_.cancel(id);
  }
  cv_.notify_all();  // a cancelled waiting request finishes without a step: wake the loop to report it
  return ok;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = sched_.stats();
  s.running = int64_t(sched_.num_running());
  s.waiting = int64_t(sched_.num_waiting());
  s.pages_total = sched_.cache().pages().num_pages();
  s.pages_used = s.pages_total - sched_.cache().pages().num_free();
  s.pages_held = s.pages_total - sched_.cache().available_pages();
  s.prompt_tokens = prompt_tokens_;
  s.generation_tokens = generation_tokens_;
  s.tokens_forwarded = exec_stats_.tokens_forwarded;
  s.busy_seconds = exec_stats_.forward_seconds;
  s.spec_drafts = exec_stats_.spec_drafts;
  s.spec_draft_tokens = exec_stats_.spec_draft_tokens;
  s.spec_accepted_tokens = exec_stats_.spec_accepted_tokens;
  return s;
}

IntegrityReport Engine::check_integrity() const {
  std::lock_guard<std::mutex> lk(mu_);
  // Consistent at any moment under mu_: schedule() and complete() run under it, and a step in flight
  // holds its pages and pending snapshots through the requests that planned them.
  sched_.check_integrity();
  const cache::CacheManager& cm = sched_.cache();
  IntegrityReport r;
  r.requests = int64_t(reqs_.size());
  r.running = int64_t(sched_.num_running());
  r.waiting = int64_t(sched_.num_waiting());
  r.pages_total = cm.pages().num_pages();
  r.pages_free = cm.pages().num_free();
  r.pages_cached = int32_t(cm.prefix_cache().size());
  r.pages_held = r.pages_total - cm.available_pages();
  r.slots_total = cm.slots().num_slots();
  r.slots_free = cm.slots().num_free();
  r.checkpoints = cm.prefix_cache().num_checkpoints();
  return r;
}

bool Engine::ready() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !stop_ && failed_.empty();
}

std::string Engine::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failed_;
}

void Engine::wait_idle() {
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return reqs_.empty(); });
}

void Engine::stamp(Req& q, TokenEvent& ev) const {
  if (q.first_sent) return;
  q.first_sent = true;
  ev.prompt_tokens = int32_t(q.r.prompt.size());
  ev.cached_prompt_tokens = int32_t(std::max<int64_t>(q.cached, 0));
  ev.prompt_logprobs = std::move(q.prompt_lp);
}

sched::SeqResult Engine::emit(Req& q, const SampleResult& s, const uint32_t* words) {
  bool grammar_end = false;
  if (q.constraint && q.error.empty()) {
    // Not timed: at batch 64 two clock reads a row cost more than the take itself (StructuredStats::host_seconds).
    ensure_masks();  // the take must not run beside this request's job
    bool ok = true;
    if (q.preaccepted == s.token) grammar_end = q.pre_terminated;
    else ok = q.constraint->take(s.token, words, grammar_end);
    if (!ok) q.error = fmt::format("structured output: token {} is not allowed by the grammar here", s.token);
    grammar_end = ok && grammar_end;
  }
  q.preaccepted = -1;
  TokenEvent ev;
  ev.index = int32_t(q.output.size());
  ev.token = s.token;
  ev.logprob = s.logprob;
  ev.top_logprobs = s.top;
  q.output.push_back(s.token);
  q.pending.push_back(std::move(ev));
  const bool stop = std::find(q.stop_ids.begin(), q.stop_ids.end(), s.token) != q.stop_ids.end();
  sched::SeqResult r;
  r.token = s.token;
  r.finished = stop || grammar_end || !q.error.empty();
  return r;
}

Engine::StructuredStats Engine::structured_stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return sstats_copy_;
}

ExecutorStats Engine::executor_stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return exec_stats_;
}

void Engine::ensure_masks() {
  if (!mask_plan_) return;
  const sched::StepPlan& plan = *mask_plan_;
  mask_plan_ = nullptr;
  start_masks(plan, *mask_in_step_);
}

// This step's mask jobs: one per constrained sequence that samples (its table row), run by the pool in
// this order while the executor runs the forward.
void Engine::start_masks(const sched::StepPlan& plan, const InStep& in_step) {
  std::vector<MaskPool::Job> jobs;
  const auto t0 = std::chrono::steady_clock::now();
  size_t k = 0;  // in_step lists the plan's sequences in this order (loop())
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list) {
      Req* q = k < in_step.size() && in_step[k].first == x.id ? in_step[k].second : nullptr;
      ++k;
      for (size_t i = 0; !q && i < in_step.size(); ++i)
        if (in_step[i].first == x.id) q = in_step[i].second;
      if (!q) continue;
      q->job = -1, q->allowed = -2;
      if (!x.sample || !q->constraint || !q->error.empty()) continue;
      if (!q->constraint->sync(q->output)) {
        q->error = "structured output: the generated tokens do not follow the grammar";
        continue;
      }
      // The tokens left, this one included (output holds the deferred token), for this step's job.
      if (q->r.constraint->complete_within_max_tokens) q->constraint->set_budget(q->r.max_tokens, q->output.size());
      KCHECK(int64_t(jobs.size()) < masks_.rows(), "engine: more masked sequences than mask rows ({})", masks_.rows());
      q->job = int32_t(jobs.size());
      jobs.push_back({q->constraint.get(), masks_.row(int64_t(jobs.size()))});
    }
  sstats_.host_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  worker_.start(std::move(jobs));
}

namespace {
// Masks never lead where nothing can follow, the nesting limit included (structured/matcher.h), so this
// is a safety net: a grammar whose shortest completion needs a byte no single token spells.
const char* kDeadEnd = "structured output: the grammar allows no token here";
const char* kFillFailed = "structured output: computing the token mask failed";
}  // namespace

int64_t Engine::wait_mask(Req& q) {
  ensure_masks();
  if (q.job < 0) return MaskPool::kFreeText;
  if (q.allowed == -2) {
    if (!worker_.done(size_t(q.job), q.allowed)) {  // done already: no clock read
      const auto t0 = std::chrono::steady_clock::now();
      q.allowed = worker_.wait(size_t(q.job));
      sstats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (q.allowed == 0) q.error = kDeadEnd;
    if (q.allowed == MaskPool::kFailed) q.error = kFillFailed;
    if (q.allowed == MaskPool::kRefused)
      q.error = fmt::format("structured output: token {} is not allowed by the grammar here", q.constraint->deferred());
  }
  return q.allowed;
}

std::span<const int32_t> Engine::held_stops(const Req& q, const uint32_t* words, int64_t allowed) const {
  const std::span<const int32_t> stops = q.stop_ids;
  if (!words || allowed <= 0 || q.output.size() >= size_t(std::max(q.r.sampling.min_tokens, 0))) return stops;
  // Distinct stop ids the mask allows (a stop id may be listed twice: an eos id also in stop_token_ids).
  int64_t stops_allowed = 0;
  for (size_t i = 0; i < stops.size(); ++i) {
    const int32_t t = stops[i];
    if (t < 0 || int64_t(t) >= mask_words_ * 32 || !structured::mask_test(words, structured::TokenId(t))) continue;
    if (std::find(stops.begin(), stops.begin() + std::ptrdiff_t(i), t) == stops.begin() + std::ptrdiff_t(i)) ++stops_allowed;
  }
  return stops_allowed == allowed ? std::span<const int32_t>() : stops;
}

sched::SeqResult Engine::sample_host(Req& q, const sched::ScheduledSeq& x, std::span<const float> logits,
                                     bool penalised) {
  (void)x;
  SamplingParams p = q.r.sampling;
  if (penalised) p.repetition_penalty = 1.0f, p.frequency_penalty = 0.0f, p.presence_penalty = 0.0f;
  uint64_t index = q.output.size();
  if (!q.constraint || !q.error.empty()) return emit(q, sample_token(p, logits, q.r.prompt, q.output, index, q.stop_ids));
  int64_t allowed = wait_mask(q);
  const uint32_t* words = nullptr;
  if (allowed == MaskPool::kFreeText && q.error.empty()) {
    // Free text: draw without a mask and check; a refused token is drawn again under the mask.
    SampleResult s = sample_token(p, logits, q.r.prompt, q.output, index, q.stop_ids);
    bool ok, end;
    {
      Timed t{sstats_.host_seconds};
      ok = q.constraint->take(s.token, nullptr, end);
    }
    if (ok) {
      q.preaccepted = s.token, q.pre_terminated = end;
      ++sstats_.free_samples;
      return emit(q, s);
    }
    ++sstats_.redraws;
    Timed t{sstats_.host_seconds};
    allowed = q.constraint->fill(redraw_mask_.data());
    if (allowed == 0) q.error = kDeadEnd;
    words = redraw_mask_.data();
    index |= uint64_t(1) << 63;
  } else if (allowed > 0) {
    words = masks_.row(q.job);
  }
  if (!q.error.empty()) {
    SampleResult s;
    s.token = 0;  // not an output token: the event is token-less (run_step)
    return emit(q, s);
  }
  {
    Timed t{sstats_.host_seconds};
    masked_logits_.assign(logits.begin(), logits.end());
    apply_token_mask(masked_logits_, words);
  }
  // Only allowed ids have finite logits: cutting top-k to their count keeps exactly them, so even a
  // draw that rounds to the end of the kept prefix lands on an allowed id.
  if (p.top_k <= 0 || p.top_k > allowed) p.top_k = int32_t(std::min<int64_t>(allowed, INT32_MAX));
  const int32_t want_logprobs = p.logprobs;
  p.logprobs = -1;
  SampleResult s = sample_token(p, masked_logits_, q.r.prompt, q.output, index, held_stops(q, words, allowed));
  if (want_logprobs >= 0) raw_logprobs(logits, s.token, want_logprobs, s.logprob, s.top);
  ++sstats_.masked_samples;
  return emit(q, s, words);
}

void Engine::end_all(FinishReason why, const std::string& error, Outbox& out) {
  for (auto& [id, q] : reqs_) {
    if (q->ended) continue;  // its final event is out
    TokenEvent ev;
    ev.id = id;
    ev.finish = why;
    ev.error = error;
    stamp(*q, ev);
    out.push_back({std::move(q->sink), std::move(ev)});
  }
  reqs_.clear();
}

// Executors call the hooks in plan order (or close to it), one or several hooks per row in turn: look at
// the entry last found, then the ones after it, so a batch of B rows costs O(B) lookups, not O(B²).
Engine::Req& Engine::step_req(const InStep& in_step, RequestId id, size_t& hint) {
  const size_t n = in_step.size();
  const size_t from = hint > 0 ? hint - 1 : 0;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (from + k) % n;
    if (in_step[i].first == id) {
      hint = i + 1;
      return *in_step[i].second;
    }
  }
  fail("engine: request {} is not in this step", id);
}

// One step: the executor's run, with the hooks that tie it to the requests of this plan.
void Engine::run_step(sched::StepPlan& plan, const InStep& in_step) {
  size_t hint = 0;
  auto find = [&](RequestId id) -> Req& { return step_req(in_step, id, hint); };
  // Structured outputs: the masks of this step start filling on the pool — before the run, or, with an
  // executor that announces its forward, once the forward is enqueued (StepHooks::forward_launched) — and
  // must be done before this function leaves (the requests they name may go away after it), also on a
  // throw. Every hook that needs a mask starts them first if they have not started.
  mask_plan_ = &plan, mask_in_step_ = &in_step;
  if (!exec_->announces_forward()) ensure_masks();
  struct WaitAll {
    Engine& e;
    ~WaitAll() {
      e.mask_plan_ = nullptr;  // not started (the run threw before its forward): nothing to wait for
      e.worker_.wait_all();
    }
  } wait_all{*this};
  StepHooks hooks;
  hooks.sample = [&](const sched::ScheduledSeq& x, std::span<const float> logits) {
    return sample_host(find(x.id), x, logits, false);
  };
  hooks.sample_penalised = [&](const sched::ScheduledSeq& x, std::span<const float> logits) {
    return sample_host(find(x.id), x, logits, true);
  };
  hooks.token_mask = [&](const sched::ScheduledSeq& x) {
    StepHooks::TokenMask m;
    Req& q = find(x.id);
    const int64_t allowed = wait_mask(q);
    if (allowed > 0) m.row = q.job, m.allowed = allowed;
    return m;
  };
  // A device token: a bit test of its mask row (free text: of ordinary ids); its matcher step is
  // deferred to the next step's job unless it is special (SeqConstraint::take).
  hooks.check_token = [&](const sched::ScheduledSeq& x, int32_t token) {
    Req& q = find(x.id);
    if (!q.constraint || !q.error.empty()) return true;
    const int64_t allowed = wait_mask(q);
    if (!q.error.empty()) return true;  // take_token ends it with the error
    bool end;
    const bool ok = q.constraint->take(token, allowed > 0 ? masks_.row(q.job) : nullptr, end);  // untimed: see emit()
    if (ok) q.preaccepted = token, q.pre_terminated = end, ++(allowed > 0 ? sstats_.masked_samples : sstats_.free_samples);
    return ok;
  };
  hooks.mask_table = {masks_.data(), masks_.rows(), masks_.words()};
  hooks.forward_launched = [&] { ensure_masks(); };
  hooks.sampling_inputs = [&](const sched::ScheduledSeq& x) {
    Req& q = find(x.id);
    std::span<const int32_t> stops = q.stop_ids;
    // While min_tokens holds the stop ids back, whether it may (held_stops) depends on this step's mask:
    // such a row waits for its mask here, before the forward, instead of during it. Only constrained
    // requests below min_tokens pay this.
    if (q.constraint && q.error.empty() && x.sample && q.output.size() < size_t(std::max(q.r.sampling.min_tokens, 0))) {
      const int64_t allowed = wait_mask(q);
      if (allowed > 0) stops = held_stops(q, masks_.row(q.job), allowed);
    }
    return StepHooks::SamplingInputs{&q.r.sampling, q.r.prompt, q.output, stops};
  };
  hooks.take_token = [&](const sched::ScheduledSeq& x, int32_t token) {
    Req& q = find(x.id);
    const uint32_t* words = nullptr;
    if (q.constraint && q.error.empty() && wait_mask(q) > 0) words = masks_.row(q.job);
    SampleResult s;
    s.token = token;
    return emit(q, s, words);
  };
  hooks.media_inputs = [&](const sched::ScheduledSeq& x) {
    const Req& q = find(x.id);
    return StepHooks::MediaInputs{q.r.prompt, q.r.media, q.r.images};
  };
  // A verified speculative step: its tokens in order, up to the first that ends the request.
  hooks.take_tokens = [&](const sched::ScheduledSeq& x, std::span<const int32_t> tokens) {
    Req& q = find(x.id);
    sched::SeqResult r;
    for (size_t k = 0; k < tokens.size(); ++k) {
      SampleResult s;
      s.token = tokens[k];
      const sched::SeqResult e = emit(q, s);
      if (k + 1 < tokens.size() && !e.finished) {
        r.accepted.push_back(tokens[k]);
        continue;
      }
      r.token = e.token;
      r.finished = e.finished;
      break;
    }
    return r;
  };
  // Every position's logits: for the debug hook, and for prompt logprobs until the prompt is done.
  hooks.wants_all_logits = [&](RequestId id) {
    const Req& q = find(id);
    return bool(q.r.on_logits) ||
           (q.r.sampling.prompt_logprobs >= 0 && q.logits_sent + 1 < int64_t(q.r.prompt.size()));
  };
  hooks.all_logits = [&](const sched::ScheduledSeq& x, std::span<const float> rows) {
    Req& q = find(x.id);
    const int64_t V = c_.text.vocab_size, P = int64_t(q.r.prompt.size());
    for (int64_t p = std::max(x.start, q.logits_sent); p < x.end; ++p) {
      const std::span<const float> row = rows.subspan(size_t((p - x.start) * V), size_t(V));
      if (q.r.on_logits) q.r.on_logits(p, row);
      // Row p predicts position p + 1.
      if (q.r.sampling.prompt_logprobs >= 0 && p + 1 < P)
        q.prompt_lp.push_back(token_logprobs(row, q.r.prompt[size_t(p + 1)], q.r.sampling.prompt_logprobs));
    }
    q.logits_sent = std::max(q.logits_sent, x.end);
  };
  sched::StepResult result;
  const auto t0 = std::chrono::steady_clock::now();
  if (plan.has_work()) result = exec_->run(plan, hooks);
  const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  mask_plan_ = nullptr;  // a step whose executor never needed them: nothing to start
  worker_.wait_all();
  finish_step(plan, in_step, result, step_s, nullptr);
}

void Engine::finish_step(const sched::StepPlan& plan, const InStep& in_step, const sched::StepResult& result,
                         double step_s, const sched::StepPlan* next) {
  // Bookkeeping under the lock; sinks after it.
  Outbox out;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sched_.complete(plan, result);
    exec_stats_ = exec_->stats();
    sstats_copy_ = sstats_;
    sstats_copy_.fill_seconds = worker_.busy_seconds();
    sstats_copy_.stolen = worker_.stolen();
    sstats_copy_.mask_threads = worker_.threads();
    // Long prompts' chunks sized to the step-time target (engine.h).
    if (cfg_.prefill_step_target_s > 0.0 && cfg_.long_prefill_token_threshold > 0 && plan.num_tokens >= 16) {
      // Up at once (a slower step must not repeat), down gently (one fast step proves little).
      const double spt = step_s / double(plan.num_tokens);
      seconds_per_token_ = spt > seconds_per_token_ ? spt : 0.7 * seconds_per_token_ + 0.3 * spt;
      const double fit = cfg_.prefill_step_target_s / seconds_per_token_;
      sched_.set_long_prefill_chunk(
          int32_t(std::clamp<double>(fit, 16.0, double(cfg_.long_prefill_token_threshold))));
    }
    for (const sched::SeqResult& r : result.seqs) generation_tokens_ += 1 + int64_t(r.accepted.size());
    std::map<RequestId, FinishReason> done;
    for (const sched::FinishedRequest& f : sched_.drain_finished()) done[f.id] = f.reason;
    for (auto& [id, q] : in_step) {
      if (q->pending.empty()) continue;
      std::vector<TokenEvent> evs = std::move(q->pending);
      q->pending.clear();
      auto d = done.find(id);
      if (d != done.end()) {
        // A cancel that landed while the step was in flight drops the tokens it produced.
        if (d->second == FinishReason::cancelled) continue;
        evs.back().finish = d->second;
        done.erase(d);
      }
      if (!q->error.empty()) {  // a structured-output failure: token-less, this request only
        TokenEvent& ev = evs.back();
        ev.index = -1, ev.token = -1, ev.logprob = 0.0f, ev.top_logprobs.clear();
        ev.finish = FinishReason::error;
        ev.error = q->error;
      }
      for (TokenEvent& ev : evs) {
        ev.id = id;
        stamp(*q, ev);
        out.push_back({q->sink, std::move(ev)});
      }
    }
    for (auto [id, why] : done) {  // finished without a token this step (cancellations)
      TokenEvent ev;
      ev.id = id;
      ev.finish = why;
      stamp(*reqs_.at(id), ev);
      out.push_back({reqs_.at(id)->sink, std::move(ev)});
    }
    // Requests that ended at the step before (run-ahead) had their last row here.
    for (auto& [id, q] : in_step)
      if (q->ended) reqs_.erase(id);
    auto in_next = [&](RequestId id) {
      return next && std::any_of(next->decodes.begin(), next->decodes.end(),
                                 [&](const sched::ScheduledSeq& x) { return x.id == id; });
    };
    for (auto& [sink, ev] : out)
      if (ev.finished()) {
        if (in_next(ev.id)) reqs_.at(ev.id)->ended = true;  // its row of `next` is in flight: kept until then
        else reqs_.erase(ev.id);  // `sink` is a copy: it outlives the request
      }
  }
  for (auto& [sink, ev] : out) sink(std::move(ev));
  std::unique_lock<std::mutex> lk(mu_);
  if (reqs_.empty()) idle_cv_.notify_all();
  // Nothing ran and nothing was reported: wait for a submit/cancel instead of spinning.
  if (!plan.has_work() && out.empty() && !stop_) cv_.wait_for(lk, std::chrono::milliseconds(5));
}

void Engine::loop() {
  for (;;) {
    sched::StepPlan plan;
    InStep in_step;  // requests of this plan (nodes are stable)
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !sched_.idle() || !reqs_.empty(); });
      if (stop_) break;
      plan = sched_.schedule();
      for (const auto* list : {&plan.decodes, &plan.prefills})
        for (const sched::ScheduledSeq& x : *list) in_step.push_back({x.id, reqs_.at(x.id).get()});
      // A request's first prefill chunk starts where its prefix-cache hit ended.
      for (const sched::ScheduledSeq& x : plan.prefills) {
        Req& q = *reqs_.at(x.id);
        if (q.cached < 0) q.cached = x.start;
      }
    }
    try {
      if (starts_run_ahead(plan, in_step)) run_ahead(std::move(plan), std::move(in_step));
      else run_step(plan, in_step);
    } catch (const std::exception& e) {
      // A step that threw leaves caches half-written: end every request with the error, refuse more.
      Outbox out;
      {
        std::lock_guard<std::mutex> lk(mu_);
        failed_ = e.what();
        stop_ = true;
        end_all(FinishReason::error, failed_, out);
      }
      // Said once where an operator looks (the server's /health and API errors repeat it): without this line a
      // failed step showed only as requests refused with 503.
      fmt::print(stderr, "kestrel: an engine step failed; every request is refused from now on: {}\n", e.what());
      std::fflush(stderr);
      for (auto& [sink, ev] : out) sink(std::move(ev));
      idle_cv_.notify_all();
      return;
    }
  }
  // Shutdown: every request still held ends as cancelled.
  Outbox out;
  {
    std::lock_guard<std::mutex> lk(mu_);
    end_all(FinishReason::cancelled, "", out);
  }
  for (auto& [sink, ev] : out) sink(std::move(ev));
  idle_cv_.notify_all();
}

}  // namespace kestrel::runtime
