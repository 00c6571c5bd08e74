// Job: one generation request of the server while it runs — n engine requests (one per choice),
// each with a ChoiceStream (openai.h), their events posted onto the connection's strand and turned
// into SSE chunks or collected for the JSON body, and the final chunk or body once every choice has
// ended. A client that leaves abandons the job: the engine requests still running are cancelled at
// once (their pages and state slots are free when their final events arrive).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "request/engine.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/routes.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::server {

class Job : public Pending, public std::enable_shared_from_this<Job> {
 public:
  using Clock = std::chrono::steady_clock;
  Job(Engine& engine, Metrics& metrics, std::atomic<int>& jobs, ResponseHead head, bool stream);

  // Submits one engine request per choice (choice i > 0 draws with seed + i: n distinct but
  // reproducible streams), holds the connection and, streaming, writes the head and the role
  // chunks. Throws ApiError (400 invalid, 429 queue full, 503 not ready); nothing is left running.
  void start(const std::shared_ptr<Connection>& conn, const Request& request, int n, const tok::Tokenizer& tok,
             bool thinking, const std::vector<std::string>& tools);
  void abandon() override;

 private:
  void on_event(size_t i, TokenEvent&& ev);
  void finish();

  Engine& engine_;
  Metrics& metrics_;
  std::atomic<int>& jobs_;
  ResponseHead head_;
  bool stream_;
  Connection* conn_ = nullptr;  // valid while the job runs: the connection holds the job
  bool ended_ = false;          // finished or abandoned
  Clock::time_point start_;
  std::vector<RequestId> engine_ids_;
  std::vector<ChoiceStream> choices_;
  std::vector<Clock::time_point> last_token_;  // per choice; start until the first token
  std::vector<bool> got_token_;
  std::vector<size_t> text_offset_;            // completions logprobs
  int remaining_ = 0;
  std::string error_;                          // first engine error (non-streaming: 500)
};

}  // namespace kestrel::server
