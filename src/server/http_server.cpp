// HTTP server: see http_server.h.
//
// A Session owns one connection. Its life: read a request (header first, so `Expect: 100-continue`
// and oversize bodies are answered before the body is read), route it, write a response. Responses
// are written from one outgoing string buffer (`out_`) so that token events arriving while a write is
// in flight are coalesced into the next write instead of queueing one write per token. Generation
// requests become a Job: n engine requests (one per choice), each with a ChoiceStream. While a Job
// runs, a read is kept pending on the raw socket: EOF or an error there means the client left.
#include "server/http_server.h"

#include <utility>  // before Boost 1.74: its asio/awaitable.hpp uses std::exchange without it

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <ctime>
#include <optional>
#include <thread>
#include <vector>

#include "core/check.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "tokenizer/chat.h"

namespace kestrel::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

const char* reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
  }
}

std::string http_response(int status, const std::string& body, const std::string& content_type, bool keep_alive) {
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n\r\n{}", status,
                     reason_phrase(status), content_type, body.size(), keep_alive ? "keep-alive" : "close", body);
}

std::string chunk(const std::string& data) { return fmt::format("{:x}\r\n{}\r\n", data.size(), data); }

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string dumps(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Completions-API logprobs from chat-style entries.
json completion_logprobs(const json& entries, size_t& offset) {
  json o = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
            {"text_offset", json::array()}};
  for (const auto& e : entries) {
    o["tokens"].push_back(e["token"]);
    o["token_logprobs"].push_back(e["logprob"]);
    json top = json::object();
    for (const auto& t : e["top_logprobs"]) top[t["token"].get<std::string>()] = t["logprob"];
    o["top_logprobs"].push_back(top);
    o["text_offset"].push_back(offset);
    offset += e["token"].get<std::string>().size();
  }
  return o;
}

}  // namespace

struct Session;

struct Server::Impl {
  Impl(ServerOptions o, Engine& e, const tok::Tokenizer& t)
      : opt(std::move(o)), engine(e), tok(t), encoder(t), metrics(opt.served_model_name), acceptor(ioc),
        signals(ioc, SIGINT, SIGTERM), stop_ids(stop_token_ids(t)) {}

  // Counters first: sessions destroyed with the io_context still decrement them.
  std::atomic<int> connections{0};
  std::atomic<int> jobs{0};
  std::atomic<bool> draining{false};
  std::atomic<uint64_t> next_engine_id{1};
  ServerOptions opt;
  Engine& engine;
  const tok::Tokenizer& tok;
  tok::ChatEncoder encoder;
  Metrics metrics;
  net::io_context ioc;
  tcp::acceptor acceptor;
  net::signal_set signals;
  std::vector<int32_t> stop_ids;
  std::optional<net::steady_timer> drain_timer;
  std::optional<net::steady_timer> accept_retry;
  Clock::time_point drain_deadline;

  void do_accept();
  void begin_shutdown();
  void drain_tick();
};

struct Job {
  uint64_t serial = 0;
  Api api = Api::kChat;
  bool stream = false;
  bool include_usage = false;
  std::string id, model;
  int64_t created = 0;
  Clock::time_point start;
  std::vector<uint64_t> engine_ids;
  std::vector<ChoiceStream> choices;
  std::vector<Clock::time_point> last_token;  // per choice; start until the first token
  std::vector<bool> got_token;
  std::vector<size_t> text_offset;            // completions logprobs
  int remaining = 0;
  std::string error;                          // first engine error (non-streaming: 500)
};

struct Session : std::enable_shared_from_this<Session> {
  Session(Server::Impl* srv, tcp::socket&& s)
      : srv_(srv), stream_(std::move(s)), idle_timer_(stream_.get_executor()) {}

  ~Session() { srv_->connections.fetch_sub(1); }

  void start(bool reject) {
    if (reject) {
      net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
        self->close_after_write_ = true;
        self->send(http_response(503, error_body(503, "too many connections"), "application/json", false));
      });
      return;
    }
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->do_read(); });
  }

 private:
  using Parser = http::request_parser<http::string_body>;

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
    send(http_response(status, error_body(status, msg), "application/json", false));
  }

  void on_read(beast::error_code ec) {
    if (closed_) return;
    if (ec) return on_read_error(ec);
    stream_.expires_never();
    auto req = parser_->release();
    keep_alive_ = req.keep_alive();
    try {
      route(req);
    } catch (const ApiError& e) {
      reply(e.status, error_body(e.status, e.what(), e.param));
    } catch (const Error& e) {
      reply(400, error_body(400, e.what()));
    } catch (const std::exception& e) {
      reply(500, error_body(500, std::string("internal error: ") + e.what()));
    }
  }

  // ---- routing ------------------------------------------------------------------------------

  void route(const http::request<http::string_body>& req) {
    std::string target(req.target());
    if (auto q = target.find('?'); q != std::string::npos) target.resize(q);
    const auto method = req.method();
    auto need = [&](http::verb v) {
      if (method != v) throw ApiError(405, fmt::format("method {} not allowed on {}", std::string(req.method_string()), target));
    };
    const bool protected_path = target.rfind("/v1/", 0) == 0 || target == "/tokenize" || target == "/detokenize";
    if (protected_path && !srv_->opt.api_key.empty()) {
      const std::string want = "Bearer " + srv_->opt.api_key;
      const auto got = req[http::field::authorization];
      // Constant-time comparison: the key's bytes do not leak through response timing.
      unsigned diff = got.size() != want.size();
      for (size_t i = 0; i < want.size(); ++i) diff |= unsigned(i < got.size() ? got[i] : 0) ^ unsigned(want[i]);
      if (diff) throw ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)");
    }
    if (target == "/health") {
      need(http::verb::get);
      const bool ok = srv_->engine.ready() && !srv_->draining;
      return reply(ok ? 200 : 503, ok ? "" : error_body(503, srv_->draining ? "shutting down" : "model is loading"));
    }
    if (target == "/metrics") {
      need(http::verb::get);
      return reply(200, srv_->metrics.render(srv_->engine.stats()), "text/plain; version=0.0.4; charset=utf-8");
    }
    if (target == "/v1/models") {
      need(http::verb::get);
      json m = {{"id", srv_->opt.served_model_name},
                {"object", "model"},
                {"created", int64_t(std::time(nullptr))},
                {"owned_by", "kestrel"},
                {"root", srv_->opt.served_model_name},
                {"max_model_len", srv_->engine.max_model_len()}};
      return reply(200, dumps(json{{"object", "list"}, {"data", json::array({m})}}));
    }
    const bool gen = target == "/v1/chat/completions" || target == "/v1/completions";
    if (!gen && target != "/tokenize" && target != "/detokenize") throw ApiError(404, "no route for " + target);
    need(http::verb::post);
    ojson body = ojson::parse(req.body(), nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) throw ApiError(400, "request body is not valid JSON");
    if (!body.is_object()) throw ApiError(400, "request body must be a JSON object");
    if (target == "/tokenize") return tokenize(body);
    if (target == "/detokenize") return detokenize(body);
    if (!srv_->engine.ready()) throw ApiError(503, srv_->draining ? "shutting down" : "model is loading");
    if (srv_->draining) throw ApiError(503, "shutting down");
    generate(body, target == "/v1/chat/completions" ? Api::kChat : Api::kCompletion);
  }

  std::vector<int32_t> to_ids(const std::vector<tok::TokenId>& ids) {
    const int64_t V = srv_->engine.vocab_size();
    std::vector<int32_t> out;
    out.reserve(ids.size());
    for (auto id : ids) {
      if (int64_t(id) >= V) throw ApiError(400, fmt::format("prompt token {} is outside the model's vocabulary", id));
      out.push_back(int32_t(id));
    }
    return out;
  }

  void check_model(const ojson& body) {
    auto it = body.find("model");
    if (it == body.end() || it->is_null()) return;
    if (!it->is_string()) throw ApiError(400, "'model' must be a string", "model");
    if (it->get<std::string>() != srv_->opt.served_model_name)
      throw ApiError(404, fmt::format("The model `{}` does not exist.", it->get<std::string>()), "model");
  }

  void tokenize(const ojson& body) {
    check_model(body);
    std::vector<tok::TokenId> ids;
    if (body.contains("messages")) {
      ids = srv_->encoder.encode_request(body).ids;
    } else {
      auto p = body.find("prompt");
      if (p == body.end() || !p->is_string()) throw ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt");
      ids = srv_->tok.encode(p->get<std::string>(), false);
    }
    reply(200, dumps(json{{"count", ids.size()}, {"max_model_len", srv_->engine.max_model_len()}, {"tokens", ids}}));
  }

  void detokenize(const ojson& body) {
    check_model(body);
    auto t = body.find("tokens");
    if (t == body.end() || !t->is_array()) throw ApiError(400, "'tokens' must be an array of token ids", "tokens");
    std::vector<tok::TokenId> ids;
    for (const auto& x : *t) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= int64_t(srv_->tok.vocab_size()))
        throw ApiError(400, "'tokens' must be an array of token ids in the vocabulary", "tokens");
      ids.push_back(tok::TokenId(x.get<int64_t>()));
    }
    reply(200, dumps(json{{"prompt", srv_->tok.decode(ids)}}));
  }

  // ---- generation ---------------------------------------------------------------------------

  void generate(const ojson& body, Api api) {
    GenParams g = parse_gen_params(body, api);
    check_model(body);
    std::vector<int32_t> prompt;
    bool thinking = false;
    std::vector<std::string> tools;
    if (api == Api::kChat) {
      auto m = body.find("messages");
      if (m == body.end() || !m->is_array() || m->empty())
        throw ApiError(400, "'messages' must be a non-empty array", "messages");
      tok::ChatPrompt p = srv_->encoder.encode_request(body);
      prompt = to_ids(p.ids);
      thinking = p.thinking;
      tools = p.tool_names;
    } else {
      for (const char* f : {"suffix"})
        if (body.contains(f) && !body[f].is_null()) throw ApiError(400, fmt::format("'{}' is not supported", f), f);
      if (body.contains("echo") && body["echo"].is_boolean() && body["echo"].get<bool>())
        throw ApiError(400, "'echo' is not supported", "echo");
      auto p = body.find("prompt");
      if (p == body.end()) throw ApiError(400, "'prompt' is required", "prompt");
      const ojson* one = &*p;
      if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) one = &(*p)[0];
      if (one->is_string()) {
        prompt = to_ids(srv_->tok.encode(one->get<std::string>(), false));
      } else if (one->is_array() && !one->empty() && std::all_of(one->begin(), one->end(), [](const ojson& x) { return x.is_number_integer(); })) {
        for (const auto& x : *one) {
          const int64_t v = x.get<int64_t>();
          if (v < 0 || v >= srv_->engine.vocab_size()) throw ApiError(400, fmt::format("prompt token {} is outside the vocabulary", v), "prompt");
          prompt.push_back(int32_t(v));
        }
      } else {
        throw ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those (batches are not supported)", "prompt");
      }
    }
    if (prompt.empty()) throw ApiError(400, "the prompt is empty", api == Api::kChat ? "messages" : "prompt");
    const int64_t mml = srv_->engine.max_model_len();
    const int64_t P = int64_t(prompt.size());
    if (P >= mml)
      throw ApiError(400, fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} tokens. Please reduce the length of the input.", mml, P), api == Api::kChat ? "messages" : "prompt");
    const int64_t max_tokens = g.max_tokens ? *g.max_tokens : mml - P;
    if (P + max_tokens > mml)
      throw ApiError(400, fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} for the completion). Please reduce the length of the input or of max_tokens.", mml, P + max_tokens, P, max_tokens), "max_tokens");
    g.sampling.max_tokens = int(max_tokens);
    for (int32_t id : srv_->stop_ids) g.sampling.stop_token_ids.push_back(id);

    auto job = std::make_unique<Job>();
    job->serial = ++serial_;
    job->api = api;
    job->stream = g.stream;
    job->include_usage = g.include_usage;
    job->id = random_id(api == Api::kChat ? "chatcmpl-" : "cmpl-");
    job->model = srv_->opt.served_model_name;
    job->created = int64_t(std::time(nullptr));
    job->start = Clock::now();
    for (int i = 0; i < g.n; ++i) {
      job->choices.emplace_back(api, srv_->tok, thinking, tools, g.stop, g.logprobs);
      job->engine_ids.push_back(srv_->next_engine_id.fetch_add(1));
    }
    job->last_token.assign(size_t(g.n), job->start);
    job->got_token.assign(size_t(g.n), false);
    job->text_offset.assign(size_t(g.n), 0);
    job->remaining = g.n;

    for (int i = 0; i < g.n; ++i) {
      EngineRequest er{job->engine_ids[size_t(i)], prompt, g.sampling};
      if (g.sampling.seed && i > 0) er.sampling.seed = *g.sampling.seed + uint64_t(i);  // n distinct but reproducible
      auto self = shared_from_this();
      const uint64_t serial = job->serial;
      TokenSink sink = [self, serial, i](TokenEvent&& ev) {
        net::post(self->stream_.get_executor(),
                  [self, serial, i, ev = std::move(ev)]() mutable { self->on_event(serial, size_t(i), std::move(ev)); });
      };
      SubmitResult r;
      try {
        r = srv_->engine.submit(std::move(er), std::move(sink));
      } catch (const Error& e) {  // a request this engine can never serve: a 400, choices so far cancelled
        for (int k = 0; k < i; ++k) srv_->engine.cancel(job->engine_ids[size_t(k)]);
        throw ApiError(400, e.what());
      }
      if (r != SubmitResult::kAccepted) {
        for (int k = 0; k < i; ++k) srv_->engine.cancel(job->engine_ids[size_t(k)]);
        if (r == SubmitResult::kQueueFull) throw ApiError(429, "the server is overloaded (request queue full); retry later");
        throw ApiError(503, "the engine is not ready");
      }
    }
    job_ = std::move(job);
    srv_->jobs.fetch_add(1);
    if (job_->stream) {
      out_ += "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
              "Transfer-Encoding: chunked\r\nConnection: " + std::string(keep_alive_ ? "keep-alive" : "close") + "\r\n\r\n";
      if (api == Api::kChat)  // OpenAI opens every choice with the role
        for (int i = 0; i < g.n; ++i) out_ += chunk(sse(dumps(chat_chunk(size_t(i), json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr))));
      flush();
    }
    watch_disconnect();
  }

  json chat_chunk(size_t index, json delta, json finish, json logprobs) {
    json c = {{"id", job_->id},
              {"object", "chat.completion.chunk"},
              {"created", job_->created},
              {"model", job_->model},
              {"system_fingerprint", nullptr},
              {"choices", json::array({json{{"index", index}, {"delta", std::move(delta)}, {"logprobs", std::move(logprobs)}, {"finish_reason", std::move(finish)}}})}};
    if (job_->include_usage) c["usage"] = nullptr;
    return c;
  }

  json completion_chunk(size_t index, const std::string& text, json finish, json logprobs) {
    json c = {{"id", job_->id},
              {"object", "text_completion"},
              {"created", job_->created},
              {"model", job_->model},
              {"system_fingerprint", nullptr},
              {"choices", json::array({json{{"index", index}, {"text", text}, {"logprobs", std::move(logprobs)}, {"finish_reason", std::move(finish)}}})}};
    if (job_->include_usage) c["usage"] = nullptr;
    return c;
  }

  json usage() const {
    int prompt = 0, completion = 0, reasoning = 0, cached = 0;
    for (const auto& c : job_->choices) {
      completion += c.completion_tokens();
      reasoning += c.reasoning_tokens();
    }
    // The prompt is one prompt, whatever n is (OpenAI counts it once).
    prompt = job_->choices.empty() ? 0 : job_->choices[0].prompt_tokens();
    cached = job_->choices.empty() ? 0 : job_->choices[0].cached_tokens();
    return usage_json(prompt, completion, reasoning, cached);
  }

  void on_event(uint64_t serial, size_t i, TokenEvent&& ev) {
    if (!job_ || job_->serial != serial || closed_) return;  // a finished or abandoned job
    Job& j = *job_;
    ChoiceStream& c = j.choices[i];
    if (c.done()) return;
    const auto now = Clock::now();
    if (ev.prompt_tokens > 0) srv_->metrics.on_prompt_tokens(ev.prompt_tokens);
    if (ev.token >= 0) {
      srv_->metrics.on_generation_tokens(1);
      if (!j.got_token[i])
        srv_->metrics.on_ttft(secs(now - j.start));
      else
        srv_->metrics.on_itl(secs(now - j.last_token[i]));
      j.got_token[i] = true;
      j.last_token[i] = now;
    }
    ChoiceStream::Delta d = c.on_event(ev);
    if (d.cancel_engine) srv_->engine.cancel(j.engine_ids[i]);
    if (!d.error.empty() && j.error.empty()) j.error = d.error;
    if (j.stream) {
      if (!d.error.empty()) {
        out_ += chunk(sse(error_body(500, d.error)));
      } else if (j.api == Api::kChat) {
        json delta = json::object();
        if (!d.reasoning.empty()) delta["reasoning_content"] = delta["reasoning"] = d.reasoning;
        if (!d.content.empty()) delta["content"] = d.content;
        if (!d.tool_calls.empty()) delta["tool_calls"] = d.tool_calls;
        json lp = d.logprobs.is_null() ? json(nullptr) : json{{"content", d.logprobs}};
        const bool has = !delta.empty() || !lp.is_null();
        if (has && d.finish_reason) {  // content and finish in separate chunks, as OpenAI sends them
          out_ += chunk(sse(dumps(chat_chunk(i, delta, nullptr, lp))));
          out_ += chunk(sse(dumps(chat_chunk(i, json::object(), *d.finish_reason, nullptr))));
        } else if (has || d.finish_reason) {
          out_ += chunk(sse(dumps(chat_chunk(i, delta, d.finish_reason ? json(*d.finish_reason) : json(nullptr), lp))));
        }
      } else {
        json lp = d.logprobs.is_null() ? json(nullptr) : completion_logprobs(d.logprobs, j.text_offset[i]);
        if (!d.content.empty() || d.finish_reason || !lp.is_null())
          out_ += chunk(sse(dumps(completion_chunk(i, d.content, d.finish_reason ? json(*d.finish_reason) : json(nullptr), lp))));
      }
    }
    if (c.done()) {
      std::string reason = c.finish_reason();
      srv_->metrics.on_finished(reason == "tool_calls" ? "stop" : reason, secs(now - j.start));
      if (--j.remaining == 0) finish_job();
    }
    flush();
  }

  void finish_job() {
    Job& j = *job_;
    if (j.stream) {
      if (j.include_usage) {
        json u = {{"id", j.id}, {"object", j.api == Api::kChat ? "chat.completion.chunk" : "text_completion"},
                  {"created", j.created}, {"model", j.model}, {"system_fingerprint", nullptr},
                  {"choices", json::array()}, {"usage", usage()}};
        out_ += chunk(sse(dumps(u)));
      }
      out_ += chunk(sse("[DONE]"));
      out_ += "0\r\n\r\n";
      if (!keep_alive_) close_after_write_ = true;
    } else if (!j.error.empty()) {
      out_ += http_response(500, error_body(500, j.error), "application/json", keep_alive_);
      if (!keep_alive_) close_after_write_ = true;
    } else {
      json choices = json::array();
      for (size_t i = 0; i < j.choices.size(); ++i) {
        const ChoiceStream& c = j.choices[i];
        if (j.api == Api::kChat) {
          json msg = {{"role", "assistant"},
                      {"content", c.content().empty() && !c.tool_calls_message().empty() ? json(nullptr) : json(c.content())},
                      {"reasoning_content", c.reasoning().empty() ? json(nullptr) : json(c.reasoning())}};
          msg["reasoning"] = msg["reasoning_content"];
          json calls = c.tool_calls_message();
          msg["tool_calls"] = calls;
          json lp = c.logprobs_all().empty() ? json(nullptr) : json{{"content", c.logprobs_all()}};
          choices.push_back({{"index", i}, {"message", msg}, {"logprobs", lp}, {"finish_reason", c.finish_reason()}});
        } else {
          size_t off = 0;
          json lp = c.logprobs_all().empty() ? json(nullptr) : completion_logprobs(c.logprobs_all(), off);
          choices.push_back({{"index", i}, {"text", c.content()}, {"logprobs", lp}, {"finish_reason", c.finish_reason()}});
        }
      }
      json r = {{"id", j.id}, {"object", j.api == Api::kChat ? "chat.completion" : "text_completion"},
                {"created", j.created}, {"model", j.model}, {"system_fingerprint", nullptr},
                {"choices", choices}, {"usage", usage()}};
      out_ += http_response(200, dumps(r), "application/json", keep_alive_);
      if (!keep_alive_) close_after_write_ = true;
    }
    job_.reset();
    srv_->jobs.fetch_sub(1);
    response_done_ = true;
  }

  // Cancels whatever the engine still runs for this connection.
  void abandon_job() {
    if (!job_) return;
    for (size_t i = 0; i < job_->choices.size(); ++i)
      if (!job_->choices[i].done()) {
        srv_->engine.cancel(job_->engine_ids[i]);
        srv_->metrics.on_finished("abort", secs(Clock::now() - job_->start));
      }
    job_.reset();
    srv_->jobs.fetch_sub(1);
  }

  // A read pending on the raw socket during a response: EOF/error = the client is gone. Bytes that
  // do arrive (a pipelined next request) are kept in buf_ for the next parse.
  void watch_disconnect() {
    if (watching_ || closed_) return;
    watching_ = true;
    auto space = buf_.prepare(4096);
    stream_.socket().async_read_some(space, [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->watching_ = false;
      if (self->closed_) return;
      if (ec) return self->close();
      self->buf_.commit(n);
      if (self->job_ && self->buf_.size() < 65536) return self->watch_disconnect();
      if (!self->job_ && !self->writing_ && self->out_.empty() && !self->closed_) self->do_read();
    });
  }

  // ---- output -------------------------------------------------------------------------------

  void reply(int status, const std::string& body, const std::string& ctype = "application/json") {
    if (!keep_alive_) close_after_write_ = true;
    out_ += http_response(status, body, ctype, !close_after_write_);
    response_done_ = true;
    flush();
  }

  void send(std::string data) {
    out_ += data;
    response_done_ = true;
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
      if (self->response_done_ && !self->job_) {
        self->response_done_ = false;
        // Between requests: read the next one, unless the disconnect watch still owns the socket;
        // it starts the read itself when bytes come, and the idle timer ends a silent connection.
        if (!self->watching_) return self->do_read();
        self->idle_timer_.expires_after(self->srv_->opt.idle_timeout);
        self->idle_timer_.async_wait([self](beast::error_code ec) {
          if (!ec && !self->job_ && self->watching_ && !self->writing_) self->close();
        });
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
    abandon_job();
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
  std::unique_ptr<Job> job_;
  uint64_t serial_ = 0;
  bool writing_ = false, watching_ = false, closed_ = false, close_after_write_ = false;
  bool keep_alive_ = true, response_done_ = false, first_request_ = true, continue_sent_ = false;
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
  beast::error_code ec;
  acceptor.close(ec);
  signals.cancel(ec);
  drain_deadline = Clock::now() + opt.shutdown_timeout;
  drain_timer.emplace(ioc);
  drain_tick();
}

void Server::Impl::drain_tick() {
  if (jobs.load() > 0 && Clock::now() < drain_deadline) {
    drain_timer->expires_after(std::chrono::milliseconds(50));
    drain_timer->async_wait([this](beast::error_code) { drain_tick(); });
    return;
  }
  // Aborts what is left (each stream gets its terminal event and is closed off), then give the
  // sessions a moment to write their last bytes before the io threads stop.
  engine.shutdown();
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
