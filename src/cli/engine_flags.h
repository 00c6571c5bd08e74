// The engine flags `kestrel serve` and `kestrel generate` share: checkpoint, device, memory budget,
// cache formats and batching, registered once on each subcommand and turned into the engine layer's
// EngineOptions (runtime/engine_host.h), which owns what they mean.
//
//   --model DIR  --device cpu|cuda  --no-cuda-graphs  --quantization bf16|ptpc-fp8
//   --memory-budget SIZE | --gpu-memory-utilization F
//   --kv-cache-dtype bf16|fp8  --index-cache-dtype bf16|fp8|mxfp4  --kda-state-dtype f32|f16
//   --block-size N  --max-num-seqs N  --max-num-batched-tokens N  --max-model-len N  --no-prefix-cache
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "runtime/engine_host.h"

namespace kestrel::cli {

struct EngineFlags {
  std::string model, device = "cpu", memory_budget;
  double gpu_memory_utilization = 0.0;
  std::string kv_cache_dtype = "bf16", index_cache_dtype = "bf16", kda_state_dtype = "f32";
  int block_size = 0;     // 0: the engine's (128)
  int max_num_seqs = 0;   // 0: the command's default
  int max_num_batched_tokens = 2048;
  int64_t max_model_len = 0;  // 0: the model's context capped by the memory plan
  bool no_prefix_cache = false, no_cuda_graphs = false;
  std::string quantization = "bf16";

  void add_to(CLI::App& cmd);
  // The options these flags describe; bad spellings (dtype, size) fail here, before anything loads.
  runtime::EngineOptions options(int default_max_num_seqs) const;
};

// "512M", "2G", "1.5GiB", "1000000" -> bytes; kestrel::Error for anything else.
int64_t parse_bytes(const std::string& s);

}  // namespace kestrel::cli
