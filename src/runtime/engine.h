// Engine: requests in, streamed token events out, one loop on its own thread, driven by the
// scheduler (src/sched) and executing on the CPU model through the Executor.
//
//   Engine e(weights, config, EngineConfig{...}, &tokenizer);   // plans memory, starts the loop
//   RequestId id = e.submit(GenerateRequest{...}, [](const TokenEvent& ev) { ... });
//   e.cancel(id);  e.stats();  e.wait_idle();
//
// The API is plain data + a callback so a server adapter (submit with a token-event callback,
// cancel, stats, readiness) is a thin shim. Callbacks run on the engine thread, never under the
// engine's lock, so a callback may call cancel() or submit(); a slow callback stalls every request.
// Every accepted request gets exactly one event with finished = true (its last token, or a token-less
// event for a cancellation); a request that can never fit, or is malformed, is refused by submit()
// with a kestrel::Error and gets no events.
//
// Memory: at construction plan_memory() splits `memory_budget` into KDA state slots (max_running
// running + checkpoint_slots prefix-cache checkpoints) and cache pages; the capacity is printed by
// callers from memory_plan().describe().
//
// Stop conditions: max_tokens (reason length), a stop token id or EOS unless ignore_eos (reason
// stop, the token is the last output token), a stop string (reason stop; needs the tokenizer; the
// text is cut before the match and text that might start a stop string is held back until it cannot).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cache/layout.h"
#include "loader/config.h"
#include "loader/weights.h"
#include "runtime/executor.h"
#include "runtime/sampler.h"
#include "sched/memory_plan.h"
#include "sched/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::runtime {

using RequestId = uint64_t;

enum class FinishReason : uint8_t { none, length, stop, cancelled, error };
const char* finish_reason_name(FinishReason r);

struct GenerateRequest {
  std::vector<int32_t> prompt;
  int32_t max_tokens = 16;
  SamplingParams sampling;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings (need a tokenizer)
  bool ignore_eos = false;
  // Debug hook (`generate --dump-logits`): every position's logits once, in position order
  // (prompt positions, then each generated token fed back). Costs a full lm_head per position.
  std::function<void(int64_t pos, std::span<const float> row /* f32 [V] */)> on_logits;
};

struct TokenEvent {
  RequestId id = 0;
  int32_t index = -1;   // output index of `token`; −1 for a token-less final event
  int32_t token = -1;
  float logprob = 0.0f;                   // when sampling.logprobs >= 0
  std::vector<TokenLogprob> top_logprobs;
  std::string text;     // newly released text (empty without a tokenizer)
  int32_t cached_prompt_tokens = 0;  // index 0 only: prompt tokens the prefix cache served at admission
  bool finished = false;
  FinishReason reason = FinishReason::none;
  std::string error;    // reason == error: what went wrong (the engine stops accepting requests)
};
using EventCallback = std::function<void(const TokenEvent&)>;

struct EngineConfig {
  int64_t memory_budget = int64_t(1) << 30;  // bytes for KDA slots + cache pages
  int32_t max_running = 16;                  // concurrent requests (one running state slot each)
  int32_t checkpoint_slots = 4;              // prefix-cache KDA checkpoints
  cache::CacheFormats formats = {128, cache::LatentFormat::bf16, cache::IndexKeyFormat::bf16,
                                 cache::KdaStateDtype::f32};
  int32_t max_num_batched_tokens = 2048;
  bool enable_prefix_cache = true;
  int32_t checkpoint_interval_blocks = 0;
  bool batch_invariant = true;  // see executor.h
  // Builds the executor for the planned caches (e.g. make_cuda_executor_factory in
  // runtime/executor_cuda.h); empty = the CPU Executor.
  std::function<std::unique_ptr<StepExecutor>(const cache::CacheFormats&, const cache::CacheConfig&)> make_executor;
};

struct EngineStats {
  int64_t running = 0, waiting = 0;
  int32_t pages_total = 0, pages_used = 0;  // used = not free (includes cached prefix pages)
  int32_t pages_held = 0;                   // used and not reclaimable: held by requests (0 when idle)
  double kv_usage = 0.0;                    // pages_used / pages_total
  int64_t prefix_queries = 0, prefix_hits = 0, prefix_hit_tokens = 0;  // admissions; hits; tokens skipped
  int64_t prefix_query_tokens = 0;          // prompt tokens looked up (vLLM's prefix_cache_queries)
  int64_t prompt_tokens = 0, generation_tokens = 0;  // accepted prompts; tokens sampled
  int64_t tokens_forwarded = 0;  // positions actually computed (prefill work incl. recompute + decodes)
  int64_t steps = 0, preemptions = 0, finished = 0, cancelled = 0;
  double busy_seconds = 0.0;     // time spent in forward steps
};

class Engine {
 public:
  // `tokenizer` (optional) must outlive the engine; without it stop strings are refused and events
  // carry no text. Throws kestrel::Error when the budget cannot hold the plan.
  Engine(const ModelWeights& w, const ModelConfig& c, const EngineConfig& cfg, const tok::Tokenizer* tokenizer = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  RequestId submit(GenerateRequest r, EventCallback cb);
  bool cancel(RequestId id);
  EngineStats stats() const;
  const sched::MemoryPlan& memory_plan() const { return plan_; }
  // False after a step failed (the engine then refuses requests).
  bool ready() const;
  // Blocks until no request is waiting or running (all events delivered).
  void wait_idle();
  // Requests accepted and not yet admitted (cheap; for bounded queues in front of the engine).
  int64_t num_waiting() const;

 private:
  struct Req {
    GenerateRequest r;
    EventCallback cb;
    std::vector<int32_t> output;
    std::optional<tok::StreamDecoder> decoder;
    std::string text;            // all decoded output text (stop strings cut it)
    size_t released = 0;         // bytes of `text` already sent
    size_t stop_hold = 0;        // longest stop string − 1: bytes that may not be released yet
    int64_t logits_sent = 0;     // positions already passed to on_logits
    int64_t cached = -1;         // prompt tokens skipped at the first admission (−1: not yet admitted)
    std::optional<TokenEvent> pending;  // this step's event, sent after complete()
  };
  void loop();
  sched::SeqResult sample(Req& q, std::span<const float> logits);
  sched::SeqResult emit(Req& q, const SampleResult& s);

  const ModelWeights& w_;
  const ModelConfig& c_;
  EngineConfig cfg_;
  const tok::Tokenizer* tok_;
  sched::MemoryPlan plan_;
  sched::Scheduler sched_;
  std::unique_ptr<StepExecutor> exec_;

  mutable std::mutex mu_;
  std::condition_variable cv_;       // work arrived / stop
  std::condition_variable idle_cv_;  // went idle
  std::map<RequestId, std::unique_ptr<Req>> reqs_;  // guarded by mu_; Req contents: engine thread only
  RequestId next_id_ = 1;
  bool stop_ = false;
  std::string failed_;  // set when a step threw: every request ended with an error event
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  std::thread thread_;
};

}  // namespace kestrel::runtime
