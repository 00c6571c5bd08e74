// The tensor-core MLA attention core shared by the paged decode (mla_decode.cu) and the paged prefill
// (mla_prefill.cu): internal to kernels/cuda, not a public launcher (paged.h has those).
//
// Work unit: one query row (a decode token or one prefill token) with all its Hm ≤ 16 heads, attending in
// the absorbed (MQA) form of MODEL.md §3.4 to its key list — positions 0..lens[b]−1 (dense) or the
// −1-terminated selection sel[b, ..] (§3.5 step 7) — read straight from the paged latent cache through the
// row's block table. The key list is cut into n_splits chunks of `chunk` keys (split-KV); one CTA per
// (row, split). Output per CTA: either the unnormalised FP32 partial (o_lat, running max m in the log2
// domain, running sum l) for a log-sum-exp combine, or — when n_splits == 1 — the normalised bf16 ô.
// Design, numerics and costs: the header of mla_tc.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/paged.h"
#ifdef __CUDACC__
#include <utility>

#include "kernels/cuda/cuda_check.h"
#endif

namespace kestrel::cuda::tc {

constexpr int kKeysPerTile = 64;   // keys per shared-memory tile (the MMA's N side, 4 × 16)
constexpr int kMaxHeads = 16;      // the MMA's M side: Hm ≤ 16 heads, padded with zero rows
constexpr int kMaxSplits = 256;    // split-KV chunks per row, at most

// True when the tensor-core kernel is instantiated for (C, R) and the head count fits (Hm ≤ 16).
// Instantiated: (C, R) = (512, 64) (K3 / mini) and (64, 16) (nano). Other shapes use the CUDA-core
// kernel (mla_decode_paged_simple).
bool supported(const MlaDims& d);

// Split-KV plan for B rows of at most max_keys keys: chunk (a multiple of kKeysPerTile) keys per CTA and
// the number of chunks, chosen to fill the SMs in few waves (see mla_tc.cu).
struct Plan {
  int n_splits = 1;
  int chunk = kKeysPerTile;
};
Plan plan(int64_t B, int64_t max_keys);
int sm_count();  // multiprocessors of the current device (cached)

struct Args {
  MlaDims d;
  const PagedMlaCache* cache = nullptr;  // latent arena, format, block size, block tables
  const int32_t* lens = nullptr;         // device i32 [B]: dense key count of row b (unused when sel)
  const int32_t* req = nullptr;          // device i32 [B]: block-table row of row b, or null (b)
  const int32_t* sel = nullptr;          // device i32 [B, Ksel] or null: ascending positions, −1 ends
  int64_t Ksel = 0;
  int64_t B = 0;
  Plan plan;
  const float* qt = nullptr;             // device f32 [B, Hm, C]: q̃ = W_UKᵀ q_nope per head
  const uint16_t* q = nullptr;           // device bf16 [B, Hm, N+R]: q_pe = q[.., N:]
  // Outputs (exactly one form):
  float* part_ml = nullptr;              // device f32 [B, n_splits, Hm, 2]: (m in log2 units, l)
  float* part_acc = nullptr;             // device f32 [B, n_splits, Hm, C]: Σ 2^(x−m) ĉ (unnormalised)
  uint16_t* ohat = nullptr;              // device bf16 [B, Hm, C]: normalised ô (n_splits == 1 only)
  bool longest_first = false;            // launch rows in reverse order (prefill: later rows see more keys)
  bool pdl = false;                      // programmatic dependent launch (see below)
};
void attend(const Args& a, cudaStream_t stream);

// ---- the decode's pieces around the core (mla_decode.cu), also timed one by one by bench_mla --breakdown ----
// q̃[b, h, :] = q_nope[b, h, :] · W_UK,h in FP32: CUDA cores for B ≤ kAbsorbMaxRows (one CTA per 64 columns,
// head and 8 rows; W_UK read once per 8 rows, from L2 after the first), cuBLASLt's strided-batched GEMM
// above (where tensor cores pay off).
constexpr int64_t kAbsorbMaxRows = 64;
void absorb(GemmLt& lt, const MlaDims& d, const uint16_t* q /* bf16 [B, Hm, N+R] */,
            const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */, float* qt /* f32 [B, Hm, C] */, int64_t B,
            cudaStream_t stream, bool pdl);
void absorb_cuda_cores(const MlaDims& d, const uint16_t* q /* bf16 [B, Hm, N+R] */,
                       const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */, float* qt /* f32 [B, Hm, C] */, int64_t B,
                       cudaStream_t stream, bool pdl);
// o[b, h] = W_UV,h · (Σ_s 2^(m_s−M) acc_s / Σ_s 2^(m_s−M) l_s): the log-sum-exp merge of the splits fused
// with W_UV, parallel over heads, blocks of output columns and blocks of rows. With a gate (MODEL.md §3.4 step
// 5's ô = o ⊙ σ(g)), each stored o is bf16(o · σ(g)) — sigmoid_gate_bf16's arithmetic on the same bf16 o.
void merge_uv(const MlaDims& d, int64_t B, int n_splits, const float* part_ml /* f32 [B, n_splits, Hm, 2] */,
              const float* part_acc /* f32 [B, n_splits, Hm, C] */, const uint16_t* kv_b /* bf16 [Hm*(N+Dv), C] */,
              uint16_t* o /* bf16 [B, Hm*Dv] */, cudaStream_t stream, bool pdl,
              const uint16_t* gate = nullptr /* bf16 [B, Hm*Dv] or null */);

// Programmatic dependent launch (sm_90): the decode launches q̃, the core and the merge with
// cudaLaunchAttributeProgrammaticStreamSerialization, so each grid is scheduled while its predecessor
// finishes; every kernel waits (griddepcontrol.wait) before its first global memory access, so the order
// of reads and writes is exactly the stream order. On by default; bench_mla turns it off to measure it.
void set_pdl(bool on);
bool pdl_enabled();

#ifdef __CUDACC__
// Device side of the above: wait for the predecessor grid (no-op without PDL), then let the successor be
// scheduled (it waits for this grid's completion in turn).
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
// The split merge's inner step: (x, y) += Σ_{j<K} wr[s+j]·acc[(s+j)·astride + {0, 1}], added in split order
// with the K loads in flight first. An empty split's accumulator was never written: it is loaded (inside
// the workspace) but not added.
template <int K>
__device__ __forceinline__ void merge_step(const float* acc /* f32, split s at acc + s·astride */, int64_t astride,
                                           const float* wr /* f32 [splits] weights */, int s, float& x, float& y) {
  const float* a = acc + s * astride;
  float2 v[K];
#pragma unroll
  for (int j = 0; j < K; ++j) v[j] = __ldg(reinterpret_cast<const float2*>(a + j * astride));
#pragma unroll
  for (int j = 0; j < K; ++j)
    if (wr[s + j] != 0.0f) x += wr[s + j] * v[j].x, y += wr[s + j] * v[j].y;
}
// Launches kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when pdl.
template <typename... P, typename... A>
void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr, cfg.numAttrs = pdl ? 1 : 0;
  KCUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
}
#endif

}  // namespace kestrel::cuda::tc
