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
// stream, and a rank's blocks spin until the other ranks' kernels have published. That is safe when every
// kernel any rank enqueues can still be scheduled while the spinning blocks are resident: at most one
// one-shot kernel per rank runs at a time (stream order), so at most N·G blocks spin, and G is chosen so
// that N·G ≤ SMs / 2 — the spinning blocks sit on at most half the SMs, the other half stays wholly free
// for any other kernel, which can therefore always make progress; the ranks' streams
// then reach their one-shot calls and the spinning ends. Not covered by that argument: two ranks' streams
// sharing one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS, default 8 — the engine creates one stream per
// rank) could order a rank's launch behind another rank's waiting work; the kernel's 10 s trap turns such
// a deadlock into a launch error, never a hang.
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
