// The server's routes, apart from sockets: dispatch by path and method, authentication, the small
// endpoints (/health, /metrics, /v1/models[/{id}], /tokenize, /detokenize, the chat page at /;
// /debug/integrity with ServerOptions::debug_routes) and the start of a generation (/v1/chat/completions,
// /v1/completions, /v1/responses: prompt encoding, the engine requests, the Job that streams their events
// back, job.h). The transport (http_server.cpp) hands each parsed request to Router::handle() with the
// Connection to answer on; errors become OpenAI error bodies here.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "request/engine.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/params.h"
#include "server/structured.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::server {

// One parsed HTTP request, as the routes need it.
struct HttpRequest {
  std::string method;         // "GET", "POST", ...
  std::string target;         // path and query
  std::string authorization;  // the Authorization header
  std::string body;
};

// A response that continues after its handler returned (a generation): told when the client leaves.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void abandon() = 0;
};

// What the access log line says about the exchange in progress: the routes and jobs fill it in, the
// transport writes the line when the exchange ends (log.h).
struct AccessRecord {
  std::string id;                 // the response id of a generation (chatcmpl-…, cmpl-…, resp_…)
  int prompt_tokens = -1;         // −1: not a generation
  int completion_tokens = -1;
  std::string error;              // the message of an error answer
};

// What a route sees of its HTTP connection; the transport's Session implements it. Every call is
// made on the connection's strand (from the handler, or from a function given to post()); output is
// written when the handler or the posted function returns.
class Connection {
 public:
  virtual ~Connection() = default;
  // A whole response; ends the exchange. `headers`: extra header lines, each ending in "\r\n".
  virtual void reply(int status, const std::string& body, const std::string& content_type = "application/json",
                     const std::string& headers = {}) = 0;
  // A chunked text/event-stream response: its head, SSE payloads ("data: ..." each; with `event`,
  // an "event: ..." line first), its end (which ends the exchange).
  virtual void stream_begin() = 0;
  virtual void stream_event(const std::string& payload, const std::string& event = {}) = 0;
  virtual void stream_end() = 0;
  // The response goes on after the handler: `p` is abandoned if the client disconnects first. The
  // exchange ends with reply() or stream_end().
  virtual void hold(std::shared_ptr<Pending> p) = 0;
  // Runs `fn` on the connection's strand (from any thread) unless the connection has closed.
  virtual void post(std::function<void()> fn) = 0;
  // The access record of the exchange in progress.
  virtual AccessRecord& record() = 0;
};

class Job;  // job.h

class Router {
 public:
  Router(const ServerOptions& opt, Engine& engine, const tok::Tokenizer& tok);
  // Answers `req` on `conn` (now, or later through a held Job); never throws.
  void handle(const HttpRequest& req, const std::shared_ptr<Connection>& conn);

  Engine& engine() { return engine_; }
  // Shutdown: new generations are refused (503) and /health answers 503; jobs() counts those running.
  void start_draining() { draining_ = true; }
  int jobs() const { return jobs_.load(); }

 private:
  void route(const HttpRequest& req, const std::shared_ptr<Connection>& conn);
  bool knows_model(const std::string& name) const;  // the served name or one of its aliases
  // The 503 message while the engine cannot serve: shutting down, the engine's failure, or still loading.
  std::string unavailable() const {
    if (draining_) return "shutting down";
    const std::string why = engine_.failure();
    return why.empty() ? "model is loading" : "the engine failed: " + why;
  }
  void check_model(const ojson& body) const;
  json model_card() const;
  void tokenize(const ojson& body, Connection& conn);
  void detokenize(const ojson& body, Connection& conn);
  // A chat or completions body as engine requests, one per choice, with their output options.
  struct Prepared {
    GenParams g;
    std::vector<Request> requests;
    std::vector<ChoiceOptions> options;
  };
  // completion_tokens_field: parse_gen_params's (the Responses API: max_output_tokens).
  Prepared prepare(ojson& body, Api api, const std::string& completion_tokens_field = "max_completion_tokens");
  void generate(ojson& body, Api api, const std::shared_ptr<Connection>& conn);
  void responses(const ojson& body, const std::shared_ptr<Connection>& conn);
  // Submits the job once every request's grammar is compiled (on a GrammarService worker when one
  // is not cached; the connection is held meanwhile, and answered with the compile error if any).
  // responses: a Responses request (its errors are renamed by responses_error).
  void start_when_compiled(std::shared_ptr<Job> job, std::vector<Request> requests,
                           std::vector<ChoiceOptions> options, const std::shared_ptr<Connection>& conn,
                           bool responses = false);
  struct Starting;  // routes.cpp
  void continue_start(std::shared_ptr<Starting> st, const std::shared_ptr<Connection>& conn);

  const ServerOptions& opt_;
  Engine& engine_;
  const tok::Tokenizer& tok_;
  tok::ChatEncoder encoder_;
  Metrics metrics_;
  std::atomic<bool> draining_{false};
  std::atomic<int> jobs_{0};
  GrammarService grammars_;  // last: its workers stop before the rest goes away
};

}  // namespace kestrel::server
