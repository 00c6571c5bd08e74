// Parameter and memory accounting of a model, from its config alone (MODEL.md §1-§2).
//
// Built on expected_tensors(), the same list the loader binds, so `kestrel inspect --config-only`
// and a real checkpoint agree by construction. "Active" parameters are those one token touches in
// the text model: everything but the input embedding (a row lookup, not a matmul) and the vision
// tower, with routed experts counted at K of X.
//
// Tensor-parallel memory: heads, FFN widths, the vocabulary and the routed experts (EP = TP) are
// sharded; norms, router, latent projections, the MLA down-projections (q_a, kv_a), the indexer
// (replicated per rank as vLLM does) and the vision tower are replicated on every GPU.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "loader/config.h"
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
  int64_t sharded_bytes = 0;     // bytes split across TP ranks
  int64_t replicated_bytes = 0;  // bytes every rank holds

  int64_t bytes_per_gpu(int tp) const { return replicated_bytes + (sharded_bytes + tp - 1) / tp; }
};

Inventory take_inventory(const ModelConfig& c);

// Per-request cache footprint (MODEL.md §0.3-§0.4): KDA recurrent state (f32) + conv state (bf16)
// for all KDA layers, and per-token latent (bf16) + index-key (fp8) cache over the MLA layers.
int64_t kda_state_bytes_per_request(const TextConfig& t);
int64_t cache_bytes_per_token(const TextConfig& t);

// Human-readable report for `kestrel inspect`.
std::string format_inventory(const ModelConfig& c, const Inventory& inv);

}  // namespace kestrel
