// Structured outputs in the engine: see constraints.h.
#include "runtime/constraints.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#include "core/check.h"

namespace kestrel::runtime {

void apply_token_mask(std::span<float> logits, const uint32_t* words) {
  const size_t V = logits.size();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (size_t w = 0; w * 32 < V; ++w) {
    const uint32_t bits = words[w];
    if (bits == 0xFFFFFFFFu) continue;  // common in free-ish states: nothing to clear
    const size_t end = std::min(V, w * 32 + 32);
    for (size_t v = w * 32; v < end; ++v)
      if (!((bits >> (v & 31)) & 1u)) logits[v] = ninf;
  }
}

namespace {
// Set bits in words [0, n). Built for generic x86-64 (no POPCNT), std::popcount is a call into libgcc's table
// popcount, about 3 ns a word: a third of a mask job's time on k3-tiny's 383 words (perf, bench/RESULTS.md)
// and 15 µs a mask on a K3-sized vocabulary. So: POPCNT where the CPU has it, 64-bit SWAR otherwise.
int64_t count_bits_swar(const uint32_t* words, int64_t n) {
  int64_t c = 0, i = 0;
  for (; i + 2 <= n; i += 2) {
    uint64_t x;
    std::memcpy(&x, words + i, 8);
    x = x - ((x >> 1) & 0x5555555555555555ull);
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    c += int64_t((x * 0x0101010101010101ull) >> 56);
  }
  for (; i < n; ++i) {
    uint32_t x = words[i];
    x = x - ((x >> 1) & 0x55555555u);
    x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
    x = (x + (x >> 4)) & 0x0F0F0F0Fu;
    c += int64_t((x * 0x01010101u) >> 24);
  }
  return c;
}
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("popcnt"))) int64_t count_bits_popcnt(const uint32_t* words, int64_t n) {
  int64_t c = 0, i = 0;
  for (; i + 2 <= n; i += 2) {
    uint64_t x;
    std::memcpy(&x, words + i, 8);
    c += __builtin_popcountll(x);
  }
  if (i < n) c += __builtin_popcount(words[i]);
  return c;
}
#endif
int64_t count_bits(const uint32_t* words, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool popcnt = __builtin_cpu_supports("popcnt");
  if (popcnt) return count_bits_popcnt(words, n);
#endif
  return count_bits_swar(words, n);
}
}  // namespace

int64_t mask_count(const uint32_t* words, int64_t V) {
  const int64_t full = V / 32;
  int64_t n = count_bits(words, full);
  if (V % 32) n += std::popcount(words[full] & ((1u << (V % 32)) - 1u));
  return n;
}

int64_t mask_count_portable(const uint32_t* words, int64_t V) {
  const int64_t full = V / 32;
  int64_t n = count_bits_swar(words, full);
  if (V % 32) {
    const uint32_t last = words[full] & ((1u << (V % 32)) - 1u);
    n += count_bits_swar(&last, 1);
  }
  return n;
}

void raw_logprobs(std::span<const float> raw, int32_t token, int32_t n, float& logprob, std::vector<TokenLogprob>& top) {
  // As runtime/sampler.cpp: log-softmax in FP64, ties by lower id.
  const double mx = *std::max_element(raw.begin(), raw.end());
  double Z = 0.0;
  for (float v : raw) Z += std::exp(double(v) - mx);
  const double lz = mx + std::log(Z);
  logprob = float(double(raw[size_t(token)]) - lz);
  const size_t k = std::min(raw.size(), size_t(std::max(n, 0)));
  std::vector<int32_t> ids(raw.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
  std::partial_sort(ids.begin(), ids.begin() + std::ptrdiff_t(k), ids.end(), [&](int32_t a, int32_t b) {
    return raw[size_t(a)] > raw[size_t(b)] || (raw[size_t(a)] == raw[size_t(b)] && a < b);
  });
  top.clear();
  for (size_t i = 0; i < k; ++i) top.push_back({ids[i], float(double(raw[size_t(ids[i])]) - lz)});
}

// ---- SeqConstraint ---------------------------------------------------------------------------------

SeqConstraint::SeqConstraint(std::shared_ptr<const structured::CompiledGrammar> grammar, std::vector<int32_t> end_tokens)
    : m_(grammar, [&] {
        std::vector<structured::TokenId> ids;
        for (int32_t t : end_tokens)
          if (t >= 0) ids.push_back(structured::TokenId(t));
        return ids;
      }()),
      V_(int64_t(grammar->vocab().vocab_size())) {}

bool SeqConstraint::sync(std::span<const int32_t> output) {
  // The usual case, one token taken per token generated, costs one comparison.
  if (ids_.size() == output.size() && (ids_.empty() || ids_.back() == output.back())) return true;
  if (!flush()) return false;
  size_t common = 0;
  while (common < ids_.size() && common < output.size() && ids_[common] == output[common]) ++common;
  m_.rollback(ids_.size() - common);
  ids_.resize(common);
  for (size_t i = common; i < output.size(); ++i)
    if (!accept(output[i])) return false;
  return true;
}

bool SeqConstraint::flush() {
  if (!pending_) return true;
  if (!m_.accept(structured::TokenId(ids_.back()))) return false;  // stays pending: sync() reports it again
  pending_ = false;
  return true;
}

void SeqConstraint::require_fits(int64_t max_tokens, const std::string& field) {
  const uint32_t need = min_completion();
  // No complete answer at all: every one nests deeper than the matcher's stack limit allows.
  if (need >= structured::detail::StackDistance::kInf)
    throw RequestError("response_format", fmt::format("no complete answer in this response_format fits in the "
                                                      "structured-output nesting limit ({} frames, --grammar-max-nesting)",
                                                      m_.compiled().max_stack_depth()));
  if (int64_t(need) > max_tokens)
    throw RequestError(field, fmt::format("{} is {}, too few to finish an answer in this response_format: its shortest "
                                          "complete answer takes {} tokens (markup included); raise {}, or set "
                                          "complete_within_max_tokens to false to accept an answer cut at {}",
                                          field, max_tokens, need, field, field));
}

uint32_t SeqConstraint::min_completion() {
  KCHECK(!pending_, "SeqConstraint::min_completion with a deferred token");
  return m_.min_completion();
}

bool SeqConstraint::free_text() {
  KCHECK(!pending_, "SeqConstraint::free_text with a deferred token");
  return m_.free_text(budget_);
}

int64_t SeqConstraint::fill(uint32_t* words) {
  KCHECK(!pending_, "SeqConstraint::fill with a deferred token");
  if (!m_.fill_mask(words, budget_)) return 0;
  return mask_count(words, V_);
}

bool SeqConstraint::accept(int32_t token) {
  if (!flush()) return false;
  if (token < 0 || int64_t(token) >= V_ || !m_.accept(structured::TokenId(token))) return false;
  ids_.push_back(token);
  return true;
}

bool SeqConstraint::take(int32_t token, const uint32_t* words, bool& terminated) {
  terminated = false;
  if (token < 0 || int64_t(token) >= V_ || !flush()) return false;
  const auto id = structured::TokenId(token);
  const bool ordinary = m_.compiled().vocab().is_ordinary(id);
  // Allowed without a matcher step: the bit of the (exact) mask, or in free text any ordinary token.
  const bool allowed = words ? structured::mask_test(words, id) : ordinary && m_.free_text();
  if (allowed && ordinary && !m_.token_may_terminate(id)) {
    ids_.push_back(token);
    pending_ = true;
    return true;
  }
  if (words && !allowed) return false;
  // A special or stop token, or one drawn outside a mask: the matcher decides now.
  if (!accept(token)) return false;
  terminated = m_.is_terminated();
  return true;
}

// ---- MaskTable -------------------------------------------------------------------------------------

MaskTable::MaskTable(int64_t rows, int64_t words) : rows_(rows), words_(words) {
  KCHECK(rows >= 1 && words >= 1, "mask table of {} x {} words", rows, words);
  const size_t bytes = (size_t(rows * words) * 4 + 4095) / 4096 * 4096;  // whole pages: pinned registration
  data_ = static_cast<uint32_t*>(std::aligned_alloc(4096, bytes));
  if (!data_) fail("mask table: cannot allocate {} bytes", bytes);
  std::memset(data_, 0, bytes);
}

MaskTable::~MaskTable() { std::free(data_); }

// ---- MaskPool --------------------------------------------------------------------------------------

// One batch: its jobs, their states (claimed by compare-and-swap) and results. Waiters sleep on the
// batch's condition variable only when a job they need is running elsewhere; a finishing job takes the
// lock only if someone sleeps.
struct MaskPool::Batch {
  enum : uint8_t { kPending, kRunning, kDone };
  std::vector<Job> jobs;
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  std::unique_ptr<std::atomic<int64_t>[]> result;
  std::atomic<size_t> next{0};  // the next job a pool thread tries
  std::atomic<int> sleepers{0};
  std::mutex mu;
  std::condition_variable done_cv;

  explicit Batch(std::vector<Job> j)
      : jobs(std::move(j)), state(new std::atomic<uint8_t>[jobs.size()]), result(new std::atomic<int64_t>[jobs.size()]) {
    for (size_t i = 0; i < jobs.size(); ++i) state[i].store(kPending, std::memory_order_relaxed), result[i] = 0;
  }
  bool claim(size_t i) {
    uint8_t want = kPending;
    return state[i].compare_exchange_strong(want, kRunning, std::memory_order_acq_rel);
  }
  void wait_done(size_t i) {
    if (state[i].load(std::memory_order_acquire) == kDone) return;
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    {
      std::unique_lock<std::mutex> lk(mu);
      done_cv.wait(lk, [&] { return state[i].load(std::memory_order_seq_cst) == kDone; });
    }
    sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
};

int MaskPool::auto_threads(int requested) {
  if (requested > 0) return requested;
  const int cores = int(std::thread::hardware_concurrency());
  return std::clamp(cores / 4, 1, 8);
}

MaskPool::MaskPool(int threads) {
  KCHECK(threads >= 1, "mask pool of {} threads", threads);
  for (int t = 0; t < threads; ++t) threads_.emplace_back([this] { thread_main(); });
}

MaskPool::~MaskPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int64_t MaskPool::run_job(const Job& job) {
  try {
    if (!job.constraint->flush()) return kRefused;
    if (job.constraint->free_text()) return kFreeText;
    return job.constraint->fill(job.words);
  } catch (const std::exception&) {
    return kFailed;
  }
}

void MaskPool::run_claimed(Batch& b, size_t i) {
  const auto t0 = std::chrono::steady_clock::now();
  b.result[i].store(run_job(b.jobs[i]), std::memory_order_relaxed);
  busy_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
      std::memory_order_relaxed);
  b.state[i].store(Batch::kDone, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lk(b.mu); }
    b.done_cv.notify_all();
  }
}

void MaskPool::start(std::vector<Job> jobs) {
  if (batch_)
    for (size_t i = 0; i < batch_->jobs.size(); ++i)
      KCHECK(batch_->state[i].load() == Batch::kDone, "mask pool: a batch started before the previous one was waited for");
  auto b = std::make_shared<Batch>(std::move(jobs));
  const bool any = !b->jobs.empty();
  {
    std::lock_guard<std::mutex> lk(mu_);  // the pool threads copy batch_ under mu_
    batch_ = std::move(b);
    generation_ += any;
  }
  if (any) work_cv_.notify_all();
}

int64_t MaskPool::wait(size_t i) {
  KCHECK(batch_ && i < batch_->jobs.size(), "mask pool: job {} of {}", i, batch_ ? batch_->jobs.size() : 0);
  Batch& b = *batch_;
  if (b.claim(i)) {
    stolen_.fetch_add(1, std::memory_order_relaxed);
    run_claimed(b, i);
  }
  b.wait_done(i);
  return b.result[i].load(std::memory_order_relaxed);
}

bool MaskPool::done(size_t i, int64_t& result) const {
  KCHECK(batch_ && i < batch_->jobs.size(), "mask pool: job {} of {}", i, batch_ ? batch_->jobs.size() : 0);
  if (batch_->state[i].load(std::memory_order_acquire) != Batch::kDone) return false;
  result = batch_->result[i].load(std::memory_order_relaxed);
  return true;
}

void MaskPool::wait_all() {
  if (!batch_) return;
  Batch& b = *batch_;
  for (size_t i = 0; i < b.jobs.size(); ++i)
    if (b.claim(i)) run_claimed(b, i);
  for (size_t i = 0; i < b.jobs.size(); ++i) b.wait_done(i);
}

double MaskPool::busy_seconds() const { return 1e-9 * double(busy_ns_.load(std::memory_order_relaxed)); }

int64_t MaskPool::stolen() const { return stolen_.load(std::memory_order_relaxed); }

void MaskPool::thread_main() {
  uint64_t seen = 0;
  for (;;) {
    std::shared_ptr<Batch> b;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      b = batch_;  // written only by start(), under mu_
    }
    // Claim in order; jobs a waiter or another thread took are skipped.
    for (size_t i = b->next.fetch_add(1); i < b->jobs.size(); i = b->next.fetch_add(1))
      if (b->claim(i)) run_claimed(*b, i);
  }
}

}  // namespace kestrel::runtime
