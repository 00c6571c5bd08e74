// `kestrel serve`: the OpenAI-compatible HTTP server (src/server) over an engine.
//
//   kestrel serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key K] [--served-model-name NAME]
//                 [--max-model-len N] [--max-num-seqs N] [--max-queue N] [--block-size N]
//
// Flags follow `vllm serve` where they mean the same. The server listens at once and answers
// /health with 503 until the model is loaded (on the engine thread). The engine today is the CPU
// reference model stepped a few requests at a time (src/server/loop_engine.h); --fake-engine swaps
// it for random tokens without loading weights, to measure the HTTP layer alone (bench/).
// SIGINT/SIGTERM drain running requests (up to --shutdown-timeout seconds) and exit 0.
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "cli/commands.h"
#include "core/check.h"
#include "server/backends.h"
#include "server/http_server.h"
#include "server/loop_engine.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

void register_serve(CLI::App& app) {
  struct Opts {
    std::string model, host = "127.0.0.1", api_key, served_name;
    int port = 8000, max_num_seqs = 4, max_queue = 256, block_size = 16, threads = 1, shutdown_timeout = 10;
    int64_t max_model_len = 0, max_request_bytes = 8 << 20;
    int max_connections = 16384;
    bool fake = false;
    int fake_delay_ms = 0, fake_load_ms = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server");
  cmd->add_option("--model", o->model, "checkpoint directory (tokenizer files included)")->required();
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "TCP port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o->api_key, "require Authorization: Bearer KEY (default: $KESTREL_API_KEY)");
  cmd->add_option("--served-model-name", o->served_name, "model id in the API (default: the --model argument)");
  cmd->add_option("--max-model-len", o->max_model_len, "context length: prompt + completion (default: the model's)")
      ->check(CLI::Range(int64_t(2), int64_t(1) << 40));
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "requests generating at once")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--max-queue", o->max_queue, "requests waiting beyond those; more are answered 429")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--block-size", o->block_size, "KV page size in tokens")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--max-request-bytes", o->max_request_bytes, "largest request body (413 beyond)")
      ->check(CLI::Range(int64_t(1024), int64_t(1) << 32));
  cmd->add_option("--max-connections", o->max_connections, "open connections; more are answered 503")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--http-threads", o->threads, "io threads")->check(CLI::Range(1, 64));
  cmd->add_option("--shutdown-timeout", o->shutdown_timeout, "seconds running requests get on SIGTERM")
      ->check(CLI::Range(0, 3600));
  cmd->add_flag("--fake-engine", o->fake, "no model: random tokens (tests and HTTP benchmarks)");
  cmd->add_option("--fake-delay-ms", o->fake_delay_ms, "fake engine: pause per round of tokens")->check(CLI::Range(0, 60000));
  cmd->add_option("--fake-load-ms", o->fake_load_ms, "fake engine: pretend loading takes this long")->check(CLI::Range(0, 600000));
  cmd->callback([o] {
    if (o->api_key.empty())
      if (const char* k = std::getenv("KESTREL_API_KEY")) o->api_key = k;
    const tok::Tokenizer tokenizer = tok::Tokenizer::load(o->model);

    std::unique_ptr<server::Backend> backend;
    if (o->fake) {
      server::FakeBackendOptions f;
      f.vocab_size = int64_t(tokenizer.vocab_size());
      f.context_len = o->max_model_len > 0 ? o->max_model_len : 4096;
      f.round_delay = std::chrono::milliseconds(o->fake_delay_ms);
      f.load_delay = std::chrono::milliseconds(o->fake_load_ms);
      backend = std::make_unique<server::FakeBackend>(f);
    } else {
      backend = std::make_unique<server::CpuBackend>(o->model);
    }
    server::LoopEngine engine(std::move(backend), {o->max_model_len, o->max_num_seqs, o->max_queue, o->block_size});

    server::ServerOptions so;
    so.host = o->host;
    so.port = uint16_t(o->port);
    so.api_key = o->api_key;
    so.served_model_name = o->served_name.empty() ? o->model : o->served_name;
    so.max_body_bytes = size_t(o->max_request_bytes);
    so.threads = o->threads;
    so.max_connections = o->max_connections;
    so.shutdown_timeout = std::chrono::seconds(o->shutdown_timeout);
    server::Server srv(so, engine, tokenizer);
    srv.listen();
    const std::string url = fmt::format("http://{}:{}", o->host.find(':') != std::string::npos ? "[" + o->host + "]" : o->host, srv.port());
    fmt::print("kestrel serve: listening on {} (model '{}', {}); /health answers 200 once loaded\n", url,
               so.served_model_name, o->fake ? "fake engine" : "CPU engine");
    fmt::print("try: curl {}/v1/chat/completions -H 'Content-Type: application/json'{} -d '{{\"model\": \"{}\", "
               "\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 32}}'\n",
               url, o->api_key.empty() ? "" : " -H 'Authorization: Bearer $KEY'", so.served_model_name);
    std::fflush(stdout);

    std::string load_error;
    std::thread watcher([&] {
      if (engine.wait_loaded()) {
        fmt::print("kestrel serve: model loaded, ready (max_model_len {})\n", engine.max_model_len());
        std::fflush(stdout);
      } else {
        load_error = engine.load_error();
        srv.shutdown();
      }
    });
    srv.run();
    engine.shutdown();
    watcher.join();
    if (!load_error.empty()) fail("{}", load_error);
    fmt::print("kestrel serve: shut down\n");
  });
}

}  // namespace kestrel::cli
