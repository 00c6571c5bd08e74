// Instruments of the GPU model, off unless a caller turns them on: op timing (bench_ops splits a step
// by op group) and debug captures (tests/gpu/test_model_gpu.cpp compares discrete choices and
// per-layer activations with the CPU engine's observer).
//
// OpTimer records a CUDA event at each mark of an eager forward and, after the step's sync, sums the
// time between consecutive marks per name (µs, in first-seen order). Captures copy device tensors to
// the host at once (a stream sync each), appended under model.h's observer names.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kestrel::model::gpu {

class OpTimer {
 public:
  OpTimer() = default;
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  bool on = false;
  void begin_step();                              // forgets the marks of the last step
  void mark(const char* name, cudaStream_t stream);  // an event after everything queued so far
  void end_step();                                // after the stream sync: sums the intervals
  const std::vector<std::pair<std::string, double>>& last_times() const { return last_times_; }

 private:
  std::vector<std::pair<std::string, cudaEvent_t>> marks_;
  std::vector<cudaEvent_t> pool_;
  size_t used_ = 0;
  std::vector<std::pair<std::string, double>> last_times_;
};

struct Captures {
  bool on = false;
  std::map<std::string, std::vector<int32_t>> ids;   // "L{L}.router_ids" i32 [T, K], "L{L}.index_topk" i32 [T, Ki]
  std::map<std::string, std::vector<float>> acts;    // "L{L}.attn_out", "L{L}.mlp_out": bf16 [T, D] as f32
  void ids_i32(int layer, const char* what, const int32_t* d /* i32 [n] */, int64_t n, cudaStream_t stream);
  void bf16(const std::string& name, const uint16_t* d /* bf16 [n] */, int64_t n, cudaStream_t stream);
};

}  // namespace kestrel::model::gpu
