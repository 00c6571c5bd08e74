// The engine flags `kestrel serve` and `kestrel generate` share: checkpoint, device, memory budget,
// cache formats and batching, registered once on each subcommand and turned into the engine layer's
// EngineOptions (runtime/engine_host.h), which owns what they mean.
//
//   --model DIR  --device cpu|cuda  --no-cuda-graphs  --quantization bf16|ptpc-fp8
//   --memory-budget SIZE | --gpu-memory-utilization F
//   --kv-cache-dtype bf16|fp8  --index-cache-dtype bf16|fp8|mxfp4  --kda-state-dtype f32|f16
//   --block-size N  --max-num-seqs N  --max-num-batched-tokens N  --max-model-len N  --no-prefix-cache
//   --threads N (CPU ops)  --structured-mask-threads N (structured outputs' mask pool)
//   --tensor-parallel-size N  --enable-expert-parallel  --decode-context-parallel-size N  (docs/parallel.md)
//   --enable-custom-all-reduce  --debug-tp-on-one-gpu
//   --long-prefill-token-threshold N  --max-num-partial-prefills N  --max-long-partial-prefills N
//   --async-scheduling (pure-decode steps run ahead of the host: docs/serving.md)
//
// Without --model the embedded k3-tiny is used when it is found (default_model_dir()).
//   --speculative-config JSON (vLLM's keys; DSpark)
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
  int threads = 0;            // 0: every core
  int mask_threads = 0;       // 0: automatic (runtime::MaskPool::auto_threads)
  bool no_prefix_cache = false, no_cuda_graphs = false;
  std::string quantization = "bf16";
  int tensor_parallel_size = 1;
  bool enable_expert_parallel = false;
  int decode_context_parallel_size = 1;
  bool debug_tp_on_one_gpu = false;
  bool enable_custom_all_reduce = false;  // opt-in (vLLM's is opt-out: --disable-custom-all-reduce)
  // Fairness (sched/scheduler.h). threshold -1: the device's default (long_prefill_default()).
  int long_prefill_token_threshold = -1;
  int max_num_partial_prefills = 4, max_long_partial_prefills = 1;
  bool model_given = false;  // --model was on the command line (else the embedded default)
  std::string speculative_config;  // --speculative-config JSON (runtime/spec_config.h)
  bool async_scheduling = false;   // --async-scheduling (runtime/engine.h EngineConfig::async_scheduling)

  void add_to(CLI::App& cmd);
  // Fills in `model` when --model was not given: the embedded k3-tiny, or a kestrel::Error naming
  // where it was looked for. Call after parsing, before options().
  void resolve_model();
  // The options these flags describe; bad spellings (dtype, size) fail here, before anything loads.
  runtime::EngineOptions options(int default_max_num_seqs) const;
};

// The embedded k3-tiny next to the binary or under its install prefix: <bin>/models/k3-tiny,
// <bin>/k3-tiny, <bin>/../share/kestrel/models/k3-tiny, and a checkout's models/k3-tiny for a
// binary built in it (<checkout>/<build>/src/cli/kestrel). Empty when none holds a config.json.
std::string default_model_dir();

// --long-prefill-token-threshold when not given: CPU 256, GPU 2048, never more than half the step
// budget. The engine sizes long chunks below it to a step-time target (docs/serving.md "Fairness").
int long_prefill_default(bool cuda, int max_num_batched_tokens);

// "512M", "2G", "1.5GiB", "1000000" -> bytes; kestrel::Error for anything else.
int64_t parse_bytes(const std::string& s);

}  // namespace kestrel::cli
