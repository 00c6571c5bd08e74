// Job: one generation request of the server while it runs — one engine request per choice (n per
// prompt, for every prompt of a batch), each with a ChoiceStream (openai.h), their events posted
// onto the connection's strand and turned into SSE chunks or collected for the JSON body, and the
// final chunk or body once every choice has ended. A client that leaves abandons the job: the engine
// requests still running are cancelled at once (their pages and state slots are free when their
// final events arrive). The job fills in the exchange's access record (ids, token counts).
//
// The shape of the answer is the caller's: the chat and completions endpoints use the default
// (openai.h chunks and bodies); the Responses API gives its own Shaper (responses.h).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "request/engine.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/routes.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::server {

// How a job writes its answer (streaming: begin, one call per delta, end; else one body at the end).
struct Shaper {
  virtual ~Shaper() = default;
  virtual void begin(Connection& conn, const std::vector<ChoiceStream>& choices) = 0;  // streaming only
  virtual void delta(Connection& conn, size_t i, const std::vector<ChoiceStream>& choices,
                     const ChoiceStream::Delta& d) = 0;                                    // streaming only
  virtual void end(Connection& conn, const std::vector<ChoiceStream>& choices) = 0;      // streaming only
  virtual void body(Connection& conn, const std::vector<ChoiceStream>& choices) = 0;     // non-streaming, no error
};

// The chat / completions shapes of openai.h.
std::unique_ptr<Shaper> openai_shaper(ResponseHead head);

class Job : public Pending, public std::enable_shared_from_this<Job> {
 public:
  using Clock = std::chrono::steady_clock;
  // n: choices per prompt (choices i·n … i·n + n − 1 share a prompt; the access log counts it once).
  Job(Engine& engine, Metrics& metrics, std::atomic<int>& jobs, Api api, std::string id,
      std::unique_ptr<Shaper> shaper, bool stream, int n);

  // Submits requests[i] for choice i with options[i], holds the connection and, streaming, writes
  // the head (Shaper::begin). Throws ApiError (400 invalid, 429 queue full, 503 not ready); nothing
  // is left running then.
  void start(const std::shared_ptr<Connection>& conn, std::vector<Request> requests,
             std::vector<ChoiceOptions> options, const tok::Tokenizer& tok);
  void abandon() override;

 private:
  void on_event(size_t i, TokenEvent&& ev);
  void finish();
  void record_usage();

  Engine& engine_;
  Metrics& metrics_;
  std::atomic<int>& jobs_;
  Api api_;
  std::string id_;
  std::unique_ptr<Shaper> shaper_;
  bool stream_;
  int n_;
  Connection* conn_ = nullptr;  // valid while the job runs: the connection holds the job
  bool ended_ = false;          // finished or abandoned
  Clock::time_point start_;
  std::vector<RequestId> engine_ids_;
  std::vector<ChoiceStream> choices_;
  std::vector<Clock::time_point> last_token_;  // per choice; start until the first token
  std::vector<bool> got_token_;
  int remaining_ = 0;
  std::string error_;                          // first engine error (non-streaming: 500)
};

}  // namespace kestrel::server
