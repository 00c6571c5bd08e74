// Subcommands of the `kestrel` binary. Each registers itself on the CLI11 app; main() owns error
// handling so every subcommand may simply throw kestrel::Error.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "loader/config.h"
#include "loader/weights.h"
#include "runtime/engine.h"

namespace kestrel::cli {

void register_inspect(CLI::App& app);
void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_serve(CLI::App& app);
void register_bench(CLI::App& app);
void register_eval(CLI::App& app);

// Shared by `generate` and `serve` (defined in cmd_generate.cpp).
// "512M", "2G", "1.5GiB", "1000000" -> bytes; kestrel::Error for anything else.
int64_t parse_bytes(const std::string& s);
// Bytes of the checkpoint's .safetensors files (the weights' share of memory).
int64_t checkpoint_bytes(const std::string& dir);
// The cache budget from --memory-budget (a size) or --gpu-memory-utilization (a fraction of physical
// memory, less the weights); `fallback` when neither is given.
int64_t memory_budget_from_flags(const std::string& memory_budget, double gpu_memory_utilization,
                                 const std::string& model_dir, int64_t fallback);

// --device cuda for `generate` and `serve`: given the bound weights and the engine config, uploads the
// weights (model::CudaModel), checks the cache formats, sets the GPU executor factory and, for
// --gpu-memory-utilization F (> 0), the cache budget from the device's memory (F × total − in use −
// an activation reserve); decode steps use CUDA graphs unless `cuda_graphs` is false; returns the GPU model, to be kept alive as long as the engine.
// Fails with a clear error in a build without CUDA.
using DeviceSetup = std::function<std::shared_ptr<void>(const ModelConfig&, const ModelWeights&, runtime::EngineConfig&)>;
// quantization: "bf16" (the checkpoint's weights) or "ptpc-fp8" (dense projections re-quantised at load;
// model::WeightQuant).
DeviceSetup cuda_device_setup(double gpu_memory_utilization, bool cuda_graphs = true,
                              const std::string& quantization = "bf16");

}  // namespace kestrel::cli
