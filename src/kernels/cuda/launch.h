// Kernel launches with Programmatic Dependent Launch (PDL, sm_90): a kernel launched through
// launch_pdl may start while the kernel before it on the stream is still running, once every CTA of
// that kernel has executed griddepcontrol.launch_dependents (dev::pdl_trigger) or exited. Its CTAs
// then run their prologue (address arithmetic, loads of weights, which no kernel writes) and block in
// griddepcontrol.wait (dev::pdl_wait) until the previous kernel has completed and its writes are
// visible; so the launch gap and the prologue overlap the previous kernel's tail. Captured into CUDA
// graphs as programmatic edges.
//
// The rule every PDL kernel keeps (device_util.cuh): call dev::pdl_wait() on every path before reading
// anything an earlier kernel wrote, before writing anything, and before exiting — so "kernel N+1 passed
// its wait" implies "every kernel before N+1 completed", which the split-K counters of the skinny GEMM
// and the in-place buffers of the forward rely on.
//
// KESTREL_PDL=0 in the environment turns the attribute off (plain stream order; the device-side wait
// and trigger are then no-ops), for A/B timing and as a fallback.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"

namespace kestrel::cuda {

bool pdl_enabled();  // KESTREL_PDL (default on), read once
int sm_count();      // the current device's SM count, read once (132 if the query fails)
void set_pdl_enabled(bool on);  // tests and benchmarks

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute when enabled; cluster_x > 1 also
// groups grid.x in thread-block clusters of that size (grid.x a multiple of it; at most 8, the portable size).
template <typename... KArgs, typename... Args>
void launch_pdl_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        unsigned cluster_x, Args&&... args) {
  KCUDA_REQUIRE(cluster_x >= 1 && cluster_x <= 8 && grid.x % cluster_x == 0,
                std::string("launch_pdl_cluster: cluster size must be 1..8 and divide grid.x"));
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  // Not on the legacy default stream (tests, uploads): plain stream order there.
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() && stream != nullptr ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster_x;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = cluster_x > 1 ? 2 : 1;
  KCUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  launch_pdl_cluster(kernel, grid, block, smem, stream, 1u, std::forward<Args>(args)...);
}

}  // namespace kestrel::cuda
