// MPI communicator; see mpi_comm.h. Without MPI (KESTREL_HAVE_MPI undefined) only the stubs at the
// bottom are compiled, so callers need no #ifdefs.
#include "parallel/mpi_comm.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "core/check.h"

#ifdef KESTREL_HAVE_MPI
// The C API only: OpenMPI's mpi.h would otherwise drag in its (deprecated, separately linked) C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace kestrel::parallel {

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

#ifdef KESTREL_HAVE_MPI

bool mpi_available() { return true; }

namespace {

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("MPI call {} failed: {}", call, std::string(msg, size_t(len)));
}
#define KMPI(call) check_mpi((call), #call)

void finalize_at_exit() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Finalize();
}

void ensure_init() {
  int init = 0;
  MPI_Initialized(&init);
  if (init) return;
  int provided = 0;
  KMPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
  std::atexit(finalize_at_exit);
  if (provided < MPI_THREAD_SERIALIZED)
    fail("MPI provides thread level {} but kestrel needs MPI_THREAD_SERIALIZED", provided);
  // Errors come back as return codes (turned into kestrel::Error), not as an abort of the job.
  KMPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
}

int as_int(size_t bytes, const char* what) {
  if (bytes > size_t(std::numeric_limits<int>::max()))
    fail("MPI {} of {} bytes exceeds the 2^31 - 1 bytes one MPI message can carry", what, bytes);
  return int(bytes);
}

class MpiComm final : public Comm {
 public:
  MpiComm() {
    ensure_init();
    KMPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    KMPI(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  Device device() const override { return Device::cpu; }

  void all_reduce_sum(void* buf, size_t count, DType dt) override {
    check_reduce_dtype(dt, "all_reduce_sum");
    const size_t esz = dtype_size(dt), n = size_t(size_);
    // Block p holds elements [off[p], off[p] + len[p]); the first count % n blocks get one extra.
    std::vector<int> len(n), off(n), recv_len(n), recv_off(n);
    for (size_t p = 0, at = 0; p < n; ++p) {
      const size_t c = count / n + (p < count % n ? 1 : 0);
      len[p] = as_int(c * esz, "all_reduce block");
      off[p] = as_int(at * esz, "all_reduce offset");
      at += c;
    }
    const int mine = len[size_t(rank_)];
    std::vector<uint8_t> pieces(size_t(mine) * n);
    for (size_t p = 0; p < n; ++p) {
      recv_len[p] = mine;
      recv_off[p] = int(p) * mine;
    }
    as_int(pieces.size(), "all_reduce");
    KMPI(MPI_Alltoallv(buf, len.data(), off.data(), MPI_BYTE, pieces.data(), recv_len.data(), recv_off.data(),
                       MPI_BYTE, MPI_COMM_WORLD));
    std::vector<const void*> parts(n);
    for (size_t p = 0; p < n; ++p) parts[p] = pieces.data() + p * size_t(mine);
    std::vector<uint8_t> reduced(static_cast<size_t>(mine));
    sum_in_rank_order(parts.data(), size_, reduced.data(), size_t(mine) / esz, dt);
    KMPI(MPI_Allgatherv(reduced.data(), mine, MPI_BYTE, buf, len.data(), off.data(), MPI_BYTE, MPI_COMM_WORLD));
  }

  void all_gather(const void* send, void* recv, size_t count, DType dt) override {
    const int b = as_int(comm_bytes(count, dt), "all_gather block");
    as_int(size_t(b) * size_t(size_), "all_gather");
    KMPI(MPI_Allgather(send, b, MPI_BYTE, recv, b, MPI_BYTE, MPI_COMM_WORLD));
  }

  void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dt) override {
    check_reduce_dtype(dt, "reduce_scatter_sum");
    const int b = as_int(comm_bytes(count, dt), "reduce_scatter block");
    as_int(size_t(b) * size_t(size_), "reduce_scatter");
    std::vector<uint8_t> pieces(size_t(b) * size_t(size_));
    KMPI(MPI_Alltoall(send, b, MPI_BYTE, pieces.data(), b, MPI_BYTE, MPI_COMM_WORLD));
    std::vector<const void*> parts(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) parts[size_t(p)] = pieces.data() + size_t(p) * size_t(b);
    sum_in_rank_order(parts.data(), size_, recv, count, dt);
  }

  void broadcast(void* buf, size_t count, DType dt, int root) override {
    KCHECK(root >= 0 && root < size_, "broadcast root {} outside [0, {})", root, size_);
    KMPI(MPI_Bcast(buf, as_int(comm_bytes(count, dt), "broadcast"), MPI_BYTE, root, MPI_COMM_WORLD));
  }

  void all_to_all(const void* send, void* recv, size_t count, DType dt) override {
    const int b = as_int(comm_bytes(count, dt), "all_to_all block");
    as_int(size_t(b) * size_t(size_), "all_to_all");
    KMPI(MPI_Alltoall(send, b, MPI_BYTE, recv, b, MPI_BYTE, MPI_COMM_WORLD));
  }

  void barrier() override { KMPI(MPI_Barrier(MPI_COMM_WORLD)); }

 private:
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> mpi_world() { return std::make_unique<MpiComm>(); }

#else  // !KESTREL_HAVE_MPI

bool mpi_available() { return false; }

std::unique_ptr<Comm> mpi_world() {
  fail("this kestrel was built without MPI (install libopenmpi-dev and rebuild: scripts/install-deps.sh)");
}

#endif

}  // namespace kestrel::parallel
