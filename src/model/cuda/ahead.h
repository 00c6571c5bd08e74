// Run-ahead sampling on the GPU (async scheduling: runtime/executor_cuda.h, docs/serving.md "Async scheduling"):
// the host enqueues step N+1 before it has step N's sampled ids. The ids a step samples (CudaModel::sample_ahead)
// are written to a device buffer, which the next forward's decodes with CudaSeq::prev_id read their token from
// (kernels/cuda/rows.h resolve_pending_ids, after the step's static inputs are uploaded), and are copied to a
// page-locked buffer on a side stream, so that the host waits for step N's ids only — not for step N+1, queued
// behind them on the model's stream — and the copy engine's transfer is not on the path from step N to N+1.
//
// Two slots alternate (ticket k uses slot k % 2): step N's ids must stay readable while step N+1's sampling writes
// the other slot. A slot is reused only after its ticket was taken (take() waited for its side copy, so nothing
// still reads its buffers when they are resized).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_alloc.h"

namespace kestrel::model::gpu {

class AheadIds {
 public:
  AheadIds() = default;
  ~AheadIds();
  AheadIds(const AheadIds&) = delete;
  AheadIds& operator=(const AheadIds&) = delete;

  // A new ticket for n ids: returns the device buffer (i32 [n]) the sampling kernel is to write on `stream`;
  // ticket() names it. Fails if the slot's previous ticket was not taken (more than two outstanding).
  int32_t* begin(cuda::CachingAllocator& a, int64_t n);
  int64_t ticket() const { return issued_ - 1; }
  // After the sampling was enqueued on `stream`: the side-stream copy to the host, behind an event.
  void end(cudaStream_t stream);
  // Waits for ticket k's ids (only them) and copies its n ids to host. Each ticket once, in any order.
  void take(int64_t k, int32_t* host /* i32 [n of that ticket] */);
  // The latest ticket's device ids and their count, for the next forward's prev_id rows (null, 0: none yet). The
  // buffer stays valid for work enqueued on the model's stream before the next begin() of the same slot.
  const int32_t* latest() const { return issued_ > 0 ? slot_[(issued_ - 1) % 2].dev : nullptr; }
  int64_t latest_n() const { return issued_ > 0 ? slot_[(issued_ - 1) % 2].n : 0; }
  void release(cuda::CachingAllocator& a);  // before the allocator goes; waits for the side stream

 private:
  struct Slot {
    int32_t* dev = nullptr;  // i32 [cap]: the sampling writes, the next forward reads
    int32_t* pin = nullptr;  // page-locked i32 [cap]: the side stream's copy
    int64_t cap = 0, n = 0, ticket = -1;
    bool outstanding = false;
    cudaEvent_t sampled = nullptr, copied = nullptr;
  };
  Slot slot_[2];
  cudaStream_t side_ = nullptr;
  int64_t issued_ = 0;
};

}  // namespace kestrel::model::gpu
