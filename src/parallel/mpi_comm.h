// One rank per process under `mpirun` (OpenMPI from Debian), host buffers: the CPU twin across
// processes and nodes, and the bootstrap that carries NCCL's unique id (nccl_comm.h).
//
// MPI is initialised on first use (MPI_THREAD_SERIALIZED: collectives may come from any thread, one at
// a time, which is how the engine calls them) and finalised at process exit. Reductions are computed
// as in the in-process backend, not by MPI's own operators, whose summation order depends on the
// algorithm MPI picks: every rank sends block p of its buffer to rank p (MPI_Alltoallv), rank p sums
// what it received with sum_in_rank_order, and the reduced blocks are gathered back (MPI_Allgatherv).
// That is a bandwidth-optimal reduce-scatter + all-gather whose bytes equal InProcessComm's.
// MPI counts are ints: a single message over 2^31 - 1 bytes is refused with a clear error.
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace kestrel::parallel {

// True when this binary was built with MPI (KESTREL_HAVE_MPI).
bool mpi_available();

// True when the process was started by an MPI launcher (OMPI_COMM_WORLD_SIZE, PMI_SIZE or
// PMIX_RANK in the environment); MPI itself is not initialised by asking.
bool launched_by_mpi();

// The world communicator (all processes of the mpirun). Throws when MPI is not built in.
std::unique_ptr<Comm> mpi_world();

}  // namespace kestrel::parallel
