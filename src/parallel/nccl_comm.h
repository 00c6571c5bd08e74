// NCCL communicator: one rank per GPU, device buffers, collectives enqueued on the comm's stream.
//
// Compiled when the CUDA toolkit's nccl.h is found (KESTREL_HAVE_NCCL); libnccl.so.2 itself is loaded
// with dlopen on first use, so a kestrel binary runs on machines without NCCL until a multi-GPU run
// asks for it. KESTREL_NCCL_LIBRARY names the library file when it is not on the loader path (PyTorch's
// wheels ship one as site-packages/nvidia/nccl/lib/libnccl.so.2).
//
// Creation goes through a bootstrap Comm over the same ranks: rank 0 draws the NCCL unique id,
// bootstrap.broadcast() carries its 128 bytes to every rank (MPI across processes and nodes, the
// in-process comm across threads), and every rank calls ncclCommInitRank for its device.
// Ordering: every call returns once the NCCL kernel is enqueued on `stream`; the buffers must stay
// valid until the stream reaches it. barrier() synchronises the stream. Reductions use NCCL's own
// order (ring/tree, bf16 accumulated by NCCL), so they equal the host backends only within rounding.
#pragma once

#include <memory>
#include <string>

#include "parallel/comm.h"

namespace kestrel::parallel {

// True when this binary was compiled with nccl.h.
bool nccl_compiled();

// NCCL's version as "2.28.9" (loads the library; throws with a clear message when it cannot).
std::string nccl_version();

// Rank bootstrap.rank() of bootstrap.size() on CUDA device `device`, enqueueing on `stream`
// (a cudaStream_t; nullptr = the legacy default stream). Collective over bootstrap's ranks.
std::unique_ptr<Comm> nccl_comm(Comm& bootstrap, int device, void* stream);

}  // namespace kestrel::parallel
