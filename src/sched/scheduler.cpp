// Scheduler policy (see scheduler.h). All memory goes through CacheManager; this file decides who
// runs, how much, and who yields.
#include "sched/scheduler.h"

#include <algorithm>
#include <unordered_map>

#include "core/check.h"

namespace kestrel::sched {
namespace {
int64_t max_budget(const SchedulerConfig& c) { return c.max_num_batched_tokens; }
}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config, const cache::CacheConfig& cache_config)
    : config_(config), cache_(cache_config) {
  if (config.max_num_seqs <= 0) fail("scheduler: max_num_seqs must be positive, got {}", config.max_num_seqs);
  if (config.max_num_batched_tokens <= 0)
    fail("scheduler: max_num_batched_tokens must be positive, got {}", config.max_num_batched_tokens);
  if (config.checkpoint_interval_blocks < 0)
    fail("scheduler: checkpoint_interval_blocks must be >= 0, got {}", config.checkpoint_interval_blocks);
  if (config.long_prefill_token_threshold < 0)
    fail("scheduler: long_prefill_token_threshold must be >= 0, got {}", config.long_prefill_token_threshold);
  if (config.max_num_partial_prefills < 1 || config.max_long_partial_prefills < 1)
    fail("scheduler: max_num_partial_prefills ({}) and max_long_partial_prefills ({}) must be >= 1",
         config.max_num_partial_prefills, config.max_long_partial_prefills);
}

int32_t Scheduler::pages_for(int64_t tokens) const {
  const int P = cache_.config().block_size;
  return int32_t((tokens + P - 1) / P);
}

Scheduler::Seq& Scheduler::seq(RequestId id) {
  auto it = seqs_.find(id);
  KCHECK(it != seqs_.end(), "unknown request {}", id);
  return it->second;
}

void Scheduler::submit(RequestId id, const Request& r, bool speculate) {
  if (seqs_.count(id)) fail("request {}: id already in use", id);
  // validate() has checked the request; admission needs at least one prompt token and one to generate.
  KCHECK(!r.prompt.empty() && r.max_tokens >= 1, "request {} was not validated", id);
  // The last sampled token is never fed back, so at most prompt + max_tokens − 1 positions are cached.
  const int64_t most = int64_t(r.prompt.size()) + r.max_tokens - 1;
  if (pages_for(most) > cache_.config().num_pages)
    fail("request {}: prompt ({} tokens) + max_tokens ({}) needs {} cache pages, the pool has only {} ({} tokens); "
         "it can never run",
         id, r.prompt.size(), r.max_tokens, pages_for(most), cache_.config().num_pages,
         int64_t(cache_.config().num_pages) * cache_.config().block_size);
  Seq s;
  s.id = id;
  s.prompt_len = int64_t(r.prompt.size());
  s.max_tokens = r.max_tokens;
  s.tokens = r.prompt;
  s.extras = cache::block_extra_keys(s.prompt_len, cache_.config().block_size, r.media);
  s.no_prefix_hit = r.sampling.prompt_logprobs >= 0;
  s.speculate = speculate && config_.num_speculative_tokens > 0;  // on_logits sees only the positions computed (a hit skips some)
  s.arrival = next_arrival_++;
  waiting_.insert({s.arrival, id});
  seqs_.emplace(id, std::move(s));
}

bool Scheduler::cancel(RequestId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  Seq& s = it->second;
  if (s.retired) return false;  // finished already; only its memory waits for a step in flight
  if (s.cancel_pending) return true;
  if (!in_flight_.empty() && s.running) {
    s.cancel_pending = true;  // the step in flight still uses its pages; complete() frees them
    return true;
  }
  finish(s, FinishReason::cancelled);
  return true;
}

void Scheduler::release(Seq& s) {
  const RequestId id = s.id;
  if (s.running) {
    cache_.free(id);
    running_.erase({s.arrival, id});
  } else {
    waiting_.erase({s.arrival, id});
  }
  seqs_.erase(id);
}

void Scheduler::finish(Seq& s, FinishReason why) {
  const RequestId id = s.id;
  FinishedRequest f;
  f.id = id;
  f.output.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
  f.reason = why;
  outputs_.push_back(std::move(f));
  if (why == FinishReason::cancelled) {
    cancelled_since_.push_back(id);
    ++stats_.cancelled;
  } else {
    finished_since_.push_back(id);
    ++stats_.finished;
  }
  if (s.in_flight > 0) {
    // Run-ahead: a later step in flight still writes its pages and state; complete() of that step releases them.
    s.retired = true;
    s.cancel_pending = false;
    return;
  }
  release(s);
}

std::vector<FinishedRequest> Scheduler::drain_finished() {
  std::vector<FinishedRequest> out;
  out.swap(outputs_);
  return out;
}

void Scheduler::preempt(Seq& s, StepPlan& plan) {
  cache_.free(s.id);
  running_.erase({s.arrival, s.id});
  s.running = false;
  s.prefill_done = false;
  s.computed = 0;
  s.checkpoints.clear();
  waiting_.insert({s.arrival, s.id});
  plan.preempted.push_back(s.id);
  ++stats_.preemptions;
}

bool Scheduler::grow_or_preempt(Seq& s, int64_t end, const std::set<RequestId>& scheduled, StepPlan& plan) {
  while (!cache_.grow(s.id, end)) {
    // Newest running request that this step has not scheduled yet, if newer than the requester.
    Seq* victim = nullptr;
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      if (it->first <= s.arrival) break;
      if (!scheduled.count(it->second)) {
        victim = &seq(it->second);
        break;
      }
    }
    if (!victim) {
      preempt(s, plan);
      return false;
    }
    preempt(*victim, plan);
  }
  return true;
}

bool Scheduler::is_long(const Seq& s) const {
  const int64_t L = config_.long_prefill_token_threshold;
  return L > 0 && int64_t(s.tokens.size()) - s.computed > L;
}

int32_t Scheduler::long_prefill_chunk() const {
  const int32_t L = config_.long_prefill_token_threshold;
  return long_chunk_ > 0 ? std::min(long_chunk_, L) : L;
}

// A long prompt's chunk is at most long_prefill_chunk(); any other at most L (it has no more left).
int64_t Scheduler::chunk_end(const Seq& s, int64_t budget, bool long_prefill) const {
  if (config_.long_prefill_token_threshold > 0)
    budget = std::min<int64_t>(budget, long_prefill ? long_prefill_chunk() : config_.long_prefill_token_threshold);
  int64_t end = std::min<int64_t>(int64_t(s.tokens.size()), s.computed + budget);
  auto it = s.checkpoints.upper_bound(s.computed);
  if (it != s.checkpoints.end() && *it < end) end = *it;
  return end;
}

ScheduledSeq Scheduler::make_scheduled(const Seq& s, int64_t end, bool reset) const {
  ScheduledSeq x;
  x.id = s.id;
  x.start = s.computed;
  x.end = end;
  x.tokens.assign(s.tokens.begin() + s.computed, s.tokens.begin() + end);
  x.sample = end == int64_t(s.tokens.size());
  x.reset_state = reset;
  x.state_slot = cache_.state_slot(s.id);
  const auto& pages = cache_.block_table(s.id).pages;
  x.block_table.assign(pages.begin(), pages.begin() + pages_for(end));
  return x;
}

void Scheduler::start_flight(const StepPlan& plan) {
  Flight f;
  f.step = plan.step;
  f.decodes_only = plan.prefills.empty();
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const ScheduledSeq& x : *list) {
      f.decodes_only = f.decodes_only && x.num_draft == 0;
      f.rows.push_back({x.id, x.start, x.end});
      ++seq(x.id).in_flight;
    }
  in_flight_.push_back(std::move(f));
}

StepPlan Scheduler::schedule() {
  if (!in_flight_.empty())
    fail("scheduler: schedule() called again before complete() of step {}", in_flight_.front().step);
  StepPlan plan;
  plan.step = next_step_++;
  plan.finished.swap(finished_since_);
  plan.cancelled.swap(cancelled_since_);
  int64_t budget = max_budget(config_);
  std::set<RequestId> scheduled;
  const int P = cache_.config().block_size;

  // 1. Decodes, oldest first. A copy of the keys: preemption edits running_.
  const std::vector<Key> order(running_.begin(), running_.end());
  bool draft = config_.num_speculative_tokens > 0;
  if (draft && config_.spec_disable_by_batch_size > 0) {
    int64_t decodes = 0;
    for (const Key& k : order) {
      auto it = seqs_.find(k.second);
      decodes += it != seqs_.end() && it->second.running && it->second.prefill_done;
    }
    draft = decodes <= config_.spec_disable_by_batch_size;
  }
  for (const Key& k : order) {
    if (budget == 0) break;
    auto it = seqs_.find(k.second);
    if (it == seqs_.end() || !it->second.running || !it->second.prefill_done) continue;
    Seq& s = it->second;
    // Speculation: the anchor + γ draft positions, γ cut so the step can never emit past max_tokens
    // (it emits at most γ + 1) and to the step's budget.
    int64_t gamma = 0;
    if (s.speculate && draft) {
      const int64_t generated = int64_t(s.tokens.size()) - s.prompt_len;
      gamma = std::clamp<int64_t>(std::min<int64_t>({config_.num_speculative_tokens, s.max_tokens - generated - 1,
                                                     budget - 1}), 0, config_.num_speculative_tokens);
    }
    if (!grow_or_preempt(s, s.computed + 1 + gamma, scheduled, plan)) continue;
    ScheduledSeq x = make_scheduled(s, s.computed + 1, false);
    if (gamma > 0) {
      x.end += gamma;
      x.num_draft = int32_t(gamma);
      const auto& pages = cache_.block_table(s.id).pages;
      x.block_table.assign(pages.begin(), pages.begin() + pages_for(x.end));
    }
    plan.decodes.push_back(std::move(x));
    scheduled.insert(k.second);
    budget -= 1 + gamma;
  }
  // 2. Running requests still prefilling, oldest first (each chunk at most the long-prefill cap).
  int32_t partial = 0, partial_long = 0;  // requests mid-prefill, long ones among them
  for (const Key& k : order) {
    auto it = seqs_.find(k.second);
    if (it == seqs_.end() || !it->second.running || it->second.prefill_done) continue;
    ++partial;
    partial_long += it->second.long_prefill;
    if (budget == 0) continue;
    Seq& s = it->second;
    const int64_t end = chunk_end(s, budget, s.long_prefill);
    if (!grow_or_preempt(s, end, scheduled, plan)) {
      --partial;  // preempted: it waits again
      partial_long -= s.long_prefill;
      continue;
    }
    plan.prefills.push_back(make_scheduled(s, end, false));
    scheduled.insert(k.second);
    budget -= end - s.computed;
  }
  // 3. Admissions, first come first served; none in a step that had to preempt (memory is short,
  // and the victim must not come straight back). A long prompt finding every long-prefill slot taken
  // is passed over (it keeps its place); anything else that does not fit ends admission.
  for (auto w = waiting_.begin(); plan.preempted.empty() && budget > 0 && w != waiting_.end() &&
                                  int32_t(running_.size()) < config_.max_num_seqs &&
                                  partial < config_.max_num_partial_prefills;) {
    Seq& s = seq(w->second);
    if (is_long(s) && partial_long >= config_.max_long_partial_prefills) {
      ++w;
      continue;
    }
    const int64_t n = int64_t(s.tokens.size());
    // At least the last token is computed: its logits give the next token.
    const cache::PrefixHit hit = s.no_prefix_hit ? cache::PrefixHit{} : cache_.lookup(s.tokens, s.extras, n - 1);
    std::set<int64_t> wanted;
    const int64_t last_full = n / P * P;
    if (last_full > 0) wanted.insert(last_full);
    if (config_.checkpoint_interval_blocks > 0)
      for (int64_t b = int64_t(config_.checkpoint_interval_blocks) * P; b < last_full;
           b += int64_t(config_.checkpoint_interval_blocks) * P)
        wanted.insert(b);
    if (hit.matched_tokens > hit.num_tokens) wanted.insert(hit.matched_tokens);  // a branch point
    s.checkpoints.clear();
    if (cache_.config().enable_prefix_cache)  // otherwise nobody would read a snapshot
      for (int64_t b : wanted)
        if (b > hit.num_tokens) s.checkpoints.insert(b);
    s.computed = hit.num_tokens;
    const bool long_prefill = is_long(s);
    const int64_t end = chunk_end(s, budget, long_prefill);
    if (cache_.available_pages(&hit) < pages_for(end) - int32_t(hit.pages.size()) || !cache_.admit(s.id, hit)) {
      s.computed = 0;  // a waiting request holds no progress
      s.checkpoints.clear();
      break;
    }
    // Cannot fail: the pages were counted above and taking a slot evicts no pages.
    KCHECK(cache_.grow(s.id, end), "admission of request {} lost its pages", s.id);
    s.long_prefill = long_prefill;
    ++partial;
    partial_long += s.long_prefill;
    w = waiting_.erase(w);
    running_.insert({s.arrival, s.id});
    s.running = true;
    s.cacheable = n;
    ++stats_.admitted;
    if (cache_.config().enable_prefix_cache) ++stats_.prefix_queries, stats_.prefix_query_tokens += n;
    if (hit.num_tokens > 0) ++stats_.prefix_hits;
    stats_.prefix_hit_tokens += hit.num_tokens;
    plan.prefills.push_back(make_scheduled(s, end, hit.checkpoint < 0));
    scheduled.insert(s.id);
    budget -= end - s.computed;
  }
  // 4. Snapshots last: they are optional and must not take slots from admissions.
  for (const ScheduledSeq& x : plan.prefills) {
    const Seq& s = seq(x.id);
    if (s.checkpoints.count(x.end)) cache_.snapshot(x.id, int32_t(x.end / P - 1));
  }
  for (const cache::SlotCopy& c : cache_.drain_copies())
    (c.phase == cache::CopyPhase::before_forward ? plan.copies_before : plan.copies_after).push_back(c);
  for (const auto& x : plan.decodes) stats_.decode_tokens += x.end - x.start;
  for (const auto& x : plan.prefills) stats_.prefill_tokens += x.end - x.start;
  plan.num_tokens = max_budget(config_) - budget;
  ++stats_.steps;
  start_flight(plan);
  return plan;
}

StepPlan Scheduler::schedule_ahead() {
  if (in_flight_.size() != 1)
    fail("scheduler: schedule_ahead() needs exactly one step in flight, {} are", in_flight_.size());
  const Flight& prev = in_flight_.front();
  if (!prev.decodes_only)
    fail("scheduler: schedule_ahead() after step {}, which has prefills or drafts (only decodes can run ahead)",
         prev.step);
  StepPlan plan;
  plan.step = next_step_;
  for (const Flight::Row& row : prev.rows) {
    Seq& s = seq(row.id);
    if (s.retired || s.cancel_pending) continue;
    // Its tokens so far + the one `prev` samples must leave room for one more.
    const int64_t generated = int64_t(s.tokens.size()) - s.prompt_len;
    if (generated + 1 >= s.max_tokens) continue;
    KCHECK(row.end == int64_t(s.tokens.size()), "request {}: step {} ends at {} with {} tokens known", s.id,
           prev.step, row.end, s.tokens.size());
    // Pages for position row.end, without preempting: a preemption would free pages the step in flight
    // writes. One that cannot grow goes on through schedule() after this.
    const int64_t end = row.end + 1;
    if (!cache_.grow(s.id, end)) continue;
    ScheduledSeq x;
    x.id = s.id;
    x.start = row.end;
    x.end = end;
    x.tokens = {-1};
    x.token_pending = true;
    x.sample = true;
    x.state_slot = cache_.state_slot(s.id);
    const auto& pages = cache_.block_table(s.id).pages;
    x.block_table.assign(pages.begin(), pages.begin() + pages_for(end));
    plan.decodes.push_back(std::move(x));
  }
  if (!plan.has_work()) return plan;
  ++next_step_;
  plan.num_tokens = int64_t(plan.decodes.size());
  stats_.decode_tokens += plan.num_tokens;
  ++stats_.steps;
  ++stats_.ahead_steps;
  start_flight(plan);
  return plan;
}

void Scheduler::complete(const StepPlan& plan, const StepResult& result) {
  if (in_flight_.empty() || plan.step != in_flight_.front().step)
    fail("scheduler: complete() for step {} but the oldest step in flight is {}", plan.step,
         in_flight_.empty() ? std::string("none") : std::to_string(in_flight_.front().step));
  std::unordered_map<RequestId, const SeqResult*> by_id;
  for (const SeqResult& r : result.seqs)
    if (!by_id.emplace(r.id, &r).second) fail("step {}: two results for request {}", plan.step, r.id);
  // Validate the whole result before changing anything, so a bad one leaves the state intact. A retired
  // request's row may have a result or not (its step was launched before it finished); it is ignored.
  auto retired = [&](RequestId id) {
    auto it = seqs_.find(id);
    return it != seqs_.end() && it->second.retired;
  };
  size_t expected = 0;
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const ScheduledSeq& x : *list) {
      if (!x.sample) continue;
      if (retired(x.id)) {
        expected += by_id.count(x.id);
        continue;
      }
      ++expected;
      auto r = by_id.find(x.id);
      if (r == by_id.end()) fail("step {}: no sampled token for request {}", plan.step, x.id);
      const int32_t t = r->second->token;
      if (t < 0 || (config_.vocab_size > 0 && t >= config_.vocab_size))
        fail("step {}: request {} sampled token {} outside the vocabulary", plan.step, x.id, t);
      if (int64_t(r->second->accepted.size()) > x.num_draft)
        fail("step {}: request {} accepted {} of {} draft tokens", plan.step, x.id, r->second->accepted.size(),
             x.num_draft);
      for (int32_t a : r->second->accepted)
        if (a < 0 || (config_.vocab_size > 0 && a >= config_.vocab_size))
          fail("step {}: request {} accepted token {} outside the vocabulary", plan.step, x.id, a);
    }
  if (expected != by_id.size()) fail("step {}: {} results for {} sampling requests", plan.step, by_id.size(), expected);
  in_flight_.pop_front();

  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const ScheduledSeq& x : *list) {
      auto it = seqs_.find(x.id);
      KCHECK(it != seqs_.end() && it->second.running, "step {} scheduled request {} that is gone", plan.step, x.id);
      Seq& s = it->second;
      --s.in_flight;
      if (s.retired) {  // finished at the previous complete(): nothing of this row counts
        if (s.in_flight == 0) release(s);
        continue;
      }
      KCHECK(s.computed == x.start, "request {} advanced under a plan in flight", x.id);
      s.computed = x.end;
      const SeqResult* spec = x.num_draft > 0 && !s.cancel_pending ? by_id.at(x.id) : nullptr;
      if (spec) {
        // Speculative decode: the anchor and the accepted draft tokens are computed; the rejected
        // positions' pages go back (their rows are garbage the next forward overwrites).
        s.computed = x.start + 1 + int64_t(spec->accepted.size());
        s.tokens.insert(s.tokens.end(), spec->accepted.begin(), spec->accepted.end());
        cache_.shrink(x.id, s.computed);
      }
      if (!s.cancel_pending) cache_.commit(x.id, s.tokens, s.extras, s.computed, s.cacheable);
      if (x.sample && !s.cancel_pending) {
        const SeqResult& r = *by_id.at(x.id);
        s.tokens.push_back(r.token);
        s.prefill_done = true;
        if (r.finished)
          finish(s, FinishReason::stop);
        else if (int64_t(s.tokens.size()) - s.prompt_len >= s.max_tokens)
          finish(s, FinishReason::length);
      }
    }
  cache_.end_step();
  // Cancels that landed while this step was in flight; one whose request a later step in flight still
  // computes is reported now and retired (finish()).
  std::vector<RequestId> cancels;
  for (auto& [id, s] : seqs_)
    if (s.cancel_pending) cancels.push_back(id);
  for (RequestId id : cancels) finish(seq(id), FinishReason::cancelled);
}

bool Scheduler::could_admit() const {
  if (waiting_.empty()) return false;
  // A retired request's slot is as good as free: it goes when the step in flight completes, before any schedule().
  int32_t running = 0;
  for (const Key& k : running_) running += !seqs_.at(k.second).retired;
  if (running >= config_.max_num_seqs) return false;
  // The admission loop's first candidate: the head (a long prompt is passed over only while long prefills run,
  // and none runs beside a chain of decodes, which is when this is asked).
  const Seq& s = seqs_.at(waiting_.begin()->second);
  const int64_t n = int64_t(s.tokens.size());
  const cache::PrefixHit hit = s.no_prefix_hit ? cache::PrefixHit{} : cache_.lookup(s.tokens, s.extras, n - 1);
  return cache_.available_pages(&hit) >= pages_for(hit.num_tokens + 1) - int32_t(hit.pages.size());
}

int32_t Scheduler::evict_prefix_cache() {
  if (!in_flight_.empty())
    fail("scheduler: evict_prefix_cache() while step {} is in flight", in_flight_.front().step);
  return cache_.evict_all();
}

void Scheduler::check_integrity() const {
  cache_.check_integrity();
  KCHECK(int32_t(running_.size()) <= config_.max_num_seqs, "{} running > max_num_seqs", running_.size());
  KCHECK(running_.size() + waiting_.size() == seqs_.size(), "{} running + {} waiting != {} requests",
         running_.size(), waiting_.size(), seqs_.size());
  for (const auto& [id, s] : seqs_) {
    const Key k{s.arrival, id};
    KCHECK(s.running ? running_.count(k) == 1 : waiting_.count(k) == 1, "request {} in the wrong queue", id);
    KCHECK(cache_.has(id) == s.running, "request {} running {} but holds cache {}", id, s.running, cache_.has(id));
    const int64_t generated = int64_t(s.tokens.size()) - s.prompt_len;
    KCHECK(generated >= 0 && generated < s.max_tokens, "request {} generated {} of {}", id, generated, s.max_tokens);
    if (s.running) {
      KCHECK(s.computed <= int64_t(s.tokens.size()) && cache_.block_table(id).num_tokens >= s.computed,
             "request {} computed {} beyond its cache", id, s.computed);
    } else {
      KCHECK(s.computed == 0 && !s.prefill_done, "waiting request {} keeps progress", id);
    }
    // Retired: finished, kept only for the steps in flight that compute it (see the header).
    KCHECK(!s.retired || (s.running && s.in_flight > 0 && !s.cancel_pending), "request {} retired but running {}, "
           "in {} steps in flight, cancel pending {}", id, s.running, s.in_flight, s.cancel_pending);
  }
  // Steps in flight: at most two (run-ahead), each row a running request, each request's rows consecutive
  // from its computed position (the later step starts where the earlier ends) and covered by its pages.
  KCHECK(in_flight_.size() <= 2, "{} steps in flight", in_flight_.size());
  KCHECK(in_flight_.size() < 2 || in_flight_.front().decodes_only, "a step runs ahead of step {}, which is not "
         "decodes only", in_flight_.front().step);
  std::unordered_map<RequestId, std::pair<int32_t, int64_t>> seen;  // rows so far, end of the last
  for (const Flight& f : in_flight_)
    for (const Flight::Row& row : f.rows) {
      auto it = seqs_.find(row.id);
      KCHECK(it != seqs_.end() && it->second.running, "step {} in flight computes request {}, which is not running",
             f.step, row.id);
      const Seq& s = it->second;
      auto [n, last_end] = seen.count(row.id) ? seen.at(row.id) : std::pair<int32_t, int64_t>{0, s.computed};
      KCHECK(row.start == last_end, "step {} computes request {} from {}, expected {}", f.step, row.id, row.start,
             last_end);
      KCHECK(cache_.block_table(row.id).num_tokens >= row.end, "request {}: step {} in flight writes past its pages",
             row.id, f.step);
      seen[row.id] = {n + 1, row.end};
    }
  for (const auto& [id, s] : seqs_) {
    const auto it = seen.find(id);
    KCHECK((it == seen.end() ? 0 : it->second.first) == s.in_flight, "request {} counts {} steps in flight, {} list it",
           id, s.in_flight, it == seen.end() ? 0 : it->second.first);
  }
}

}  // namespace kestrel::sched
