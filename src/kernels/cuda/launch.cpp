// PDL switch (see launch.h).
#include "kernels/cuda/launch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace kestrel::cuda {
namespace {
std::atomic<int> g_pdl{-1};  // -1: not read yet
}  // namespace

bool pdl_enabled() {
  int v = g_pdl.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("KESTREL_PDL");
    v = (e && std::strcmp(e, "0") == 0) ? 0 : 1;
    g_pdl.store(v, std::memory_order_relaxed);
  }
  return v != 0;
}

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0)
      return 132;
    return v;
  }();
  return n;
}

void set_pdl_enabled(bool on) { g_pdl.store(on ? 1 : 0, std::memory_order_relaxed); }

}  // namespace kestrel::cuda
