// Parameter and memory accounting of a model, from its config alone (MODEL.md §1-§2).
//
// Built on expected_tensors(), the same list the loader binds, so `kestrel inspect --config-only`
// and a real checkpoint agree by construction. "Active" parameters are those one token touches in
// the text model: everything but the input embedding (a row lookup, not a matmul) and the vision
// tower, with routed experts counted at K of X.
//
// Memory per GPU under a parallel layout is summed over the slices shard_slice() gives a rank, the
// very rules bind_shard() binds (loader/shard.h, docs/parallel.md), so `inspect` and the loader cannot
// disagree about what a rank holds.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loader/config.h"
#include "loader/shard.h"
#include "loader/weights.h"

namespace kestrel {

struct Inventory {
  std::array<int64_t, size_t(Module::count_)> params{};  // logical parameters per module
  std::array<int64_t, size_t(Module::count_)> bytes{};   // stored bytes per module
  std::map<std::string, int64_t> bytes_by_dtype;          // "BF16", "F32", "MXFP4", ...
  int64_t num_tensors = 0;
  int64_t total_params = 0;
  int64_t active_params = 0;
  int64_t total_bytes = 0;
};

Inventory take_inventory(const ModelConfig& c);

// What one rank holds under a layout (rank 0; with a valid layout every rank holds the same bytes).
struct LayoutMemory {
  ParallelLayout layout;
  std::vector<std::string> problems;   // why the layout cannot split this config; empty when it can
  int64_t weight_bytes = 0;            // weight bytes bound on the rank
  int64_t replicated_bytes = 0;        // of which every rank holds a whole copy
  int64_t cache_bytes_per_token = 0;   // MLA latent (bf16) + index keys (fp8) per context token, all MLA layers
  int64_t kda_state_bytes = 0;         // one request's KDA state (f32 recurrent + bf16 conv), all KDA layers
};
LayoutMemory layout_memory(const ModelConfig& c, const ParallelLayout& p);

// A machine to fit the model on: `gpus` devices of `bytes_per_gpu` usable memory each.
struct Platform {
  std::string name;
  int gpus = 0;
  int64_t bytes_per_gpu = 0;
};
// 8 x H200 and 16 x H200 (139.8 GiB each, as cudaMemGetInfo reports on the H200 we measure on) and
// 8 x MI355X (288 GiB each, nominal).
std::vector<Platform> reference_platforms();
// Per-GPU memory that is not weights or cache: activations and workspaces, NCCL and IPC buffers, the
// CUDA context and graphs. A layout fits when weights + this + one request at max_position_embeddings
// (its KDA state and MLA cache) fit in a GPU.
inline constexpr int64_t kRuntimeReserveBytes = int64_t(6) << 30;
// The layout table of `kestrel inspect`: weights per GPU for TP1, TP8, TP8+EP8, TP8+EP8+DCP8 and
// TP16+EP16, then whether each fits each reference platform. One line per entry.
std::vector<std::string> format_layouts(const ModelConfig& c);

// Per-request cache footprint (MODEL.md §0.3-§0.4): KDA recurrent state (f32) + conv state (bf16)
// for all KDA layers, and per-token latent (bf16) + index-key (fp8) cache over the MLA layers.
int64_t kda_state_bytes_per_request(const TextConfig& t);
int64_t cache_bytes_per_token(const TextConfig& t);

// Human-readable report for `kestrel inspect`.
std::string format_inventory(const ModelConfig& c, const Inventory& inv);

}  // namespace kestrel
