// Engine loop (see engine.h).
#include "runtime/engine.h"

#include <algorithm>
#include <chrono>

#include "core/check.h"

namespace kestrel::runtime {
namespace {

sched::MemoryPlan make_plan(const ModelConfig& c, const EngineConfig& cfg) {
  if (cfg.max_running < 1) fail("engine: max_running must be >= 1, got {}", cfg.max_running);
  sched::MemoryPlanOptions o;
  o.max_running = cfg.max_running;
  o.checkpoint_slots = cfg.enable_prefix_cache ? cfg.checkpoint_slots : 0;
  o.formats = cfg.formats;
  return sched::plan_memory(c.text, cfg.memory_budget, o);
}

sched::SchedulerConfig sched_config(const ModelConfig& c, const EngineConfig& cfg) {
  sched::SchedulerConfig s;
  s.max_num_seqs = cfg.max_running;
  s.max_num_batched_tokens = cfg.max_num_batched_tokens;
  s.checkpoint_interval_blocks = cfg.checkpoint_interval_blocks;
  s.vocab_size = int32_t(c.text.vocab_size);
  return s;
}

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::none: return "none";
    case FinishReason::length: return "length";
    case FinishReason::stop: return "stop";
    case FinishReason::cancelled: return "cancelled";
    case FinishReason::error: return "error";
  }
  return "?";
}

Engine::Engine(const ModelWeights& w, const ModelConfig& c, const EngineConfig& cfg, const tok::Tokenizer* tokenizer)
    : w_(w),
      c_(c),
      cfg_(cfg),
      tok_(tokenizer),
      plan_(make_plan(c, cfg)),
      sched_(sched_config(c, cfg), plan_.cache_config(cfg.enable_prefix_cache)),
      exec_(cfg.make_executor
                ? cfg.make_executor(cfg.formats, plan_.cache_config(cfg.enable_prefix_cache))
                : std::make_unique<Executor>(w, c, cfg.formats, plan_.cache_config(cfg.enable_prefix_cache),
                                             ExecutorOptions{cfg.batch_invariant})) {
  KCHECK(exec_ != nullptr, "engine: the executor factory returned nothing");
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

RequestId Engine::submit(GenerateRequest r, EventCallback cb) {
  if (!cb) fail("submit: no event callback");
  r.sampling.validate();
  if (r.max_tokens < 1) fail("max_tokens must be >= 1, got {}", r.max_tokens);
  for (const std::string& s : r.stop)
    if (s.empty()) fail("stop strings must not be empty");
  if (!r.stop.empty() && !tok_) fail("stop strings need the tokenizer, and this engine has none");
  for (int32_t t : r.stop_token_ids)
    if (t < 0 || t >= c_.text.vocab_size) fail("stop token id {} outside the vocabulary [0, {})", t, c_.text.vocab_size);
  auto q = std::make_unique<Req>();
  for (const std::string& s : r.stop) q->stop_hold = std::max(q->stop_hold, s.size() - 1);
  if (tok_) q->decoder.emplace(*tok_);
  sched::Request sr;
  sr.prompt = r.prompt;
  sr.max_tokens = r.max_tokens;
  q->r = std::move(r);
  q->cb = std::move(cb);
  RequestId id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failed_.empty()) fail("engine stopped after an error: {}", failed_);
    id = next_id_++;
    sr.id = id;
    try {
      sched_.submit(std::move(sr));
    } catch (const Error& e) {
      // The scheduler names pages; say what the engine can hold as well.
      fail("{} (engine capacity: {} tokens in total, longest single request {} tokens; raise --memory-budget)",
           e.what(), plan_.token_capacity, plan_.longest_request);
    }
    prompt_tokens_ += int64_t(q->r.prompt.size());
    reqs_.emplace(id, std::move(q));
  }
  cv_.notify_all();
  return id;
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
  EngineStats s;
  const sched::SchedulerStats& ss = sched_.stats();
  s.running = int64_t(sched_.num_running());
  s.waiting = int64_t(sched_.num_waiting());
  s.pages_total = sched_.cache().pages().num_pages();
  s.pages_used = s.pages_total - sched_.cache().pages().num_free();
  s.pages_held = s.pages_total - sched_.cache().available_pages();
  s.kv_usage = s.pages_total ? double(s.pages_used) / s.pages_total : 0.0;
  s.prefix_queries = cfg_.enable_prefix_cache ? ss.admitted : 0;
  s.prefix_hits = ss.prefix_hits;
  s.prefix_hit_tokens = ss.prefix_hit_tokens;
  s.prefix_query_tokens = ss.prefix_query_tokens;
  s.prompt_tokens = prompt_tokens_;
  s.generation_tokens = generation_tokens_;
  s.tokens_forwarded = exec_->stats().tokens_forwarded;
  s.busy_seconds = exec_->stats().forward_seconds;
  s.steps = ss.steps;
  s.preemptions = ss.preemptions;
  s.finished = ss.finished;
  s.cancelled = ss.cancelled;
  return s;
}

bool Engine::ready() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failed_.empty();
}

int64_t Engine::num_waiting() const {
  std::lock_guard<std::mutex> lk(mu_);
  return int64_t(sched_.num_waiting());
}

void Engine::wait_idle() {
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return reqs_.empty(); });
}

sched::SeqResult Engine::sample(Req& q, std::span<const float> logits) {
  const GenerateRequest& r = q.r;
  return emit(q, sample_token(r.sampling, logits, r.prompt, q.output, uint64_t(q.output.size())));
}

sched::SeqResult Engine::emit(Req& q, const SampleResult& s) {
  const GenerateRequest& r = q.r;
  TokenEvent ev;
  ev.index = int32_t(q.output.size());
  ev.token = s.token;
  ev.logprob = s.logprob;
  ev.top_logprobs = s.top;
  if (q.output.empty()) ev.cached_prompt_tokens = int32_t(std::max<int64_t>(q.cached, 0));
  q.output.push_back(s.token);
  bool stop = std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), s.token) != r.stop_token_ids.end() ||
              (!r.ignore_eos && s.token == c_.text.eos_token_id);
  // Text: stop tokens add none; ids past the tokenizer's table (padded vocab) have no text.
  if (q.decoder && !stop && size_t(s.token) < tok_->vocab_size()) {
    const size_t before = q.text.size();
    q.text += q.decoder->push(tok::TokenId(s.token));
    for (const std::string& st : r.stop) {
      // Only matches that end in the new text are new; search from where they could start.
      const size_t from = before >= st.size() - 1 ? before - (st.size() - 1) : 0;
      const size_t at = q.text.find(st, from);
      if (at != std::string::npos) {
        q.text.resize(std::max(at, q.released));
        stop = true;
      }
    }
  }
  const bool last = stop || int32_t(q.output.size()) >= r.max_tokens;
  if (last && q.decoder && !stop) q.text += q.decoder->finish();
  const size_t upto = last ? q.text.size() : (q.text.size() > q.stop_hold ? q.text.size() - q.stop_hold : 0);
  if (upto > q.released) {
    ev.text = q.text.substr(q.released, upto - q.released);
    q.released = upto;
  }
  q.pending = std::move(ev);
  return {0, s.token, stop};
}

void Engine::loop() {
  for (;;) {
    sched::StepPlan plan;
    std::vector<std::pair<RequestId, Req*>> in_step;  // requests of this plan (nodes are stable)
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
    auto find = [&](RequestId id) -> Req& {
      for (auto& [i, q] : in_step)
        if (i == id) return *q;
      fail("engine: request {} is not in this step", id);
    };
    StepHooks hooks;
    hooks.sample = [&](const sched::ScheduledSeq& x, std::span<const float> logits) { return sample(find(x.id), logits); };
    hooks.sampling_inputs = [&](const sched::ScheduledSeq& x) {
      Req& q = find(x.id);
      return StepHooks::SamplingInputs{&q.r.sampling, q.r.prompt, q.output};
    };
    hooks.take_token = [&](const sched::ScheduledSeq& x, int32_t token) {
      SampleResult s;
      s.token = token;
      return emit(find(x.id), s);
    };
    hooks.wants_all_logits = [&](RequestId id) { return bool(find(id).r.on_logits); };
    hooks.all_logits = [&](const sched::ScheduledSeq& x, std::span<const float> rows) {
      Req& q = find(x.id);
      const int64_t V = c_.text.vocab_size;
      for (int64_t p = std::max(x.start, q.logits_sent); p < x.end; ++p)
        q.r.on_logits(p, rows.subspan(size_t((p - x.start) * V), size_t(V)));
      q.logits_sent = std::max(q.logits_sent, x.end);
    };
    sched::StepResult result;
    std::string error;
    try {
      if (plan.has_work()) result = exec_->run(plan, hooks);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty()) {
      // A step that threw leaves caches half-written: end every request with the error, refuse more.
      std::vector<std::pair<EventCallback, TokenEvent>> out;
      {
        std::lock_guard<std::mutex> lk(mu_);
        failed_ = error;
        for (auto& [id, q] : reqs_) {
          TokenEvent ev;
          ev.id = id, ev.finished = true, ev.reason = FinishReason::error, ev.error = error;
          out.push_back({q->cb, ev});
        }
        reqs_.clear();
        stop_ = true;
      }
      for (auto& [cb, ev] : out) cb(ev);
      idle_cv_.notify_all();
      return;
    }

    // Bookkeeping under the lock; callbacks after it.
    std::vector<std::pair<EventCallback, TokenEvent>> out;
    {
      std::lock_guard<std::mutex> lk(mu_);
      sched_.complete(plan, result);
      generation_tokens_ += int64_t(result.seqs.size());
      std::map<RequestId, FinishReason> done;
      for (const sched::FinishedRequest& f : sched_.drain_finished())
        done[f.id] = f.reason == sched::FinishReason::length ? FinishReason::length
                     : f.reason == sched::FinishReason::stop ? FinishReason::stop
                                                             : FinishReason::cancelled;
      for (auto& [id, q] : in_step)
        if (q->pending) {
          TokenEvent ev = std::move(*q->pending);
          q->pending.reset();
          ev.id = id;
          auto d = done.find(id);
          if (d != done.end()) {
            // A cancel that landed while the step was in flight drops the token it produced.
            if (d->second == FinishReason::cancelled) continue;
            ev.finished = true;
            ev.reason = d->second;
            done.erase(d);
          }
          out.push_back({q->cb, std::move(ev)});
        }
      for (auto [id, why] : done) {  // finished without a token this step (cancellations)
        TokenEvent ev;
        ev.id = id;
        ev.finished = true;
        ev.reason = why;
        out.push_back({reqs_.at(id)->cb, std::move(ev)});
      }
      for (auto& [cb, ev] : out)
        if (ev.finished) reqs_.erase(ev.id);  // `cb` is a copy: it outlives the request
    }
    for (auto& [cb, ev] : out) cb(ev);
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (reqs_.empty()) idle_cv_.notify_all();
      // Nothing ran and nothing was reported: wait for a submit/cancel instead of spinning.
      if (!plan.has_work() && out.empty()) cv_.wait_for(lk, std::chrono::milliseconds(5));
    }
  }
  // Shutdown: report every request still held as cancelled.
  std::vector<std::pair<EventCallback, TokenEvent>> out;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [id, q] : reqs_) {
      TokenEvent ev;
      ev.id = id;
      ev.finished = true;
      ev.reason = FinishReason::cancelled;
      out.push_back({q->cb, ev});
    }
    reqs_.clear();
  }
  for (auto& [cb, ev] : out) cb(ev);
  idle_cv_.notify_all();
}

}  // namespace kestrel::runtime
