// The server tests' harness: the test tokenizer, the whole HTTP server in-process over the real
// engine with a fake executor whose greedy output is a fixed script, and raw-socket helpers.
#pragma once

#include <utility>

#include <boost/asio.hpp>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "loader/config.h"
#include "runtime/engine.h"
#include "runtime/fake_executor.h"
#include "server/http_server.h"
#include "tokenizer/parser.h"
#include "tokenizer/tokenizer.h"
#include "chat_markers.h"

namespace kestrel::server::testing {

inline const tok::Tokenizer& T() {
  static const tok::Tokenizer t = tok::Tokenizer::load(std::string(KESTREL_SOURCE_DIR) + "/tests/data/tok_golden");
  return t;
}

inline std::vector<int32_t> ids(const std::string& text) {
  std::vector<int32_t> out;
  for (auto id : T().encode(text, /*allow_special=*/true)) out.push_back(int32_t(id));
  return out;
}

using chat_markers::C;
using chat_markers::END;
using chat_markers::O;
using chat_markers::S;


namespace net = boost::asio;
using tcp = net::ip::tcp;

inline std::string nano_dir() {
  const char* d = std::getenv("KESTREL_NANO_DIR");
  if (!d) throw std::runtime_error("KESTREL_NANO_DIR is not set");
  return d;
}

// The engine settings of the servers under test (make_executor left to the caller): small queues, nano-sized
// pages and budget, the test tokenizer's end-of-turn ids.
inline runtime::EngineConfig engine_config() {
  runtime::EngineConfig ec;
  ec.max_running = 4;
  ec.max_queue = 8;
  ec.formats.block_size = 16;
  ec.memory_budget = int64_t(256) << 20;
  ec.max_model_len = 2048;
  for (tok::TokenId id : tok::end_of_turn_ids(T())) ec.eos_token_ids.push_back(int32_t(id));
  return ec;
}

// The server over the real engine with a fake executor: nano's cache shapes (bookkeeping only), the
// test tokenizer's vocabulary and end-of-turn ids, greedy output = the script.
struct Running {
  // step_delay: the fake executor's sleep per engine step (a test that needs the queue to fill before the
  // engine drains it must not race a step that takes no time).
  explicit Running(std::vector<int32_t> script, std::string api_key = {},
                   std::chrono::microseconds step_delay = std::chrono::microseconds(0)) {
    cfg = load_config(nano_dir());
    cfg.text.vocab_size = int(T().vocab_size());
    runtime::EngineConfig ec = engine_config();
    runtime::FakeExecutorOptions f;
    f.script = std::move(script);
    f.step_delay = step_delay;
    ec.make_executor = runtime::fake_executor_factory(cfg.text.vocab_size, f);
    engine = std::make_unique<runtime::Engine>(cfg, ec);
    ServerOptions so;
    so.port = 0;
    so.api_key = std::move(api_key);
    so.served_model_name = "m";
    so.max_body_bytes = 64 * 1024;
    server = std::make_unique<Server>(so, *engine, T());
    server->listen();
    port = server->port();
    thread = std::thread([this] { server->run(); });
  }
  ~Running() {
    server->shutdown();
    thread.join();
    engine->shutdown();
    server.reset();
  }
  ModelConfig cfg;
  std::unique_ptr<runtime::Engine> engine;
  std::unique_ptr<Server> server;
  uint16_t port = 0;
  std::thread thread;
};

// Sends raw bytes, reads until the server closes; returns the raw response.
inline std::string raw(uint16_t port, const std::string& data) {
  net::io_context io;
  tcp::socket s(io);
  s.connect({net::ip::make_address("127.0.0.1"), port});
  boost::system::error_code ec;
  net::write(s, net::buffer(data), ec);  // the server may answer (413) and stop reading early
  std::string out;
  char buf[4096];
  for (;;) {
    size_t n = s.read_some(net::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  return out;
}

inline std::string request(const std::string& method, const std::string& path, const std::string& body,
                    const std::string& extra = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n" + extra +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

inline int status(const std::string& resp) { return std::stoi(resp.substr(9, 3)); }

inline std::string body_of(const std::string& resp) {
  const size_t h = resp.find("\r\n\r\n");
  std::string body = resp.substr(h + 4);
  if (resp.substr(0, h).find("Transfer-Encoding: chunked") == std::string::npos) return body;
  std::string out;  // de-chunk
  size_t p = 0;
  while (p < body.size()) {
    const size_t e = body.find("\r\n", p);
    const size_t n = std::stoul(body.substr(p, e - p), nullptr, 16);
    if (n == 0) break;
    out += body.substr(e + 2, n);
    p = e + 2 + n + 2;
  }
  return out;
}

inline std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  size_t p = 0;
  while ((p = body.find("data: ", p)) != std::string::npos) {
    const size_t e = body.find("\n\n", p);
    out.push_back(body.substr(p + 6, e - p - 6));
    p = e + 2;
  }
  return out;
}


}  // namespace kestrel::server::testing
