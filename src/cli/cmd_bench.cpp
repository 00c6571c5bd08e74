// `kestrel bench`: serving benchmark against any OpenAI-compatible server (ours or vLLM's).
//
//   kestrel bench --base-url http://127.0.0.1:8000 [--endpoint /v1/completions|/v1/chat/completions]
//                 [--model NAME] [--tokenizer DIR] [--dataset random|custom [--dataset-path FILE.jsonl]]
//                 [--preset 8k-1k|128k-100]
//                 [--input-len N --output-len N --range-ratio R] [--num-prompts N]
//                 [--max-concurrency C] [--request-rate R|inf] [--burstiness B] [--seed S]
//                 [--num-warmups N] [--ignore-eos] [--api-key K] [--result-file out.json]
//                 [--save-detailed] [--metric-percentiles 50,90,99] [--no-progress]
//   kestrel bench --cpu-ceilings [--tokenizer CKPT_DIR [--input-len L]]
//
// --cpu-ceilings measures this machine instead (kernels/cpu/cpu_ceilings.h: STREAM copy, the engine's
// bf16 GEMM and OpenBLAS sgemm, with every core) and, given a checkpoint, the bytes one decode step
// of one sequence reads at context L (weights: all but the embedding table, routed experts × top-k /
// experts; caches: the selected latent rows, every index key, the KDA states) and so the step's floor,
// bytes ÷ copy rate.
//
//   kestrel bench --soak ROUNDS [--server-pid PID] [--soak-drop F] [--soak-prefix-len N] ... (benchclient/soak.h)
//
// Flags, metrics, the printed table and the JSON keys follow `vllm bench serve`, so the two clients'
// numbers can be set side by side (src/benchclient/stats.h has the definitions). Like vLLM's, it
// first sends one test request (retried until --ready-check-timeout; 0 skips it), then the warm-ups,
// then the measured run. Failed requests are counted and reported; if every request fails the
// command exits 1 after writing its report.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "benchclient/client.h"
#include "benchclient/dataset.h"
#include "benchclient/report.h"
#include "benchclient/soak.h"
#include "benchclient/stats.h"
#include "cli/commands.h"
#include "core/cache_format.h"
#include "core/check.h"
#include "kernels/cpu/cpu_ceilings.h"
#include "loader/config.h"
#include "loader/weights.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {

namespace {

struct Preset {
  const char* name;
  int input_len, output_len;
};
// 128k-100 is 128,000 tokens, not 131,072, so prompt + output fits a 128Ki-token context.
constexpr Preset kPresets[] = {{"8k-1k", 8192, 1024}, {"128k-100", 128000, 100}};

double parse_rate(const std::string& s) {
  if (s == "inf" || s == "Inf" || s == "infinity") return INFINITY;
  size_t used = 0;
  double r = 0;
  try {
    r = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || !(r > 0)) fail("--request-rate must be a positive number or 'inf' (got '{}')", s);
  return r;
}

std::vector<double> parse_percentiles(const std::string& s) {
  std::vector<double> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    size_t used = 0;
    double p = -1;
    try {
      p = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || p < 0 || p > 100)
      fail("--metric-percentiles: '{}' is not a percentile in [0, 100]", item);
    out.push_back(p);
  }
  if (out.empty()) fail("--metric-percentiles: no percentile given");
  return out;
}

bool is_tokenizer_dir(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(std::filesystem::path(dir) / "tiktoken.model", ec);
}

// Bytes one decode step of one sequence reads at context L (BF16 caches), see the header.
double decode_step_bytes(const ModelConfig& cfg, int64_t L) {
  const TextConfig& t = cfg.text;
  double bytes = 0;
  for (const TensorSpec& s : expected_tensors(cfg)) {
    const double b = double(s.shape.numel()) * double(dtype_size(s.dtype));
    switch (s.module) {
      case Module::embedding: bytes += double(t.hidden_size) * 2; break;  // one row
      case Module::routed_experts: bytes += b * double(t.num_experts_per_token) / double(t.num_experts); break;
      case Module::vision: break;
      default: bytes += b;
    }
  }
  for (int layer = 0; layer < t.num_hidden_layers; ++layer) {
    if (t.attn_kind[size_t(layer)] == AttnKind::kda) {
      const double HD = double(t.kda.num_heads) * t.kda.head_dim;
      bytes += HD * t.kda.head_dim * 4 + 3.0 * (t.kda.conv_size - 1) * HD * 2;
    } else {
      const int64_t keys = t.has_indexer() ? std::min<int64_t>(L, t.index_topk) : L;
      bytes += double(keys) * double(latent_token_bytes(LatentFormat::bf16, t.kv_lora_rank, t.qk_rope_head_dim));
      if (t.has_indexer() && L > t.index_topk)
        bytes += double(L) * double(index_key_token_bytes(IndexKeyFormat::bf16, t.index_head_dim));
    }
  }
  return bytes;
}

void print_cpu_ceilings(const std::string& ckpt, int64_t context) {
  const cpu::CpuCeilings c = cpu::measure_cpu_ceilings();
  fmt::print("CPU ceilings ({} threads, {} kernels; best of repeats):\n", c.threads, c.isa);
  fmt::print("  STREAM copy, 64 MiB arrays:      {:8.1f} GB/s (read + write)\n", c.copy_gbs);
  fmt::print("  copy, 1 MiB per thread (cache):  {:8.1f} GB/s\n", c.copy_l2_gbs);
  fmt::print("  bf16 GEMM 1024^3 (engine):       {:8.1f} GFLOP/s\n", c.gemm_gflops);
  fmt::print("  OpenBLAS sgemm 1024^3 (f32):     {:8.1f} GFLOP/s\n", c.sgemm_gflops);
  if (ckpt.empty()) return;
  const ModelConfig cfg = load_config((std::filesystem::path(ckpt) / "config.json").string());
  const double b = decode_step_bytes(cfg, context);
  fmt::print("  decode step of one sequence at context {}: {:.2f} MB read; floor {:.3f} ms at the STREAM copy rate "
             "({:.3f} ms at the cache copy rate)\n",
             context, b / 1e6, b / (c.copy_gbs * 1e9) * 1e3, b / (c.copy_l2_gbs * 1e9) * 1e3);
}

struct BenchOpts {
  std::string base_url = "http://127.0.0.1:8000", endpoint = "/v1/completions", model, tokenizer,
              dataset = "random", dataset_path, preset, api_key, result_file, rate = "inf", label, percentiles = "99";
  int input_len = 1024, output_len = 128, num_prompts = 1000, max_concurrency = 0, num_warmups = 0;
  double range_ratio = 0, burstiness = 1, timeout = 600, ready_timeout = 60;
  uint64_t seed = 0;
  bool ignore_eos = false, no_progress = false, detailed = false, cpu_ceilings = false;
  bench::SoakOptions soak;
  double soak_max_rss = -1, soak_max_gpu = -1, soak_max_heap = -1;
};

// --soak: the rounds, a row printed as each is sampled, the summary, the JSON; exit 1 on a failed check.
void soak(BenchOpts& o, const bench::ClientOptions& co, const tok::Tokenizer* tok) {
  using namespace kestrel::bench;
  SoakOptions so = o.soak;
  so.dataset = RandomDatasetOptions{o.num_prompts, o.input_len, o.output_len, o.range_ratio, o.seed};
  so.max_concurrency = o.max_concurrency;
  if (o.soak_max_rss >= 0) so.max_rss_growth_mb = o.soak_max_rss;
  if (o.soak_max_gpu >= 0) so.max_gpu_growth_mib = o.soak_max_gpu;
  if (o.soak_max_heap >= 0) so.max_heap_bytes_per_request = o.soak_max_heap;
  fmt::print("Soak: {} rounds of {} streams ({} at a time), {:.0f}% of clients leaving early{}\n", so.rounds,
             o.num_prompts, o.max_concurrency > 0 ? std::to_string(o.max_concurrency) : std::string("all"),
             100 * so.drop_fraction,
             so.server_pid ? fmt::format("; server pid {}", so.server_pid) : std::string("; no --server-pid: no memory"));
  fmt::print("{}\n", soak_table_header());
  std::fflush(stdout);
  const std::vector<SoakRound> rounds = run_soak(so, co, tok, [](const SoakRound& r) {
    fmt::print("{}\n", soak_table_row(r));
    std::fflush(stdout);
  });
  const SoakSummary sum = summarize(rounds, so);
  fmt::print("{}\n", sum.verdict);
  for (const SoakRound& r : rounds)
    if (!r.first_error.empty()) fmt::print(stderr, "round {}: {} failed; first error: {}\n", r.round, r.failed, r.first_error);
  if (!o.result_file.empty()) {
    std::ofstream f(o.result_file);
    if (!f) fail("cannot write --result-file {}", o.result_file);
    f << soak_json(rounds, sum, so, co).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    if (!f) fail("error writing --result-file {}", o.result_file);
    fmt::print("results written to {}\n", o.result_file);
  }
  if (!sum.ok) fail("soak check failed");
}

}  // namespace

void register_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOpts>();
  CLI::App* cmd = app.add_subcommand("bench", "serving benchmark against an OpenAI-compatible server (as `vllm bench serve`)");
  cmd->add_option("--base-url", o->base_url, "server URL, http://HOST:PORT[/PREFIX]");
  cmd->add_option("--endpoint", o->endpoint, "/v1/completions or /v1/chat/completions");
  cmd->add_option("--model", o->model, "model name sent in requests (default: the server's first in /v1/models)");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "checkpoint/tokenizer directory: exact prompt lengths and token counts (default: --model if it is one)");
  cmd->add_option("--dataset", o->dataset,
                  "random (prompts of --input-len random tokens) or custom (--dataset-path: JSONL lines with \"prompt\", "
                  "\"messages\" or a kestrel eval set's \"request\")");
  cmd->add_option("--dataset-path", o->dataset_path, "the custom dataset's JSONL file");
  cmd->add_option("--preset", o->preset, "input/output lengths: 8k-1k (8192/1024) or 128k-100 (128000/100)");
  cmd->add_option("--input-len", o->input_len, "prompt tokens (random dataset)")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--output-len", o->output_len, "max_tokens per request")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--range-ratio", o->range_ratio, "lengths uniform in [L(1-R), L(1+R)], 0 <= R < 1");
  cmd->add_option("--num-prompts", o->num_prompts, "requests in the measured run")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--max-concurrency", o->max_concurrency, "requests in flight at most (0: no limit)")
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--request-rate", o->rate, "arrivals per second, Poisson (with --burstiness 1), or 'inf': all at once");
  cmd->add_option("--burstiness", o->burstiness, "gamma shape of the arrival gaps (1: Poisson; < 1 burstier)");
  cmd->add_option("--seed", o->seed, "seed for prompts, lengths and arrival times");
  cmd->add_option("--num-warmups", o->num_warmups, "unmeasured requests first")->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--ignore-eos", o->ignore_eos, "ask the server to generate all --output-len tokens (vLLM's ignore_eos)");
  cmd->add_option("--api-key", o->api_key, "Authorization: Bearer KEY (default: $OPENAI_API_KEY)");
  cmd->add_option("--result-file", o->result_file, "write the results as JSON (vLLM's keys)");
  cmd->add_flag("--save-detailed", o->detailed, "per-request arrays in the JSON too (ttfts, itls, texts, errors)");
  cmd->add_option("--metric-percentiles", o->percentiles, "comma-separated percentiles to report");
  cmd->add_option("--label", o->label, "label recorded in the JSON");
  cmd->add_option("--timeout", o->timeout, "seconds without data from the server that fail a request");
  cmd->add_option("--ready-check-timeout", o->ready_timeout, "seconds to retry the initial test request (0: skip it)");
  cmd->add_flag("--no-progress", o->no_progress, "no progress bar on stderr");
  cmd->add_flag("--cpu-ceilings", o->cpu_ceilings,
                "measure this machine (copy rate, GEMM rate) instead; with --tokenizer CKPT also a decode step's "
                "bytes at context --input-len and its floor");
  // Soak mode (benchclient/soak.h): rounds of --num-prompts streams with disconnects, memory per round.
  cmd->add_option("--soak", o->soak.rounds, "soak: ROUNDS of --num-prompts concurrent streams with random disconnects, "
                                            "printing the server's memory and gauges after each")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--server-pid", o->soak.server_pid, "soak: the server's pid (RSS from /proc, GPU memory from nvidia-smi)")
      ->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--soak-drop", o->soak.drop_fraction, "soak: fraction of clients that disconnect early (default 0.3)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--soak-queued-share", o->soak.queued_share,
                  "soak: share of the drops made soon after the response head, while likely queued (default 0.5)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--soak-queued-drop-ms", o->soak.queued_drop_ms, "soak: such a drop comes within this long (default 200)")
      ->check(CLI::Range(0, 3600000));
  cmd->add_option("--soak-prefix-len", o->soak.shared_prefix_len,
                  "soak: every prompt starts with one of --soak-prefix-groups shared prefixes of this many tokens")
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--soak-prefix-groups", o->soak.shared_prefix_groups, "soak: distinct shared prefixes (default 4)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--soak-settle", o->soak.settle_s, "soak: seconds between the drain and the sample (default 2)")
      ->check(CLI::Range(0.0, 3600.0));
  cmd->add_option("--soak-drain-timeout", o->soak.drain_timeout_s, "soak: seconds to wait for running = waiting = 0")
      ->check(CLI::Range(0.0, 86400.0));
  cmd->add_option("--soak-baseline-round", o->soak.baseline_round, "soak: growth is measured from after this round (default 2)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--soak-max-rss-growth", o->soak_max_rss, "soak: exit 1 if RSS grows more (MB) from the baseline round to the last")
      ->check(CLI::Range(0.0, 1e12));
  cmd->add_option("--soak-max-gpu-growth", o->soak_max_gpu, "soak: exit 1 if GPU memory grows more (MiB) likewise")
      ->check(CLI::Range(0.0, 1e12));
  cmd->add_option("--soak-max-heap-growth", o->soak_max_heap,
                  "soak: exit 1 if the server's heap (/debug/integrity's heap_bytes) grows more from the baseline round "
                  "to the last than this many bytes per request sent after the baseline")
      ->check(CLI::Range(0.0, 1e12));
  cmd->callback([o, cmd] {
    using namespace kestrel::bench;
    if (o->cpu_ceilings) return print_cpu_ceilings(o->tokenizer, o->input_len);
    if (o->dataset != "random" && o->dataset != "custom") fail("--dataset {}: expected random or custom", o->dataset);
    if (o->dataset == "random" && !o->dataset_path.empty()) fail("--dataset-path needs --dataset custom");
    if (o->dataset == "custom" && cmd->count("--soak")) fail("--soak runs on the random dataset only");
    if (!o->preset.empty()) {
      const Preset* p = nullptr;
      for (const auto& x : kPresets)
        if (o->preset == x.name) p = &x;
      if (!p) fail("--preset {}: expected 8k-1k or 128k-100", o->preset);
      // Explicit lengths win over the preset's.
      if (cmd->count("--input-len") == 0) o->input_len = p->input_len;
      if (cmd->count("--output-len") == 0) o->output_len = p->output_len;
    }
    ClientOptions co;
    co.base = parse_url(o->base_url);
    if (o->endpoint.empty() || o->endpoint[0] != '/') fail("--endpoint must start with '/' (got '{}')", o->endpoint);
    co.endpoint = o->endpoint;
    const bool chat = o->endpoint.size() >= 16 && o->endpoint.ends_with("chat/completions");
    if (!chat && !o->endpoint.ends_with("completions"))
      fail("--endpoint {}: expected /v1/completions or /v1/chat/completions", o->endpoint);
    co.api = chat ? Api::kChat : Api::kCompletions;
    co.api_key = o->api_key;
    if (co.api_key.empty())
      if (const char* k = std::getenv("OPENAI_API_KEY")) co.api_key = k;
    co.ignore_eos = o->ignore_eos;
    co.timeout_s = o->timeout;
    const double rate = parse_rate(o->rate);
    const std::vector<double> percentiles = parse_percentiles(o->percentiles);

    std::optional<tok::Tokenizer> tokenizer;
    auto load_tokenizer = [&](const std::string& dir) {
      tokenizer.emplace(tok::Tokenizer::load(dir));
      o->tokenizer = dir;
    };
    if (!o->tokenizer.empty()) load_tokenizer(o->tokenizer);

    // The model name only matters to the server; fetching it needs no tokenizer yet.
    std::unique_ptr<Client> client;
    client = std::make_unique<Client>(co, nullptr);
    if (o->model.empty()) {
      o->model = client->first_model();
      fmt::print("model: {} (from /v1/models)\n", o->model);
    }
    if (!tokenizer && is_tokenizer_dir(o->model)) load_tokenizer(o->model);
    if (!tokenizer)
      fmt::print(stderr, "warning: no --tokenizer: prompts are random words of about {} tokens, and output tokens "
                         "are counted from the server's usage or the stream's chunks\n", o->input_len);
    co.model = o->model;
    client = std::make_unique<Client>(co, tokenizer ? &*tokenizer : nullptr);

    RandomDatasetOptions dopt{o->num_prompts, o->input_len, o->output_len, o->range_ratio, o->seed};
    const std::vector<SampleRequest> requests =
        o->dataset == "custom"
            ? custom_dataset({o->dataset_path, o->num_prompts, o->output_len, o->seed}, tokenizer ? &*tokenizer : nullptr)
            : random_dataset(dopt, tokenizer ? &*tokenizer : nullptr);
    if (!chat)
      for (const SampleRequest& r : requests)
        if (!r.messages.empty())
          fail("--dataset-path {}: lines with \"messages\" need --endpoint /v1/chat/completions", o->dataset_path);
    // The readiness probe and the warm-ups use prompts of their own (another seed): a measured
    // prompt sent before the run would be served from the prefix cache in it.
    RandomDatasetOptions wopt = dopt;
    wopt.num_prompts = o->num_warmups + 1;  // the warm-ups, then the probe's
    wopt.seed = o->seed ^ 0x77a4c0ffee5eedull;
    const std::vector<SampleRequest> warmups = random_dataset(wopt, tokenizer ? &*tokenizer : nullptr);

    Schedule sched;
    sched.request_rate = rate;
    sched.burstiness = o->burstiness;
    sched.max_concurrency = o->max_concurrency;
    sched.seed = o->seed;

    if (o->ready_timeout > 0) {
      fmt::print("Starting initial single prompt test run...\n");
      std::fflush(stdout);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(o->ready_timeout);
      for (;;) {
        const auto out = client->run({warmups.back()}, Schedule{}, nullptr, nullptr);
        if (out[0].success) break;
        if (std::chrono::steady_clock::now() >= deadline)
          fail("initial test request to {}{} failed: {} (check --base-url, --endpoint and --model)", o->base_url,
               o->endpoint, out[0].error);
        std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      fmt::print("Initial test run completed.\n");
    }
    if (cmd->count("--soak")) return soak(*o, co, tokenizer ? &*tokenizer : nullptr);
    if (o->num_warmups > 0) {
      fmt::print("Warming up with {} requests...\n", o->num_warmups);
      std::fflush(stdout);
      Schedule ws;
      ws.max_concurrency = o->max_concurrency;
      const auto out = client->run(std::vector<SampleRequest>(warmups.begin(), warmups.end() - 1), ws, nullptr, nullptr);
      int failed = 0;
      for (const auto& r : out) failed += !r.success;
      fmt::print("Warmup run completed{}.\n", failed ? fmt::format(" ({} of {} failed)", failed, out.size()) : "");
    }

    fmt::print("Starting main benchmark run...\n");
    fmt::print("Traffic request rate: {}\n", std::isfinite(rate) ? fmt::format("{}", rate) : "inf");
    // Printed as Python prints the float (1.0, 0.25), like vLLM.
    fmt::print("Burstiness factor: {} ({})\n",
               o->burstiness == std::floor(o->burstiness) ? fmt::format("{:.1f}", o->burstiness) : fmt::format("{}", o->burstiness), o->burstiness == 1 ? "Poisson process" : "Gamma distribution");
    fmt::print("Maximum request concurrency: {}\n", o->max_concurrency > 0 ? std::to_string(o->max_concurrency) : "None");
    std::fflush(stdout);
    ProgressBar bar(int(requests.size()), !o->no_progress);
    double duration = 0;
    // The server's speculative-decoding counters around the run (vLLM's client does the same).
    auto spec_counters = [&]() -> std::optional<SpecDecodeCounters> {
      const HttpReply r = client->get("/metrics");
      return r.status == 200 ? parse_spec_decode_metrics(r.body) : std::nullopt;
    };
    const auto spec_before = spec_counters();
    const auto outputs = client->run(requests, sched, [&](int done, int) { bar.update(done); }, &duration);
    bar.finish();

    Metrics m = compute_metrics(outputs, duration, percentiles);
    // A server without speculation reports zeros: no section then.
    if (const auto spec_after = spec_before ? spec_counters() : std::nullopt; spec_after && spec_after->drafts > 0) {
      SpecDecodeCounters d;
      d.drafts = spec_after->drafts - spec_before->drafts;
      d.draft_tokens = spec_after->draft_tokens - spec_before->draft_tokens;
      d.accepted_tokens = spec_after->accepted_tokens - spec_before->accepted_tokens;
      m.spec = d;
    }
    RunInfo info;
    info.endpoint_type = chat ? "openai-chat" : "openai";
    info.label = o->label;
    info.model_id = o->model;
    info.tokenizer_id = o->tokenizer;
    info.base_url = o->base_url;
    info.endpoint = o->endpoint;
    info.num_prompts = o->num_prompts;
    info.max_concurrency = o->max_concurrency;
    info.num_warmups = o->num_warmups;
    info.request_rate = rate;
    info.burstiness = o->burstiness;
    info.input_len = o->input_len;
    info.output_len = o->output_len;
    info.range_ratio = o->range_ratio;
    info.seed = o->seed;
    info.ignore_eos = o->ignore_eos;
    info.percentiles = percentiles;
    fmt::print("{}\n", format_table(m, info));
    std::fflush(stdout);

    if (m.failed > 0) {
      fmt::print(stderr, "{} of {} requests failed; first errors:\n", m.failed, outputs.size());
      int shown = 0;
      for (size_t i = 0; i < outputs.size() && shown < 10; ++i)
        if (!outputs[i].success) fmt::print(stderr, "  request {}: {}\n", i, outputs[i].error), ++shown;
    }
    if (!o->result_file.empty()) {
      std::ofstream f(o->result_file);
      if (!f) fail("cannot write --result-file {}", o->result_file);
      f << result_json(m, info, outputs, o->detailed).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
      if (!f) fail("error writing --result-file {}", o->result_file);
      fmt::print("results written to {}\n", o->result_file);
    }
    if (m.completed == 0) fail("all {} requests failed (first error: {})", outputs.size(), outputs[0].error);
  });
}

}  // namespace kestrel::cli
