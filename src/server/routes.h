// The server's routes, apart from sockets: dispatch by path and method, authentication, the small
// endpoints (/health, /metrics, /v1/models, /tokenize, /detokenize) and the start of a generation
// (/v1/chat/completions, /v1/completions: prompt encoding, the engine requests, the Job that
// streams their events back, job.h). The transport (http_server.cpp) hands each parsed request to
// Router::handle() with the Connection to answer on; errors become OpenAI error bodies here.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "request/engine.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai.h"
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

// What a route sees of its HTTP connection; the transport's Session implements it. Every call is
// made on the connection's strand (from the handler, or from a function given to post()); output is
// written when the handler or the posted function returns.
class Connection {
 public:
  virtual ~Connection() = default;
  // A whole response; ends the exchange.
  virtual void reply(int status, const std::string& body, const std::string& content_type = "application/json") = 0;
  // A chunked text/event-stream response: its head, SSE payloads ("data: ..." each), its end (which
  // ends the exchange).
  virtual void stream_begin() = 0;
  virtual void stream_event(const std::string& payload) = 0;
  virtual void stream_end() = 0;
  // The response goes on after the handler: `p` is abandoned if the client disconnects first. The
  // exchange ends with reply() or stream_end().
  virtual void hold(std::shared_ptr<Pending> p) = 0;
  // Runs `fn` on the connection's strand (from any thread) unless the connection has closed.
  virtual void post(std::function<void()> fn) = 0;
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
  void check_model(const ojson& body) const;
  void tokenize(const ojson& body, Connection& conn);
  void detokenize(const ojson& body, Connection& conn);
  void generate(const ojson& body, Api api, const std::shared_ptr<Connection>& conn);
  // Submits the job once the request's grammar is compiled (on a GrammarService worker when it is
  // not cached; the connection is held meanwhile, and answered with the compile error if any).
  void start_when_compiled(std::shared_ptr<Job> job, Request r, int n, bool thinking,
                           std::vector<std::string> tools, const std::shared_ptr<Connection>& conn);

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
