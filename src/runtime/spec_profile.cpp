// Phase timing of speculative steps (see spec_profile.h).
#include "runtime/spec_profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/cuda_check.h"

namespace kestrel::runtime {

bool SpecProfile::enabled_from_env(int64_t* every) {
  const char* e = std::getenv("KESTREL_SPEC_PROFILE");
  if (!e || !*e) return false;
  const long long n = std::atoll(e);
  if (n <= 0) return false;
  *every = n > 1 ? int64_t(n) : 0;
  return true;
}

SpecProfile::SpecProfile(cudaStream_t stream, int64_t every) : stream_(stream), every_(every) {}

SpecProfile::~SpecProfile() {
  if (steps_ > 0) report();
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

void SpecProfile::begin_step() {
  marks_.clear();
  used_ = 0;
  mark("(start)");
}

void SpecProfile::mark(const char* phase) {
  if (used_ == pool_.size()) {
    cudaEvent_t e;
    KCUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  cudaEvent_t e = pool_[used_++];
  KCUDA_CHECK(cudaEventRecord(e, stream_));
  marks_.push_back({phase, std::chrono::steady_clock::now(), e});
}

size_t SpecProfile::sum(const char* phase) {
  for (size_t i = 0; i < sums_.size(); ++i)
    if (sums_[i].phase == phase) return i;
  sums_.push_back({phase});
  return sums_.size() - 1;
}

void SpecProfile::end_step(int64_t verify_seqs, int64_t draft_tokens) {
  mark("(end)");
  if (verify_seqs <= 0 || marks_.size() < 2) return;
  // The last marks may follow the step's sync: wait for the last event (the stream is idle by then, so this
  // costs nothing) — cudaEventElapsedTime fails on an event not yet reached.
  KCUDA_CHECK(cudaEventSynchronize(marks_.back().ev));
  // A phase marked several times in one step (per-sequence work) counts once in `count`.
  std::vector<size_t> seen;  // indices into sums_ (it may grow below)
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0.0f;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, marks_[i - 1].ev, marks_[i].ev));
    const size_t k = sum(marks_[i].phase);
    Sum& s = sums_[k];
    s.host_us += std::chrono::duration<double, std::micro>(marks_[i].host - marks_[i - 1].host).count();
    s.dev_us += 1e3 * double(ms);
    if (std::find(seen.begin(), seen.end(), k) == seen.end()) ++s.count, seen.push_back(k);
  }
  float ms = 0.0f;
  KCUDA_CHECK(cudaEventElapsedTime(&ms, marks_.front().ev, marks_.back().ev));
  step_dev_us_ += 1e3 * double(ms);
  step_host_us_ += std::chrono::duration<double, std::micro>(marks_.back().host - marks_.front().host).count();
  ++steps_, seqs_ += verify_seqs, tokens_ += draft_tokens;
  if (every_ > 0 && steps_ >= every_) report();
}

void SpecProfile::report() {
  const double n = double(steps_);
  std::string s = fmt::format(
      "spec-profile #{}: {} speculative steps, {:.2f} verify sequences and {:.1f} draft tokens a step; "
      "step {:.1f} µs host, {:.1f} µs device (µs per step, mean over all {} steps; count = steps with the phase)\n",
      ++reports_, steps_, double(seqs_) / n, double(tokens_) / n, step_host_us_ / n, step_dev_us_ / n, steps_);
  s += fmt::format("  {:<28} {:>8} {:>10} {:>10}\n", "phase", "count", "host_us", "device_us");
  for (const Sum& x : sums_)
    s += fmt::format("  {:<28} {:>8} {:>10.1f} {:>10.1f}\n", x.phase, x.count, x.host_us / n, x.dev_us / n);
  std::fputs(s.c_str(), stderr);
  std::fflush(stderr);
  sums_.clear();
  steps_ = seqs_ = tokens_ = 0;
  step_host_us_ = step_dev_us_ = 0;
}

}  // namespace kestrel::runtime
