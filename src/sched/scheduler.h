// Scheduler: continuous batching over the CacheManager, emitting plain-data step plans. It never
// touches tensors; an executor turns a StepPlan into kernel launches and reports the sampled tokens.
//
// Loop: submit()/cancel() at any time; then repeatedly plan = schedule(), run it, complete(plan,
// result). Each schedule() fills one step under max_num_batched_tokens and max_num_seqs:
//  1. decodes of running requests (one token each), oldest first: decode before prefill keeps
//     inter-token latency flat while prompts stream in. A speculating request's decode (DSpark,
//     docs/speculative.md) also takes γ draft positions after its anchor (num_draft: the executor
//     drafts and verifies them); complete() keeps the anchor + the accepted drafts and gives the
//     pages wholly past them back. Draft positions are never hashed into the prefix cache;
//  2. the next chunk of running requests still prefilling (chunked prefill), oldest first;
//  3. admission of waiting requests, first come first served (a head that does not fit in memory
//     blocks the queue, so a big request is never starved by small ones). Admission looks up the
//     prefix cache first; a hit skips the cached tokens and restores the KDA checkpoint.
// Fairness between long and short prompts (vLLM's partial-prefill limits): with
// long_prefill_token_threshold L > 0 no prefill chunk is longer than L, so a long prompt leaves
// most of every step's budget to others and a short request admitted meanwhile gets its first token
// in the next step; a prompt longer than L is *long*, and at most max_long_partial_prefills long
// ones prefill at once — a waiting long prompt beyond that is passed over by shorter ones behind it
// (it keeps its place for the next long slot, freed when a long prefill ends). At most
// max_num_partial_prefills requests are mid-prefill at once. The chunk of a long prompt may be
// smaller than L (set_long_prefill_chunk: the engine sizes it to a step-time target).
// When a running request cannot get pages, the newest running request not yet scheduled in this
// step is preempted by recompute (pages and slot freed, requeued by arrival); if there is none newer
// than the requester, the requester itself yields. A preempted request keeps its generated tokens
// and later re-prefills prompt + outputs, so its output is unchanged. The oldest request can always
// progress, because submit() rejects anything whose prompt + max_tokens could never fit.
//
// Prefill chunks end at the block boundaries where a KDA checkpoint is wanted (the prompt's last
// full block, every checkpoint_interval_blocks blocks, and the point where a cached chain stops):
// the executor snapshots state after the forward pass, which must be exactly the boundary state.
//
// Run-ahead (the engine's async scheduling, docs/serving.md): while a decodes-only step N is in
// flight, schedule_ahead() plans its continuation N+1 before N's tokens are known, so a device need
// not idle while the host completes N. N+1 holds every decode of N whose request is still alive and
// will still be below max_tokens after N's token, one position further, with its input token pending
// (ScheduledSeq::token_pending: the executor takes it from N's result). It admits, prefills, preempts
// and copies nothing: a request whose pages cannot grow without preempting is left out and goes on
// through schedule() once nothing is in flight. At most two steps are in flight; complete() takes them
// in order. A request that finishes at complete(N) (stop id, cancel) while N+1 still computes its row
// is *retired*: its finish is reported at once (drain_finished, stats), but it keeps its pages, slot
// and queue entry until complete(N+1), which ignores its row — the executor may still be writing them.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "request/request.h"

namespace kestrel::sched {

using cache::PageId;
using cache::RequestId;
using cache::SlotId;
using kestrel::EngineStats;
using kestrel::FinishReason;
using kestrel::Request;

struct SchedulerConfig {
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  // Extra KDA checkpoints every N blocks of a prompt (0 = only the prompt's last full block and the
  // end of a matched cached chain). More checkpoints = more prefix hits, more state slots.
  int32_t checkpoint_interval_blocks = 0;
  int32_t vocab_size = 0;  // > 0: sampled ids are checked against it
  // Fairness (see the header): the longest prefill chunk (0 = no cap: a chunk may fill the budget;
  // then no prompt counts as long), prefills at once, long prefills at once.
  int32_t long_prefill_token_threshold = 0;
  int32_t max_num_partial_prefills = 1 << 30;
  int32_t max_long_partial_prefills = 1;
  // DSpark speculation (docs/speculative.md): a speculating request's decode verifies up to this many
  // draft tokens after its anchor (0: off). Fewer near max_tokens or when the step's budget is short.
  int32_t num_speculative_tokens = 0;
  // vLLM's disable_by_batch_size: a step with more decodes than this drafts nothing (0 = never). A large batch's
  // verify forward over B·(1+γ) rows costs more than the tokens it gains (k3-tiny on the H200: speculation is
  // 0.34–0.37 × plain's TPOT at c = 1 but 1.07–1.16 × at c = 8–32, bench/RESULTS.md session 11).
  int32_t spec_disable_by_batch_size = 0;
};

// One request's work in a step: compute positions [start, end) from `tokens`.
struct ScheduledSeq {
  RequestId id = 0;
  int64_t start = 0;
  int64_t end = 0;
  std::vector<int32_t> tokens;       // ids at positions [start, end)
  bool sample = false;               // end is the sequence end: sample the next token from the last logits
  bool reset_state = false;          // zero the KDA state slot first (a fresh start without restore)
  SlotId state_slot = -1;
  std::vector<PageId> block_table;   // covers positions [0, end)
  // > 0: a speculative decode. tokens holds the anchor only (position start); the executor drafts the
  // num_draft tokens at [start+1, end) and verifies all of them in the step's forward; sample is set.
  int32_t num_draft = 0;
  // A run-ahead decode (schedule_ahead): tokens = {-1}, a placeholder; the token at position `start` is
  // the one that the step launched just before this one samples for the same request.
  bool token_pending = false;
};

struct StepPlan {
  uint64_t step = 0;
  std::vector<ScheduledSeq> decodes;  // one token each (+ num_draft for speculation); listed first
  std::vector<ScheduledSeq> prefills;
  std::vector<cache::SlotCopy> copies_before;  // restore checkpoint → running slot, before the forward
  std::vector<cache::SlotCopy> copies_after;   // snapshot running → checkpoint slot, after the forward
  std::vector<RequestId> preempted;  // this step; their slots and pages are already released
  std::vector<RequestId> finished;   // since the previous plan; resources released
  std::vector<RequestId> cancelled;  // since the previous plan; resources released
  int64_t num_tokens = 0;            // Σ (end − start)

  bool has_work() const { return !decodes.empty() || !prefills.empty(); }
};

// The executor's answer for every ScheduledSeq with sample = true.
struct SeqResult {
  RequestId id = 0;
  int32_t token = -1;
  bool finished = false;  // stop condition seen by the sampler (EOS, stop string)
  // A speculative decode (num_draft > 0): the accepted draft tokens, emitted before `token` (at most
  // num_draft). The request's computed positions become start + 1 + accepted.size().
  std::vector<int32_t> accepted;
};
struct StepResult {
  std::vector<SeqResult> seqs;
};

struct FinishedRequest {
  RequestId id = 0;
  std::vector<int32_t> output;
  FinishReason reason = FinishReason::length;  // length, stop or cancelled
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, const cache::CacheConfig& cache_config);

  // Queues a request under `id` (unique among live requests). The request is already validated
  // (request.h validate()); throws kestrel::Error for a reused id or one whose prompt + max_tokens
  // could never fit the page pool. Only the prompt, max_tokens, media and whether every prompt
  // position must be computed (prompt logprobs, logits dumps: no prefix-cache hit) are kept.
  // speculate: its decodes verify draft tokens (config.num_speculative_tokens > 0).
  void submit(RequestId id, const Request& r, bool speculate = false);
  // Frees everything the request holds (deferred to complete() while a plan is in flight). False
  // when the id is unknown or already finished.
  bool cancel(RequestId id);
  // The next step; nothing may be in flight.
  StepPlan schedule();
  // Run-ahead (see the header): the continuation of the one step in flight, which must be decodes only
  // (no prefills, no drafts). Nothing in it when no decode can continue; such a plan is not in flight
  // (do not complete it) and counts as no step. finished/cancelled stay for the next schedule().
  StepPlan schedule_ahead();
  // The chunk size of long prompts' prefills from the next schedule() on: clamped to [1, L]; 0 = L.
  void set_long_prefill_chunk(int32_t n) { long_chunk_ = n; }
  int32_t long_prefill_chunk() const;
  // The oldest step in flight has run. A retired request's row (see the header) may have a result or
  // not; it is ignored either way.
  void complete(const StepPlan& plan, const StepResult& result);
  std::vector<FinishedRequest> drain_finished();

  bool idle() const { return seqs_.empty(); }
  size_t num_waiting() const { return waiting_.size(); }
  size_t num_running() const { return running_.size(); }  // retired requests included: they hold a slot
  size_t num_in_flight() const { return in_flight_.size(); }
  // Whether schedule() might admit the head of the queue now: a slot under max_num_seqs (retired requests' slots
  // counted free: they are released before the next schedule()), and pages for at least
  // one token past its prefix hit. False means it surely would not (run-ahead then goes on: breaking a chain for a
  // request that cannot come in yet only loses overlap, e.g. under a backlog of more requests than slots); true
  // may still admit nothing (the first chunk may need more pages), which only costs one synchronous step.
  bool could_admit() const;
  // The scheduler's share of the engine's counters: steps, admissions, preemptions, prefix cache,
  // prefill/decode tokens, finished and cancelled requests (the rest stays 0).
  const EngineStats& stats() const { return stats_; }
  const cache::CacheManager& cache() const { return cache_; }
  // Drops every unshared prefix-cache entry (between steps only).
  int32_t evict_prefix_cache();
  void check_integrity() const;

 private:
  struct Seq {
    RequestId id = 0;
    int64_t prompt_len = 0;
    int32_t max_tokens = 1;
    std::vector<int32_t> tokens;   // prompt + generated
    std::vector<uint64_t> extras;  // prefix-cache extra key per full prompt block
    uint64_t arrival = 0;          // priority: lower = older = more important
    bool running = false;
    bool prefill_done = false;     // sampled since the last (re)admission
    bool cancel_pending = false;
    bool no_prefix_hit = false;    // every prompt position is computed (its logits are wanted)
    bool long_prefill = false;     // admitted with more than long_prefill_token_threshold tokens to prefill
    bool speculate = false;        // decodes verify draft tokens
    bool retired = false;          // finished and reported; released when its last step in flight completes
    int32_t in_flight = 0;         // steps in flight that compute a row of it (at most two)
    int64_t computed = 0;          // positions whose caches are written
    int64_t cacheable = 0;         // tokens known at admission: blocks below may enter the prefix cache
    std::set<int64_t> checkpoints; // token boundaries where a KDA snapshot is wanted
  };
  using Key = std::pair<uint64_t, RequestId>;  // (arrival, id): ordered by priority
  // A step in flight: what schedule_ahead() continues and check_integrity() checks.
  struct Flight {
    struct Row {
      RequestId id = 0;
      int64_t start = 0, end = 0;
    };
    uint64_t step = 0;
    bool decodes_only = true;  // no prefills, no drafts: schedule_ahead() may continue it
    std::vector<Row> rows;     // decodes, then prefills, as planned
  };

  Seq& seq(RequestId id);
  int64_t chunk_end(const Seq& s, int64_t budget, bool long_prefill) const;
  bool is_long(const Seq& s) const;
  bool grow_or_preempt(Seq& s, int64_t end, const std::set<RequestId>& scheduled, StepPlan& plan);
  void preempt(Seq& s, StepPlan& plan);
  ScheduledSeq make_scheduled(const Seq& s, int64_t end, bool reset) const;
  // Reports s as finished; releases it at once unless a step in flight computes a row of it (retired).
  void finish(Seq& s, FinishReason why);
  void release(Seq& s);  // frees its memory and forgets it (s is gone after)
  void start_flight(const StepPlan& plan);
  int32_t pages_for(int64_t tokens) const;

  SchedulerConfig config_;
  cache::CacheManager cache_;
  std::map<RequestId, Seq> seqs_;
  std::set<Key> waiting_;
  std::set<Key> running_;
  int32_t long_chunk_ = 0;
  uint64_t next_arrival_ = 0;
  uint64_t next_step_ = 0;
  std::deque<Flight> in_flight_;  // oldest first; at most two (run-ahead)
  std::vector<RequestId> finished_since_;
  std::vector<RequestId> cancelled_since_;
  std::vector<FinishedRequest> outputs_;
  EngineStats stats_;
};

}  // namespace kestrel::sched
