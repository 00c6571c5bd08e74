// The one-shot device all-reduce (kernels/cuda/allreduce.h) wired across processes with CUDA IPC:
// the fast path for decode-sized all-reduces inside one node when ranks are processes (docs/parallel.md
// §2). The GPU engine's ranks are threads of one process; --enable-custom-all-reduce wires them through
// peer access instead (peer_allreduce.h). Larger messages, and ranks on other nodes, go through NCCL.
//
// Construction is collective over a host bootstrap comm (MPI: one process per GPU; IPC handles cannot
// be opened in the process that made them, so in-process threads cannot use it beyond world size 1):
// each rank allocates one device block on its current device — control words (zeroed) then two halves
// of `max_bytes` — draws its cudaIpcMemHandle, all-gathers the handles, opens its peers' and ends with
// a barrier, so no rank launches before every rank's control words are zero.
// Results equal the host backends' bytes (rank-order f32 sum, one rounding).
#pragma once

#include <cstddef>
#include <memory>

#include "core/dtype.h"
#include "parallel/comm.h"

namespace kestrel::parallel {

class IpcAllReduce {
 public:
  IpcAllReduce(Comm& bootstrap, size_t max_bytes);
  ~IpcAllReduce();
  IpcAllReduce(const IpcAllReduce&) = delete;
  IpcAllReduce& operator=(const IpcAllReduce&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t max_bytes() const { return max_bytes_; }
  // Whether a message can take this path: f32/bf16, a multiple of 16 bytes, at most max_bytes.
  bool supports(size_t count, DType dt) const;

  // buf: dt [count] device memory, 16-byte aligned, in place; enqueued on `stream` (a cudaStream_t).
  // Every rank must make the same calls in the same order.
  void all_reduce_sum(void* buf, size_t count, DType dt, void* stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, size_ = 1;
  size_t max_bytes_ = 0;
};

}  // namespace kestrel::parallel
