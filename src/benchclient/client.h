// The HTTP side of `kestrel bench`: streaming requests to an OpenAI-compatible server.
//
// One io_context on the calling thread drives every request (Boost.Beast over Asio coroutines): no
// thread per request, so thousands may be in flight. Each request is a streamed POST to
// /v1/completions or /v1/chat/completions with `stream_options.include_usage`; the SSE chunks are
// timestamped as their bytes are read. Connections are kept alive and reused, as vLLM's aiohttp
// client does; connecting is part of the latency of the request that needs the connection.
//
// Scheduling follows `vllm bench serve`: requests arrive all at once (rate inf) or with gamma-
// distributed gaps of mean 1/rate (burstiness 1 = Poisson); at most max_concurrency are sent at a
// time (0 = no limit), the rest wait in arrival order. A request's clock starts when it is sent.
//
// Output tokens of a request: usage.completion_tokens when the server sends it, else the generated
// text re-encoded with the tokenizer when there is one, else the number of token chunks. Requests
// ask for usage in every chunk (stream_options.continuous_usage_stats) so that inter-token latency
// is per token (stats.h).
// Nothing here throws for a failed request: it becomes a RequestOutput with success = false (or an
// HttpReply with its error set, for the plain POSTs of `kestrel eval`).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <utility>  // before Boost 1.74: its asio/awaitable.hpp uses std::exchange without it

#include <boost/asio/awaitable.hpp>

#include "benchclient/dataset.h"
#include "benchclient/sse.h"
#include "benchclient/stats.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::bench {

// Seconds in a steady-clock span (every time the client and the soak report).
inline double secs(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// One non-streamed answer: status 0 and `error` set when no HTTP answer came (refused, timeout).
struct HttpReply {
  int status = 0;
  std::string body, error;
  double latency = 0;  // s, from sending to the last byte
};

// http://host[:port][/prefix]; only plain HTTP. Throws kestrel::Error.
struct Url {
  std::string host, port = "80", path;  // path: prefix without a trailing '/'
};
Url parse_url(const std::string& url);

struct ClientOptions {
  Url base;
  std::string endpoint = "/v1/completions";
  Api api = Api::kCompletions;
  std::string model;
  std::string api_key;
  bool ignore_eos = false;
  double timeout_s = 600;  // no bytes from the server for this long fails a request
};

struct Schedule {
  double request_rate = 0;  // requests/s; <= 0 or inf: all at once
  double burstiness = 1;
  int max_concurrency = 0;  // 0: unlimited
  uint64_t seed = 0;
};

class Client {
 public:
  // `tok` (may be null) counts output tokens when the server sends no usage.
  Client(ClientOptions o, const tok::Tokenizer* tok);
  ~Client();

  // Runs the requests; outputs[i] belongs to requests[i]. `progress(done, total)` is called after
  // each request. duration_s: from the first arrival to the last completion.
  std::vector<RequestOutput> run(const std::vector<SampleRequest>& requests, const Schedule& s,
                                 const std::function<void(int, int)>& progress, double* duration_s);

  // POSTs each body (non-streaming) to the endpoint, at most max_concurrency at a time (0: all at
  // once); replies[i] belongs to bodies[i]. Used by `kestrel eval`.
  std::vector<HttpReply> post_all(const std::vector<std::string>& bodies, int max_concurrency,
                                  const std::function<void(int, int)>& progress);

  // GET base + path (e.g. "/metrics"); status 0 and `error` set when no answer came. Never throws.
  HttpReply get(const std::string& path);

  // GET base/v1/models: the first model's id. Throws kestrel::Error when unreachable or empty.
  std::string first_model();

  // The JSON body sent for one request (exposed for tests).
  std::string request_body(const SampleRequest& r) const;

 private:
  std::chrono::steady_clock::time_point drive(
      size_t n, const Schedule& s, const std::function<void(int, int)>& progress,
      const std::function<boost::asio::awaitable<void>(size_t)>& job,
      const std::function<void(size_t, const std::string&)>& on_error,
      std::vector<std::chrono::steady_clock::time_point>* arrival);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::bench
