// Structured outputs in the engine: see constraints.h.
#include "runtime/constraints.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>

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

int64_t mask_count(const uint32_t* words, int64_t V) {
  int64_t n = 0;
  const int64_t full = V / 32;
  for (int64_t w = 0; w < full; ++w) n += std::popcount(words[w]);
  if (V % 32) n += std::popcount(words[full] & ((1u << (V % 32)) - 1u));
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
  // The usual case, one token accepted per token generated, costs one comparison.
  if (ids_.size() == output.size() && (ids_.empty() || ids_.back() == output.back())) return true;
  size_t common = 0;
  while (common < ids_.size() && common < output.size() && ids_[common] == output[common]) ++common;
  m_.rollback(ids_.size() - common);
  ids_.resize(common);
  for (size_t i = common; i < output.size(); ++i)
    if (!accept(output[i])) return false;
  return true;
}

int64_t SeqConstraint::fill(uint32_t* words) {
  if (!m_.fill_mask(words, budget_)) return 0;
  return mask_count(words, V_);
}

bool SeqConstraint::accept(int32_t token) {
  if (token < 0 || int64_t(token) >= V_ || !m_.accept(structured::TokenId(token))) return false;
  ids_.push_back(token);
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

// ---- MaskWorker ------------------------------------------------------------------------------------

MaskWorker::MaskWorker() : thread_([this] { run(); }) {}

MaskWorker::~MaskWorker() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

void MaskWorker::start(std::vector<Job> jobs) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    KCHECK(done_ == jobs_.size(), "mask worker: a batch started before the previous one was waited for");
    jobs_ = std::move(jobs);
    allowed_.assign(jobs_.size(), 0);
    state_.assign(jobs_.size(), kPending);
    done_ = 0;
    ++batch_;
  }
  if (!jobs_.empty()) work_cv_.notify_one();
}

void MaskWorker::fill(size_t i, std::unique_lock<std::mutex>& lk) {
  state_[i] = kRunning;
  const Job job = jobs_[i];
  lk.unlock();
  const auto t0 = std::chrono::steady_clock::now();
  int64_t allowed;
  try {
    allowed = job.constraint->fill(job.words);
  } catch (const std::exception&) {
    allowed = -1;
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  lk.lock();
  allowed_[i] = allowed;
  state_[i] = kDone;
  ++done_;
  busy_ += dt;
  done_cv_.notify_all();
}

int64_t MaskWorker::wait(size_t i) {
  std::unique_lock<std::mutex> lk(mu_);
  KCHECK(i < jobs_.size(), "mask worker: job {} of {}", i, jobs_.size());
  if (state_[i] == kPending) {
    ++stolen_;
    fill(i, lk);
  }
  done_cv_.wait(lk, [&] { return state_[i] == kDone; });
  return allowed_[i];
}

void MaskWorker::wait_all() {
  std::unique_lock<std::mutex> lk(mu_);
  for (size_t i = 0; i < jobs_.size(); ++i)
    if (state_[i] == kPending) fill(i, lk);
  done_cv_.wait(lk, [&] { return done_ == jobs_.size(); });
}

double MaskWorker::busy_seconds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return busy_;
}

int64_t MaskWorker::stolen() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stolen_;
}

void MaskWorker::run() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait(lk, [&] { return stop_ || (batch_ != seen && done_ < jobs_.size()); });
    if (stop_) return;
    seen = batch_;
    // In order; jobs a waiter claimed are skipped. The batch stays until it is all done.
    for (size_t i = 0; i < jobs_.size(); ++i)
      if (state_[i] == kPending) fill(i, lk);
  }
}

}  // namespace kestrel::runtime
