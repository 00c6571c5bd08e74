// PagedEngine: server::Engine (engine_api.h) over the multi-request paged engine (runtime/engine.h):
// continuous batching, paged KV cache, KDA state slots, prefix cache and the one sampler of the
// project. A thin shim: it maps the server's request/event types onto the runtime's, keeps the
// server's request ids apart from the runtime's, and adds what the server needs and the runtime
// leaves to its callers:
//   - loading off the caller's thread, so the server can listen (and answer /health 503) meanwhile;
//   - a bounded waiting queue (kQueueFull beyond max_queue requests not yet admitted);
//   - max_model_len: the model's context, capped by the longest request the memory plan can hold
//     (an explicit --max-model-len beyond either is refused at load, as vLLM does).
// A request the runtime refuses (it could never fit, or is malformed) makes submit() throw
// kestrel::Error; the server answers that with a 400 and OpenAI's error object.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "runtime/engine.h"
#include "server/engine_api.h"

namespace kestrel::server {

// The server's sampling knobs in the runtime sampler's terms (a fresh random seed when none is given).
// The fake engine samples through this too, so the project has one sampler.
runtime::SamplingParams runtime_sampling(const SamplingParams& p);

struct PagedEngineOptions {
  std::string model_dir;
  runtime::EngineConfig engine;  // memory budget, max_running, formats (block size), batching, ...
  int64_t max_model_len = 0;     // 0: min(model context, longest request the plan holds)
  int max_queue = 256;           // requests accepted but not yet running; more get kQueueFull
  // Optional device setup, run on the loader thread once the weights are bound and before the runtime
  // engine is built: it may upload the weights, set engine.make_executor and engine.memory_budget,
  // and returns whatever must live as long as the engine (e.g. the GPU model). `kestrel serve
  // --device cuda` uses it; the server itself knows nothing of devices.
  std::function<std::shared_ptr<void>(const ModelConfig&, const ModelWeights&, runtime::EngineConfig&)> device_setup;
};

class PagedEngine : public Engine {
 public:
  // Starts loading (weights, memory plan, engine) on a thread of its own; ready() turns true once
  // done. On failure load_error() says why and ready() stays false.
  explicit PagedEngine(PagedEngineOptions opt);
  ~PagedEngine() override;

  bool ready() const override;
  int64_t max_model_len() const override;
  int64_t vocab_size() const override;
  SubmitResult submit(EngineRequest req, TokenSink sink) override;
  void cancel(uint64_t id) override;
  EngineStats stats() const override;
  void shutdown() override;

  // Blocks until loaded or failed; returns true when loaded.
  bool wait_loaded() const;
  std::string load_error() const;
  // After a successful load: the memory plan (capacity in tokens, requests, longest request).
  const sched::MemoryPlan& memory_plan() const;

 private:
  struct Model;
  void load();

  PagedEngineOptions opt_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool loaded_ = false, stopping_ = false;
  std::string load_error_;
  int64_t max_model_len_ = 0, vocab_ = 0;
  std::unique_ptr<Model> model_;             // weights + runtime engine; set once, under mu_
  std::unordered_map<uint64_t, runtime::RequestId> ids_;  // server id -> runtime id, live requests
  std::thread loader_;
};

}  // namespace kestrel::server
