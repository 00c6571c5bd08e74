// Structured outputs in the engine (docs/structured-outputs.md, "In the engine"): the per-request
// matcher, the fixed table the step's masks are written to, and the thread pool that writes them
// while the executor runs the forward.
//
// Per step (runtime/engine.cpp): every sampled sequence with a constraint is brought to its output
// (SeqConstraint::sync: a no-op unless the output changed behind the matcher's back) and gets a job
// and a row of the MaskTable; the MaskPool's threads run the step's jobs in order — the matcher's step
// over the previous token (deferred by SeqConstraint::take), then, unless the grammar is in free text
// (every ordinary token allowed: the think section, a free response), the row — started before the
// executor's forward (a device executor: right after it has enqueued the forward, StepHooks::
// forward_launched, so that starting them — syncs, waking the pool — is not on the path to the launch
// while the device idles), and the sampler of each sequence waits for its own job only. So the mask of
// step N+1 (which needs the token of step N) is computed while the model runs step N+1's forward, which
// takes far longer; the sampler then pays the apply (CPU: one pass over the row; GPU: one kernel) and a
// bit test per token.
//
// Mask rows are uint32 words, bit (id % 32) of word (id / 32) = id allowed, over the model's logit
// count (structured/vocab.h). The table is page-aligned host memory at a fixed address for the
// engine's lifetime: a device executor registers it as pinned memory and copies rows [0, n) straight
// into its own fixed device table (CUDA graphs need fixed addresses).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "request/request.h"
#include "structured/matcher.h"

// The engine has the MaskPool (bench/bench_structured_engine.cpp builds against engines before it too).
#define KESTREL_MASK_POOL 1

namespace kestrel::runtime {

// logits[v] = −inf where bit v of `words` is 0 (words cover logits.size() ids). The CPU twin of
// cuda::apply_token_masks (kernels/cuda/token_mask.h).
void apply_token_mask(std::span<float> logits /* f32 [V] */, const uint32_t* words /* u32 [ceil(V/32)] */);
// Allowed ids among the first V (POPCNT where the CPU has it: the build targets generic x86-64).
int64_t mask_count(const uint32_t* words, int64_t V);
// The same without POPCNT (the fallback; tests compare both with a bit-by-bit count).
int64_t mask_count_portable(const uint32_t* words, int64_t V);
// The logprob of `token` and the n most likely ids under the raw logits (the sampler's rule: logprobs
// describe the model, not the sampling knobs — nor the grammar's mask), for a token drawn under a mask.
void raw_logprobs(std::span<const float> raw /* f32 [V] */, int32_t token, int32_t n, float& logprob,
                  std::vector<TokenLogprob>& top);

// One request's grammar state.
//
// Deferred steps: the token sampled in step N is needed by the matcher only for step N+1's mask, so an
// allowed ordinary token that cannot end the grammar (Matcher::token_may_terminate) is taken without
// stepping the matcher (take()); the step is done by flush(), which the mask job of step N+1 runs first,
// on a pool thread while the forward runs. Whether a token is allowed needs no matcher step either: the
// step's mask is exact (bit set ⇔ accept() would take it; structured tests check this), and in free
// text every ordinary token is allowed. Special tokens, stop tokens and tokens drawn outside a mask
// are stepped at once, as before. So a decode step's critical path holds no matcher step for the
// common token.
class SeqConstraint {
 public:
  // end_tokens: ids that end a document grammar where it may end (chat grammars end on their own
  // <|end_of_msg|>, a special terminal of the grammar, and take none).
  SeqConstraint(std::shared_ptr<const structured::CompiledGrammar> grammar, std::vector<int32_t> end_tokens);

  // Brings the matcher to `output` (the tokens the request has generated): rolls back what it has
  // accepted beyond them, accepts what it lacks. Normally both agree and this is O(1) (a deferred
  // token stays deferred); it makes the matcher a function of the output, whatever happened to the
  // request (preemption keeps the output; a future scheduler that drops tokens needs nothing more).
  // False: an output token is refused.
  bool sync(std::span<const int32_t> output);
  // Applies a deferred token. False: the matcher refused it (a mask that was not exact: a bug).
  bool flush();
  int32_t deferred() const { return pending_ ? ids_.back() : -1; }
  // Budget-aware completion (docs/structured-outputs.md, "Finishing within max_tokens"): the request
  // may generate `tokens` more, the next one included; free_text() and fill() then keep the output
  // completable within them. Unset (the default, and for requests that did not ask): masks know
  // nothing of the budget. The engine sets it before the step's job runs (the job reads it).
  // The budget of a request with max_tokens after `generated` tokens (the deferred one included).
  void set_budget(int64_t max_tokens, size_t generated) {
    budget_ = uint32_t(std::clamp<int64_t>(max_tokens - int64_t(generated), 1, structured::Matcher::kNoBudget - 1));
  }
  // At submit: a RequestError naming `field` (the request's max_tokens_field: how the client spelled
  // max_tokens) when the shortest complete output is longer than max_tokens, which no mask could then
  // keep within it.
  void require_fits(int64_t max_tokens, const std::string& field);
  // The tokens that finish the output from here along its shortest path (an upper bound on the
  // fewest; structured/matcher.h). After flush().
  uint32_t min_completion();
  // After flush():
  // Free text within the budget (structured::Matcher::free_text(budget)): no mask needed — every
  // ordinary token is allowed and none can push the completion past the budget.
  bool free_text();
  // The mask of the next token, within the budget; returns the number of allowed ids (0: nothing can follow).
  int64_t fill(uint32_t* words);
  // Advances by `token` now; false (unchanged) when the grammar refuses it.
  bool accept(int32_t token);
  // The token sampled for the next position. `words`: the mask it was drawn under (this step's, for
  // this state); null: drawn without one (free text; outside free text the matcher then decides now). False (unchanged) when the grammar refuses it;
  // otherwise `terminated` says whether the request is complete. Defers the matcher's step when it can.
  bool take(int32_t token, const uint32_t* words, bool& terminated);
  // Nothing more can be generated: the request is complete.
  bool terminated() const { return !pending_ && m_.is_terminated(); }
  size_t accepted() const { return ids_.size(); }

 private:
  structured::Matcher m_;
  std::vector<int32_t> ids_;  // the tokens taken (the matcher keeps configurations, not ids)
  bool pending_ = false;      // ids_.back() is taken but the matcher has not stepped over it yet
  int64_t V_;
  uint32_t budget_ = structured::Matcher::kNoBudget;
};

// Host u32 [rows, words], page-aligned, zeroed, at a fixed address until destroyed.
class MaskTable {
 public:
  MaskTable(int64_t rows, int64_t words);
  ~MaskTable();
  MaskTable(const MaskTable&) = delete;
  MaskTable& operator=(const MaskTable&) = delete;
  uint32_t* row(int64_t i) { return data_ + i * words_; }
  const uint32_t* data() const { return data_; }
  int64_t rows() const { return rows_; }
  int64_t words() const { return words_; }

 private:
  uint32_t* data_ = nullptr;
  int64_t rows_, words_;
};

// A step's mask jobs on a pool of threads. A job brings one request's matcher up to date (flush: the
// deferred token of the previous step) and, unless it is in free text, fills its row. start() hands the
// pool a batch; the threads claim jobs in order; wait(i) returns job i's result once it is done — and
// if no thread has claimed job i yet, the caller runs it itself rather than wait (on a loaded machine
// the pool may get no core in time: then a sampler never waits longer than its own job takes plus the
// jobs in progress). wait_all() finishes the batch the same way. A batch must be waited for before the
// next start() and before the constraints or rows it names go away (the engine does both at the end of
// each step). Each batch is its own object: a thread still leaving an old batch never touches the new.
class MaskPool {
 public:
  struct Job {
    SeqConstraint* constraint;
    uint32_t* words;
  };
  // Job results besides an allowed count > 0: 0 nothing allowed (a dead end), and
  static constexpr int64_t kFailed = -1;    // filling threw
  static constexpr int64_t kFreeText = -3;  // free text: no mask (the row is untouched)
  static constexpr int64_t kRefused = -4;   // the deferred token was refused (flush() failed)
  // threads >= 1.
  explicit MaskPool(int threads = 1);
  ~MaskPool();
  MaskPool(const MaskPool&) = delete;
  MaskPool& operator=(const MaskPool&) = delete;

  void start(std::vector<Job> jobs);
  int64_t wait(size_t i);
  // Job i's result if it is done (no waiting, no clock read): the engine's common case once the forward has
  // hidden the jobs.
  bool done(size_t i, int64_t& result) const;
  void wait_all();
  int threads() const { return int(threads_.size()); }
  double busy_seconds() const;  // time spent in jobs, on the pool and by waiters, in total
  int64_t stolen() const;       // jobs a waiter ran itself
  // The pool size for `requested` (<= 0: automatic: a quarter of the cores, 1 to 8).
  static int auto_threads(int requested);

 private:
  struct Batch;
  static int64_t run_job(const Job& job);
  void run_claimed(Batch& b, size_t i);
  void thread_main();
  std::shared_ptr<Batch> batch_;  // the current batch (engine thread; the pool takes copies under mu_)
  std::mutex mu_;
  std::condition_variable work_cv_;
  uint64_t generation_ = 0;  // batches started (under mu_)
  bool stop_ = false;
  std::atomic<int64_t> busy_ns_{0}, stolen_{0};
  std::vector<std::thread> threads_;
};

}  // namespace kestrel::runtime
