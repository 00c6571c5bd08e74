// The soak mode of `kestrel bench`: see soak.h.
//
// Every stream has its own connection (Connection: close), so a drop is a real disconnect the server
// must notice. A queued drop uses the stream's deadline: Beast's tcp_stream closes the socket when
// it passes, exactly what a client that gives up does. Server-side samples come from the server's
// own /metrics (and /debug/integrity when offered) plus the process's /proc status and nvidia-smi.
#include "benchclient/soak.h"

#include <utility>  // before Boost 1.74: its asio/awaitable.hpp uses std::exchange without it

#include <boost/asio.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>
#include <sys/resource.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include "core/check.h"

namespace kestrel::bench {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using net::use_awaitable;

// ---- pure helpers ------------------------------------------------------------------------------

void parse_metrics(const std::string& text, ServerSample& s) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    const size_t sp = line.rfind(' ');
    if (name_end == std::string::npos || sp == std::string::npos || sp + 1 >= line.size()) continue;
    const std::string name = line.substr(0, name_end);
    std::optional<double>* dst = name == "vllm:num_requests_running"    ? &s.running
                                 : name == "vllm:num_requests_waiting"  ? &s.waiting
                                 : name == "kestrel:kv_pages_used"      ? &s.pages_used
                                 : name == "kestrel:kv_pages_allocated" ? &s.pages_allocated
                                 : name == "vllm:kv_cache_usage_perc"   ? &s.kv_usage
                                                                        : nullptr;
    if (!dst) continue;
    char* end = nullptr;
    const double v = std::strtod(line.c_str() + sp + 1, &end);
    if (end == line.c_str() + sp + 1) continue;
    *dst = dst->value_or(0.0) + v;
  }
}

std::optional<double> parse_gpu_mib(const std::string& csv, int pid) {
  std::optional<double> total;
  std::istringstream in(csv);
  for (std::string line; std::getline(in, line);) {
    const size_t comma = line.find(',');
    if (comma == std::string::npos) continue;
    char* end = nullptr;
    const long p = std::strtol(line.c_str(), &end, 10);
    if (end == line.c_str() || p != pid) continue;
    const char* v = line.c_str() + comma + 1;
    const double mib = std::strtod(v, &end);
    if (end == v) continue;  // "[N/A]"
    total = total.value_or(0.0) + mib;
  }
  return total;
}

std::optional<double> parse_vm_rss_mb(const std::string& status) {
  std::istringstream in(status);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) {
      const double kb = std::strtod(line.c_str() + 6, nullptr);
      return kb * 1024.0 / 1e6;
    }
  return std::nullopt;
}

SoakSummary summarize(const std::vector<SoakRound>& rounds, const SoakOptions& o) {
  SoakSummary s;
  std::vector<std::string> notes;
  for (const SoakRound& r : rounds) {
    if (!r.drained) s.ok = false, notes.push_back(fmt::format("round {}: the server did not drain", r.round));
    if (r.broken > 0)
      s.ok = false, notes.push_back(fmt::format("round {}: {} stream(s) ended without a finish or an error: {}", r.round,
                                                r.broken, r.first_error));
    if (r.server.integrity != "ok" && r.server.integrity != "-")
      s.ok = false, notes.push_back(fmt::format("round {}: integrity check failed: {}", r.round, r.server.integrity));
  }
  if (rounds.empty()) return s;
  const SoakRound& last = rounds.back();
  s.baseline_round = std::min(o.baseline_round, last.round);
  const SoakRound* base = nullptr;
  for (const SoakRound& r : rounds)
    if (r.round == s.baseline_round) base = &r;
  if (base && base->server.rss_mb && last.server.rss_mb) s.rss_growth_mb = *last.server.rss_mb - *base->server.rss_mb;
  if (base && base->server.gpu_mib && last.server.gpu_mib)
    s.gpu_growth_mib = *last.server.gpu_mib - *base->server.gpu_mib;
  for (const SoakRound& r : rounds)
    if (r.round > s.baseline_round) s.requests_after_baseline += r.sent;
  if (base && base->server.heap_bytes && last.server.heap_bytes) {
    s.heap_growth_bytes = *last.server.heap_bytes - *base->server.heap_bytes;
    if (s.requests_after_baseline > 0) s.heap_bytes_per_request = *s.heap_growth_bytes / s.requests_after_baseline;
  }
  auto check = [&](const char* what, const std::optional<double>& growth, const std::optional<double>& limit,
                   const char* unit) {
    if (!limit) return;
    if (!growth) {
      s.ok = false;
      notes.push_back(fmt::format("{} growth was asked to stay within {} {} but was not measured", what, *limit, unit));
    } else if (*growth > *limit) {
      s.ok = false;
      notes.push_back(fmt::format("{} grew {:.1f} {} from round {} to {} (limit {} {})", what, *growth, unit,
                                  s.baseline_round, last.round, *limit, unit));
    }
  };
  check("RSS", s.rss_growth_mb, o.max_rss_growth_mb, "MB");
  check("GPU memory", s.gpu_growth_mib, o.max_gpu_growth_mib, "MiB");
  if (o.max_heap_bytes_per_request) {
    if (!s.heap_bytes_per_request) {
      s.ok = false;
      notes.push_back(fmt::format("heap growth was asked to stay within {} bytes per request but was not measured "
                                  "(no heap_bytes from /debug/integrity, or no round after the baseline)",
                                  *o.max_heap_bytes_per_request));
    } else if (*s.heap_bytes_per_request > *o.max_heap_bytes_per_request) {
      s.ok = false;
      notes.push_back(fmt::format("the heap grew {:.0f} bytes from round {} to {}, {:.1f} per request over {} "
                                  "requests (limit {} per request)",
                                  *s.heap_growth_bytes, s.baseline_round, last.round, *s.heap_bytes_per_request,
                                  s.requests_after_baseline, *o.max_heap_bytes_per_request));
    }
  }
  auto fmt_growth = [](const std::optional<double>& g, const char* unit) {
    return g ? fmt::format("{:+.1f} {}", *g, unit) : std::string("not measured");
  };
  s.verdict = fmt::format("growth from round {} to round {}: RSS {}, GPU memory {}", s.baseline_round, last.round,
                          fmt_growth(s.rss_growth_mb, "MB"), fmt_growth(s.gpu_growth_mib, "MiB"));
  if (s.heap_growth_bytes)
    s.verdict += fmt::format(", heap {:+.0f} bytes", *s.heap_growth_bytes) +
                 (s.heap_bytes_per_request ? fmt::format(" ({:+.1f} per request)", *s.heap_bytes_per_request) : "");
  for (const std::string& n : notes) s.verdict += "\n" + n;
  return s;
}

namespace {
constexpr const char* kRowFormat =
    "{:>5} {:>6} {:>6} {:>6} {:>6} {:>5} {:>7} {:>6} {:>9} {:>10} {:>9} {:>5} {:>5} {:>7} {:>7}  {}";
}  // namespace

std::string soak_table_header() {
  return fmt::format(kRowFormat, "round", "sent", "done", "drop-q", "drop-s", "fail", "secs", "drain", "RSS MB",
                     "heap KB", "GPU MiB", "run", "wait", "pg held", "pg allc", "integrity");
}

std::string soak_table_row(const SoakRound& r) {
  auto num = [](const std::optional<double>& v, int prec) {
    return v ? fmt::format("{:.{}f}", *v, prec) : std::string("-");
  };
  const ServerSample& s = r.server;
  const bool pre = r.round == 0;
  auto cnt = [&](int v) { return pre ? std::string("-") : std::to_string(v); };
  return fmt::format(kRowFormat, r.round, cnt(r.sent), cnt(r.completed), cnt(r.dropped_queued),
                     cnt(r.dropped_stream), cnt(r.failed), pre ? "-" : fmt::format("{:.1f}", r.seconds),
                     pre ? "-" : (r.drained ? fmt::format("{:.1f}", r.drain_seconds) : "NO"), num(s.rss_mb, 1),
                     s.heap_bytes ? fmt::format("{:.1f}", *s.heap_bytes / 1e3) : std::string("-"),
                     s.gpu_whole_device ? num(s.gpu_mib, 0) + "*" : num(s.gpu_mib, 0), num(s.running, 0), num(s.waiting, 0), num(s.pages_used, 0),
                     num(s.pages_allocated, 0), s.integrity);
}

std::string format_soak_table(const std::vector<SoakRound>& rounds) {
  std::string out = soak_table_header() + "\n";
  for (const SoakRound& r : rounds) out += soak_table_row(r) + "\n";
  return out;
}

nlohmann::json soak_json(const std::vector<SoakRound>& rounds, const SoakSummary& sum, const SoakOptions& o,
                         const ClientOptions& co) {
  auto opt = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  nlohmann::json rs = nlohmann::json::array();
  for (const SoakRound& r : rounds) {
    const ServerSample& s = r.server;
    rs.push_back({{"round", r.round}, {"sent", r.sent}, {"completed", r.completed},
                  {"dropped_queued", r.dropped_queued}, {"dropped_stream", r.dropped_stream}, {"failed", r.failed},
                  {"broken", r.broken}, {"finish_reasons", r.finish_reasons}, {"first_error", r.first_error}, {"seconds", r.seconds}, {"drain_seconds", r.drain_seconds},
                  {"drained", r.drained}, {"rss_mb", opt(s.rss_mb)}, {"heap_bytes", opt(s.heap_bytes)}, {"gpu_mib", opt(s.gpu_mib)},
                  {"running", opt(s.running)}, {"waiting", opt(s.waiting)}, {"kv_pages_used", opt(s.pages_used)},
                  {"gpu_whole_device", s.gpu_whole_device},
                  {"kv_pages_allocated", opt(s.pages_allocated)}, {"kv_cache_usage_perc", opt(s.kv_usage)},
                  {"integrity", s.integrity}});
  }
  return {{"mode", "soak"},
          {"base_url", fmt::format("http://{}:{}{}", co.base.host, co.base.port, co.base.path)},
          {"endpoint", co.endpoint},
          {"model_id", co.model},
          {"streams_per_round", o.dataset.num_prompts},
          {"input_len", o.dataset.input_len},
          {"output_len", o.dataset.output_len},
          {"max_concurrency", o.max_concurrency},
          {"drop_fraction", o.drop_fraction},
          {"queued_share", o.queued_share},
          {"shared_prefix_len", o.shared_prefix_len},
          {"shared_prefix_groups", o.shared_prefix_groups},
          {"server_pid", o.server_pid},
          {"baseline_round", sum.baseline_round},
          {"rss_growth_mb", opt(sum.rss_growth_mb)},
          {"gpu_growth_mib", opt(sum.gpu_growth_mib)},
          {"heap_growth_bytes", opt(sum.heap_growth_bytes)},
          {"requests_after_baseline", sum.requests_after_baseline},
          {"heap_bytes_per_request", opt(sum.heap_bytes_per_request)},
          {"ok", sum.ok},
          {"verdict", sum.verdict},
          {"rounds", rs}};
}

// ---- the run -----------------------------------------------------------------------------------

namespace {

struct Fate {
  enum Kind { complete, queued, stream } kind = complete;
  int after_tokens = 0;                  // stream: drop after this many tokens
  std::chrono::milliseconds delay{0};    // queued: drop this long after the head
};

struct Outcome {
  enum Kind { completed, dropped_queued, dropped_stream, failed } kind = failed;
  bool broken = true;         // failed without an error from the server
  std::string error;
  std::string finish_reason;  // completed
};

using Parser = http::response_parser<http::string_body>;

class Soak {
 public:
  Soak(const SoakOptions& o, const ClientOptions& co, const tok::Tokenizer* tok)
      : o_(o), co_(co), tok_(tok), body_maker_(co, nullptr) {
    tcp::resolver r(ioc_);
    boost::system::error_code ec;
    auto res = r.resolve(co.base.host, co.base.port, ec);
    if (ec) fail("cannot resolve {}:{}: {}", co.base.host, co.base.port, ec.message());
    eps_ = std::move(res);
    if (o.shared_prefix_len > 0) {
      RandomDatasetOptions p{std::max(1, o.shared_prefix_groups), o.shared_prefix_len, 1, 0, o.dataset.seed ^ 0x5eed};
      for (SampleRequest& s : random_dataset(p, tok)) prefixes_.push_back(std::move(s));
    }
  }

  SoakRound round(int index) {
    SoakRound r;
    r.round = index;
    RandomDatasetOptions d = o_.dataset;
    d.seed = o_.dataset.seed * 1000003ull + uint64_t(index);
    std::vector<SampleRequest> reqs = random_dataset(d, tok_);
    std::mt19937_64 rng(d.seed ^ 0xd209);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<Fate> fates(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (!prefixes_.empty()) {
        const SampleRequest& p = prefixes_[i % prefixes_.size()];
        // Word tokens start with a space and stay one pre-token each: the lengths add up exactly.
        reqs[i].prompt = p.prompt + (tok_ ? "" : " ") + reqs[i].prompt;
        reqs[i].prompt_len += p.prompt_len;
      }
      if (u(rng) < o_.drop_fraction) {
        if (u(rng) < o_.queued_share) {
          fates[i].kind = Fate::queued;
          fates[i].delay = std::chrono::milliseconds(int64_t(u(rng) * o_.queued_drop_ms));
        } else {
          fates[i].kind = Fate::stream;
          std::uniform_int_distribution<int> k(1, std::max(1, reqs[i].output_len - 1));
          fates[i].after_tokens = k(rng);
        }
      }
    }
    std::vector<Outcome> out(reqs.size());
    std::vector<http::request<http::string_body>> wire;
    wire.reserve(reqs.size());
    for (const SampleRequest& q : reqs) wire.push_back(post(body_maker_.request_body(q)));
    const auto t0 = Clock::now();
    size_t next = 0;
    int in_flight = 0;
    auto t_end = t0;
    std::function<void()> launch_more = [&] {
      while (next < reqs.size() && (o_.max_concurrency <= 0 || in_flight < o_.max_concurrency)) {
        const size_t i = next++;
        ++in_flight;
        net::co_spawn(ioc_, stream(wire[i], fates[i], out[i]), [&, i](std::exception_ptr e) {
          if (e) {
            try {
              std::rethrow_exception(e);
            } catch (const std::exception& x) {
              out[i].kind = Outcome::failed;
              out[i].error = x.what();
            }
          }
          --in_flight;
          t_end = Clock::now();
          launch_more();
        });
      }
    };
    launch_more();
    ioc_.restart();
    ioc_.run();
    r.seconds = secs(t_end - t0);
    r.sent = int(reqs.size());
    for (const Outcome& x : out) {
      switch (x.kind) {
        case Outcome::completed:
          ++r.completed;
          ++r.finish_reasons[x.finish_reason];
          break;
        case Outcome::dropped_queued: ++r.dropped_queued; break;
        case Outcome::dropped_stream: ++r.dropped_stream; break;
        case Outcome::failed:
          ++r.failed;
          r.broken += x.broken;
          if (r.first_error.empty() || (x.broken && r.broken == 1)) r.first_error = x.error;
          break;
      }
    }
    return r;
  }

  // Waits for running = waiting = 0 (false at the deadline), then settles and samples.
  bool drain(double& waited) {
    const auto t0 = Clock::now();
    for (;;) {
      ServerSample s;
      const HttpReply m = get("/metrics");
      if (m.status == 200) parse_metrics(m.body, s);
      if (s.running && s.waiting && *s.running == 0 && *s.waiting == 0) break;
      if (secs(Clock::now() - t0) > o_.drain_timeout_s) {
        waited = secs(Clock::now() - t0);
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    waited = secs(Clock::now() - t0);
    return true;
  }

  ServerSample sample() {
    ServerSample s;
    const HttpReply m = get("/metrics");
    if (m.status == 200) parse_metrics(m.body, s);
    const HttpReply integ = get("/debug/integrity");
    if (integ.status == 200) {
      s.integrity = "ok";
      const auto j = nlohmann::json::parse(integ.body, nullptr, false);
      if (j.is_object() && j.contains("heap_bytes") && j["heap_bytes"].is_number())
        s.heap_bytes = j["heap_bytes"].get<double>();
    } else if (integ.status != 404 && integ.status != 0) {
      const auto j = nlohmann::json::parse(integ.body, nullptr, false);
      s.integrity = fmt::format("HTTP {}: {}", integ.status,
                                j.is_object() && j.contains("error") ? j["error"].dump() : integ.body.substr(0, 300));
    }
    if (o_.server_pid > 0) {
      std::ifstream f(fmt::format("/proc/{}/status", o_.server_pid));
      std::stringstream ss;
      ss << f.rdbuf();
      s.rss_mb = parse_vm_rss_mb(ss.str());
      if (nvidia_smi_) {
        std::string csv;
        if (command("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits", csv) != 0) {
          nvidia_smi_ = false;  // not installed or no driver: ask no more
        } else {
          s.gpu_mib = parse_gpu_mib(csv, o_.server_pid);
          // In a container nvidia-smi may list no process of ours (another PID namespace): then the whole
          // device's memory in use, which is the server's when it is the only GPU process.
          if (!s.gpu_mib && command("nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits", csv) == 0) {
            double sum = 0;
            bool any = false;
            std::istringstream in(csv);
            for (std::string line; std::getline(in, line);) {
              char* end = nullptr;
              const double v = std::strtod(line.c_str(), &end);
              if (end != line.c_str()) sum += v, any = true;
            }
            if (any) s.gpu_mib = sum, s.gpu_whole_device = true;
          }
        }
      }
    }
    return s;
  }

 private:
  // Runs a shell command (stderr discarded); its stdout in `out`, its exit status returned.
  static int command(const std::string& cmd, std::string& out) {
    out.clear();
    FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
    if (!p) return -1;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    return pclose(p);
  }

  http::request<http::string_body> post(std::string body) const {
    http::request<http::string_body> req{http::verb::post, co_.base.path + co_.endpoint, 11};
    set_common(req);
    req.set(http::field::content_type, "application/json");
    req.set(http::field::accept, "text/event-stream");
    req.body() = std::move(body);
    req.prepare_payload();
    return req;
  }

  template <class Req>
  void set_common(Req& req) const {
    req.set(http::field::host, co_.base.host.find(':') != std::string::npos
                                   ? "[" + co_.base.host + "]:" + co_.base.port
                                   : co_.base.host + ":" + co_.base.port);
    req.set(http::field::user_agent, "kestrel-bench-soak");
    if (!co_.api_key.empty()) req.set(http::field::authorization, "Bearer " + co_.api_key);
    req.keep_alive(false);
  }

  Clock::duration timeout() const {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(co_.timeout_s));
  }

  net::awaitable<void> stream(const http::request<http::string_body>& req, Fate f, Outcome& out) {
    beast::tcp_stream s(ioc_);
    beast::flat_buffer buf;
    int tokens = 0;
    bool done = false, timed_drop = false;
    std::string reason;  // the first finish_reason seen
    try {
      s.expires_after(timeout());
      co_await s.async_connect(eps_, use_awaitable);
      co_await http::async_write(s, req, use_awaitable);
      Parser p;
      p.body_limit(std::numeric_limits<std::uint64_t>::max());
      co_await http::async_read_header(s, buf, p, use_awaitable);
      const int status = p.get().result_int();
      if (status != 200) {
        while (!p.is_done()) co_await http::async_read_some(s, buf, p, use_awaitable);
        out.kind = Outcome::failed;
        out.broken = false;
        out.error = fmt::format("HTTP {}: {}", status, p.get().body().substr(0, 300));
        co_return;
      }
      SseParser sse;
      const auto drop_at = Clock::now() + f.delay;
      while (!p.is_done()) {
        // A queued drop: the deadline closes the socket, exactly as a client that gives up.
        if (f.kind == Fate::queued) {
          s.expires_at(drop_at);
          timed_drop = true;
        } else {
          s.expires_after(timeout());
        }
        co_await http::async_read_some(s, buf, p, use_awaitable);
        timed_drop = false;
        std::string& b = p.get().body();
        for (const std::string& data : sse.feed(b)) {
          const StreamChunk c = interpret_chunk(data, co_.api);
          if (!c.error.empty()) {
            out.kind = Outcome::failed;
            out.broken = c.error.rfind("server error", 0) != 0;  // else a malformed chunk
            out.error = c.error;
            co_return;
          }
          if (c.finished && reason.empty()) reason = c.finish_reason.empty() ? "?" : c.finish_reason;
          done = done || c.done;
          tokens += c.token;
          if (f.kind == Fate::stream && tokens >= f.after_tokens && !done) {
            beast::error_code ec;
            s.socket().shutdown(tcp::socket::shutdown_both, ec);
            s.close();
            out.kind = Outcome::dropped_stream;
            co_return;
          }
        }
        b.clear();
      }
      out.kind = done && !reason.empty() ? Outcome::completed : Outcome::failed;
      out.finish_reason = reason;
      if (!done) out.error = "the stream ended without [DONE]";
      else if (reason.empty()) out.error = "the stream ended without a finish_reason";
    } catch (const boost::system::system_error& e) {
      if (timed_drop && e.code() == beast::error::timeout) {
        out.kind = tokens > 0 ? Outcome::dropped_stream : Outcome::dropped_queued;
      } else {
        out.kind = Outcome::failed;
        out.error = e.code() == beast::error::timeout ? fmt::format("no data from the server for {} s", co_.timeout_s)
                                                      : e.code().message();
      }
    }
  }

  net::awaitable<void> get_one(std::string path, HttpReply& out) {
    beast::tcp_stream s(ioc_);
    s.expires_after(std::chrono::seconds(30));
    co_await s.async_connect(eps_, use_awaitable);
    http::request<http::empty_body> req{http::verb::get, co_.base.path + path, 11};
    set_common(req);
    co_await http::async_write(s, req, use_awaitable);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    co_await http::async_read(s, buf, res, use_awaitable);
    out.status = res.result_int();
    out.body = std::move(res.body());
  }

  HttpReply get(const std::string& path) {
    HttpReply r;
    net::co_spawn(ioc_, get_one(path, r), [&](std::exception_ptr e) {
      if (!e) return;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        r.status = 0;
        r.error = x.what();
      }
    });
    ioc_.restart();
    ioc_.run();
    return r;
  }

  const SoakOptions& o_;
  const ClientOptions& co_;
  const tok::Tokenizer* tok_;
  Client body_maker_;  // the request bodies `kestrel bench` sends
  net::io_context ioc_;
  tcp::resolver::results_type eps_;
  std::vector<SampleRequest> prefixes_;
  bool nvidia_smi_ = true;
};

}  // namespace

std::vector<SoakRound> run_soak(const SoakOptions& o, const ClientOptions& co, const tok::Tokenizer* tok,
                                const std::function<void(const SoakRound&)>& on_round) {
  if (o.rounds < 1) fail("--soak: at least one round (got {})", o.rounds);
  if (!(o.drop_fraction >= 0 && o.drop_fraction <= 1)) fail("--soak-drop must be in [0, 1] (got {})", o.drop_fraction);
  if (!(o.queued_share >= 0 && o.queued_share <= 1))
    fail("--soak-queued-share must be in [0, 1] (got {})", o.queued_share);
  if (o.queued_drop_ms < 0) fail("--soak-queued-drop-ms must not be negative");
  if (o.shared_prefix_len < 0 || o.shared_prefix_groups < 1) fail("--soak-prefix-len >= 0 and --soak-prefix-groups >= 1");
  // Every stream is a descriptor: thousands at once need more than the usual soft limit of 1024.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  Soak soak(o, co, tok);
  std::vector<SoakRound> rounds;
  SoakRound pre;
  double waited = 0;
  pre.drained = soak.drain(waited);
  pre.server = soak.sample();
  rounds.push_back(pre);
  if (on_round) on_round(pre);
  for (int i = 1; i <= o.rounds; ++i) {
    SoakRound r = soak.round(i);
    r.drained = soak.drain(r.drain_seconds);
    std::this_thread::sleep_for(std::chrono::duration<double>(o.settle_s));
    r.server = soak.sample();
    rounds.push_back(r);
    if (on_round) on_round(r);
  }
  return rounds;
}

}  // namespace kestrel::bench
