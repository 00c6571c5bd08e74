// `kestrel serve`'s HTTP transport: Boost.Beast/Asio, one io_context on a few threads, every socket
// on its own strand, all I/O asynchronous, so thousands of open streams cost memory, not threads.
// This layer reads requests (header first: `Expect: 100-continue` and oversize bodies are answered
// before the body is read), writes responses from one coalescing buffer, keeps connections alive,
// enforces the timeouts and notices clients that leave; what a request means is the routes' business
// (routes.h), what an OpenAI response looks like is openai.h's.
//
// The server never blocks on the engine: engine events arrive on the engine thread through the
// TokenSink and are posted onto the connection's strand. A client that disconnects is noticed by a
// read kept pending on the socket for the whole response; its engine requests are cancelled at once.
//
// Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models,
// GET /v1/models/{id}, GET /health, GET /metrics, POST /tokenize, POST /detokenize, GET / (the chat
// page); with debug_routes also GET /debug/integrity. With an API key, /v1/*, /debug/*, /tokenize and
// /detokenize need `Authorization: Bearer KEY` (health, metrics and the page stay open for probes,
// scrapers and browsers, as vLLM).
//
// HTTP/1.1 pipelining: requests sent back to back on one connection are answered in order, one at a
// time (the next is parsed once the current response is written). CORS (allowed_origins): matching
// `Origin`s get Access-Control-Allow-Origin on every answer, and preflight OPTIONS requests are
// answered here. Every exchange ends with one access-log line (log.h).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "request/engine.h"
#include "server/media.h"
#include "server/structured.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;                 // 0: any free port (tests)
  std::string api_key;                  // empty: no authentication
  std::string served_model_name = "kestrel";
  // Other names a request may give the model (its directory's name, the path given to --model);
  // /v1/models reports served_model_name only.
  std::vector<std::string> model_aliases;
  // CORS: origins whose browser pages may call the API ("*": any); empty: no CORS headers.
  std::vector<std::string> allowed_origins;
  size_t max_body_bytes = 8u << 20;     // larger bodies: 413
  int threads = 1;                      // io_context threads
  int max_connections = 16384;          // beyond: answered 503 and closed
  std::chrono::seconds read_timeout{30};      // to receive a whole request once it started
  std::chrono::seconds idle_timeout{60};      // keep-alive wait for the next request
  std::chrono::seconds write_timeout{60};     // a client that reads nothing for this long is dropped
  std::chrono::seconds shutdown_timeout{10};  // SIGTERM: running requests get this long to finish
  StructuredOptions structured;               // grammar compile limits and workers (structured.h)
  bool debug_routes = false;  // GET /debug/integrity (routes.h); off: 404 like any unknown path
  MediaOptions media;         // image input: whether the model sees images, limits, local files (media.h)
};

class Server {
 public:
  Server(ServerOptions opt, Engine& engine, const tok::Tokenizer& tok);
  ~Server();
  // Binds and listens; throws kestrel::Error when the address cannot be used.
  void listen();
  uint16_t port() const;
  // Runs the io threads until shutdown completes (blocks). SIGINT/SIGTERM start a graceful shutdown.
  void run();
  // Thread-safe: stop accepting, let running requests finish (up to shutdown_timeout), then abort
  // what is left, shut the engine down and return from run().
  void shutdown();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::server
