// The host side of the CUDA runtime, as the kernel files' own launchers call it, for the CPU emulation of simt.h:
// with it a launcher (moe_experts_mxfp4, launch_fixed, ...) runs unchanged and its grids run on the emulator, so a
// test runs what the launcher would launch on the GPU — its plan, its choice of instantiation, its arguments —
// instead of a copy of that logic. (Launches written <<<...>>>, which g++ cannot parse, stay behind
// #ifndef KESTREL_SIMT_EMU in the kernel files, which launch the same grid through cudaLaunchKernelEx there.)
//
//   cudaLaunchKernelEx   runs the whole grid before it returns (simt::launch): the grids of a stream run one after
//                        another, so programmatic dependent launch has nothing to overlap and a grid sees every
//                        write of the grids before it; the cluster-dimension attribute runs each cluster's CTAs
//                        together. Each launch is logged in simt::g_launches with the kernel's name
//                        (simt::name_kernel) and its cluster shape for tests to check what ran.
//   device properties    from a table of emulated devices, simt::g_devices (SM count, CTAs resident per SM: one
//                        number for every kernel, where the real occupancy depends on each kernel's registers);
//                        cudaGetDevice answers simt::g_device, so the launchers' per-device caches stay right when a
//                        test switches devices.
//   memory               host and device memory are one: cudaMemcpy / cudaMemsetAsync are memcpy / memset.
//   streams, events      no-ops; nothing is ever being captured.
#pragma once

#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simt.h"

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "invalid configuration";
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

namespace simt {
struct Device {
  const char* name;
  int sms, ctas_per_sm;
};
// 0: the H200's SM count (4 CTAs an SM: the t8 / t8p kernels' occupancy there is 4–8). 1: two SMs, where the small
// shapes of the tests fill the waves as the real shapes fill the H200's (the launchers then choose what they choose
// at the real shape: the persistent kernel, the activations read at use, several units a CTA).
inline std::vector<Device> g_devices = {{"H200 (132 SMs)", 132, 4}, {"two SMs", 2, 4}};
inline int g_device = 0;

struct Launched {
  std::string kernel;  // simt::name_kernel's name, "?" if none
  dim3 grid, block;
  size_t smem;
  bool pdl;  // asked for programmatic stream serialization
  dim3 cluster;  // the thread-block cluster's shape (1, 1, 1 without the attribute)
};
inline std::vector<Launched> g_launches;

inline std::map<const void*, std::string>& kernel_names() {
  static std::map<const void*, std::string> m;
  return m;
}
template <typename... A>
inline void name_kernel(void (*kernel)(A...), std::string name) {
  kernel_names()[reinterpret_cast<const void*>(kernel)] = std::move(name);
}
inline std::string kernel_name(const void* kernel) {
  const auto it = kernel_names().find(kernel);
  return it == kernel_names().end() ? "?" : it->second;
}
}  // namespace simt

enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
inline cudaError_t cudaGetDevice(int* dev) {
  *dev = simt::g_device;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int dev) {
  if (attr != cudaDevAttrMultiProcessorCount || dev < 0 || size_t(dev) >= simt::g_devices.size())
    return cudaErrorInvalidValue;
  *v = simt::g_devices[size_t(dev)].sms;
  return cudaSuccess;
}
template <typename... A>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void (*)(A...), int block, size_t) {
  if (block < 1 || block > 1024) return cudaErrorInvalidValue;
  *n = simt::g_devices.at(size_t(simt::g_device)).ctas_per_sm;
  return cudaSuccess;
}

enum cudaLaunchAttributeID { cudaLaunchAttributeClusterDimension = 4, cudaLaunchAttributeProgrammaticStreamSerialization = 5 };
union cudaLaunchAttributeValue {
  int programmaticStreamSerializationAllowed;
  struct {
    unsigned x, y, z;
  } clusterDim;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};
// The arguments are converted to the kernel's parameter types once, as the runtime does, and every thread gets
// its own copy of them.
template <typename... ExpTypes, typename... ActTypes>
inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* cfg, void (*kernel)(ExpTypes...), ActTypes&&... args) {
  const dim3 g = cfg->gridDim, b = cfg->blockDim;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  if (threads < 1 || threads > 1024 || b.z > 64 || g.x < 1 || g.y < 1 || g.z < 1 || g.y > 65535 || g.z > 65535 ||
      cfg->dynamicSmemBytes > 227 * 1024)
    return cudaErrorInvalidConfiguration;
  bool pdl = false;
  dim3 cluster(1, 1, 1);
  for (unsigned i = 0; i < cfg->numAttrs; ++i) {
    pdl = pdl || (cfg->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization &&
                  cfg->attrs[i].val.programmaticStreamSerializationAllowed);
    if (cfg->attrs[i].id == cudaLaunchAttributeClusterDimension) {
      const auto& c = cfg->attrs[i].val.clusterDim;
      cluster = dim3(c.x, c.y, c.z);
    }
  }
  // Portable cluster sizes only (at most 8 CTAs), dividing the grid, as the hardware requires.
  if (cluster.x < 1 || cluster.y < 1 || cluster.z < 1 || cluster.x * cluster.y * cluster.z > 8 || g.x % cluster.x ||
      g.y % cluster.y || g.z % cluster.z)
    return cudaErrorInvalidConfiguration;
  simt::g_launches.push_back(
      {simt::kernel_name(reinterpret_cast<const void*>(kernel)), g, b, cfg->dynamicSmemBytes, pdl, cluster});
  const std::tuple<std::decay_t<ExpTypes>...> params(std::forward<ActTypes>(args)...);
  simt::launch(g, b, cfg->dynamicSmemBytes, [&] { std::apply(kernel, params); }, cluster);
  return cudaSuccess;
}

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t bytes, cudaStream_t = nullptr) {
  if (bytes) std::memset(p, v, bytes);
  return cudaSuccess;
}
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2
};
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* s) {
  *s = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) { return cudaSuccess; }
