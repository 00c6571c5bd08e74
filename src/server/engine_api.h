// What the HTTP server needs from an engine: the whole contract between `src/server` and whatever
// generates tokens (the multi-request paged engine, paged_engine.h, or the fake engine for tests,
// loop_engine.h). Plain data and one small abstract class, so an engine can be swapped without the
// server noticing.
//
// Threading contract:
//   - submit(), cancel(), stats(), ready() may be called from any thread and must not block on
//     generation (they only touch queues and counters under a short lock).
//   - The sink is called on the engine's own thread, in order, one event per generated token. It
//     must be cheap and non-blocking (the server posts the event onto the connection's strand).
//   - Every accepted request gets exactly one terminal event (finish != kNone), whether it finished,
//     was cancelled or failed; after it the engine drops the sink and frees everything the request
//     held (pages, state slot). cancel() of a finished or unknown id is a no-op.
//   - Text-level stop strings are NOT the engine's business: the server sees the detokenized text,
//     matches them there (src/server/openai.h StopMatcher) and cancel()s the request on a match.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kestrel::server {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy
  float top_p = 1.0f;               // (0, 1]
  int top_k = 0;                    // 0 = off
  float min_p = 0.0f;               // [0, 1]; 0 = off
  float presence_penalty = 0.0f;    // [-2, 2], OpenAI semantics
  float frequency_penalty = 0.0f;   // [-2, 2]
  float repetition_penalty = 1.0f;  // > 0; 1 = off (vLLM/HF semantics, prompt tokens included)
  std::optional<uint64_t> seed;     // absent: the engine picks one
  int max_tokens = 16;              // generated tokens, >= 1
  std::vector<int32_t> stop_token_ids;  // generation ends after emitting one of these (finish kStop)
  bool ignore_eos = false;          // stop_token_ids are then ignored too
  bool logprobs = false;            // report the sampled token's logprob
  int top_logprobs = 0;             // and this many alternatives (0..20)
};

struct EngineRequest {
  uint64_t id = 0;                  // unique per engine, chosen by the caller
  std::vector<int32_t> prompt;      // token ids, non-empty, each < vocab size
  SamplingParams sampling;
};

enum class Finish : uint8_t {
  kNone,     // more tokens follow
  kStop,     // a stop token was generated (it is this event's token)
  kLength,   // max_tokens or the model's context ran out
  kAbort,    // cancel() or engine shutdown
  kError,    // the engine failed on this request; `error` says why
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

struct TokenEvent {
  int32_t token = -1;               // -1: no token in this event (kAbort / kError)
  float logprob = 0.0f;             // of `token`, when logprobs were asked for
  std::vector<TokenLogprob> top_logprobs;
  Finish finish = Finish::kNone;
  std::string error;                // kError only
  int32_t prompt_tokens = 0;        // set on the first event: prompt length as the engine saw it
  int32_t cached_prompt_tokens = 0; // set on the first event: prompt tokens served from prefix cache
};

using TokenSink = std::function<void(TokenEvent&&)>;

struct EngineStats {
  int running = 0;                  // requests holding a state slot
  int waiting = 0;                  // accepted, not yet running
  double kv_cache_usage = 0.0;      // fraction of KV pages in use, [0, 1]
  int64_t kv_pages_used = 0;        // absolute, for leak checks (0 when idle)
  uint64_t prefix_cache_queries = 0;  // prompt tokens looked up in the prefix cache (vLLM meaning)
  uint64_t prefix_cache_hits = 0;     // of which found
};

enum class SubmitResult : uint8_t {
  kAccepted,
  kQueueFull,   // bounded queue is full: the server answers 429
  kNotReady,    // still loading or shutting down: 503
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual bool ready() const = 0;
  virtual int64_t max_model_len() const = 0;
  virtual int64_t vocab_size() const = 0;
  // On kAccepted the sink will receive events; otherwise it is dropped unused. A request the engine
  // can never serve (e.g. more KV cache than it has) throws kestrel::Error: the server answers 400.
  virtual SubmitResult submit(EngineRequest req, TokenSink sink) = 0;
  virtual void cancel(uint64_t id) = 0;
  virtual EngineStats stats() const = 0;
  // Aborts everything (terminal kAbort events) and joins the engine thread. Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace kestrel::server
