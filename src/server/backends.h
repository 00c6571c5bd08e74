// Backends for LoopEngine (loop_engine.h).
//
// CpuBackend: the reference CPU model (src/model) on a checkpoint directory; one model::State per
// request. FakeBackend: no model at all: logits that make a fixed script come out under greedy
// sampling (tests of the server's output shaping), or random logits (anything else), optionally
// sleeping per round so that streams last long enough to measure the HTTP layer with many of them.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "server/loop_engine.h"

namespace kestrel::server {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(std::string model_dir);
  ~CpuBackend() override;
  void load() override;
  int64_t vocab_size() const override;
  int64_t context_len() const override;
  std::unique_ptr<SeqState> new_state() override;
  void prefill(SeqState& s, std::span<const int32_t> tokens, float* logits) override;
  void decode(SeqState& s, int32_t token, float* logits) override;

 private:
  struct Impl;
  std::string dir_;
  std::unique_ptr<Impl> impl_;
};

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
