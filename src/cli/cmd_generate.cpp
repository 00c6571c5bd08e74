// `kestrel generate`: CPU text generation through the serving engine (src/runtime/engine.h): the
// scheduler, paged caches and sampler that a server would use, for checking a checkpoint end to end
// and for small-model benchmarks.
//
//   kestrel generate --model DIR (--prompt-tokens 1,2,3 | --prompt TEXT | --prompts-file FILE)
//                    --max-tokens N [sampling flags] [--memory-budget 2G | --gpu-memory-utilization F]
//                    [--kv-cache-dtype bf16|fp8] [--index-cache-dtype bf16|fp8|mxfp4] [--kda-state-dtype f32|f16] [--dump-logits FILE]
//                    [--device cpu|cuda]
//
// --device cuda (builds with CUDA only) runs the same engine on the GPU executor
// (runtime/executor_cuda.h): weights on the device, paged caches and KDA slots in device memory,
// batched steps; greedy ids are picked on the device. BF16 cache formats only.
//
// Prints the memory plan (capacity in tokens, concurrent requests, longest single request), then
// per request the generated ids (and text when the prompt was text), then throughput. A single
// prompt prints the original lines ("tokens:", "prompt tokens:", "text:", "prefill:", "decode:");
// several prompts (--prompts-file: one per line, text or `ids:1,2,3`; blank lines and lines starting
// with '#' skipped) run concurrently and print "[i] ..." lines plus aggregate throughput.
// Generation stops after N tokens, at eos_token_id (unless --ignore-eos), a --stop-token-id or a
// --stop string.
// --dump-logits (single prompt only) writes every position fed through the model (prompt, then each
// generated token but the last) as a NumPy .npy v1.0 file: magic "\x93NUMPY", version 1 0, u16
// little-endian header length, an ASCII dict {'descr': '<f4', 'fortran_order': False, 'shape':
// (positions, vocab), } padded with spaces and a final '\n' so the data starts at a multiple of 64
// bytes, then the row-major little-endian float32 logits.
//
// Text prompts are encoded with the checkpoint's own tokenizer (tiktoken.model +
// tokenizer_config.json, src/tokenizer) as plain text: special-token text in it stays ordinary text.
// --memory-budget is the byte budget of the KV/state caches; --gpu-memory-utilization F on this CPU
// path means F x physical RAM minus the checkpoint's bytes. Default: 1 GiB. The CPU default cache
// formats are BF16 (the reference); fp8 / mxfp4 run the GPU formats with their measured error.
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <span>
#include <sstream>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/check.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "cache/layout.h"
#include "runtime/engine.h"
#ifdef KESTREL_WITH_CUDA
#include "model/cuda/cuda_model.h"
#include "runtime/executor_cuda.h"
#endif
#include "tokenizer/tokenizer.h"

namespace kestrel::cli {
namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      fail("--prompt-tokens: '{}' is not an integer", item);
    }
    if (used != item.size() || v < 0 || v > INT32_MAX) fail("--prompt-tokens: '{}' is not a token id", item);
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) fail("--prompt-tokens is empty");
  return ids;
}

void write_npy(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols) {
  std::string header = fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", rows, cols);
  const size_t prefix = 10;  // magic(6) + version(2) + header length(2)
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) fail("{}: cannot open for writing", path);
  const uint16_t hl = uint16_t(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {char(hl & 0xFF), char(hl >> 8)};
  out.write(len, 2);
  out.write(header.data(), std::streamsize(header.size()));
  static_assert(std::endian::native == std::endian::little, "npy writer assumes a little-endian host");
  out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size() * sizeof(float)));
  if (!out) fail("{}: write failed", path);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// "512M", "2G", "1.5GiB", "1000000" -> bytes.
int64_t parse_bytes(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    fail("--memory-budget: '{}' is not a size", s);
  }
  std::string unit = s.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (unit.size() == 2 && unit[1] == 'i') unit.pop_back();
  double mul = 1;
  if (unit == "K" || unit == "k") mul = 1024.0;
  else if (unit == "M" || unit == "m") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") mul = 1024.0 * 1024 * 1024;
  else if (!unit.empty()) fail("--memory-budget: unknown unit in '{}' (use K, M or G)", s);
  if (!(v > 0)) fail("--memory-budget must be positive, got '{}'", s);
  return int64_t(v * mul);
}

int64_t checkpoint_bytes(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") n += int64_t(e.file_size());
  return n;
}

int64_t memory_budget_from_flags(const std::string& memory_budget, double gpu_memory_utilization,
                                 const std::string& model_dir, int64_t fallback) {
  if (!memory_budget.empty()) return parse_bytes(memory_budget);
  if (gpu_memory_utilization <= 0.0) return fallback;
  if (gpu_memory_utilization > 1.0) fail("--gpu-memory-utilization must be in (0, 1]");
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  const int64_t budget = int64_t(gpu_memory_utilization * ram) - checkpoint_bytes(model_dir);
  if (budget <= 0) fail("--gpu-memory-utilization {} leaves no memory after the weights", gpu_memory_utilization);
  return budget;
}


DeviceSetup cuda_device_setup(double gpu_memory_utilization, bool cuda_graphs, const std::string& quantization) {
#ifdef KESTREL_WITH_CUDA
  model::CudaModelOptions mo;
  mo.quant = model::parse_weight_quant(quantization);
  return [gpu_memory_utilization, cuda_graphs, mo](const ModelConfig& c, const ModelWeights& w,
                                  runtime::EngineConfig& ec) -> std::shared_ptr<void> {
    auto m = std::make_shared<model::CudaModel>(c, w, mo);
    // Activations of one step (max_num_batched_tokens rows through the widest layer) and cuBLASLt's
    // workspace: a fixed 2 GiB covers the mini and nano shapes with room to spare.
    if (gpu_memory_utilization > 0.0) ec.memory_budget = runtime::cuda_cache_budget(gpu_memory_utilization, int64_t(2) << 30);
    model::CudaModel* mp = m.get();
    const ModelConfig* cp = &c;
    ec.make_executor = [mp, cp, cuda_graphs](const cache::CacheFormats& f, const cache::CacheConfig& cc) {
      return std::unique_ptr<runtime::StepExecutor>(
          std::make_unique<runtime::CudaExecutor>(*mp, *cp, f, cc, runtime::CudaExecutorOptions{cuda_graphs}));
    };
    return m;
  };
#else
  (void)gpu_memory_utilization, (void)cuda_graphs, (void)quantization;
  fail("--device cuda: this kestrel was built without CUDA");
#endif
}

void register_generate(CLI::App& app) {
  struct Opts {
    std::string model, prompt_tokens, prompt, prompts_file, dump_logits, memory_budget;
    std::string kv_cache_dtype = "bf16", index_cache_dtype = "bf16", kda_state_dtype = "f32", device = "cpu";
    std::string quantization = "bf16";
    double gpu_memory_utilization = 0.0;
    int max_tokens = 16, top_k = 0, logprobs = -1, max_running = 0, max_batched_tokens = 2048;
    float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f, repetition_penalty = 1.0f, presence_penalty = 0.0f,
          frequency_penalty = 0.0f;
    uint64_t seed = 0;
    std::vector<std::string> stop;
    std::vector<int32_t> stop_token_ids;
    bool ignore_eos = false, no_prefix_cache = false, quiet = false, no_cuda_graphs = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens through the serving engine (CPU or GPU)");
  cmd->add_option("--model", o->model, "checkpoint directory")->required();
  auto* pt = cmd->add_option("--prompt-tokens", o->prompt_tokens, "comma-separated prompt token ids");
  auto* pr = cmd->add_option("--prompt", o->prompt, "prompt text, encoded with the checkpoint's tokenizer");
  auto* pf = cmd->add_option("--prompts-file", o->prompts_file, "one prompt per line (text, or ids:1,2,3), run at once");
  pt->excludes(pr)->excludes(pf);
  pr->excludes(pf);
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate per request")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", o->temperature, "0 = greedy");
  cmd->add_option("--top-p", o->top_p, "nucleus mass in (0, 1]");
  cmd->add_option("--top-k", o->top_k, "keep the k most likely tokens (0 = off)");
  cmd->add_option("--min-p", o->min_p, "drop tokens below min_p x the top probability");
  cmd->add_option("--repetition-penalty", o->repetition_penalty, "over prompt + output tokens (1 = off)");
  cmd->add_option("--presence-penalty", o->presence_penalty, "subtracted once per output token id seen");
  cmd->add_option("--frequency-penalty", o->frequency_penalty, "subtracted per occurrence in the output");
  cmd->add_option("--seed", o->seed, "sampler seed (request i of a prompts file uses seed + i)");
  cmd->add_option("--stop", o->stop, "stop string (repeatable; needs the tokenizer)");
  cmd->add_option("--stop-token-id", o->stop_token_ids, "stop token id (repeatable)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "do not stop at eos_token_id");
  cmd->add_option("--logprobs", o->logprobs, "print the sampled token's logprob and the N most likely");
  cmd->add_option("--dump-logits", o->dump_logits, "write f32 logits [positions, vocab] as .npy (single prompt)");
  auto* mb = cmd->add_option("--memory-budget", o->memory_budget, "bytes for KV pages + KDA state slots (e.g. 512M, 2G)");
  auto* gu = cmd->add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                             "fraction of memory for weights + caches (CPU: of physical RAM)");
  mb->excludes(gu);
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "MLA latent cache: bf16 | fp8");
  cmd->add_option("--index-cache-dtype", o->index_cache_dtype, "indexer key cache: bf16 | fp8 | mxfp4");
  cmd->add_option("--kda-state-dtype", o->kda_state_dtype, "KDA recurrent state in the state pool: f32 | f16 (half the bytes)");
  cmd->add_option("--max-num-seqs", o->max_running, "concurrent requests (default: prompts, at most 16)");
  cmd->add_option("--max-num-batched-tokens", o->max_batched_tokens, "token budget of one engine step");
  cmd->add_flag("--no-prefix-cache", o->no_prefix_cache, "disable prefix caching");
  cmd->add_flag("--quiet", o->quiet, "print only the summary for several prompts");
  cmd->add_option("--device", o->device, "cpu or cuda (the engine on the GPU executor)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_flag("--no-cuda-graphs", o->no_cuda_graphs, "--device cuda: run decode steps eagerly");
  cmd->add_option("--quantization", o->quantization, "--device cuda: dense projection weights bf16 | ptpc-fp8")
      ->check(CLI::IsMember({"bf16", "ptpc-fp8"}));
  cmd->callback([o] {
    if (int(!o->prompt_tokens.empty()) + int(!o->prompt.empty()) + int(!o->prompts_file.empty()) != 1)
      fail("give exactly one of --prompt-tokens, --prompt or --prompts-file");
    const ModelConfig cfg = load_config(o->model);
    const Checkpoint ckpt(o->model);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;

    // Prompts: (ids, was text).
    std::vector<std::pair<std::vector<int32_t>, bool>> prompts;
    std::optional<tok::Tokenizer> tokenizer;
    auto need_tok = [&]() -> const tok::Tokenizer& {
      if (!tokenizer) tokenizer = tok::Tokenizer::load(o->model);
      return *tokenizer;
    };
    auto encode = [&](const std::string& text, const char* what) {
      std::vector<int32_t> ids;
      for (tok::TokenId id : need_tok().encode(text, /*allow_special=*/false)) ids.push_back(int32_t(id));
      if (ids.empty()) fail("{} encodes to no tokens", what);
      return ids;
    };
    if (!o->prompt.empty()) {
      prompts.push_back({encode(o->prompt, "--prompt"), true});
    } else if (!o->prompt_tokens.empty()) {
      prompts.push_back({parse_ids(o->prompt_tokens), false});
    } else {
      std::ifstream in(o->prompts_file);
      if (!in) fail("{}: cannot open", o->prompts_file);
      std::string line;
      int lineno = 0;
      while (std::getline(in, line)) {
        ++lineno;
        if (line.empty() || line[0] == '#') continue;
        if (line.rfind("ids:", 0) == 0)
          prompts.push_back({parse_ids(line.substr(4)), false});
        else
          prompts.push_back({encode(line, fmt::format("{} line {}", o->prompts_file, lineno).c_str()), true});
      }
      if (prompts.empty()) fail("{}: no prompts", o->prompts_file);
    }
    for (auto& [ids, text] : prompts)
      for (int32_t id : ids)
        if (id >= V) fail("prompt token {} is outside the vocabulary (size {})", id, V);
    if (!o->stop.empty()) need_tok();
    const bool dump = !o->dump_logits.empty();
    if (dump && prompts.size() != 1) fail("--dump-logits works with a single prompt only");
    runtime::EngineConfig ec;
    ec.formats.latent = cache::parse_latent_format(o->kv_cache_dtype);
    ec.formats.index_keys = cache::parse_index_key_format(o->index_cache_dtype);
    ec.formats.kda_state = cache::parse_kda_state_dtype(o->kda_state_dtype);
    ec.max_running = o->max_running > 0 ? o->max_running : int32_t(std::min<size_t>(prompts.size(), 16));
    ec.max_num_batched_tokens = o->max_batched_tokens;
    ec.enable_prefix_cache = !o->no_prefix_cache;
    std::shared_ptr<void> device;  // the GPU model behind --device cuda; outlives the engine
    if (o->device == "cuda") {
      if (!o->memory_budget.empty()) ec.memory_budget = parse_bytes(o->memory_budget);
      device = cuda_device_setup(o->gpu_memory_utilization, !o->no_cuda_graphs, o->quantization)(cfg, w, ec);
    } else {
      if (o->quantization != "bf16") fail("--quantization {} needs --device cuda", o->quantization);
      ec.memory_budget = memory_budget_from_flags(o->memory_budget, o->gpu_memory_utilization, o->model, ec.memory_budget);
    }
    const tok::Tokenizer* tp = tokenizer ? &*tokenizer : nullptr;
    runtime::Engine engine(w, cfg, ec, tp);
    fmt::print("memory plan ({} latent, {} index keys, {} KDA state):\n{}\n", o->kv_cache_dtype, o->index_cache_dtype,
               cache::format_name(ec.formats.kda_state),
               engine.memory_plan().describe());

    struct Result {
      std::vector<int32_t> tokens;
      std::vector<std::string> logprob_lines;
      std::string text;
      runtime::FinishReason reason = runtime::FinishReason::none;
      std::string error;
      double first_token_s = 0, done_s = 0;
    };
    std::vector<Result> results(prompts.size());
    std::vector<float> dumped;  // f32 [positions, V]
    std::mutex mu;
    std::condition_variable cv;
    size_t finished = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < prompts.size(); ++i) {
      runtime::GenerateRequest r;
      r.prompt = prompts[i].first;
      r.max_tokens = o->max_tokens;
      r.sampling.temperature = o->temperature;
      r.sampling.top_p = o->top_p;
      r.sampling.top_k = o->top_k;
      r.sampling.min_p = o->min_p;
      r.sampling.repetition_penalty = o->repetition_penalty;
      r.sampling.presence_penalty = o->presence_penalty;
      r.sampling.frequency_penalty = o->frequency_penalty;
      r.sampling.seed = o->seed + i;
      r.sampling.logprobs = o->logprobs;
      r.stop = o->stop;
      r.stop_token_ids = o->stop_token_ids;
      r.ignore_eos = o->ignore_eos;
      if (dump) r.on_logits = [&](int64_t, std::span<const float> row) { dumped.insert(dumped.end(), row.begin(), row.end()); };
      engine.submit(std::move(r), [&, i](const runtime::TokenEvent& ev) {
        std::lock_guard<std::mutex> lk(mu);
        Result& res = results[i];
        if (ev.token >= 0) {
          if (res.tokens.empty()) res.first_token_s = seconds_since(t0);
          res.tokens.push_back(ev.token);
          if (o->logprobs >= 0) {
            std::string line = fmt::format("{} ({:.4f})", ev.token, ev.logprob);
            for (const auto& t : ev.top_logprobs) line += fmt::format(" {}:{:.4f}", t.token, t.logprob);
            res.logprob_lines.push_back(line);
          }
        }
        res.text += ev.text;
        if (ev.finished) {
          res.reason = ev.reason;
          res.error = ev.error;
          res.done_s = seconds_since(t0);
          ++finished;
          cv.notify_all();
        }
      });
    }
    {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return finished == prompts.size(); });
    }
    const double wall = seconds_since(t0);
    for (const Result& r : results)
      if (r.reason == runtime::FinishReason::error) fail("engine error: {}", r.error);
    const runtime::EngineStats st = engine.stats();

    if (prompts.size() == 1) {
      const Result& r = results[0];
      const auto& [prompt, text] = prompts[0];
      fmt::print("tokens: {}\n", fmt::join(r.tokens, ","));
      for (const std::string& l : r.logprob_lines) fmt::print("logprobs: {}\n", l);
      if (text || tokenizer) {
        fmt::print("prompt tokens: {}\n", fmt::join(prompt, ","));
        fmt::print("text: {}\n", r.text);
      }
      fmt::print("finish: {}\n", runtime::finish_reason_name(r.reason));
      fmt::print("prefill: {} tokens in {:.3f} s ({:.1f} tok/s)\n", prompt.size(), r.first_token_s,
                 double(prompt.size()) / r.first_token_s);
      const int decoded = int(r.tokens.size()) - 1;
      if (decoded > 0)
        fmt::print("decode: {} tokens in {:.3f} s ({:.1f} tok/s)\n", decoded, r.done_s - r.first_token_s,
                   double(decoded) / (r.done_s - r.first_token_s));
    } else {
      int64_t in = 0, outn = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        const Result& r = results[i];
        in += int64_t(prompts[i].first.size());
        outn += int64_t(r.tokens.size());
        if (o->quiet) continue;
        fmt::print("[{}] tokens: {}\n", i, fmt::join(r.tokens, ","));
        if (prompts[i].second || tokenizer) fmt::print("[{}] text: {}\n", i, r.text);
        fmt::print("[{}] finish: {}, {} prompt tokens, first token {:.3f} s, done {:.3f} s\n", i,
                   runtime::finish_reason_name(r.reason), prompts[i].first.size(), r.first_token_s, r.done_s);
      }
      fmt::print("requests: {} in {:.3f} s; prompt {} tokens, generated {} tokens; {:.1f} generated tok/s, "
                 "{:.1f} total tok/s\n",
                 prompts.size(), wall, in, outn, double(outn) / wall, double(in + outn) / wall);
    }
    fmt::print("engine: {} steps, {} preemptions, prefix cache {} hits / {} queries skipping {} tokens, {} positions "
               "computed\n",
               st.steps, st.preemptions, st.prefix_hits, st.prefix_queries, st.prefix_hit_tokens, st.tokens_forwarded);
    if (dump) {
      write_npy(o->dump_logits, dumped, int64_t(dumped.size()) / V, V);
      fmt::print("logits: {} positions written to {}\n", int64_t(dumped.size()) / V, o->dump_logits);
    }
  });
}

}  // namespace kestrel::cli
