// `kestrel generate`: CPU text generation with the reference forward pass (src/model), for checking
// a checkpoint end to end and for small-model benchmarks.
//
//   kestrel generate --model DIR (--prompt-tokens 1,2,3 | --prompt TEXT) --max-tokens N
//                    [--temperature T --top-p P --seed S] [--dump-logits FILE] [--device cpu|cuda]
//
// --device cuda runs the GPU forward pass (model/model_cuda.h; only in builds with CUDA); the default
// is the CPU reference.
//
// Prints the generated ids (and their text when the prompt was text), then prefill and decode
// throughput. Generation stops after N tokens or at eos_token_id.
// --dump-logits writes every position fed through the model (prompt, then each generated token but
// the last) as a NumPy .npy v1.0 file: magic "\x93NUMPY", version 1 0, u16 little-endian header
// length, an ASCII dict {'descr': '<f4', 'fortran_order': False, 'shape': (positions, vocab), }
// padded with spaces and a final '\n' so the data starts at a multiple of 64 bytes, then the
// row-major little-endian float32 logits.
//
// --prompt is encoded with the checkpoint's own tokenizer (tiktoken.model + tokenizer_config.json,
// src/tokenizer) as plain text: special-token text in it stays ordinary text.
#include <fmt/format.h>

#include <chrono>
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
#include "model/model.h"
#ifdef KESTREL_WITH_CUDA
#include "model/model_cuda.h"
#endif
#include "runtime/sampler.h"
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

void register_generate(CLI::App& app) {
  struct Opts {
    std::string model, prompt_tokens, prompt, dump_logits, device = "cpu";
    int max_tokens = 16;
    float temperature = 0.0f, top_p = 1.0f;
    uint64_t seed = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens on the CPU with the reference forward pass");
  cmd->add_option("--model", o->model, "checkpoint directory")->required();
  auto* pt = cmd->add_option("--prompt-tokens", o->prompt_tokens, "comma-separated prompt token ids");
  auto* pr = cmd->add_option("--prompt", o->prompt, "prompt text, encoded with the checkpoint's tokenizer");
  pt->excludes(pr);
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", o->temperature, "0 = greedy");
  cmd->add_option("--top-p", o->top_p, "nucleus mass in (0, 1]");
  cmd->add_option("--seed", o->seed, "sampler seed");
  cmd->add_option("--dump-logits", o->dump_logits, "write f32 logits [positions, vocab] as .npy");
  cmd->add_option("--device", o->device, "cpu (reference) or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([o] {
    if (o->prompt_tokens.empty() == o->prompt.empty()) fail("give exactly one of --prompt-tokens or --prompt");
    runtime::Sampler sampler({o->temperature, o->top_p, o->seed});
    const ModelConfig cfg = load_config(o->model);
    const Checkpoint ckpt(o->model);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size;

    const bool text = !o->prompt.empty();
    std::optional<tok::Tokenizer> tokenizer;
    std::vector<int32_t> prompt;
    if (text) {
      tokenizer = tok::Tokenizer::load(o->model);
      for (tok::TokenId id : tokenizer->encode(o->prompt, /*allow_special=*/false)) prompt.push_back(int32_t(id));
      if (prompt.empty()) fail("--prompt encodes to no tokens");
    } else {
      prompt = parse_ids(o->prompt_tokens);
    }
    for (int32_t id : prompt)
      if (id >= V) fail("prompt token {} is outside the vocabulary (size {})", id, V);

    const bool dump = !o->dump_logits.empty();
    model::State state(cfg);
    model::ForwardOptions opt;
    opt.last_logits_only = !dump;
    // One forward of `ids` on the chosen device (the CPU state stays unused on the GPU path).
    std::function<void(std::span<const int32_t>, float*)> run;
    if (o->device == "cpu") {
      run = [&](std::span<const int32_t> ids, float* lg) { model::prefill(w, cfg, state, ids, lg, opt); };
    } else {
#ifdef KESTREL_WITH_CUDA
      struct Gpu {  // the state is freed before the model that owns its allocator
        model::CudaModel m;
        std::unique_ptr<model::CudaState, void (*)(model::CudaState*)> s;
        Gpu(const ModelConfig& c, const ModelWeights& mw, int64_t cap) : m(c, mw), s(m.new_state(cap)) {}
        ~Gpu() { s.reset(); }
      };
      auto gpu = std::make_shared<Gpu>(cfg, w, int64_t(prompt.size()) + o->max_tokens);
      run = [gpu, last = !dump](std::span<const int32_t> ids, float* lg) { gpu->m.forward(*gpu->s, ids, lg, last); };
#else
      fail("--device cuda: this kestrel was built without CUDA");
#endif
    }
    std::vector<float> dumped;  // f32 [positions, V]
    std::vector<float> logits(size_t(dump ? int64_t(prompt.size()) * V : V));

    auto t0 = std::chrono::steady_clock::now();
    run(prompt, logits.data());
    const double t_prefill = seconds_since(t0);
    if (dump) dumped = logits;
    std::vector<int32_t> out;
    out.push_back(sampler.sample(std::span<const float>(logits.data() + (dump ? (int64_t(prompt.size()) - 1) * V : 0), size_t(V))));
    logits.resize(size_t(V));
    t0 = std::chrono::steady_clock::now();
    while (int(out.size()) < o->max_tokens && out.back() != cfg.text.eos_token_id) {
      run(std::span<const int32_t>(&out.back(), 1), logits.data());
      if (dump) dumped.insert(dumped.end(), logits.begin(), logits.end());
      out.push_back(sampler.sample(logits));
    }
    const double t_decode = seconds_since(t0);
    const int decoded = int(out.size()) - 1;

    fmt::print("tokens: {}\n", fmt::join(out, ","));
    if (text) {
      // Ids past the tokenizer's table (a model vocab padded beyond it) have no text; they are
      // still listed under "tokens" above.
      std::vector<tok::TokenId> ids;
      for (int32_t id : out)
        if (size_t(id) < tokenizer->vocab_size()) ids.push_back(tok::TokenId(id));
      fmt::print("prompt tokens: {}\n", fmt::join(prompt, ","));
      fmt::print("text: {}\n", tokenizer->decode(ids));
    }
    fmt::print("prefill: {} tokens in {:.3f} s ({:.1f} tok/s)\n", prompt.size(), t_prefill,
               double(prompt.size()) / t_prefill);
    if (decoded > 0)
      fmt::print("decode: {} tokens in {:.3f} s ({:.1f} tok/s)\n", decoded, t_decode, double(decoded) / t_decode);
    if (dump) {
      write_npy(o->dump_logits, dumped, int64_t(dumped.size()) / V, V);
      fmt::print("logits: {} positions written to {}\n", int64_t(dumped.size()) / V, o->dump_logits);
    }
  });
}

}  // namespace kestrel::cli
