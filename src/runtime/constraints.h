// Structured outputs in the engine (docs/structured-outputs.md, "In the engine"): the per-request
// matcher, the fixed table the step's masks are written to, and the worker thread that writes them
// while the executor runs the forward.
//
// Per step (runtime/engine.cpp): every sampled sequence with a constraint is brought to its output
// (SeqConstraint::sync: a no-op unless the output changed behind the matcher's back), and unless its
// grammar is in free text (every ordinary token allowed: the think section, a free response), gets a
// row of the MaskTable; the MaskWorker fills those rows in order on its own thread, started before the
// executor's forward, and the sampler of each sequence waits for its row only. So the mask of step
// N+1 (which needs the token of step N) is computed while the model runs step N+1's forward, which
// takes far longer; the sampler then pays the apply (CPU: one pass over the row; GPU: one kernel).
//
// Mask rows are uint32 words, bit (id % 32) of word (id / 32) = id allowed, over the model's logit
// count (structured/vocab.h). The table is page-aligned host memory at a fixed address for the
// engine's lifetime: a device executor registers it as pinned memory and copies rows [0, n) straight
// into its own fixed device table (CUDA graphs need fixed addresses).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "request/request.h"
#include "structured/matcher.h"

namespace kestrel::runtime {

// logits[v] = −inf where bit v of `words` is 0 (words cover logits.size() ids). The CPU twin of
// cuda::apply_token_masks (kernels/cuda/token_mask.h).
void apply_token_mask(std::span<float> logits /* f32 [V] */, const uint32_t* words /* u32 [ceil(V/32)] */);
// Allowed ids among the first V.
int64_t mask_count(const uint32_t* words, int64_t V);
// The logprob of `token` and the n most likely ids under the raw logits (the sampler's rule: logprobs
// describe the model, not the sampling knobs — nor the grammar's mask), for a token drawn under a mask.
void raw_logprobs(std::span<const float> raw /* f32 [V] */, int32_t token, int32_t n, float& logprob,
                  std::vector<TokenLogprob>& top);

// One request's grammar state.
class SeqConstraint {
 public:
  // end_tokens: ids that end a document grammar where it may end (chat grammars end on their own
  // <|end_of_msg|>, a special terminal of the grammar, and take none).
  SeqConstraint(std::shared_ptr<const structured::CompiledGrammar> grammar, std::vector<int32_t> end_tokens);

  // Brings the matcher to `output` (the tokens the request has generated): rolls back what it has
  // accepted beyond them, accepts what it lacks. Normally both agree and this is O(1); it makes the
  // matcher a function of the output, whatever happened to the request (preemption keeps the output;
  // a future scheduler that drops tokens needs nothing more). False: an output token is refused.
  bool sync(std::span<const int32_t> output);
  // Free text within the budget (structured::Matcher::free_text(budget)): no mask needed.
  bool free_text() { return m_.free_text(budget_); }
  // The mask of the next token, within the budget; returns the number of allowed ids (0: nothing can follow).
  int64_t fill(uint32_t* words);
  // Budget-aware completion (docs/structured-outputs.md, "Finishing within max_tokens"): the request
  // may generate `tokens` more, the next one included; masks then keep the document completable within
  // them. Unset (the default, and for requests that did not ask): masks know nothing of the budget.
  void set_budget(uint32_t tokens) { budget_ = tokens; }
  // The tokens that finish the output from here along its shortest path (an upper bound on the fewest;
  // structured/matcher.h).
  uint32_t min_completion() { return m_.min_completion(); }
  // Advances by `token`; false (unchanged) when the grammar refuses it.
  bool accept(int32_t token);
  // Nothing more can be generated: the request is complete.
  bool terminated() const { return m_.is_terminated(); }
  size_t accepted() const { return ids_.size(); }

 private:
  structured::Matcher m_;
  std::vector<int32_t> ids_;  // the accepted tokens (the matcher keeps configurations, not ids)
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

// One thread that fills a step's masks in order. start() hands it a batch; wait(i) returns job i's
// allowed count (−1: filling threw; the engine ends that request) once it is written — and if the
// worker has not begun job i yet, the caller fills it itself rather than wait (on a loaded machine, or
// when the forward keeps every core busy, the worker may not get a core in time: then a sampler never
// waits longer than its own mask takes plus the one job in progress). wait_all() finishes the batch the
// same way. A batch must be waited for before the next start() and before the constraints or rows it
// names go away (the engine does both at the end of each step).
class MaskWorker {
 public:
  struct Job {
    SeqConstraint* constraint;
    uint32_t* words;
  };
  MaskWorker();
  ~MaskWorker();
  MaskWorker(const MaskWorker&) = delete;
  MaskWorker& operator=(const MaskWorker&) = delete;

  void start(std::vector<Job> jobs);
  int64_t wait(size_t i);
  void wait_all();
  double busy_seconds() const;  // time spent filling, on the worker and by waiters, in total
  int64_t stolen() const;       // jobs a waiter filled itself

 private:
  enum State : uint8_t { kPending, kRunning, kDone };
  void run();
  void fill(size_t i, std::unique_lock<std::mutex>& lk);  // claims job i (pending), fills it unlocked
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<Job> jobs_;
  std::vector<int64_t> allowed_;
  std::vector<State> state_;
  size_t done_ = 0;        // jobs of the current batch finished
  uint64_t batch_ = 0;     // batches started
  bool stop_ = false;
  double busy_ = 0.0;
  int64_t stolen_ = 0;
  std::thread thread_;
};

}  // namespace kestrel::runtime
