// Run-ahead, the engine's async scheduling (engine.h, docs/serving.md "Async scheduling (run-ahead)"): a
// pure-decode step of plain requests is launched instead of run, and while it is in flight the scheduler
// plans its continuation (sched/scheduler.h schedule_ahead), which is launched before the first step is
// collected — its input tokens pending, taken by the executor from the step before. Then the first is
// collected and completed as run_step() would (finish_step), and the chain goes on one step behind until no
// decode can continue or a waiting request could be admitted; every other plan runs through run_step().
//
// Late launch: a launched continuation cannot take a request that arrives after it was planned, so whatever
// arrives while step N computes waits for N+1 too if N+1 is already launched. Launched right after N-1 was
// collected (at N's start), that was every arrival during N: one whole decode step more than the synchronous
// loop, whose next step is planned when N ends. In `kestrel bench`'s closed loop at 64 requests that step grew
// the queue of prompts each wave of new requests waited behind — the H200's median TTFT 28.5 → 35.9 ms under
// --async-scheduling (bench/RESULTS.md). So with an executor whose launch() returns while its step computes, the
// continuation is planned only `ahead_launch_lead_s` (plus the engine's own planning and launch time) before N is
// expected to end — N's start (the collect of N-1, or its own launch) plus the shortest recent period of steps
// that ran back to back — and the wait ends early when a request that could be admitted is submitted.
#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>

#include "core/check.h"
#include "runtime/engine.h"

namespace kestrel::runtime {

// A plain request is one whose next token the executor can draw by itself from the sampling parameters,
// before the engine has seen the token before it (StepExecutor::launch), and hand back as a bare id.
bool Engine::plain(const Req& q) const {
  const SamplingParams& p = q.r.sampling;
  return !q.r.constraint       // a grammar masks each draw and checks each token against this step's mask job
         && !q.r.on_logits     // the logits hook wants every position's logits on the host
         && p.logprobs < 0     // logprobs are computed beside the logits, by the host sampler
         // prompt logprobs need every prompt position's logits; once the prompt is done they need nothing
         && (p.prompt_logprobs < 0 || q.logits_sent + 1 >= int64_t(q.r.prompt.size()))
         // penalties count the output, which at launch still lacks the pending token
         && p.repetition_penalty == 1.0f && p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f
         && p.logit_bias.empty()  // the run-ahead contract keeps to the sampler without a bias table
         // min_tokens holds the stop ids back by the output's length, one short at launch; once reached, never
         && q.output.size() >= size_t(std::max(p.min_tokens, 0))
         && !q.speculate       // a speculating decode drafts and verifies γ positions: only run() does that
         && q.error.empty()    // an error ends the request with this step's event
         && exec_->samples_ahead(p);  // the executor draws it without a host fallback
}

bool Engine::starts_run_ahead(const sched::StepPlan& plan, const InStep& in_step) const {
  if (!run_ahead_ || !plan.has_work() || !plan.prefills.empty() || !plan.copies_before.empty() ||
      !plan.copies_after.empty())
    return false;
  for (const sched::ScheduledSeq& x : plan.decodes)
    if (x.num_draft != 0 || !x.sample) return false;
  return std::all_of(in_step.begin(), in_step.end(), [&](const auto& e) { return plain(*e.second); });
}

void Engine::run_ahead(sched::StepPlan first, InStep first_in_step) {
  // One launched step: its plan, its requests and the hooks it was launched with (launch and collect use
  // them both, so they live until it is collected).
  struct Flight {
    sched::StepPlan plan;
    InStep in_step;
    size_t hint = 0;
    StepHooks hooks;
    std::chrono::steady_clock::time_point launched;
    std::chrono::steady_clock::time_point started;  // on the device, as far as the host knows (late launch)
    bool queued = false;  // launched while the step before it was in flight: it runs right behind it
  };
  auto make = [this](sched::StepPlan plan, InStep in_step) {
    auto f = std::make_unique<Flight>();
    f->plan = std::move(plan);
    f->in_step = std::move(in_step);
    Flight* fp = f.get();
    // Only these two hooks: every row is plain (StepExecutor::launch).
    f->hooks.sampling_inputs = [this, fp](const sched::ScheduledSeq& x) {
      Req& q = step_req(fp->in_step, x.id, fp->hint);
      return StepHooks::SamplingInputs{&q.r.sampling, q.r.prompt, q.output, q.stop_ids};
    };
    f->hooks.take_token = [this, fp](const sched::ScheduledSeq& x, int32_t token) {
      Req& q = step_req(fp->in_step, x.id, fp->hint);
      sched::SeqResult r;
      r.token = token;
      if (q.ended) return r;  // it finished at the step before (final event out): a wasted row, dropped below
      SampleResult s;
      s.token = token;
      return emit(q, s);
    };
    return f;
  };
  std::deque<std::unique_ptr<Flight>> flights;  // launched and not collected, oldest first (at most two)
  using Clock = std::chrono::steady_clock;
  auto launch = [&](Flight& f) {
    f.launched = Clock::now();
    exec_->launch(f.plan, f.hooks);
  };
  // Late launch (see the top of this file): when the continuation of the step in flight is planned, if known.
  const bool late = cfg_.ahead_launch_lead_s >= 0.0 && exec_->launches_async();
  auto launch_at = [&](const Flight& f) -> std::optional<Clock::time_point> {
    if (!late || ahead_periods_.size() < 2) return std::nullopt;  // not before the period was seen twice
    const double period = *std::min_element(ahead_periods_.begin(), ahead_periods_.end());
    const double own = ahead_launch_times_.empty()
                           ? 0.0 : *std::max_element(ahead_launch_times_.begin(), ahead_launch_times_.end());
    const double wait = period - cfg_.ahead_launch_lead_s - own;
    if (wait <= 0.0) return std::nullopt;
    return f.started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait));
  };
  auto remember = [](std::vector<double>& v, double x) {  // the latest 8
    if (v.size() == 8) v.erase(v.begin());
    v.push_back(x);
  };
  try {
    flights.push_back(make(std::move(first), std::move(first_in_step)));
    launch(*flights.back());
    flights.back()->started = flights.back()->launched;  // nothing was in flight
    auto last_collect = Clock::now();
    for (;;) {
      // The continuation, unless a waiting request could be admitted now (schedule() admits, and it needs nothing
      // in flight; one that cannot come in yet — no slot, no pages — does not stop the chain: Scheduler::could_admit)
      // or the engine stops. The chain's requests are all plain: it starts from a plan of plain requests, and
      // a plain request stays plain (its output only grows).
      Clock::time_point due;  // when the continuation was due: from then to its launch's return is the engine's own
      {
        std::unique_lock<std::mutex> lk(mu_);
        // Late launch: not before shortly ahead of the step in flight's end, unless such a request comes first
        // (submit() notifies cv_).
        const auto at = launch_at(*flights.front());
        due = Clock::now();
        if (at && *at > due) {
          cv_.wait_until(lk, *at, [&] { return stop_ || sched_.could_admit(); });
          due = std::min(*at, Clock::now());  // a late wake-up counts as the engine's own time
        }
        if (!stop_ && !sched_.could_admit()) {
          sched::StepPlan ahead = sched_.schedule_ahead();
          if (ahead.has_work()) {
            InStep in;
            for (const sched::ScheduledSeq& x : ahead.decodes) in.push_back({x.id, reqs_.at(x.id).get()});
            flights.push_back(make(std::move(ahead), std::move(in)));
          }
        }
      }
      if (flights.size() == 2) {
        flights.back()->queued = true;
        launch(*flights.back());
        remember(ahead_launch_times_, std::chrono::duration<double>(Clock::now() - due).count());
      }
      Flight& cur = *flights.front();
      sched::StepResult result = exec_->collect(cur.plan, cur.hooks);
      // Rows of requests that ended at the step before carry no token of theirs (the scheduler ignores them
      // either way); dropped so that they count as no generated token.
      std::erase_if(result.seqs, [&](const sched::SeqResult& r) {
        return step_req(cur.in_step, r.id, cur.hint).ended;
      });
      // The step's time: from its launch, or from the collect before when it was launched earlier (the
      // chain's period), for the long-prefill chunk sizing (finish_step).
      const auto now = Clock::now();
      const double step_s = std::chrono::duration<double>(now - std::max(cur.launched, last_collect)).count();
      // Queued behind the step before, it ran right behind it: the collect-to-collect time is the device's period.
      if (cur.queued) remember(ahead_periods_, step_s);
      last_collect = now;
      // Queued behind `cur`, the next step started when `cur` ended. (The host reaches this collect before that end
      // unless it woke up late, and then launched the next step late too, which started at its launch.)
      if (flights.size() == 2) flights.back()->started = now;
      const std::unique_ptr<Flight> done = std::move(flights.front());
      flights.pop_front();
      finish_step(done->plan, done->in_step, result, step_s, flights.empty() ? nullptr : &flights.front()->plan);
      if (flights.empty()) return;
    }
  } catch (...) {
    // The engine stops after a failed step (loop()). Collect what is still launched, results dropped, so
    // the executor keeps no step that its destructor or a later call would trip over; a step that cannot
    // be collected (the one that failed) is passed over.
    StepHooks drop;
    drop.take_token = [](const sched::ScheduledSeq&, int32_t token) {
      sched::SeqResult r;
      r.token = token;
      return r;
    };
    for (const auto& f : flights) {
      try {
        exec_->collect(f->plan, drop);
      } catch (...) {
      }
    }
    throw;
  }
}

}  // namespace kestrel::runtime
