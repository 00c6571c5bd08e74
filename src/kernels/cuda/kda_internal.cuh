// Internals shared by the KDA CUDA sources: the decode kernels (kda.cu, kda_decode_fused.cu: 4-element state
// vectors, the conv window bound) and the chunk-parallel scan (kda_chunked.cu: chunk table and entry points;
// kda_chunked_v1.cu, kda_chunked_intra2.cu, kda_chunked_seq2.cu: the kernel variants): the chunk image and
// workspace layout that the intra-chunk launch writes and the sequential launch copies, the tensor-core,
// mbarrier, bulk-copy and cp.async wrappers, and the per-variant launch functions.
// Under KESTREL_SIMT_EMU (tests/emu: the kernels compiled for a CPU emulation of the thread hierarchy) the
// inline-PTX wrappers come from the emulator instead; the kernels therefore use them, and dyn_smem<T>() for
// their dynamic shared memory, rather than writing PTX or `extern __shared__` themselves.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda::kda_detail {

constexpr int kC = 64;                // chunk length
constexpr double kLog2e = 1.4426950408889634;
constexpr size_t kMaxSmemPerBlock = 232448;  // sm_90: 227 KiB of dynamic shared memory per block

// The image of one (chunk, head) in the workspace, which is also the seq kernels' shared-memory stage.
// F16 = false: the recurrence operands W, K̂ᵀ (TF32-rounded) and U0ᵀ in f32; F16 = true (the FP16 recurrence): the
// same three in FP16 (11 significant bits like TF32; the range of the FP16 state the day-0 recipe keeps).
// Strides (in elements) make the seq kernels' fragment loads conflict-free: 8-byte f32 pairs need a row
// stride ≡ 8 (mod 32 words), 4-byte 16-bit pairs a stride ≡ 4 (mod 8 words).
template <int K, bool F16 = false>
struct Img {
  static constexpr size_t WB = F16 ? 2 : 4;  // bytes of a W / K̂ᵀ / U0ᵀ element
  static constexpr int KPW = K + 8;  // W   [C tokens][KPW]
  static constexpr int TP = kC + 8;  // K̂ᵀ [K keys][TP], U0ᵀ [K values][TP]
  static constexpr int KPQ = K + 8;  // Q̃  bf16 [C tokens][KPQ]
  static constexpr int APQ = kC + 8; // QK  bf16 [C tokens t][APQ] (s ≤ t, zero elsewhere)
  static constexpr size_t w_off = 0;
  static constexpr size_t kh_off = w_off + size_t(kC) * KPW * WB;
  static constexpr size_t q_off = kh_off + size_t(K) * TP * WB;
  static constexpr size_t a_off = q_off + size_t(kC) * KPQ * 2;
  static constexpr size_t e_off = a_off + size_t(kC) * APQ * 2;  // eG f32 [K]
  static constexpr size_t shared_bytes = e_off + size_t(K) * 4;  // the part every value block needs
  static constexpr size_t u_off = shared_bytes;                  // U0ᵀ
  static constexpr size_t bytes = u_off + size_t(K) * TP * WB;
  // One seq CTA's rows of U0ᵀ (bv value columns) and its shared-memory stage.
  static constexpr size_t u_slice_bytes(int bv) { return size_t(bv) * TP * WB; }
  static constexpr size_t stage_bytes(int bv) { return shared_bytes + u_slice_bytes(bv); }
  static_assert(kh_off % 16 == 0 && q_off % 16 == 0 && a_off % 16 == 0 && e_off % 16 == 0 &&
                    shared_bytes % 16 == 0 && bytes % 16 == 0 && u_slice_bytes(16) % 16 == 0,
                "bulk copies need 16-byte sizes and offsets");
};

// Launch arguments common to the variants (pointers as in kda.h; cs, cseq: the chunk table; imgs: the images).
struct ChunkArgs {
  const float *q, *k, *v, *g;  // f32 [T, H*K], row stride ld
  int64_t ld;
  const float* beta;  // f32 [T, H], row stride ld_beta
  int64_t ld_beta;
  const int32_t* cu;     // i32 [B+1]
  const int32_t* slots;  // i32 [B]
  int32_t* cs;           // i32 [B+1] first chunk of each sequence
  int32_t* cseq;         // i32 [cap] sequence of each chunk
  char* imgs;            // [cap][H] images of Img<K, F16>::bytes (the workspace fits the larger f32 format)
  float* o;              // f32 [T, H*K], row stride ld
  int B, H;
  int64_t cap;  // chunk slots in the workspace
};

// Workspace: the chunk table (B+1 + cap i32, padded to 256 bytes), then cap × H images. cap bounds the chunks
// of any B sequences of T tokens in total: Σ⌈len_b/64⌉ ≤ T/64 + B.
inline int64_t capacity_chunks(int64_t T, int64_t B) { return T / kC + B + 1; }
inline size_t table_bytes(int64_t B, int64_t cap) { return (size_t(B + 1 + cap) * 4 + 255) / 256 * 256; }

template <int K>
void launch_intra1(const ChunkArgs& a, cudaStream_t stream);
template <int K, bool F16>
void launch_intra2(const ChunkArgs& a, cudaStream_t stream);
template <int K, typename StateT>
void launch_seq1(const ChunkArgs& a, StateT* pool, cudaStream_t stream);
// VM: 16-column value tiles per CTA (2·VM warps; each pair of warps splits the keys). F16: the image format.
// MC: the CTAs of a (head, sequence) form a cluster and the leader multicasts the shared part of each image.
template <int K, typename StateT, int VM, bool F16, bool MC>
void launch_seq2(const ChunkArgs& a, StateT* pool, cudaStream_t stream);

// ---- device helpers ------------------------------------------------------------------------------------------
#ifndef KESTREL_SIMT_EMU
// The launch's dynamic shared memory (one declaration for every kernel of these files; 128-byte aligned).
template <typename T>
__device__ __forceinline__ T* dyn_smem() {
  extern __shared__ __align__(128) unsigned char kda_dyn_smem[];
  return reinterpret_cast<T*>(kda_dyn_smem);
}

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float tf32f(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float f16lo(uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w & 0xFFFFu))); }
__device__ __forceinline__ float f16hi(uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w >> 16))); }

// D += A·B, m16n8k8 TF32. Lane l, g = l/4, t = l%4: a = (g,t) (g+8,t) (g,t+4) (g+8,t+4); b = (t,g) (t+4,g);
// d = (g,2t) (g,2t+1) (g+8,2t) (g+8,2t+1) as (row, col).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// D += A·B, m16n8k16 BF16: a regs = (g, 2t..2t+1) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..); b regs = (2t..2t+1, g)
// (2t+8.., g); d as above. The lower column / row index sits in the low 16 bits.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D += A·B, m16n8k16 FP16 operands (layouts as BF16).
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// ldmatrix: 8×8 tiles of 16-bit elements from shared memory; lane l gives the address of row l % 8 of tile
// l / 8 (16-byte aligned) and receives, per tile i, r[i] = its row l / 4, elements 2(l % 4) and 2(l % 4) + 1
// (the lower one in the low half) — an mma B fragment (n = row, k = element) when the matrix is stored
// n-major. x4: tiles 0..3; x2: tiles 0..1 (lanes 16..31 give addresses that are not used).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(row)));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}
// 1-D bulk copy global → shared (TMA), completing `bytes` of transaction on `bar`. 16-byte aligned, size % 16 == 0.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// ---- clusters (seq variant 4): one CTA's bulk copy lands in every CTA of its cluster ----
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster (release / acquire at cluster scope).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Arrive (release, cluster scope) on the mbarrier that sits at `bar`'s offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, uint32_t rank) {
  asm volatile(
      "{\n .reg .b32 ra;\n mapa.shared::cluster.u32 ra, %0, %1;\n"
      " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(smem_u32(bar)),
      "r"(rank)
      : "memory");
}
// try_wait that acquires at cluster scope (the arrivals come from other CTAs).
__device__ __forceinline__ bool mbar_try_wait_cluster(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}
// Bulk copy global → the shared memory of every CTA in `mask` (same offset as dst), each completing `bytes` of
// transaction on its own mbarrier at bar's offset. 16-byte aligned, size % 16 == 0.
__device__ __forceinline__ void bulk_g2s_multicast(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                                   uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "h"(mask)
      : "memory");
}

// Makes mbarrier.init visible to the async proxy (bulk copies completing on the barrier).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders this thread's generic-proxy shared-memory accesses before later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Named barrier ID over COUNT threads (a multiple of 32); id 0 is __syncthreads'.
template <int ID, int COUNT>
__device__ __forceinline__ void named_barrier() {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(COUNT) : "memory");
}

// 16-byte cp.async global → shared through L2 only; src_bytes = 0 fills the 16 bytes with zeros (src must still
// be a valid address). Completion: cp_async_commit, then cp_async_wait<n> (this thread's copies only).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// 8-byte form (through L1: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif  // KESTREL_SIMT_EMU

// 4-element state vectors (the decode kernels of kda.cu and kda_decode_fused.cu): f32 as one 16-byte access,
// f16 as one 8-byte access widened to f32 / rounded to nearest even.
__device__ __forceinline__ void load4(const float* p, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float (&x)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = __half2float(__ushort_as_half(uint16_t(v.x))), x[1] = __half2float(__ushort_as_half(uint16_t(v.x >> 16)));
  x[2] = __half2float(__ushort_as_half(uint16_t(v.y))), x[3] = __half2float(__ushort_as_half(uint16_t(v.y >> 16)));
}
__device__ __forceinline__ uint2 pack_half4(const float (&x)[4]) {
  const uint32_t lo = uint32_t(__half_as_ushort(__float2half_rn(x[0]))) |
                      (uint32_t(__half_as_ushort(__float2half_rn(x[1]))) << 16);
  const uint32_t hi = uint32_t(__half_as_ushort(__float2half_rn(x[2]))) |
                      (uint32_t(__half_as_ushort(__float2half_rn(x[3]))) << 16);
  return make_uint2(lo, hi);
}
// Stored through __stwb (st.global.wb, the default cache policy): a plain `*(float4*)p = v` reached the PTX as
// four st.global.f32 (two .u32 for f16) — 4× the store instructions, each lane's 16 bytes split over four
// instructions, and the fused decode's warps throttled on the LSU queue at the end of their chain (Nsight
// Compute, session 29: 28 % of its stall samples on those stores).
__device__ __forceinline__ void store4(float* p, const float (&x)[4]) {
  __stwb(reinterpret_cast<float4*>(p), make_float4(x[0], x[1], x[2], x[3]));
}
__device__ __forceinline__ void store4(uint16_t* p, const float (&x)[4]) {
  __stwb(reinterpret_cast<uint2*>(p), pack_half4(x));
}
// Streaming stores (evict-first): the state written back is not read again by this launch.
__device__ __forceinline__ void store4_cs(float* p, const float (&x)[4]) {
  __stcs(reinterpret_cast<float4*>(p), make_float4(x[0], x[1], x[2], x[3]));
}
__device__ __forceinline__ void store4_cs(uint16_t* p, const float (&x)[4]) {
  __stcs(reinterpret_cast<uint2*>(p), pack_half4(x));
}

// The longest short-conv window the decode and prefill conv kernels keep in registers (MODEL.md §3.3 step 2).
constexpr int kMaxConvW = 8;

__device__ __forceinline__ float load_state(const float* p) { return *p; }
__device__ __forceinline__ float load_state(const uint16_t* p) { return __half2float(__ushort_as_half(*p)); }
__device__ __forceinline__ void store_state(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_state(uint16_t* p, float x) { *p = __half_as_ushort(__float2half_rn(x)); }

__device__ __forceinline__ int nchunks(int32_t a, int32_t b) { return b > a ? int((int64_t(b) - a + kC - 1) / kC) : 0; }

}  // namespace kestrel::cuda::kda_detail
