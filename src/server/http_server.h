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
// Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
// GET /metrics, POST /tokenize, POST /detokenize. With an API key, /v1/*, /tokenize and /detokenize
// need `Authorization: Bearer KEY` (health and metrics stay open for probes and scrapers, as vLLM).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "request/engine.h"
#include "server/structured.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;                 // 0: any free port (tests)
  std::string api_key;                  // empty: no authentication
  std::string served_model_name = "kestrel";
  size_t max_body_bytes = 8u << 20;     // larger bodies: 413
  int threads = 1;                      // io_context threads
  int max_connections = 16384;          // beyond: answered 503 and closed
  std::chrono::seconds read_timeout{30};      // to receive a whole request once it started
  std::chrono::seconds idle_timeout{60};      // keep-alive wait for the next request
  std::chrono::seconds write_timeout{60};     // a client that reads nothing for this long is dropped
  std::chrono::seconds shutdown_timeout{10};  // SIGTERM: running requests get this long to finish
  StructuredOptions structured;               // grammar compile limits and workers (structured.h)
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
