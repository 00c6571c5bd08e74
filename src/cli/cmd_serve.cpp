// `kestrel serve`: the OpenAI-compatible HTTP server (src/server) over an engine.
//
//   kestrel serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key K] [--served-model-name NAME]
//                 [--max-model-len N] [--max-num-seqs N] [--max-queue N] [--block-size N]
//                 [--memory-budget SIZE | --gpu-memory-utilization F] [--max-num-batched-tokens N]
//                 [--kv-cache-dtype bf16|fp8] [--index-cache-dtype bf16|fp8|mxfp4] [--kda-state-dtype f32|f16] [--no-prefix-cache]
//                 [--device cpu|cuda] [--no-cuda-graphs] [--quantization bf16|ptpc-fp8]
//
// Flags follow `vllm serve` where they mean the same. The server listens at once and answers
// /health with 503 until the model is loaded (off the io threads). The engine is the multi-request
// paged engine (src/server/paged_engine.h over src/runtime/engine.h); once it is loaded its memory
// plan's capacity is printed next to a curl line. --fake-engine swaps it for random tokens without
// loading weights, to measure the HTTP layer alone (bench/).
// SIGINT/SIGTERM drain running requests (up to --shutdown-timeout seconds) and exit 0.
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "cli/commands.h"
#include "core/check.h"
#include "server/backends.h"
#include "server/http_server.h"
#include "server/loop_engine.h"
#include "server/paged_engine.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

void register_serve(CLI::App& app) {
  struct Opts {
    std::string model, host = "127.0.0.1", api_key, served_name, memory_budget;
    std::string kv_cache_dtype = "bf16", index_cache_dtype = "bf16", kda_state_dtype = "f32", device = "cpu";
    std::string quantization = "bf16";
    double gpu_memory_utilization = 0.0;
    int port = 8000, max_num_seqs = 16, max_queue = 256, block_size = 0, threads = 1, shutdown_timeout = 10;
    int max_batched_tokens = 2048;
    bool no_prefix_cache = false, no_cuda_graphs = false;
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
  cmd->add_option("--block-size", o->block_size, "KV page size in tokens (default: the engine's, 128)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--device", o->device, "cpu or cuda (the paged engine on the GPU executor)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_flag("--no-cuda-graphs", o->no_cuda_graphs, "--device cuda: run decode steps eagerly");
  cmd->add_option("--quantization", o->quantization, "--device cuda: dense projection weights bf16 | ptpc-fp8")
      ->check(CLI::IsMember({"bf16", "ptpc-fp8"}));
  auto* mb = cmd->add_option("--memory-budget", o->memory_budget, "bytes for KV pages + KDA state slots (e.g. 512M, 2G; default 1G)");
  auto* gu = cmd->add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                             "fraction of memory for weights + caches (CPU: of physical RAM)");
  mb->excludes(gu);
  cmd->add_option("--max-num-batched-tokens", o->max_batched_tokens, "token budget of one engine step")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "MLA latent cache: bf16 | fp8");
  cmd->add_option("--index-cache-dtype", o->index_cache_dtype, "indexer key cache: bf16 | fp8 | mxfp4");
  cmd->add_option("--kda-state-dtype", o->kda_state_dtype, "KDA recurrent state in the state pool: f32 | f16 (half the bytes)");
  cmd->add_flag("--no-prefix-cache", o->no_prefix_cache, "disable prefix caching");
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

    // Either engine, behind the one interface the server codes against; `wait_loaded`, `load_error`
    // and `capacity` are what the startup messages need from the concrete one.
    std::unique_ptr<server::Engine> engine;
    std::function<bool()> wait_loaded;
    std::function<std::string()> load_error, capacity;
    if (o->fake) {
      server::FakeBackendOptions f;
      f.vocab_size = int64_t(tokenizer.vocab_size());
      f.context_len = o->max_model_len > 0 ? o->max_model_len : 4096;
      f.round_delay = std::chrono::milliseconds(o->fake_delay_ms);
      f.load_delay = std::chrono::milliseconds(o->fake_load_ms);
      auto e = std::make_unique<server::LoopEngine>(std::make_unique<server::FakeBackend>(f),
          server::LoopEngineOptions{o->max_model_len, o->max_num_seqs, o->max_queue, o->block_size > 0 ? o->block_size : 16});
      wait_loaded = [p = e.get()] { return p->wait_loaded(); };
      load_error = [p = e.get()] { return p->load_error(); };
      capacity = [] { return std::string("fake engine: random tokens, no model"); };
      engine = std::move(e);
    } else {
      server::PagedEngineOptions p;
      p.model_dir = o->model;
      p.max_model_len = o->max_model_len;
      p.max_queue = o->max_queue;
      runtime::EngineConfig& ec = p.engine;
      // Bad dtype or size spellings fail here, before anything listens.
      ec.formats.latent = cache::parse_latent_format(o->kv_cache_dtype);
      ec.formats.index_keys = cache::parse_index_key_format(o->index_cache_dtype);
      ec.formats.kda_state = cache::parse_kda_state_dtype(o->kda_state_dtype);
      if (o->block_size > 0) ec.formats.block_size = o->block_size;
      if (o->device == "cuda") {
        // The weights go up on the loader thread; the budget then comes from the device's memory.
        if (!o->memory_budget.empty()) ec.memory_budget = parse_bytes(o->memory_budget);
        p.device_setup = cuda_device_setup(o->gpu_memory_utilization, !o->no_cuda_graphs, o->quantization);
      } else {
        if (o->quantization != "bf16") fail("--quantization {} needs --device cuda", o->quantization);
        ec.memory_budget = memory_budget_from_flags(o->memory_budget, o->gpu_memory_utilization, o->model, ec.memory_budget);
      }
      ec.max_running = o->max_num_seqs;
      ec.max_num_batched_tokens = o->max_batched_tokens;
      ec.enable_prefix_cache = !o->no_prefix_cache;
      auto e = std::make_unique<server::PagedEngine>(p);
      wait_loaded = [e = e.get()] { return e->wait_loaded(); };
      load_error = [e = e.get()] { return e->load_error(); };
      capacity = [e = e.get(), o] {
        const sched::MemoryPlan& m = e->memory_plan();
        return fmt::format("capacity: {} tokens of KV cache ({} pages of {}; {} latent, {} index keys), {} concurrent "
                           "requests, longest single request {} tokens",
                           m.token_capacity, m.num_pages, m.layout.block_size, o->kv_cache_dtype, o->index_cache_dtype,
                           m.max_running, m.longest_request);
      };
      engine = std::move(e);
    }

    server::ServerOptions so;
    so.host = o->host;
    so.port = uint16_t(o->port);
    so.api_key = o->api_key;
    so.served_model_name = o->served_name.empty() ? o->model : o->served_name;
    so.max_body_bytes = size_t(o->max_request_bytes);
    so.threads = o->threads;
    so.max_connections = o->max_connections;
    so.shutdown_timeout = std::chrono::seconds(o->shutdown_timeout);
    server::Server srv(so, *engine, tokenizer);
    srv.listen();
    const std::string url = fmt::format("http://{}:{}", o->host.find(':') != std::string::npos ? "[" + o->host + "]" : o->host, srv.port());
    fmt::print("kestrel serve: listening on {} (model '{}', {}); /health answers 200 once loaded\n", url,
               so.served_model_name, o->fake ? "fake engine" : "paged engine");
    std::fflush(stdout);

    std::string load_error_msg;
    std::thread watcher([&] {
      if (wait_loaded()) {
        fmt::print("kestrel serve: model loaded, ready (max_model_len {})\n  {}\n", engine->max_model_len(), capacity());
        fmt::print("try: curl {}/v1/chat/completions -H 'Content-Type: application/json'{} -d '{{\"model\": \"{}\", "
                   "\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 32}}'\n",
                   url, o->api_key.empty() ? "" : " -H \"Authorization: Bearer $KESTREL_API_KEY\"", so.served_model_name);
        std::fflush(stdout);
      } else {
        load_error_msg = load_error();
        srv.shutdown();
      }
    });
    srv.run();
    engine->shutdown();
    watcher.join();
    if (!load_error_msg.empty()) fail("{}", load_error_msg);
    fmt::print("kestrel serve: shut down\n");
  });
}

}  // namespace kestrel::cli
