// NCCL communicator (see nccl_comm.h). The library is resolved with dlopen/dlsym into a table of
// function pointers whose types come from nccl.h, so the compiler checks every call's signature.
// all_to_all is a group of ncclSend/ncclRecv (present since NCCL 2.7; ncclAlltoAll only since 2.28).
#include "parallel/nccl_comm.h"

#include "core/check.h"

#ifdef KESTREL_HAVE_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <mutex>
#endif

namespace kestrel::parallel {

#ifdef KESTREL_HAVE_NCCL

bool nccl_compiled() { return true; }

namespace {

struct NcclLib {
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
  decltype(&::ncclSend) Send = nullptr;
  decltype(&::ncclRecv) Recv = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;
};

const NcclLib& lib() {
  static NcclLib l;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string tried;
    void* h = nullptr;
    const char* env = std::getenv("KESTREL_NCCL_LIBRARY");
    for (const char* name : {env, "libnccl.so.2", "libnccl.so"}) {
      if (!name || !*name) continue;
      h = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (h) break;
      tried += fmt::format("\n  {}: {}", name, ::dlerror());
    }
    if (!h) {
      error = "cannot load the NCCL library (set KESTREL_NCCL_LIBRARY to libnccl.so.2's path):" + tried;
      return;
    }
    auto sym = [&](auto& fp, const char* name) {
      fp = reinterpret_cast<std::remove_reference_t<decltype(fp)>>(::dlsym(h, name));
      if (!fp && error.empty()) error = fmt::format("the NCCL library lacks {}", name);
    };
    sym(l.GetVersion, "ncclGetVersion");
    sym(l.GetErrorString, "ncclGetErrorString");
    sym(l.GetUniqueId, "ncclGetUniqueId");
    sym(l.CommInitRank, "ncclCommInitRank");
    sym(l.CommDestroy, "ncclCommDestroy");
    sym(l.AllReduce, "ncclAllReduce");
    sym(l.AllGather, "ncclAllGather");
    sym(l.ReduceScatter, "ncclReduceScatter");
    sym(l.Broadcast, "ncclBroadcast");
    sym(l.Send, "ncclSend");
    sym(l.Recv, "ncclRecv");
    sym(l.GroupStart, "ncclGroupStart");
    sym(l.GroupEnd, "ncclGroupEnd");
  });
  if (!error.empty()) throw Error(error);
  return l;
}

void check(ncclResult_t r, const char* call) {
  if (r == ncclSuccess) return;
  fail("NCCL call {} failed: {} (code {})", call, lib().GetErrorString(r), int(r));
}
#define KNCCL(call) check((call), #call)

void check_cuda_nccl(cudaError_t e, const char* call) {
  if (e != cudaSuccess) fail("CUDA call {} failed: {}", call, cudaGetErrorString(e));
}

ncclDataType_t reduce_type(DType dt, const char* what) {
  check_reduce_dtype(dt, what);
  return dt == DType::f32 ? ncclFloat32 : ncclBfloat16;
}

class NcclComm final : public Comm {
 public:
  NcclComm(Comm& bootstrap, int device, cudaStream_t stream) : stream_(stream), device_(device) {
    const NcclLib& l = lib();
    rank_ = bootstrap.rank();
    size_ = bootstrap.size();
    ncclUniqueId id{};
    if (rank_ == 0) KNCCL(l.GetUniqueId(&id));
    bootstrap.broadcast(&id, sizeof(id), DType::u8, 0);
    check_cuda_nccl(cudaSetDevice(device), "cudaSetDevice");
    KNCCL(l.CommInitRank(&comm_, size_, id, rank_));
    check_cuda_nccl(cudaMalloc(&one_, sizeof(float)), "cudaMalloc");
  }
  ~NcclComm() override {
    if (one_) cudaFree(one_);
    if (comm_) lib().CommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  Device device() const override { return Device::cuda; }

  void all_reduce_sum(void* buf, size_t count, DType dt) override {
    KNCCL(lib().AllReduce(buf, buf, count, reduce_type(dt, "all_reduce_sum"), ncclSum, comm_, stream_));
  }
  void all_gather(const void* send, void* recv, size_t count, DType dt) override {
    KNCCL(lib().AllGather(send, recv, comm_bytes(count, dt), ncclUint8, comm_, stream_));
  }
  void reduce_scatter_sum(const void* send, void* recv, size_t count, DType dt) override {
    KNCCL(lib().ReduceScatter(send, recv, count, reduce_type(dt, "reduce_scatter_sum"), ncclSum, comm_, stream_));
  }
  void broadcast(void* buf, size_t count, DType dt, int root) override {
    KCHECK(root >= 0 && root < size_, "broadcast root {} outside [0, {})", root, size_);
    KNCCL(lib().Broadcast(buf, buf, comm_bytes(count, dt), ncclUint8, root, comm_, stream_));
  }
  void all_to_all(const void* send, void* recv, size_t count, DType dt) override {
    const NcclLib& l = lib();
    const size_t b = comm_bytes(count, dt);
    KNCCL(l.GroupStart());
    for (int p = 0; p < size_; ++p) {
      KNCCL(l.Send(static_cast<const uint8_t*>(send) + size_t(p) * b, b, ncclUint8, p, comm_, stream_));
      KNCCL(l.Recv(static_cast<uint8_t*>(recv) + size_t(p) * b, b, ncclUint8, p, comm_, stream_));
    }
    KNCCL(l.GroupEnd());
  }
  void barrier() override {
    KNCCL(lib().AllReduce(one_, one_, 1, ncclFloat32, ncclSum, comm_, stream_));
    check_cuda_nccl(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_;
  int device_;
  int rank_ = 0, size_ = 1;
  void* one_ = nullptr;  // f32 [1] scratch for barrier()
};

}  // namespace

std::string nccl_version() {
  int v = 0;
  KNCCL(lib().GetVersion(&v));
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

std::unique_ptr<Comm> nccl_comm(Comm& bootstrap, int device, void* stream) {
  return std::make_unique<NcclComm>(bootstrap, device, static_cast<cudaStream_t>(stream));
}

#else  // !KESTREL_HAVE_NCCL

bool nccl_compiled() { return false; }
std::string nccl_version() { fail("this kestrel was built without nccl.h (no NCCL support)"); }
std::unique_ptr<Comm> nccl_comm(Comm&, int, void*) { fail("this kestrel was built without nccl.h (no NCCL support)"); }

#endif

}  // namespace kestrel::parallel
