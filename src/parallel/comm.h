// The collective interface every tensor-, expert- and context-parallel layer codes against
// (docs/parallel.md). A Comm is one rank's handle on a group of `size()` ranks; every rank of the
// group must call the same collectives, in the same order, with the same counts, dtypes and roots.
//
// Three implementations, one contract:
//   InProcessComm (inproc_comm.h)  N ranks as threads of one process, host memory: the CPU twin and
//                                  the tests. Reductions in a fixed order, so results are reproducible.
//   MpiComm       (mpi_comm.h)     one rank per process under `mpirun`, host memory: the CPU twin across
//                                  processes and nodes, and the bootstrap that hands NCCL its unique id.
//   NcclComm      (nccl_comm.h)    one rank per GPU, device memory, enqueued on the comm's CUDA stream.
//
// Reductions sum f32 or bf16. The host backends compute every output element as
//     acc = f32(x_0); acc += f32(x_1); ... acc += f32(x_{N-1}); out = round_to_dtype(acc)
// (rank order, f32 accumulation, one RNE rounding at the end; sum_in_rank_order below), so all ranks
// receive identical bytes, the in-process and MPI backends agree bit for bit, and the device one-shot
// all-reduce (kernels/cuda/allreduce.h) reproduces the same bytes. NCCL's ring/tree order differs, so
// NCCL results match only within a tolerance.
//
// Buffers: counts are in elements of `dt`; gathers, broadcasts and all-to-all move raw elements of any
// dtype. A send buffer may alias the receive buffer only where stated (all_reduce_sum is in place).
// Host backends are synchronous: the result is in place when the call returns. NcclComm returns once
// the operation is enqueued on its stream (see nccl_comm.h).
// Errors (mismatched calls, an aborted group, a failing library call) throw kestrel::Error.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kestrel::parallel {

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "inproc", "mpi", "nccl"
  virtual Device device() const = 0;        // where the buffers must live

  // buf: dt [count], in place; every rank ends with the element-wise sum over ranks. dt: f32 or bf16.
  virtual void all_reduce_sum(void* buf, size_t count, DType dt) = 0;
  // send: dt [count]; recv: dt [size, count], block p = rank p's send.
  virtual void all_gather(const void* send, void* recv, size_t count, DType dt) = 0;
  // send: dt [size, count]; recv: dt [count] = Σ_p send_p[rank()]. dt: f32 or bf16.
  virtual void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dt) = 0;
  // buf: dt [count] on every rank; afterwards every rank holds root's contents.
  virtual void broadcast(void* buf, size_t count, DType dt, int root) = 0;
  // send: dt [size, count], block p goes to rank p; recv: dt [size, count], block p came from rank p.
  virtual void all_to_all(const void* send, void* recv, size_t count, DType dt) = 0;
  // Returns when every rank has entered it (device backends: and their enqueued work has finished).
  virtual void barrier() = 0;
};

// The reference reduction of the host backends: out[i] = round(Σ_{r=0}^{n-1} f32(parts[r][i])) summed in
// rank order starting from parts[0][i] (so -0 + -0 stays -0). parts: n pointers to dt [count]; out may
// alias any part. dt: f32 or bf16; anything else throws.
void sum_in_rank_order(const void* const* parts, int n, void* out, size_t count, DType dt);

// Throws unless dt is a dtype the reductions support (f32, bf16); `what` names the caller.
void check_reduce_dtype(DType dt, const char* what);

// Bytes of `count` elements of dt, with an overflow check.
size_t comm_bytes(size_t count, DType dt);

}  // namespace kestrel::parallel
