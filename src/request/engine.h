// The engine as its front ends see it: the whole contract between the OpenAI server (src/server),
// `kestrel generate` and whatever generates tokens — runtime::Engine (runtime/engine.h), usually
// behind runtime::EngineHost (runtime/engine_host.h), which loads it off the caller's thread. The
// fake engine of tests and HTTP benchmarks is the same runtime::Engine over a fake executor
// (runtime/fake_executor.h), so queueing, cancellation and limits are always the real ones.
//
// Threading contract:
//   - submit(), cancel(), stats(), ready() may be called from any thread, including from a sink, and
//     never block on generation (they touch queues and counters under a short lock).
//   - The sink runs on the engine's thread, in order, one event per generated token, never under the
//     engine's lock. It must be cheap: a slow sink stalls every request.
//   - Every accepted request gets exactly one event with finish != none, whether it finished, was
//     cancelled or failed; after it the engine drops the sink, and the request's pages and state
//     slot are already free. cancel() of a finished or unknown id is a no-op.
//   - Stop strings are the consumer's (tokenizer/text_stream.h): it cancels the request on a match.
#pragma once

#include <cstdint>
#include <string>
#include <functional>

#include "request/request.h"

namespace kestrel {

using TokenSink = std::function<void(TokenEvent&&)>;

enum class SubmitStatus : uint8_t {
  accepted,
  queue_full,  // more requests wait for admission than the engine queues (the server answers 429)
  not_ready,   // still loading, shut down, or stopped after an error (503)
};

// What holds memory in an engine, after its bookkeeping was checked (Engine::check_integrity).
struct IntegrityReport {
  int64_t requests = 0;              // accepted, final event not yet sent
  int64_t running = 0, waiting = 0;  // the scheduler's
  int32_t pages_total = 0, pages_free = 0;
  int32_t pages_cached = 0;          // owned by prefix-cache entries (one each), maybe also read by requests
  int32_t pages_held = 0;            // not reclaimable (as EngineStats::pages_held): 0 when idle
  int32_t slots_total = 0, slots_free = 0, checkpoints = 0;  // KDA state slots; checkpoints: the cache's
};

struct Submission {
  SubmitStatus status = SubmitStatus::not_ready;
  RequestId id = 0;  // when accepted: the id cancel() takes and every event carries
  bool accepted() const { return status == SubmitStatus::accepted; }
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual bool ready() const = 0;
  // Why the engine cannot serve although it is not loading: a failed load or a step that threw (the engine then
  // refuses every request). Empty while loading, shut down or healthy.
  virtual std::string failure() const { return {}; }
  virtual int64_t max_model_len() const = 0;  // prompt + max_tokens at most
  virtual int64_t vocab_size() const = 0;
  // Validates the request (validate() in request.h: RequestError on a bad one) and queues it. On
  // acceptance the sink receives its events; otherwise the sink is dropped unused.
  virtual Submission submit(Request r, TokenSink sink) = 0;
  // False when the id is unknown or already finished.
  virtual bool cancel(RequestId id) = 0;
  virtual EngineStats stats() const = 0;
  // Debugging and soak tests (`kestrel serve --debug-routes`: GET /debug/integrity): checks the
  // engine's bookkeeping (every page's refcount equals its holders, every state slot has at most one
  // holder, the prefix cache is a consistent tree within its pages) and reports the holdings; throws
  // kestrel::Error naming the first violation, or when the engine cannot check (not loaded).
  virtual IntegrityReport check_integrity() const { fail("this engine has no integrity check"); }
  // Ends every request (one cancelled event each), refuses new ones and stops the engine thread.
  // Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace kestrel
