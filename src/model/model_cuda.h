// The K3.1 text model on one GPU: the layer loop of model/model.cpp with the CUDA ops of
// src/kernels/cuda, at the same rounding points (BF16 activations, FP32 accumulation, FP32 logits).
//
// Why here (src/model, library kestrel_model_cuda) and not src/runtime: this is the model's math,
// one forward per call over one request, mirroring model.cpp line by line so the two can be read (and
// diffed) side by side; scheduling, paging and batching many requests belong to the runtime, which
// will drive these same ops with its own state. Built only when nvcc is found.
//
// Weights: uploaded once from the mmapped checkpoint into a DeviceArena over a CachingAllocator;
// q|k|v (KDA), gate|up (MLPs) and the three conv kernels are concatenated so each is one GEMM/launch;
// routed experts stay MXFP4, each layer's X experts packed back to back in the layout
// moe_experts_mxfp4 reads (cuda::MoeExpertWeights).
// State: CudaState per request, on the device: per KDA layer the FP32 recurrent state and the
// [W−1, 3·H·Dk] conv history; per MLA layer a contiguous latent cache bf16 [cap, C+R] and index-key
// cache bf16 [cap, Di] (cap = max_context, fixed at creation).
// Forms: prefill (T > 1) runs the naive MLA form, decode (T = 1) the absorbed one, like the CPU
// defaults; KDA always runs the recurrent scan (the CPU prefill uses the chunked form, equal in exact
// arithmetic, different in FP32 rounding).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "loader/config.h"
#include "loader/weights.h"

namespace kestrel::model {

struct CudaState;
struct CudaWeights;

class CudaModel {
 public:
  CudaModel(const ModelConfig& c, const ModelWeights& w);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  std::unique_ptr<CudaState, void (*)(CudaState*)> new_state(int64_t max_context);
  void reset(CudaState& st);

  // Runs `tokens` after what `st` holds; writes FP32 logits of every token (f32 [T, V]) or of the last
  // (f32 [1, V]) to host memory (null: none).
  void forward(CudaState& st, std::span<const int32_t> tokens, float* logits_host, bool last_only);

  // Per-op timing of the last forward (CUDA events around each op group), µs; empty unless enabled.
  void enable_op_timing(bool on);
  std::vector<std::pair<std::string, double>> op_times() const;

  size_t weight_bytes() const;

  // Debug captures for tests: when on, every forward appends each MoE layer's router ids (i32 [T, K],
  // "L{L}.router_ids") and each MLA layer's indexer selection (i32 [T, Ki], "L{L}.index_topk"), the
  // names of model.h's observer. Costs a device sync per capture.
  void enable_captures(bool on);
  const std::map<std::string, std::vector<int32_t>>& captures() const;
  // Also per layer "L{L}.attn_out", "L{L}.mlp_out" and "final_hidden" (bf16 [T, D] as f32), appended.
  const std::map<std::string, std::vector<float>>& activation_captures() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::model
