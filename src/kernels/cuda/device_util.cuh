// Device-side helpers shared by the .cu files: bf16 bit-pattern conversions (RNE, the same rule as
// core/dtype.h), 16-byte vector loads of 8 bf16 values, warp/block sum reductions, the PDL wait/trigger.
// Device code only; never include from a .cpp file.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::dev {

__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// Round-to-nearest-even, NaN kept quiet (bit-identical to kestrel::f32_to_bf16).
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// 8 bf16 values <-> one 16-byte vector.
__device__ __forceinline__ void unpack8(const uint4& v, float* f /* f32 [8] */) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack8(const float* f /* f32 [8] */) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = uint32_t(f32_to_bf16(f[2 * i])) | (uint32_t(f32_to_bf16(f[2 * i + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint4 ld16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats; blockDim.x must be
// a multiple of 32. Contains __syncthreads: call from all threads.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float s = lane < nw ? scratch[lane] : 0.0f;
  return warp_sum(s);
}

// The same in double (statistics the CPU twins accumulate in double). `scratch` holds >= 32 doubles.
__device__ __forceinline__ double block_sum_d(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double s = lane < nw ? scratch[lane] : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

#ifndef KESTREL_SIMT_EMU  // (tests/emu, the CPU emulation the kernels are also compiled for: the #else below)
// Programmatic Dependent Launch (kernels/cuda/launch.h): wait until the previous kernel on the stream has
// completed and its writes are visible (a no-op without a programmatic dependency); let the next kernel's
// CTAs launch (they run up to their own wait). Every PDL kernel calls pdl_wait() on every path.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// The launch's dynamic shared memory (16-byte aligned).
template <typename T>
__device__ __forceinline__ T* dyn_smem() {
  extern __shared__ __align__(16) unsigned char dev_dyn_smem[];
  return reinterpret_cast<T*>(dev_dyn_smem);
}

// cp.async (sm_80+): 16 bytes global → shared, L2 only (.cg); src-size 0 when !in zero-fills the destination
// without reading (src must still be a valid address); the two-argument form always copies. Groups: commit,
// then wait until at most N are pending; the other threads see the data after a barrier.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#else
// The emulator's forms (tests/emu/simt.h): kernels run one after another, so the PDL calls have nothing to do;
// shared addresses are offsets into the CTA's dynamic shared memory; copies land at the wait for their group.
inline void pdl_wait() {}
inline void pdl_trigger() {}
template <typename T>
inline T* dyn_smem() {
  return reinterpret_cast<T*>(simt::my_cta().smem);
}
inline uint32_t smem_addr(const void* p) { return simt::smem_handle(p); }
inline void cp_async16(uint32_t dst, const void* src, bool in) {
  if (dst % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    throw std::runtime_error("simt: cp.async of 16 bytes not 16-byte aligned");
  simt::cp_async(simt::smem_at(dst, 16), src, 16, in ? 16 : 0);
}
inline void cp_async16(uint32_t dst, const void* src) { cp_async16(dst, src, true); }
inline void cp_async_commit() { simt::cp_commit(); }
template <int N>
inline void cp_async_wait() {
  simt::cp_wait(N);
}
#endif

}  // namespace kestrel::cuda::dev
