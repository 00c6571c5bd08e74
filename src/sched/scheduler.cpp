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
  if (s.cancel_pending) return true;
  if (in_flight_ && s.running) {
    s.cancel_pending = true;  // the step in flight still uses its pages; complete() frees them
    return true;
  }
  finish(s, FinishReason::cancelled);
  return true;
}

void Scheduler::finish(Seq& s, FinishReason why) {
  const RequestId id = s.id;
  if (s.running) {
    cache_.free(id);
    running_.erase({s.arrival, id});
  } else {
    waiting_.erase({s.arrival, id});
  }
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
  seqs_.erase(id);
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

StepPlan Scheduler::schedule() {
  if (in_flight_) fail("scheduler: schedule() called again before complete() of step {}", in_flight_step_);
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
  in_flight_ = true;
  in_flight_step_ = plan.step;
  return plan;
}

void Scheduler::complete(const StepPlan& plan, const StepResult& result) {
  if (!in_flight_ || plan.step != in_flight_step_)
    fail("scheduler: complete() for step {} but the step in flight is {}", plan.step,
         in_flight_ ? std::to_string(in_flight_step_) : std::string("none"));
  std::unordered_map<RequestId, const SeqResult*> by_id;
  for (const SeqResult& r : result.seqs)
    if (!by_id.emplace(r.id, &r).second) fail("step {}: two results for request {}", plan.step, r.id);
  // Validate the whole result before changing anything, so a bad one leaves the state intact.
  size_t expected = 0;
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const ScheduledSeq& x : *list) {
      if (!x.sample) continue;
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
  in_flight_ = false;

  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const ScheduledSeq& x : *list) {
      auto it = seqs_.find(x.id);
      KCHECK(it != seqs_.end() && it->second.running, "step {} scheduled request {} that is gone", plan.step, x.id);
      Seq& s = it->second;
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
  std::vector<RequestId> cancels;
  for (auto& [id, s] : seqs_)
    if (s.cancel_pending) cancels.push_back(id);
  for (RequestId id : cancels) finish(seq(id), FinishReason::cancelled);
}

int32_t Scheduler::evict_prefix_cache() {
  if (in_flight_) fail("scheduler: evict_prefix_cache() while step {} is in flight", in_flight_step_);
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
  }
}

}  // namespace kestrel::sched
