// A device communicator for N ranks on ONE GPU, as threads of one process: how the GPU tensor-parallel
// engine is tested on a single device (NCCL refuses two ranks on one GPU). Test and debug use only —
// selected by the GPU tests and by `--debug-tp-on-one-gpu`, never by default; a real multi-GPU run
// uses NcclComm (nccl_comm.h), one rank per GPU.
//
// Same contract as every Comm (comm.h): device buffers, every rank calls the same collectives in the same
// order. Each call is synchronous with respect to the rank's stream: it waits for the work already on
// `stream`, exchanges the buffer addresses over a host in-process group (InProcessGroup: mismatched calls
// are one Error on every rank, abort() wakes every waiter), moves the bytes with device copies, and
// returns once the result is in place. Reductions run on the GPU: every rank stages its message into its
// exchange buffer, rank 0 launches the one-shot all-reduce over all N buffers in one cooperative launch
// (kernels/cuda/allreduce.h one_shot_all_reduce_emulated: rank order, f32 accumulation, one rounding —
// the CPU twin's bytes exactly), every rank copies its result back. Messages larger than the exchange
// buffer go in pieces; odd sizes are padded with zeros to the kernel's 16-byte granule.
// Slow (several host synchronisations per collective) and meant to be: it checks the parallel code's
// arithmetic on one GPU, not its speed.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "parallel/comm.h"

namespace kestrel::parallel {

class SameDeviceGroup {
 public:
  // `size` ranks on CUDA device `device`; messages are reduced in pieces of up to `max_bytes` (a multiple
  // of 16). Allocates the exchange buffers on `device`.
  SameDeviceGroup(int size, int device, size_t max_bytes = size_t(1) << 20);
  ~SameDeviceGroup();
  SameDeviceGroup(const SameDeviceGroup&) = delete;
  SameDeviceGroup& operator=(const SameDeviceGroup&) = delete;

  int size() const;
  // Rank `rank`'s comm, enqueueing its copies on `stream` (a cudaStream_t of `device`, the rank's compute
  // stream). Call once per rank; the group must outlive the comm.
  std::unique_ptr<Comm> comm(int rank, void* stream);
  // Every current and later collective of the group throws Error(why) (a rank failed: no rank waits).
  void abort(const std::string& why);

 private:
  friend class SameDeviceComm;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::parallel
