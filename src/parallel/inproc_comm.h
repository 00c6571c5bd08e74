// N ranks as threads of one process, communicating through shared host memory: the CPU twin of the
// NCCL path (docs/parallel.md), used by `--device cpu --tensor-parallel-size N` and by the tests.
//
// How a collective runs: each rank publishes its arguments in its slot of the group and waits at a
// barrier; every rank then checks that all slots describe the same call (op, count, dtype, root) and
// throws the same Error on every rank if not, so a mismatch never deadlocks; each rank computes its own
// output into private scratch, reading the other ranks' send buffers; a second barrier; each rank
// copies its scratch into its receive buffer. Nobody writes a buffer another rank may still read, so
// send and receive buffers may alias freely. Reductions use sum_in_rank_order (comm.h): identical
// bytes on every rank, equal to MpiComm's.
//
// Failure: a rank that throws outside a collective would leave the others waiting forever, so the
// group can be aborted (InProcessGroup::abort): every waiting and later collective throws. run_ranks()
// does that for you: it runs fn(comm) on N threads, aborts the group on the first exception and
// rethrows it in the caller after joining every thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/comm.h"

namespace kestrel::parallel {

class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const { return size_; }
  // The comm of one rank; the group must outlive it. Call once per rank.
  std::unique_ptr<Comm> comm(int rank);
  // Makes every current and future collective of the group throw Error(why).
  void abort(const std::string& why);

 private:
  friend class InProcessComm;
  enum class Op : uint8_t { all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, barrier };
  struct Slot {
    Op op = Op::barrier;
    const void* send = nullptr;
    size_t count = 0;
    DType dt = DType::u8;
    int root = 0;
  };
  void wait_all();  // barrier over all ranks; throws if aborted

  int size_;
  std::vector<Slot> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_msg_;
};

// Runs fn(comm of rank r) on n threads of one fresh group. The first exception thrown (in time) aborts
// the group and is rethrown here once every thread has finished; the other ranks' abort errors are
// dropped, so the caller sees the root cause.
void run_ranks(int n, const std::function<void(Comm&)>& fn);

}  // namespace kestrel::parallel
