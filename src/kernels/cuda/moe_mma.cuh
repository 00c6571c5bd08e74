// Device helpers shared by the MoE expert kernels (moe_experts.cu: grouping, the FP32-scale kernel and the
// combine; moe_stream.cu: decode; moe_wide.cu: prefill): loads, cp.async, programmatic dependent launch,
// cluster barriers and distributed shared memory loads, BF16 mma.sync, and the MXFP4 decode of one packed 32-bit word into four A registers (layout: moe_layout.h).
// Device code only.
//
// Scale folding. The decode forms each E2M1 value v as the BF16 v·2^-126 and multiplies by a bf16x2 constant.
// When that constant is 2^(e−1) for the row's e8m0 code e instead of 2^126, the product is the scaled weight
// v·2^(e−127) itself — exact for e in [1, 128]: 2^(e−1) is a normal BF16, and every v·2^(e−127) (at least
// 2^-128, at most 6·2^1) is a BF16, subnormal ones included, which mul.rn.bf16x2 keeps (checked on the H200).
// The MMAs then accumulate scaled products directly: no FP32 partial per 32-column block, no FMA per
// accumulator, the CPU twin's order of operations (w = v·s, then Σ w·x). Weights with a code outside [1, 128]
// (MoeExpertWeights::fp32_scales) take the FP32-scale kernel in moe_experts.cu.
// Emulation: under KESTREL_SIMT_EMU (tests/emu, the kernels compiled by g++ for a CPU emulation of the thread
// hierarchy) the inline-PTX wrappers below come from tests/emu/simt.h instead, with the PTX ISA's semantics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/moe_layout.h"

namespace kestrel::cuda::moe_dev {

namespace ml = moe_layout;

// ---- loads ------------------------------------------------------------------------------------------------
#ifndef KESTREL_SIMT_EMU
// Weights are read once per job: 16-byte loads that skip L1 (read-only for the whole program).
__device__ __forceinline__ uint4 ld_stream16(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_stream4(const uint8_t* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// Activations through L1 with a coherent load: under programmatic dependent launch the kernel that wrote
// them may still be running when this one starts, so the read-only (.nc) path is not allowed; reads happen
// only after griddep_wait() (volatile: never hoisted above it). Shared loads likewise stay below cp.async waits.
__device__ __forceinline__ uint4 ld_act16(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// A flag written by another CTA of a running grid (release: __threadfence + atomic); acquire at GPU scope.
__device__ __forceinline__ int ld_acquire_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
#endif  // KESTREL_SIMT_EMU
using dev::smem_addr;

// ---- cp.async (global → shared, asynchronous; groups complete in commit order) ----------------------------
// 16-byte copies (device_util.cuh): cp_async16(dst, src) always copies, cp_async16(dst, src, valid) writes 16
// zero bytes where !valid (nothing is read from src).
using dev::cp_async16;
using dev::cp_async_commit;
using dev::cp_async_wait;
#ifndef KESTREL_SIMT_EMU
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// ---- programmatic dependent launch (no-ops when the launch had no programmatic dependency) ----------------
// wait: every write of the preceding kernel (and, transitively, of those before it) is visible after it.
// launch: lets the next kernel start its CTAs (they run up to their own wait). Each kernel calls launch only
// after its wait, so a kernel that starts early finds every kernel before its predecessor complete.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void griddep_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// ---- thread-block clusters (moe_combine.cu's cluster kernel) ----------------------------------------------
// Every thread of every CTA of the cluster, each warp's threads together (.aligned). arrive releases the thread's
// earlier writes (its shared memory's included) at cluster scope; wait returns once every thread arrived, acquiring
// theirs. Apart, the work between them overlaps the barrier's latency; cluster_sync is both at once.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
// The float at p's offset in the shared memory of CTA `rank` of the cluster (distributed shared memory: mapa, then
// a shared::cluster load). Volatile: never hoisted above the cluster barrier that published the value.
__device__ __forceinline__ float ld_shared_cluster(const float* p, uint32_t rank) {
  float v;
  asm volatile(
      "{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, %1, %2;\n ld.shared::cluster.f32 %0, [ra];\n}\n"
      : "=f"(v)
      : "r"(smem_addr(p)), "r"(rank)
      : "memory");
  return v;
}

// ---- math -------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// d = A·B (C = 0) and d += A·B: m16n8k16, A row-major 16×16 BF16 (4 registers), B 16×8 BF16 (2), FP32 C/D.
__device__ __forceinline__ void mma_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}
__device__ __forceinline__ void mma_acc(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif  // KESTREL_SIMT_EMU

// The four A registers (BF16 pairs) of one k16 step from its packed 32-bit word, each multiplied by m[j & 1]
// (registers 0, 2 hold row g, registers 1, 3 row g + 8: moe_layout.h).
__device__ __forceinline__ void decode_step(uint32_t w, uint32_t m_g, uint32_t m_g8, uint32_t (&a)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t r = ml::e2m1_pair_bits(w, j);
#ifdef KESTREL_MOE_INTEGER_DECODE
    a[j] = bf16x2_mul(ml::e2m1_pair_bf16_exact(r), (j & 1) ? m_g8 : m_g);
#else
    a[j] = bf16x2_mul(r, (j & 1) ? m_g8 : m_g);
#endif
  }
}
// The same with the constant 2^126 (the FP32-scale kernel applies the scales itself).
__device__ __forceinline__ void decode_step_unscaled(uint32_t w, uint32_t (&a)[4]) {
#ifdef KESTREL_MOE_INTEGER_DECODE
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = ml::e2m1_pair_bf16_exact(ml::e2m1_pair_bits(w, j));
#else
  decode_step(w, ml::kBf16x2Pow126, ml::kBf16x2Pow126, a);
#endif
}

// The four A registers as decoded, v·2^-126 (moe_t8.cu's kScaleRaw scales the activations instead).
__device__ __forceinline__ void decode_step_raw(uint32_t w, uint32_t (&a)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = ml::e2m1_pair_bits(w, j);
}

// bf16x2 multiplier of byte i of a group scale word (moe_layout.h: byte i = row g + 8·(i & 1), block i >> 1):
// 2^(e−1) in both halves, exponent field e + 126 (e in [1, 128]: the launcher checks the weights' flag).
// The integer decode gives v itself, so its multiplier is 2^(e−127) (exponent field e).
template <int i>
__device__ __forceinline__ uint32_t scale_mult(uint32_t word) {
  const uint32_t b = __byte_perm(word, 0u, 0x4040u | (i << 8) | i);  // byte i in bytes 0 and 2
#ifdef KESTREL_MOE_INTEGER_DECODE
  return b << 7;
#else
  return b * 128u + 0x3F003F00u;  // (e + 126) << 7 per half; at most 254 << 7: no carry between halves
#endif
}

// SiTU-GLU as cpu::situ_glu computes it (same operation order), on BF16-rounded g and u.
__device__ __forceinline__ float situ_glu(float g, float u, float beta, float lbeta) {
  const float act = beta * tanhf(g / beta) * dev::sigmoid(g);
  return act * (lbeta * tanhf(u / lbeta));
}

}  // namespace kestrel::cuda::moe_dev
