// The backend of the fake engine (LoopEngine, loop_engine.h): no model at all: logits that make a
// fixed script come out under greedy sampling (tests of the server's output shaping), or random
// logits (anything else), optionally sleeping per round so that streams last long enough to measure
// the HTTP layer with many of them. Real generation is PagedEngine's (paged_engine.h).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "server/loop_engine.h"

namespace kestrel::server {

struct FakeBackendOptions {
  int64_t vocab_size = 1024;
  int64_t context_len = 4096;
  std::vector<int32_t> script;          // non-empty: greedy output repeats this
  std::chrono::microseconds round_delay{0};
  std::chrono::milliseconds load_delay{0};  // lets tests see /health answer 503 while "loading"
};

class FakeBackend : public Backend {
 public:
  explicit FakeBackend(FakeBackendOptions opt) : opt_(std::move(opt)) {}
  void load() override;
  int64_t vocab_size() const override { return opt_.vocab_size; }
  int64_t context_len() const override { return opt_.context_len; }
  std::unique_ptr<SeqState> new_state() override;
  void prefill(SeqState& s, std::span<const int32_t> tokens, float* logits) override;
  void decode(SeqState& s, int32_t token, float* logits) override;
  void end_of_round() override;

 private:
  void fill(SeqState& s, float* logits);
  FakeBackendOptions opt_;
};

}  // namespace kestrel::server
