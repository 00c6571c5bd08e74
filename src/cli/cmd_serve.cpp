// `kestrel serve`: the OpenAI-compatible HTTP server (src/server) over the engine.
//
//   kestrel serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key K] [--served-model-name NAME]
//                 [--max-queue N] [--log-level info] [--disable-access-log] [--allowed-origins O ...]
//                 [--limit-mm-per-prompt '{"image": N}'] [--max-image-pixels N] [--max-image-bytes-per-request N]
//                 [--allowed-local-media-path DIR] [--mm-in-patch-limit N] [--mm-patch-limit-on-one-side N]
//                 [engine flags: cli/engine_flags.h] [--fake-engine ...]
//
// Without --model the embedded k3-tiny is served (found next to the binary or under its install
// prefix; engine_flags.h), as "k3-tiny". Requests may name the model by --served-model-name (the id
// /v1/models reports; default: the --model argument), by the path given, or by the directory's name.
//
// Flags follow `vllm serve` where they mean the same. The server listens at once and answers
// /health with 503 until the engine is loaded (runtime/engine_host.h, off the io threads); then the
// memory plan's capacity is printed next to a curl line. --fake-engine runs the same engine over a
// fake executor (random tokens, config.json only, no weights; its caches are bookkeeping, so its
// default budget is 64 GiB) to measure the HTTP layer alone (bench/serve_connections.py).
// SIGINT/SIGTERM drain running requests (up to --shutdown-timeout seconds) and exit 0.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "core/check.h"
#include "loader/config.h"
#include "runtime/engine_host.h"
#include "server/http_server.h"
#include "server/log.h"
#include "tokenizer/tokenizer.h"
#include "vision/image.h"

namespace kestrel::cli {
namespace {

struct ServeOpts {
  EngineFlags engine;
  std::string host = "127.0.0.1", api_key, served_name;
  int port = 8000, max_queue = 256, threads = 1, shutdown_timeout = 10, max_connections = 16384;
  int64_t max_request_bytes = 8 << 20;
  std::string log_level = "info";
  bool no_access_log = false;
  std::vector<std::string> allowed_origins;
  bool fake = false, debug_routes = false;
  int fake_delay_ms = 0, fake_load_ms = 0, fake_step_us = 0;
  double fake_token_us = 0.0;
  server::StructuredOptions structured;
  bool no_complete_within_max_tokens = false;
  // Image input (server/media.h).
  std::string limit_mm = "{\"image\": 16}", allowed_local_media_path;
  int64_t max_image_pixels = 50'000'000, max_image_bytes = int64_t(32) << 20;
  int64_t in_patch_limit = 0;  // 0: preprocessor_config.json's, else the default
  int patch_limit_on_one_side = 0;
};

// The names a request may use for the model besides the served name: the path given and the
// directory's name.
std::vector<std::string> model_aliases(const std::string& given) {
  std::vector<std::string> out = {given};
  std::string trimmed = given;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::string base = std::filesystem::path(trimmed).filename().string();
  if (!base.empty() && base != given) out.push_back(base);
  std::error_code ec;
  const std::string abs = std::filesystem::weakly_canonical(given, ec).string();
  if (!ec && !abs.empty() && abs != given) out.push_back(abs);
  return out;
}

void serve(ServeOpts& o) {
  if (o.api_key.empty())
    if (const char* k = std::getenv("KESTREL_API_KEY")) o.api_key = k;
  server::log::set_level(server::log::parse_level(o.log_level));
  server::log::set_access_log(!o.no_access_log);
  o.engine.resolve_model();
  const tok::Tokenizer tokenizer = tok::Tokenizer::load(o.engine.model);

  server::MediaOptions media;
  // Images (before loading, so a bad flag fails at once): the checkpoint has a vision tower when its config.json has a vision_config.
  media.vision = load_config(o.engine.model).vision.present;
  media.max_images = server::parse_limit_mm_per_prompt(o.limit_mm);
  media.max_image_bytes = o.max_image_bytes;
  media.decode.max_pixels = o.max_image_pixels;
  media.preprocess = vision::load_preprocess_config(o.engine.model);
  if (o.in_patch_limit > 0) media.preprocess.in_patch_limit = o.in_patch_limit;
  if (o.patch_limit_on_one_side > 0) media.preprocess.patch_limit_on_one_side = o.patch_limit_on_one_side;
  if (!o.allowed_local_media_path.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_directory(o.allowed_local_media_path, ec))
      fail("--allowed-local-media-path: '{}' is not a directory", o.allowed_local_media_path);
    media.allowed_local_media_path = o.allowed_local_media_path;
  }
  runtime::EngineOptions eo = o.engine.options(16);  // bad dtype or size spellings fail here, before listening
  eo.engine.max_queue = o.max_queue;
  eo.tokenizer = &tokenizer;
  if (o.fake) {
    eo.fake = true;
    eo.fake_executor.step_delay = std::chrono::milliseconds(o.fake_delay_ms);
    eo.fake_executor.device_step = std::chrono::microseconds(o.fake_step_us);
    eo.fake_executor.device_token = std::chrono::nanoseconds(std::llround(o.fake_token_us * 1000.0));
    eo.fake_load_delay = std::chrono::milliseconds(o.fake_load_ms);
    if (!eo.memory_budget && eo.gpu_memory_utilization == 0.0) eo.memory_budget = int64_t(64) << 30;
  }
  if (runtime::run_mpi_rank(eo)) return;  // under mpirun: ranks > 0 executed rank 0's steps (executor_mpi.h)
  runtime::EngineHost engine(eo);

  server::ServerOptions so;
  so.host = o.host;
  so.port = uint16_t(o.port);
  so.api_key = o.api_key;
  // The embedded default is served under its directory's name; a given path as given (vLLM).
  so.served_model_name = !o.served_name.empty() ? o.served_name
                         : o.engine.model_given ? o.engine.model
                                                : std::filesystem::path(o.engine.model).filename().string();
  so.model_aliases = model_aliases(o.engine.model);
  so.allowed_origins = o.allowed_origins;
  so.max_body_bytes = size_t(o.max_request_bytes);
  so.threads = o.threads;
  so.max_connections = o.max_connections;
  so.shutdown_timeout = std::chrono::seconds(o.shutdown_timeout);
  so.structured = o.structured;
  so.structured.complete_within_max_tokens = !o.no_complete_within_max_tokens;
  so.debug_routes = o.debug_routes;
  so.media = std::move(media);
  server::Server srv(so, engine, tokenizer);
  srv.listen();
  const std::string url = fmt::format("http://{}:{}", o.host.find(':') != std::string::npos ? "[" + o.host + "]" : o.host, srv.port());
  fmt::print("kestrel serve: listening on {} (model '{}', {}); /health answers 200 once loaded\n", url,
             so.served_model_name, o.fake ? "fake engine" : "paged engine");
  std::fflush(stdout);

  std::string load_error;
  std::thread watcher([&] {
    if (engine.wait_loaded()) {
      const sched::MemoryPlan& m = engine.engine().memory_plan();
      const std::string capacity =
          o.fake ? std::string("fake engine: random tokens, no model")
                 : fmt::format("capacity: {} tokens of KV cache ({} pages of {}; {} latent, {} index keys), {} "
                               "concurrent requests, longest single request {} tokens",
                               m.token_capacity, m.num_pages, m.block_size, o.engine.kv_cache_dtype,
                               o.engine.index_cache_dtype, m.max_running, m.longest_request);
      fmt::print("kestrel serve: model loaded, ready (max_model_len {})\n  {}\nchat in a browser: {}/\n",
                 engine.max_model_len(), capacity, url);
      fmt::print("try: curl {}/v1/chat/completions -H 'Content-Type: application/json'{} -d '{{\"model\": \"{}\", "
                 "\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 32}}'\n",
                 url, o.api_key.empty() ? "" : " -H \"Authorization: Bearer $KESTREL_API_KEY\"", so.served_model_name);
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
}

}  // namespace

void register_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOpts>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server");
  o->engine.add_to(*cmd);
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "TCP port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o->api_key, "require Authorization: Bearer KEY (default: $KESTREL_API_KEY)");
  cmd->add_option("--served-model-name", o->served_name, "model id in the API (default: the --model argument)");
  cmd->add_option("--max-queue", o->max_queue, "requests waiting beyond those running; more are answered 429")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--max-request-bytes", o->max_request_bytes, "largest request body (413 beyond)")
      ->check(CLI::Range(int64_t(1024), int64_t(1) << 32));
  cmd->add_option("--max-connections", o->max_connections, "open connections; more are answered 503")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--http-threads", o->threads, "io threads")->check(CLI::Range(1, 64));
  cmd->add_option("--shutdown-timeout", o->shutdown_timeout, "seconds running requests get on SIGTERM")
      ->check(CLI::Range(0, 3600));
  cmd->add_flag("--debug-routes", o->debug_routes,
                "GET /debug/integrity: check the engine's page/slot/prefix-cache bookkeeping (soak tests; not for production)");
  cmd->add_option("--log-level", o->log_level, "least severe log line written: debug, info, warning, error")
      ->check(CLI::IsMember({"debug", "info", "warning", "warn", "error"}));
  cmd->add_flag("--disable-access-log", o->no_access_log, "no access-log line per request (5xx answers are still logged)");
  cmd->add_option("--allowed-origins", o->allowed_origins,
                  "CORS: origins whose pages may call the API ('*': any), e.g. --allowed-origins http://localhost:3000")
      ->delimiter(',');
  // Structured outputs (response_format, tools): limits that bound what one schema can cost.
  auto& lim = o->structured.limits;
  cmd->add_option("--grammar-compile-timeout", lim.max_compile_seconds,
                  "seconds one response_format/tools grammar may take to compile (400 beyond)")
      ->check(CLI::Range(0.01, 3600.0));
  cmd->add_option("--grammar-max-states", lim.max_states, "automaton states of one grammar (400 beyond)")
      ->check(CLI::Range(size_t(1000), size_t(1) << 26));
  cmd->add_option("--grammar-max-nfa-nodes", lim.max_nfa_nodes, "builder nodes of one grammar, the memory bound (400 beyond)")
      ->check(CLI::Range(size_t(1000), size_t(1) << 28));
  cmd->add_option("--grammar-max-enum", lim.max_enum_values, "values of one enum (400 beyond)")
      ->check(CLI::Range(size_t(1), size_t(1) << 24));
  cmd->add_option("--grammar-max-nesting", lim.max_stack_depth, "nesting of generated values (arrays, objects, $ref)")
      ->check(CLI::Range(4u, 4096u));
  cmd->add_option("--grammar-cache-size", o->structured.cache_entries, "compiled grammars kept")
      ->check(CLI::Range(size_t(1), size_t(1) << 20));
  cmd->add_option("--grammar-threads", o->structured.compile_threads, "threads compiling grammars")
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--no-complete-within-max-tokens", o->no_complete_within_max_tokens,
                "json_object/json_schema answers may be cut by max_tokens (finish length) instead of being kept "
                "completable within it (docs/structured-outputs.md; a request's complete_within_max_tokens overrides)");
  // Image input (docs/serving.md "Image input").
  cmd->add_option("--limit-mm-per-prompt", o->limit_mm,
                  "images per request, vLLM's form '{\"image\": N}' (or image=N); other modalities only as 0 (default 16)");
  cmd->add_option("--max-image-pixels", o->max_image_pixels,
                  "width x height of one image, checked from its header before decoding (400 beyond)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 32));
  cmd->add_option("--max-image-bytes-per-request", o->max_image_bytes, "encoded image bytes of one request, summed (400 beyond)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 34));
  cmd->add_option("--allowed-local-media-path", o->allowed_local_media_path,
                  "image parts may name files (file:// or a path) under this directory; off by default");
  cmd->add_option("--mm-in-patch-limit", o->in_patch_limit,
                  "resize rule: 14-px patches per image (default: preprocessor_config.json's, else 16384)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  cmd->add_option("--mm-patch-limit-on-one-side", o->patch_limit_on_one_side,
                  "resize rule: patches along one side (default: preprocessor_config.json's, else 512)")
      ->check(CLI::Range(1, 4096));
  cmd->add_flag("--fake-engine", o->fake, "no weights: random tokens (tests and HTTP benchmarks)");
  cmd->add_option("--fake-delay-ms", o->fake_delay_ms, "fake engine: pause per engine step")->check(CLI::Range(0, 60000));
  cmd->add_option("--fake-step-us", o->fake_step_us,
                  "fake engine: model a device taking this many µs a step, waited for only when the tokens are "
                  "needed (with --async-scheduling, behind the next step: the engine's host share per step shows)")
      ->check(CLI::Range(0, 10000000));
  cmd->add_option("--fake-token-us", o->fake_token_us,
                  "fake engine, with --fake-step-us: the modelled device's time per token of a step on top (prefill "
                  "chunks cost what they would)")
      ->check(CLI::Range(0.0, 10000.0));
  cmd->add_option("--fake-load-ms", o->fake_load_ms, "fake engine: pretend loading takes this long")->check(CLI::Range(0, 600000));
  cmd->callback([o] { serve(*o); });
}

}  // namespace kestrel::cli
