// Phase timing of the GPU executor's speculative steps (KESTREL_SPEC_PROFILE; issue #19): where one step's
// time goes — draft, verify forward, verification, keep, injection, syncs — on the host clock and on the
// device (a CUDA event at each phase's end), so a measurement on the GPU machine says which phase to cut.
//
// Off (the default) the executor holds no SpecProfile and every mark is one null-pointer test. On:
//   KESTREL_SPEC_PROFILE=1   a summary on stderr when the executor is destroyed (the server's clean exit);
//   KESTREL_SPEC_PROFILE=N   (N > 1) also one every N speculative steps, each over the steps since the last.
// A step is [begin_step, end_step]; mark(phase) ends the phase that began at the previous mark (or the step's
// start). A phase's host time is the host clock between those two marks (a phase ending in a sync includes
// the wait for the device); its device time is the time between the two marks' events (the device work queued
// between them, plus any time the device sat idle waiting for the host). Only steps with at least one verify
// sequence are summed (a step of prefills alone says nothing about speculation). The marks cost an event record
// each (a few µs a step), so a profiled run is a little slower than an unprofiled one.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace kestrel::runtime {

class SpecProfile {
 public:
  // From KESTREL_SPEC_PROFILE: unset or "0" → false (off); "1" → true, *every = 0 (report at destruction
  // only); N > 1 → true, *every = N (report every N speculative steps too).
  static bool enabled_from_env(int64_t* every);

  SpecProfile(cudaStream_t stream, int64_t every);
  ~SpecProfile();  // prints what was not printed yet
  SpecProfile(const SpecProfile&) = delete;
  SpecProfile& operator=(const SpecProfile&) = delete;

  void begin_step();
  void mark(const char* phase);  // `phase` must be a string literal (kept by pointer, compared by text)
  // At the step's end (it waits for the last event itself): sums the step's phases if it verified
  // any sequence (verify_seqs > 0, with draft_tokens drafted in all), reports every `every` steps.
  void end_step(int64_t verify_seqs, int64_t draft_tokens);

 private:
  struct Mark {
    const char* phase;
    std::chrono::steady_clock::time_point host;
    cudaEvent_t ev;
  };
  struct Sum {
    std::string phase;
    int64_t count = 0;              // steps in which the phase ran at least once
    double host_us = 0, dev_us = 0;  // summed over those steps
  };
  void report();
  size_t sum(const char* phase);  // its index in sums_, added if new

  cudaStream_t stream_;
  int64_t every_;
  std::vector<Mark> marks_;
  std::vector<cudaEvent_t> pool_;
  size_t used_ = 0;
  std::vector<Sum> sums_;  // in first-seen order
  int64_t steps_ = 0, seqs_ = 0, tokens_ = 0, reports_ = 0;
  double step_host_us_ = 0, step_dev_us_ = 0;
};

// The executor's hook: a no-op without a profile.
inline void spec_mark(SpecProfile* p, const char* phase) {
  if (p) p->mark(phase);
}

}  // namespace kestrel::runtime
