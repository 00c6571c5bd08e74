// EngineFlags: see engine_flags.h.
#include "cli/engine_flags.h"

#include "cache/layout.h"
#include "core/check.h"

namespace kestrel::cli {

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

void EngineFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--model", model, "checkpoint directory (tokenizer files included)")->required();
  cmd.add_option("--device", device, "cpu or cuda (the engine on the GPU executor)")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd.add_flag("--no-cuda-graphs", no_cuda_graphs, "--device cuda: run decode steps eagerly");
  cmd.add_option("--quantization", quantization, "--device cuda: dense projection weights bf16 | ptpc-fp8 (online "
                                                 "FP8, per-token x per-channel scales)")
      ->check(CLI::IsMember({"bf16", "ptpc-fp8"}));
  auto* mb = cmd.add_option("--memory-budget", memory_budget, "bytes for KV pages + KDA state slots (e.g. 512M, 2G; default 1G)");
  auto* gu = cmd.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                            "fraction of memory for weights + caches (CPU: of physical RAM)");
  mb->excludes(gu);
  cmd.add_option("--kv-cache-dtype", kv_cache_dtype, "MLA latent cache: bf16 | fp8");
  cmd.add_option("--index-cache-dtype", index_cache_dtype, "indexer key cache: bf16 | fp8 | mxfp4");
  cmd.add_option("--kda-state-dtype", kda_state_dtype, "KDA recurrent state in the state pool: f32 | f16 (half the bytes)");
  cmd.add_option("--block-size", block_size, "KV page size in tokens (default: the engine's, 128)")->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--max-num-seqs", max_num_seqs, "requests generating at once (serve: 16; generate: the prompts, at most 16)")
      ->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--max-num-batched-tokens", max_num_batched_tokens, "token budget of one engine step")
      ->check(CLI::Range(1, 1 << 24));
  cmd.add_option("--max-model-len", max_model_len, "context length: prompt + completion (default: the model's, "
                                                   "capped by the memory plan)")
      ->check(CLI::Range(int64_t(2), int64_t(1) << 40));
  cmd.add_flag("--no-prefix-cache", no_prefix_cache, "disable prefix caching");
}

runtime::EngineOptions EngineFlags::options(int default_max_num_seqs) const {
  runtime::EngineOptions o;
  o.model_dir = model;
  o.device = device == "cuda" ? runtime::Device::cuda : runtime::Device::cpu;
  if (!memory_budget.empty()) o.memory_budget = parse_bytes(memory_budget);
  o.gpu_memory_utilization = gpu_memory_utilization;
  o.cuda_graphs = !no_cuda_graphs;
  o.quantization = quantization;
  runtime::EngineConfig& ec = o.engine;
  ec.formats.latent = cache::parse_latent_format(kv_cache_dtype);
  ec.formats.index_keys = cache::parse_index_key_format(index_cache_dtype);
  ec.formats.kda_state = cache::parse_kda_state_dtype(kda_state_dtype);
  if (block_size > 0) ec.formats.block_size = block_size;
  ec.max_running = max_num_seqs > 0 ? max_num_seqs : default_max_num_seqs;
  ec.max_num_batched_tokens = max_num_batched_tokens;
  ec.max_model_len = max_model_len;
  ec.enable_prefix_cache = !no_prefix_cache;
  return o;
}

}  // namespace kestrel::cli
