// HTTP transport: see http_server.h.
//
// A Session owns one connection. Its life: read a request (header first, so `Expect: 100-continue`
// and oversize bodies are answered before the body is read), hand it to the Router (routes.h), write
// the response. Responses are written from one outgoing string buffer (`out_`) so that token events
// arriving while a write is in flight are coalesced into the next write instead of queueing one
// write per token. While a response the routes hold goes on (a generation Job), a read is kept
// pending on the raw socket: EOF or an error there means the client left, and the Job is abandoned.
#include "server/http_server.h"

#include <utility>  // before Boost 1.74: its asio/awaitable.hpp uses std::exchange without it

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "core/check.h"
#include "server/log.h"
#include "server/openai.h"
#include "server/routes.h"

namespace kestrel::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// The reason phrase is Beast's table (RFC 9110's phrases; "<unknown-status>" for a code it lacks).
// `headers`: extra header lines, each ending in CRLF.
std::string http_response(int status, const std::string& body, const std::string& content_type, bool keep_alive,
                          const std::string& headers = {}) {
  const std::string reason(http::obsolete_reason(static_cast<http::status>(status)));
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n{}\r\n{}", status,
                     reason, content_type, body.size(), keep_alive ? "keep-alive" : "close", headers, body);
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

std::string chunk(const std::string& data) { return fmt::format("{:x}\r\n{}\r\n", data.size(), data); }

}  // namespace

struct Session;

struct Server::Impl {
  Impl(ServerOptions o, Engine& e, const tok::Tokenizer& t)
      : opt(std::move(o)), router(opt, e, t), acceptor(ioc), signals(ioc, SIGINT, SIGTERM) {}

  // Counters first: sessions destroyed with the io_context still decrement them.
  std::atomic<int> connections{0};
  std::atomic<bool> draining{false};
  ServerOptions opt;
  Router router;  // refers to opt
  net::io_context ioc;
  tcp::acceptor acceptor;
  net::signal_set signals;
  std::optional<net::steady_timer> drain_timer;
  std::optional<net::steady_timer> accept_retry;
  Clock::time_point drain_deadline;

  void do_accept();
  void begin_shutdown();
  void drain_tick();
};

struct Session : Connection, std::enable_shared_from_this<Session> {
  Session(Server::Impl* srv, tcp::socket&& s)
      : srv_(srv), stream_(std::move(s)), idle_timer_(stream_.get_executor()) {
    beast::error_code ec;
    const auto ep = stream_.socket().remote_endpoint(ec);
    if (!ec) peer_ = ep.address().to_string();
  }

  ~Session() { srv_->connections.fetch_sub(1); }

  void start(bool reject) {
    if (reject) {
      net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
        self->close_after_write_ = true;
        self->begin_exchange("-", "-");
        self->record_.error = "too many connections";
        self->send(http_response(503, error_body(503, "too many connections"), "application/json", false), 503);
      });
      return;
    }
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->do_read(); });
  }

  // ---- Connection (the routes' side) ---------------------------------------------------------

  void reply(int status, const std::string& body, const std::string& ctype, const std::string& headers) override {
    if (!keep_alive_) close_after_write_ = true;
    status_ = status;
    out_ += http_response(status, body, ctype, !close_after_write_, cors_ + headers);
    end_exchange();
  }

  void stream_begin() override {
    status_ = 200;
    out_ += "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            "Transfer-Encoding: chunked\r\nConnection: " + std::string(keep_alive_ ? "keep-alive" : "close") + "\r\n" +
            cors_ + "\r\n";
  }

  void stream_event(const std::string& payload, const std::string& event) override {
    out_ += chunk(event.empty() ? sse(payload) : "event: " + event + "\n" + sse(payload));
  }

  void stream_end() override {
    out_ += "0\r\n\r\n";
    if (!keep_alive_) close_after_write_ = true;
    end_exchange();
  }

  void hold(std::shared_ptr<Pending> p) override { pending_ = std::move(p); }

  AccessRecord& record() override { return record_; }

  void post(std::function<void()> fn) override {
    net::post(stream_.get_executor(), [self = shared_from_this(), fn = std::move(fn)] {
      if (self->closed_) return;
      fn();
      self->flush();
    });
  }

 private:
  using Parser = http::request_parser<http::string_body>;

  void end_exchange() {
    response_done_ = true;
    pending_.reset();
    log_exchange(false);
  }

  // ---- access log ---------------------------------------------------------------------------

  void begin_exchange(std::string method, std::string route) {
    exchange_open_ = true;
    exchange_start_ = Clock::now();
    method_ = std::move(method);
    route_ = std::move(route);
    status_ = 0;
    record_ = {};
  }

  // One line per exchange (log.h): when its answer is complete, or when the client left first.
  void log_exchange(bool disconnect) {
    if (!exchange_open_) return;
    exchange_open_ = false;
    const int status = status_ ? status_ : 499;  // nothing answered: the client closed the request
    const log::Level level = status >= 500 ? log::Level::error : status >= 400 ? log::Level::warning : log::Level::info;
    if (status < 500 && !log::access_log_enabled()) return;
    if (!log::enabled(level)) return;
    nlohmann::ordered_json j = {{"event", "access"},
                                {"id", record_.id.empty() ? random_id("req-") : record_.id},
                                {"method", method_},
                                {"route", route_},
                                {"status", status}};
    if (record_.prompt_tokens >= 0) j["prompt_tokens"] = record_.prompt_tokens, j["completion_tokens"] = record_.completion_tokens;
    j["latency_ms"] = std::round(ms_since(exchange_start_) * 10.0) / 10.0;
    j["client_disconnect"] = disconnect;
    j["peer"] = peer_;
    if (!record_.error.empty()) j["error"] = record_.error.size() > 300 ? record_.error.substr(0, 300) + "…" : record_.error;
    log::write(level, std::move(j));
  }

  // CORS: the Origin header against --allowed-origins.
  bool origin_allowed(const std::string& origin) const {
    for (const std::string& o : srv_->opt.allowed_origins)
      if (o == "*" || o == origin) return true;
    return false;
  }

  void on_read(beast::error_code ec) {
    if (closed_) return;
    if (ec) return on_read_error(ec);
    stream_.expires_never();
    auto req = parser_->release();
    keep_alive_ = req.keep_alive();
    std::string target(req.target());
    route_ = target.substr(0, target.find('?'));
    const std::string origin(req[http::field::origin]);
    cors_.clear();
    if (!origin.empty() && origin_allowed(origin)) {
      const bool any = std::find(srv_->opt.allowed_origins.begin(), srv_->opt.allowed_origins.end(), "*") !=
                       srv_->opt.allowed_origins.end();
      cors_ = "Access-Control-Allow-Origin: " + (any ? std::string("*") : origin) + "\r\nVary: Origin\r\n";
    }
    if (req.method() == http::verb::options && !origin.empty() &&
        !req[http::field::access_control_request_method].empty()) {
      // A CORS preflight: answered here, before the routes (no authentication: browsers send none).
      if (cors_.empty()) {
        record_.error = "CORS origin not allowed: " + origin;
        reply(403, error_body(403, "origin " + origin + " is not allowed (--allowed-origins)"), "application/json", "");
        return flush();
      }
      std::string hdrs(req[http::field::access_control_request_headers]);
      if (hdrs.empty()) hdrs = "Authorization, Content-Type";
      reply(204, "", "text/plain",
            "Access-Control-Allow-Methods: GET, POST, OPTIONS\r\nAccess-Control-Allow-Headers: " + hdrs +
                "\r\nAccess-Control-Max-Age: 600\r\n");
      return flush();
    }
    HttpRequest r{std::string(req.method_string()), std::move(target), std::string(req[http::field::authorization]),
                  std::move(req.body())};
    srv_->router.handle(r, shared_from_this());
    flush();
    if (pending_) watch_disconnect();
  }

  void do_read() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(srv_->opt.max_body_bytes);
    parser_->header_limit(16 * 1024);
    // An idle keep-alive connection and a slow request both end at the deadline.
    stream_.expires_after(first_request_ ? srv_->opt.read_timeout : srv_->opt.idle_timeout);
    http::async_read_header(stream_, buf_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (closed_) return;
    if (ec) return on_read_error(ec);
    first_request_ = false;
    auto& req = parser_->get();
    {
      const std::string target(req.target());
      begin_exchange(std::string(req.method_string()), target.substr(0, target.find('?')));
    }
    if (beast::iequals(req[http::field::expect], "100-continue")) {
      // Answer before reading the body (curl waits a second for this otherwise).
      continue_sent_ = true;
      out_ += "HTTP/1.1 100 Continue\r\n\r\n";
      flush();
    }
    stream_.expires_after(srv_->opt.read_timeout);
    http::async_read(stream_, buf_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  void on_read_error(beast::error_code ec) {
    // The peer closed between requests, went away, or idled out: nothing to answer.
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::connection_reset || ec == net::error::operation_aborted || ec == net::error::broken_pipe)
      return close();
    int status = 400;
    std::string msg = "malformed HTTP request: " + ec.message();
    if (ec == http::error::body_limit) {
      status = 413;
      msg = fmt::format("request body exceeds the limit of {} bytes", srv_->opt.max_body_bytes);
    } else if (ec == http::error::header_limit) {
      status = 431;
      msg = "request header too large";
    } else if (ec == http::error::partial_message) {
      msg = "incomplete HTTP request";
    }
    close_after_write_ = true;
    if (!exchange_open_) begin_exchange("-", "-");
    record_.error = msg;
    send(http_response(status, error_body(status, msg), "application/json", false, cors_), status);
  }

  // A read pending on the raw socket during a response: EOF/error = the client is gone. Bytes that
  // do arrive (a pipelined next request) are kept in buf_ for the next parse. When the response is
  // written, flush() cancels the watch (resume_read_) and the next request is read: pipelined
  // requests may already sit whole in buf_, so nothing else would wake the connection up.
  void watch_disconnect() {
    if (watching_ || closed_) return;
    watching_ = true;
    auto space = buf_.prepare(4096);
    stream_.socket().async_read_some(space, [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->watching_ = false;
      if (self->closed_) return;
      const bool resume = std::exchange(self->resume_read_, false);
      if (ec && !(resume && ec == net::error::operation_aborted)) return self->close();
      self->buf_.commit(n);
      if (self->pending_ && self->buf_.size() < 65536) return self->watch_disconnect();
      if (!self->pending_ && !self->writing_ && self->out_.empty() && !self->closed_) self->do_read();
    });
  }

  // ---- output -------------------------------------------------------------------------------

  void send(std::string data, int status) {
    out_ += data;
    status_ = status;
    response_done_ = true;
    log_exchange(false);
    flush();
  }

  void flush() {
    if (writing_ || closed_ || out_.empty()) return;
    writing_ = true;
    inflight_.swap(out_);
    out_.clear();
    // A client that stops reading holds our buffer: give up on it after write_timeout.
    idle_timer_.expires_after(srv_->opt.write_timeout);
    idle_timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (!ec && self->writing_) self->close();
    });
    net::async_write(stream_.socket(), net::buffer(inflight_), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->writing_ = false;
      self->idle_timer_.cancel();
      self->inflight_.clear();
      if (self->closed_) return;
      if (ec) return self->close();
      if (!self->out_.empty()) return self->flush();
      if (self->close_after_write_) return self->linger_close();
      if (self->response_done_ && !self->pending_) {
        self->response_done_ = false;
        // Between requests: read the next one. If the disconnect watch still owns the socket, stop
        // it first; its handler starts the read (watch_disconnect).
        if (!self->watching_) return self->do_read();
        self->resume_read_ = true;
        beast::error_code ignore;
        self->stream_.socket().cancel(ignore);
      }
    });
  }

  // After an error answer to a request whose body was not read (413, malformed): closing at once
  // would reset the connection while the client is still sending, and the client could lose our
  // answer. So: end our side, discard what still comes (up to 1 MiB or 2 s), then close.
  void linger_close() {
    if (closed_) return;
    if (watching_) return close();  // a finished response: the request was read whole, nothing to drain
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    idle_timer_.expires_after(std::chrono::seconds(2));
    idle_timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (!ec) self->close();
    });
    discard();
  }

  void discard() {
    if (closed_) return;
    stream_.socket().async_read_some(net::buffer(drain_buf_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->discarded_ += n;
      if (ec || self->discarded_ > (1u << 20)) return self->close();
      self->discard();
    });
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    if (auto p = std::move(pending_)) {
      p->abandon();  // cancels what the engine still runs for it
      log_exchange(true);
    }
    beast::error_code ec;
    idle_timer_.cancel();
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

  Server::Impl* srv_;
  beast::tcp_stream stream_;
  net::steady_timer idle_timer_;
  beast::flat_buffer buf_;
  std::optional<Parser> parser_;
  std::string out_, inflight_;
  std::array<char, 4096> drain_buf_{};
  size_t discarded_ = 0;
  std::shared_ptr<Pending> pending_;  // the response the routes hold (a generation), until it ends
  bool writing_ = false, watching_ = false, closed_ = false, close_after_write_ = false, resume_read_ = false;
  bool keep_alive_ = true, response_done_ = false, first_request_ = true, continue_sent_ = false;
  // The exchange in progress, for its access-log line.
  bool exchange_open_ = false;
  Clock::time_point exchange_start_;
  std::string method_, route_, peer_, cors_;
  int status_ = 0;
  AccessRecord record_;
};

void Server::Impl::do_accept() {
  acceptor.async_accept(net::make_strand(ioc), [self = this](beast::error_code ec, tcp::socket s) {
    if (!self->acceptor.is_open()) return;
    if (ec) {
      // Out of descriptors (EMFILE) and the like: wait a little instead of spinning on the error.
      self->accept_retry.emplace(self->ioc);
      self->accept_retry->expires_after(std::chrono::milliseconds(50));
      self->accept_retry->async_wait([self](beast::error_code) { self->do_accept(); });
      return;
    }
    beast::error_code ignore;
    s.set_option(tcp::no_delay(true), ignore);  // SSE chunks are small and latency-sensitive
    const bool reject = self->connections.fetch_add(1) >= self->opt.max_connections;
    std::make_shared<Session>(self, std::move(s))->start(reject);
    self->do_accept();
  });
}

void Server::Impl::begin_shutdown() {
  if (draining.exchange(true)) return;
  router.start_draining();
  beast::error_code ec;
  acceptor.close(ec);
  signals.cancel(ec);
  drain_deadline = Clock::now() + opt.shutdown_timeout;
  drain_timer.emplace(ioc);
  drain_tick();
}

void Server::Impl::drain_tick() {
  if (router.jobs() > 0 && Clock::now() < drain_deadline) {
    drain_timer->expires_after(std::chrono::milliseconds(50));
    drain_timer->async_wait([this](beast::error_code) { drain_tick(); });
    return;
  }
  // Aborts what is left (each stream gets its terminal event and is closed off), then give the
  // sessions a moment to write their last bytes before the io threads stop.
  router.engine().shutdown();
  drain_timer->expires_after(std::chrono::milliseconds(200));
  drain_timer->async_wait([this](beast::error_code) { ioc.stop(); });
}

Server::Server(ServerOptions opt, Engine& engine, const tok::Tokenizer& tok)
    : impl_(std::make_unique<Impl>(std::move(opt), engine, tok)) {}

// The engine must be shut down first (its sinks hold sessions); destroying the io_context then
// destroys every session with it.
Server::~Server() { impl_->ioc.stop(); }

void Server::listen() {
  // Each connection is a descriptor: raise the soft limit to the hard one so that thousands of
  // streams do not run into the usual 1024.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  beast::error_code ec;
  auto addr = net::ip::make_address(impl_->opt.host, ec);
  if (ec) fail("--host '{}' is not an IP address", impl_->opt.host);
  tcp::endpoint ep(addr, impl_->opt.port);
  auto& a = impl_->acceptor;
  a.open(ep.protocol(), ec);
  if (!ec) a.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(net::socket_base::max_listen_connections, ec);
  if (ec) fail("cannot listen on {}:{}: {}", impl_->opt.host, impl_->opt.port, ec.message());
}

uint16_t Server::port() const { return impl_->acceptor.local_endpoint().port(); }

void Server::run() {
  Impl* impl = impl_.get();
  impl->signals.async_wait([impl](beast::error_code ec, int) {
    if (!ec) impl->begin_shutdown();
  });
  impl->do_accept();
  std::vector<std::thread> extra;
  for (int i = 1; i < impl->opt.threads; ++i) extra.emplace_back([impl] { impl->ioc.run(); });
  impl->ioc.run();
  for (auto& t : extra) t.join();
}

void Server::shutdown() {
  net::post(impl_->ioc, [impl = impl_.get()] { impl->begin_shutdown(); });
}

}  // namespace kestrel::server
