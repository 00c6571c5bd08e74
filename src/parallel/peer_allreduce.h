// The one-shot device all-reduce (kernels/cuda/allreduce.h) for ranks that are threads of ONE process,
// one GPU each (the GPU engine's tensor parallelism, runtime/executor_cuda_tp.h), behind
// --enable-custom-all-reduce (docs/parallel.md §2 "Custom all-reduce"). Across processes the exchange
// buffers come through CUDA IPC (ipc_allreduce.h); inside one process they are plain device pointers, made
// readable and writable by the other ranks' GPUs with peer access (cudaDeviceEnablePeerAccess).
//
// PeerAllReduceGroup allocates every rank's exchange buffer (control words zeroed, then two halves of
// max_bytes) on the rank's device and, for ranks on distinct devices, enables peer access both ways between
// every pair. A pair without peer access is a start-up Error naming it (the flag was asked for explicitly;
// a silent fallback to NCCL would hide that the fast path is off).
//
// wrap() decorates a rank's comm: all_reduce_sum of an f32/bf16 message of at most max_bytes whose size
// is a multiple of 16 bytes runs the one-shot kernel on the rank's stream; every other collective and
// message goes to the wrapped comm. The choice depends on the count and dtype only — never on anything
// that could differ between ranks (a misaligned buffer is staged through an aligned scratch on the
// stream instead) — because every rank must make the same one-shot calls or their epochs part.
// Ordering: the kernel and the wrapped comm's work are on, or synchronous with, the same stream.
//
// Ranks on ONE device (the GPU tests, --debug-tp-on-one-gpu): each rank launches its own kernel on its own
// stream, and a rank's blocks spin until the other ranks' kernels have published, so all N kernels must be
// running at once. Two hazards would stop that: another rank's kernels filling the device, and a host call
// between two ranks' launches that serialises the device's streams (CUDA's implicit synchronisation: a
// device memory allocation — the caching allocator's growth in a step — or a cudaFree / device sync on a
// rank thread while a peer's kernel spins waiting for that very thread). So on one device each call is
// fenced by two barriers of the wrapped (same-device) comm, which wait for every rank's stream: before
// the launch (every stream drained: nothing else runs on the device) and after it (every rank has enqueued
// its kernel before any rank issues anything else). Between them the ranks only launch, and N·G ≤ SMs / 2
// blocks (G capped so) fit the idle device at once. That costs two host rendezvous per call — this mode
// tests the protocol and the engine's routing, not speed. Left to the kernel's 10 s trap (a launch error
// that ends the run, never a hang): streams sharing one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS,
// default 8) scheduling one rank's kernel only after another's has ended. On distinct GPUs none of this
// applies (a rank's device runs only its own stream) and there is no barrier.
// Results: the host backends' bytes (rank order, f32 accumulation, one rounding), so on one device the
// engine's logits are bit-identical with and without the flag (the same-device comm sums the same way);
// against NCCL they match within rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/comm.h"

namespace kestrel::parallel {

// Messages up to this size take the one-shot path (decode: one bf16 [D] row per token, 14 KB at D = 7168,
// so up to ~73 tokens of K3.1); larger ones are bandwidth-bound and go to NCCL (docs/parallel.md §2).
inline constexpr size_t kCustomAllReduceMaxBytes = size_t(1) << 20;

class PeerAllReduceGroup {
 public:
  // devices[r]: rank r's CUDA device (all equal: ranks sharing one GPU). Allocates on each device and
  // enables peer access between distinct ones; throws Error when a pair cannot access each other.
  explicit PeerAllReduceGroup(const std::vector<int>& devices, size_t max_bytes = kCustomAllReduceMaxBytes);
  ~PeerAllReduceGroup();
  PeerAllReduceGroup(const PeerAllReduceGroup&) = delete;
  PeerAllReduceGroup& operator=(const PeerAllReduceGroup&) = delete;

  int size() const;
  size_t max_bytes() const;
  int blocks() const;  // G of every call (bounded on one device: see the header)
  // Whether all_reduce_sum(count, dt) takes the one-shot path (the same answer on every rank).
  bool takes(size_t count, DType dt) const;
  // Rank `rank`'s comm: one-shot all-reduces on `stream` (a cudaStream_t of the rank's device), the rest
  // through `inner` (rank `rank` of a group of size()). The group must outlive it.
  std::unique_ptr<Comm> wrap(std::unique_ptr<Comm> inner, int rank, void* stream);
  // One-shot kernels launched so far over all ranks (tests check the path was taken).
  int64_t calls() const;

 private:
  friend class OneShotComm;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::parallel
