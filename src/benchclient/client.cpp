// Streaming benchmark client over Boost.Beast: see client.h.
#include "benchclient/client.h"

#include <utility>  // before Boost 1.74: its asio/awaitable.hpp uses std::exchange without it

#include <boost/asio.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <deque>
#include <limits>
#include <optional>
#include <random>

#include "core/check.h"

namespace kestrel::bench {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using net::use_awaitable;

namespace {

std::string clip(std::string s, size_t n = 300) {
  if (s.size() > n) s = s.substr(0, n) + "...";
  return s;
}

struct Conn {
  explicit Conn(net::io_context& ioc) : stream(ioc) {}
  beast::tcp_stream stream;
  beast::flat_buffer buf;
};

using Parser = http::response_parser<http::string_body>;

}  // namespace

Url parse_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind("https://", 0) == 0) fail("--base-url {}: https is not supported (plain HTTP only)", url);
  if (url.rfind(scheme, 0) != 0) fail("--base-url {}: expected http://HOST[:PORT][/PREFIX]", url);
  std::string rest = url.substr(scheme.size());
  Url u;
  const size_t slash = rest.find('/');
  std::string hostport = rest.substr(0, slash);
  if (slash != std::string::npos) u.path = rest.substr(slash);
  while (!u.path.empty() && u.path.back() == '/') u.path.pop_back();
  if (!hostport.empty() && hostport[0] == '[') {  // [v6]:port
    const size_t close = hostport.find(']');
    if (close == std::string::npos) fail("--base-url {}: unterminated IPv6 address", url);
    u.host = hostport.substr(1, close - 1);
    if (close + 1 < hostport.size()) {
      if (hostport[close + 1] != ':') fail("--base-url {}: expected ':' after the IPv6 address", url);
      u.port = hostport.substr(close + 2);
    }
  } else if (const size_t colon = hostport.rfind(':'); colon != std::string::npos) {
    u.host = hostport.substr(0, colon);
    u.port = hostport.substr(colon + 1);
  } else {
    u.host = hostport;
  }
  if (u.host.empty()) fail("--base-url {}: no host", url);
  if (u.port.empty() || u.port.size() > 5 || u.port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(u.port) > 65535)
    fail("--base-url {}: bad port '{}'", url, u.port);
  return u;
}

struct Client::Impl {
  Impl(ClientOptions o, const tok::Tokenizer* t) : opt(std::move(o)), tok(t) {}

  ClientOptions opt;
  const tok::Tokenizer* tok;
  net::io_context ioc;
  std::optional<tcp::resolver::results_type> endpoints;
  std::vector<std::unique_ptr<Conn>> idle;  // kept-alive connections, most recent last

  std::chrono::steady_clock::duration timeout() const {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.timeout_s));
  }

  void resolve() {
    if (endpoints) return;
    tcp::resolver r(ioc);
    boost::system::error_code ec;
    auto res = r.resolve(opt.base.host, opt.base.port, ec);
    if (ec) fail("cannot resolve {}:{}: {}", opt.base.host, opt.base.port, ec.message());
    endpoints = std::move(res);
  }

  std::string describe(const boost::system::error_code& ec) const {
    if (ec == beast::error::timeout) return fmt::format("no data from the server for {} s", opt.timeout_s);
    return ec.message();
  }

  template <class Req>
  void common_headers(Req& req) const {
    req.set(http::field::host, opt.base.host.find(':') != std::string::npos ? "[" + opt.base.host + "]:" + opt.base.port
                                                                             : opt.base.host + ":" + opt.base.port);
    req.set(http::field::user_agent, "kestrel-bench");
    if (!opt.api_key.empty()) req.set(http::field::authorization, "Bearer " + opt.api_key);
    req.keep_alive(true);
  }

  std::string body(const SampleRequest& r) const {
    nlohmann::ordered_json j;
    j["model"] = opt.model;
    if (opt.api == Api::kChat) {
      j["messages"] = r.messages.empty() ? nlohmann::ordered_json::array({{{"role", "user"}, {"content", r.prompt}}})
                                         : nlohmann::ordered_json::parse(r.messages);
      j["max_completion_tokens"] = r.output_len;
    } else {
      j["prompt"] = r.prompt;
      j["max_tokens"] = r.output_len;
    }
    j["temperature"] = 0.0;
    j["stream"] = true;
    // continuous_usage_stats (vLLM's, ours): every chunk says how many tokens the request has
    // produced, so inter-token latency is counted per token, not per chunk (see read_response).
    j["stream_options"] = {{"include_usage", true}, {"continuous_usage_stats", true}};
    if (opt.ignore_eos) j["ignore_eos"] = true;
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }

  // Reads the rest of a response whose head is in `p`, filling `out`. Returns whether the
  // connection may carry another request.
  net::awaitable<bool> read_response(Conn& c, Parser& p, Clock::time_point st, RequestOutput& out) {
    const int status = p.get().result_int();
    if (status != 200) {
      while (!p.is_done()) {
        c.stream.expires_after(timeout());
        co_await http::async_read_some(c.stream, c.buf, p, use_awaitable);
      }
      out.error = fmt::format("HTTP {}: {}", status, clip(p.get().body()));
      co_return p.keep_alive();
    }
    SseParser sse;
    bool first = false, finished = false, done = false;
    Clock::time_point last_token, last_choice, finish_time;
    std::optional<long long> usage_tokens;
    long long counted = 0;  // tokens accounted for in ITL so far (continuous usage)
    auto consume = [&](Clock::time_point now) {
      std::string& b = p.get().body();
      if (b.empty()) return;
      // The parser appends to the body; what was handed to the SSE parser is dropped so a long
      // stream does not accumulate in memory.
      for (const std::string& data : sse.feed(b)) {
        const StreamChunk ch = interpret_chunk(data, opt.api);
        if (ch.done) done = true;
        if (!ch.error.empty() && out.error.empty()) out.error = ch.error;
        if (ch.completion_tokens) usage_tokens = ch.completion_tokens;
        if (ch.has_choices) last_choice = now;
        if (ch.finished && !finished) finished = true, finish_time = now;
        // Tokens this chunk brings: the server's running count when every chunk carries usage
        // (tokens that produce no text, like chat markup, are then counted where they surface);
        // else the chunk's text re-encoded with the tokenizer; else one.
        long long k = 0;
        if (ch.has_choices && ch.completion_tokens) {
          k = std::max(0LL, *ch.completion_tokens - counted);
          counted = std::max(counted, *ch.completion_tokens);
        } else if (ch.token) {
          k = tok ? std::max<long long>(1, (long long)tok->encode(ch.text).size()) : 1;
        }
        if (k > 0 || ch.token) {
          if (!first) {
            out.ttft = secs(now - st);  // the first chunk's other tokens are part of the TTFT
            first = true;
          } else if (k > 0) {
            // ITL per token: the gap since the last token-bearing chunk, shared by its k tokens.
            const double gap = secs(now - last_token) / double(k);
            for (long long i = 0; i < k; ++i) out.itl.push_back(gap);
          }
          last_token = now;
        }
        if (ch.token) {
          ++out.token_chunks;
          out.generated_text += ch.text;
        }
      }
      b.clear();
    };
    consume(Clock::now());
    while (!p.is_done()) {
      c.stream.expires_after(timeout());
      co_await http::async_read_some(c.stream, c.buf, p, use_awaitable);
      consume(Clock::now());
    }
    if (out.error.empty() && !first && !finished)
      out.error = done ? "the stream carried no token" : "the stream ended without a token or [DONE]";
    if (out.error.empty()) {
      out.success = true;
      if (!first) out.ttft = secs(finish_time - st);  // nothing but a finish (e.g. EOS at once)
      out.latency = secs(last_choice - st);
      if (usage_tokens)
        out.output_tokens = int(*usage_tokens);
      else if (tok)
        out.output_tokens = int(tok->encode(out.generated_text).size());
      else
        out.output_tokens = out.token_chunks;
    }
    co_return p.keep_alive();
  }

  http::request<http::string_body> post(const std::string& body, bool stream) const {
    http::request<http::string_body> req{http::verb::post, opt.base.path + opt.endpoint, 11};
    common_headers(req);
    req.set(http::field::content_type, "application/json");
    req.set(http::field::accept, stream ? "text/event-stream" : "application/json");
    req.body() = body;
    req.prepare_payload();
    return req;
  }

  // Reads a whole non-streamed response whose head is in `p`. Returns whether the connection may
  // carry another request.
  net::awaitable<bool> read_plain(Conn& c, Parser& p, Clock::time_point st, HttpReply& out) {
    while (!p.is_done()) {
      c.stream.expires_after(timeout());
      co_await http::async_read_some(c.stream, c.buf, p, use_awaitable);
    }
    out.status = p.get().result_int();
    out.body = std::move(p.get().body());
    out.latency = secs(Clock::now() - st);
    co_return p.keep_alive();
  }

  // Sends `req` on a kept-alive connection (or a new one) and reads the answer into exactly one of
  // `streamed` (SSE, timed per chunk) or `plain` (the whole body). Network failures are recorded
  // in the output, never thrown.
  net::awaitable<void> exchange(const http::request<http::string_body>& req, Clock::time_point t0, int prompt_len,
                                RequestOutput* streamed, HttpReply* plain) {
    for (int attempt = 0;; ++attempt) {
      std::unique_ptr<Conn> c;
      const bool reused = attempt == 0 && !idle.empty();
      if (reused) {
        c = std::move(idle.back());
        idle.pop_back();
      } else {
        c = std::make_unique<Conn>(ioc);
      }
      const auto st = Clock::now();
      if (streamed) {
        *streamed = RequestOutput{};
        streamed->prompt_len = prompt_len;
        streamed->start_time = secs(st - t0);
      } else {
        *plain = HttpReply{};
      }
      bool got_head = false, keep = false;
      try {
        if (!reused) {
          c->stream.expires_after(timeout());
          co_await c->stream.async_connect(*endpoints, use_awaitable);
        }
        c->stream.expires_after(timeout());
        co_await http::async_write(c->stream, req, use_awaitable);
        Parser p;
        p.body_limit(std::numeric_limits<std::uint64_t>::max());
        c->stream.expires_after(timeout());
        co_await http::async_read_header(c->stream, c->buf, p, use_awaitable);
        got_head = true;
        keep = streamed ? co_await read_response(*c, p, st, *streamed) : co_await read_plain(*c, p, st, *plain);
      } catch (const boost::system::system_error& e) {
        // A kept-alive connection the server has meanwhile closed fails before any answer: that
        // is the pool's fault, not the request's, so it gets one fresh connection.
        if (reused && !got_head) continue;
        if (streamed) {
          streamed->success = false;
          streamed->error = describe(e.code());
        } else {
          plain->status = 0;
          plain->error = describe(e.code());
        }
        keep = false;
      }
      if (keep) idle.push_back(std::move(c));
      co_return;
    }
  }

  net::awaitable<void> request(const SampleRequest& rq, RequestOutput& out, Clock::time_point t0) {
    const auto req = post(body(rq), true);
    co_await exchange(req, t0, rq.prompt_len, &out, nullptr);
  }

  net::awaitable<void> post_one(const std::string* body, HttpReply* out) {
    const auto req = post(*body, false);
    co_await exchange(req, Clock::now(), 0, nullptr, out);
  }

  net::awaitable<void> run_one(const SampleRequest* rq, RequestOutput* out, Clock::time_point t0,
                               Clock::time_point arrival) {
    co_await request(*rq, *out, t0);
    out->queue_time = out->start_time - secs(arrival - t0);
  }

  net::awaitable<void> arrivals(size_t n, Schedule s, std::function<void(size_t)>* on_arrival) {
    const bool paced = s.request_rate > 0 && std::isfinite(s.request_rate);
    std::mt19937_64 rng(s.seed);
    // Gaps ~ Gamma(shape = burstiness, scale = 1 / (rate * burstiness)): mean 1/rate; shape 1 is Poisson.
    std::gamma_distribution<double> gap(s.burstiness, paced ? 1.0 / (s.request_rate * s.burstiness) : 1.0);
    net::steady_timer timer(ioc);
    auto next = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      if (paced && i > 0) {
        next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
        timer.expires_at(next);
        co_await timer.async_wait(use_awaitable);
      }
      (*on_arrival)(i);
    }
  }

  net::awaitable<void> get_models(std::string* out_body, int* status) { co_await get_path("/v1/models", out_body, status); }
  net::awaitable<void> get_path(std::string path, std::string* out_body, int* status) {
    Conn c(ioc);
    c.stream.expires_after(std::chrono::seconds(30));
    co_await c.stream.async_connect(*endpoints, use_awaitable);
    http::request<http::empty_body> req{http::verb::get, opt.base.path + path, 11};
    common_headers(req);
    req.keep_alive(false);
    co_await http::async_write(c.stream, req, use_awaitable);
    http::response<http::string_body> res;
    co_await http::async_read(c.stream, c.buf, res, use_awaitable);
    *status = res.result_int();
    *out_body = std::move(res.body());
  }
};

Client::Client(ClientOptions o, const tok::Tokenizer* tok) : impl_(std::make_unique<Impl>(std::move(o), tok)) {
  if (impl_->opt.timeout_s <= 0) fail("the request timeout must be positive");
}
Client::~Client() = default;

std::string Client::request_body(const SampleRequest& r) const { return impl_->body(r); }

// Arrivals per the schedule, at most max_concurrency jobs in flight, the rest waiting in arrival
// order. job(i) makes request i's coroutine when it is launched; on_error(i, what) records anything
// it threw that is not a network error (those are caught inside). Returns the last completion time.
Clock::time_point Client::drive(size_t n, const Schedule& s, const std::function<void(int, int)>& progress,
                                const std::function<net::awaitable<void>(size_t)>& job,
                                const std::function<void(size_t, const std::string&)>& on_error,
                                std::vector<Clock::time_point>* arrival) {
  Impl& I = *impl_;
  I.resolve();
  if (s.max_concurrency < 0) fail("--max-concurrency must not be negative");
  if (!(s.burstiness > 0)) fail("--burstiness must be positive (got {})", s.burstiness);
  arrival->assign(n, Clock::time_point{});
  std::deque<size_t> waiting;
  int in_flight = 0, done = 0;
  auto t_end = Clock::now();

  std::function<void(size_t)> launch = [&](size_t i) {
    ++in_flight;
    net::co_spawn(I.ioc, job(i), [&, i](std::exception_ptr e) {
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          on_error(i, x.what());
        }
      }
      --in_flight;
      ++done;
      t_end = Clock::now();
      if (progress) progress(done, int(n));
      if (!waiting.empty()) {
        const size_t j = waiting.front();
        waiting.pop_front();
        launch(j);
      }
    });
  };
  std::function<void(size_t)> on_arrival = [&](size_t i) {
    (*arrival)[i] = Clock::now();
    if (s.max_concurrency == 0 || in_flight < s.max_concurrency)
      launch(i);
    else
      waiting.push_back(i);
  };
  net::co_spawn(I.ioc, I.arrivals(n, s, &on_arrival), net::detached);
  I.ioc.restart();
  I.ioc.run();
  return t_end;
}

std::vector<RequestOutput> Client::run(const std::vector<SampleRequest>& requests, const Schedule& s,
                                       const std::function<void(int, int)>& progress, double* duration_s) {
  const size_t n = requests.size();
  std::vector<RequestOutput> outs(n);
  std::vector<Clock::time_point> arrival;
  const auto t0 = Clock::now();
  const auto t_end = drive(
      n, s, progress, [&](size_t i) { return impl_->run_one(&requests[i], &outs[i], t0, arrival[i]); },
      [&](size_t i, const std::string& what) {
        outs[i].success = false;
        outs[i].error = what;
      },
      &arrival);
  if (duration_s) *duration_s = secs(t_end - t0);
  return outs;
}

std::vector<HttpReply> Client::post_all(const std::vector<std::string>& bodies, int max_concurrency,
                                        const std::function<void(int, int)>& progress) {
  std::vector<HttpReply> outs(bodies.size());
  std::vector<Clock::time_point> arrival;
  Schedule s;
  s.max_concurrency = max_concurrency;
  drive(
      bodies.size(), s, progress, [&](size_t i) { return impl_->post_one(&bodies[i], &outs[i]); },
      [&](size_t i, const std::string& what) {
        outs[i].status = 0;
        outs[i].error = what;
      },
      &arrival);
  return outs;
}

std::string Client::first_model() {
  Impl& I = *impl_;
  I.resolve();
  std::string body, err;
  int status = 0;
  net::co_spawn(I.ioc, I.get_models(&body, &status), [&](std::exception_ptr e) {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const boost::system::system_error& x) {
      err = I.describe(x.code());
    } catch (const std::exception& x) {
      err = x.what();
    }
  });
  I.ioc.restart();
  I.ioc.run();
  const std::string url = fmt::format("http://{}:{}{}/v1/models", I.opt.base.host, I.opt.base.port, I.opt.base.path);
  if (!err.empty()) fail("cannot list the models at {}: {} (is the server up? or pass --model)", url, err);
  if (status != 200) fail("GET {}: HTTP {}: {}", url, status, clip(body));
  const auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id") || !j["data"][0]["id"].is_string())
    fail("GET {}: no model listed: {}", url, clip(body));
  return j["data"][0]["id"].get<std::string>();
}

HttpReply Client::get(const std::string& path) {
  Impl& I = *impl_;
  HttpReply r;
  try {
    I.resolve();
  } catch (const std::exception& x) {
    r.error = x.what();
    return r;
  }
  net::co_spawn(I.ioc, I.get_path(path, &r.body, &r.status), [&](std::exception_ptr e) {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const boost::system::system_error& x) {
      r.error = I.describe(x.code());
    } catch (const std::exception& x) {
      r.error = x.what();
    }
  });
  I.ioc.restart();
  I.ioc.run();
  if (!r.error.empty()) r.status = 0;
  return r;
}

}  // namespace kestrel::bench
