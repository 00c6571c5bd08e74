// The fake engine: one background thread, a bounded waiting queue, up to max_num_seqs requests
// running at once, stepped round-robin one token each, with logits from a Backend that needs no
// model (backends.h: a fixed script or random logits). It exists so the server's output shaping can
// be tested and the HTTP layer measured (bench/) without the cost of a model; tokens are drawn by
// the project's one sampler (runtime/sampler.h). `kestrel serve` generates for real through
// PagedEngine (paged_engine.h).
//
// KV "pages" here are bookkeeping only: a running request holds ceil(positions / block_size) pages
// out of max_num_seqs × ceil(max_model_len / block_size), so /metrics reports the same occupancy a
// paged engine would and the tests can check that finished and cancelled requests give everything
// back. There is no prefix cache (queries counted, hits always 0).
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "server/engine_api.h"

namespace kestrel::server {

class Backend {
 public:
  struct SeqState {
    virtual ~SeqState() = default;
  };
  virtual ~Backend() = default;
  // Runs on the engine thread before anything else; a throw makes the engine fail its load.
  virtual void load() = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t context_len() const = 0;  // the model's own limit
  virtual std::unique_ptr<SeqState> new_state() = 0;
  // f32 [V] logits of the next token after `tokens` (prefill) / after `token` (decode).
  virtual void prefill(SeqState& s, std::span<const int32_t> tokens, float* logits) = 0;
  virtual void decode(SeqState& s, int32_t token, float* logits) = 0;
  // Called once per round over the running requests (the fake backend paces itself here).
  virtual void end_of_round() {}
};

struct LoopEngineOptions {
  int64_t max_model_len = 0;  // 0: the backend's context length
  int max_num_seqs = 4;
  int max_queue = 256;        // waiting requests beyond this are refused (kQueueFull)
  int block_size = 16;
};

class LoopEngine : public Engine {
 public:
  // Starts the engine thread, which loads the backend; ready() turns true once it has. On a load
  // failure load_error() is set and ready() stays false.
  LoopEngine(std::unique_ptr<Backend> backend, LoopEngineOptions opt);
  ~LoopEngine() override;

  bool ready() const override;
  int64_t max_model_len() const override;
  int64_t vocab_size() const override;
  SubmitResult submit(EngineRequest req, TokenSink sink) override;
  void cancel(uint64_t id) override;
  EngineStats stats() const override;
  void shutdown() override;

  // Empty while loading or after a successful load.
  std::string load_error() const;
  // Blocks until loaded or failed; returns ready().
  bool wait_loaded() const;

 private:
  struct Seq;
  void run();
  void step(Seq& s, std::vector<float>& logits);
  int64_t pages_of(int64_t positions) const;
  void publish(const std::vector<std::unique_ptr<Seq>>& running);  // stats_ from `running`; mu_ held

  std::unique_ptr<Backend> backend_;
  LoopEngineOptions opt_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool loaded_ = false, stopping_ = false;
  std::string load_error_;
  int64_t max_model_len_ = 0, vocab_ = 0, total_pages_ = 1;
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::unordered_set<uint64_t> cancelled_;
  EngineStats stats_;
  std::thread thread_;
};

}  // namespace kestrel::server
