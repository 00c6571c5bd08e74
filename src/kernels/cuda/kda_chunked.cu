// KDA prefill scan in the chunk-parallel WY/UT form (MODEL.md §3.3 step 6; contract in kda.h; CPU twin
// cpu::kda_scan_chunked, oracle cpu::kda_scan_recurrent). Chunks of C = 64 tokens. Three launches:
//
// 1. chunk_table (one block): chunk_start[b] = Σ_{b'<b} ⌈len_b'/64⌉ and chunk_seq[c] = b, so the
//    other two launches need no host copy of cu_seqlens (graph-capturable).
// 2. intra (one CTA per (chunk, head), all chunks in parallel): with G the cumulative log-decay inside the
//    chunk (f64 sum, stored f32 in log2 units), β, k, q, v of the chunk:
//      A_ts  = Σ_i k_t k_s e^{G_t−G_s}   (s < t)        QK_ts = Σ_i q_t k_s e^{G_t−G_s}   (s ≤ t)
//      T     = (I + diag(β)·A)^−1 (unit lower triangular; FP32 on the CUDA cores from 16×16 diagonal blocks
//              solved by forward substitution)
//      W     = T·diag(β)·(e^G ⊙ K)       U0 = T·diag(β)·V       (so that u = U0 − W·S₀)
//      Q̃    = e^G ⊙ Q                    K̂ = e^{G_C − G} ⊙ K     eG = e^{G_C}
//    and writes them as the exact shared-memory image the next launch copies (row strides padded so
//    its fragment loads are bank-conflict free). Pairwise decays go through a reference r = G at the
//    end of the previous 16-token sub-chunk of t: e^{G_t−r} ≤ 1 times e^{r−G_s}, which is ≤ 1 for s in an
//    earlier sub-chunk and ≤ e^{16·5} = e^80 < FLT_MAX inside t's own (the §3.3 gate bound g ≥ −5), so
//    A and QK are two tensor-core products per 16-row block, never one exponential per (t, s, i).
//    Variant 1 (kda_chunked_v1.cu): one 512-thread CTA holds q, k, G and the operands of the whole chunk (190 KB of
//    shared memory, so one CTA per SM); the block rows of T follow one another (T_ij = −T_ii Σ_m L_im T_mj).
//    Variant 2 (kda_chunked_intra2.cu): the chunk's channels stream through in quarters (106 KB, two CTAs per
//    SM), T by doubling (16 → 32 → 64-row blocks).
// 3. seq (one CTA per (value columns, head, sequence), chunks in order): the state slice Sᵀ [values × Dk
//    keys] lives in the warps' mma accumulators for the whole sequence; per chunk
//      v_newᵀ = U0ᵀ − Sᵀ·Wᵀ      oᵀ = Sᵀ·Q̃ᵀ + v_newᵀ·QKᵀ      Sᵀ ← Sᵀ·diag(eG) + v_newᵀ·K̂
//    with the accumulator of one product used directly as the A operand of the next (TF32: the key /
//    token index inside each 8-wide k-step is permuted to match the accumulator layout, and the B
//    operand is read with the same permutation; BF16: the layouts already agree). Each chunk's image
//    arrives by two bulk copies (TMA, mbarrier completion) into a double buffer, two chunks ahead.
//    Variant 1 (kda_chunked_v1.cu): 2 warps per 32 value columns, each warp all Dk keys of its 16 values.
//    Variants 2, 3, 4 (kda_chunked_seq2.cu): the keys split between two warps per 16 values, which swap
//    their partial products once per chunk (half the tensor-core work on each warp's critical path); 2: 32
//    values per CTA; 3: 16; 4: 16, with the CTAs of a (head, sequence) in a cluster that receives the shared
//    part of each image by one multicast copy.
//
// Precision: the recurrence (v_new and the state update: W, K̂, S) runs TF32 × TF32 → FP32 (operands
// rounded to nearest, 2^−11 relative); the output path (Q̃·S and QK·v_new) runs BF16 × BF16 → FP32,
// since o is rounded to BF16 after the output norm anyway (MODEL.md §3.3 step 7). T, G and every
// accumulation are FP32 (G's running sum f64). Against the FP32/f64 recurrence, an emulation of these
// kernels' operand rounding gives rel-L2 of o 2.3–3.4e−3 (about one BF16 rounding) and of the final state
// 3–6e−4, flat in the sequence length (no growth over 1000 tokens of undecayed gates); without the
// rounding the same emulation agrees to 1e−7. tests/gpu/test_kda_gpu.cpp states the bounds it enforces.
//
// Where the time went (run 2 on the H200, 12 heads × 128 unless noted; intra1 + seq1): 8K 0.640, 32K 2.475,
// 128K 9.796 ms (linear in T), 8 × 8K 3.388 ms, 96 heads × 32K 13.535 ms. Writing time = intra·tokens +
// seq·(chunk steps) — one sequence runs 512 steps per 32K, 8 × 8K and 96 heads run 3 waves of 132 CTAs, i.e.
// 6 steps per 1K tokens — fits every row to 4 % with intra ≈ 38 µs per 1K tokens (1.2 ms at 32K: ~27 µs per
// CTA at one CTA per SM, where its 1.6 GB of HBM traffic alone would take 0.4 ms) and ≈ 2.4 µs per chunk step
// (1.2 ms at 32K): the two launches took about half each. (If the step is slower when every SM runs a seq CTA,
// the fit moves towards intra 0.7 / seq 1.8 ms; bench_kda now times the launches apart to settle it.)
// Per (chunk, head) at Dk = 128: intra reads q, k, g, v (128 KiB), writes a 133 KiB image (81 KiB with the
// FP16 recurrence), ~2.1 MFLOP of useful TF32 products; seq reads the image once from HBM per head (the value
// blocks share it through L2), writes o (32 KiB), 6.8 MFLOP per chunk step and head.
// Predictions for the second variants (12 heads, one sequence, 32K):
//   intra2: two CTAs per SM hide each other's load waits, barriers and narrow phases (T's diagonal blocks on
//     64 threads); per CTA ~35 K warp instructions, ~5 µs of issue per SM at two CTAs, so it should approach
//     its HBM floor: ≈ 0.5–0.7 ms (from 1.2).
//   seq2: 170 mma per warp and chunk step instead of 340, four warps per SM; bounded by ~1250 instructions per
//     warp and ~190 KB of shared-memory reads per SM per step (≈ 0.9 µs) and by 5.2 MB of L2 reads per step
//     across the 48 CTAs: ≈ 1.0–1.2 µs per step, 0.5–0.6 ms (from 1.2). seq3 (96 CTAs of 16 columns) reads
//     twice the L2 bytes per step and is likely L2-bound (≈ 1.5 µs) unless L2 delivers > 7 TB/s; seq4 reads
//     1/8 of them (multicast) and should run at its per-warp instruction bound, ≈ 0.7 µs (0.35 ms).
//   FP16 recurrence: 106 mma and ~1100 instructions per warp and step, 35 % fewer shared-memory bytes, 40 %
//     smaller images: seq2 ≈ 0.8 µs per step, seq4 ≈ 0.6 µs, intra2 −10 %.
//   When every SM runs a seq CTA (8 × 8K, 96 heads) 132 CTAs read 14 MB of image per step from L2, which
//   bounds seq1–3 near 2 µs per step (9 MB with the FP16 recurrence); seq4 reads 2.3 MB.
//   Totals, intra2 + seq2: 8K ≈ 0.3, 32K ≈ 1.0–1.3, 128K ≈ 4–5 ms, 8 × 8K ≈ 1.8–2.2 ms, 96 heads ≈
//   7–9 ms; intra2 + seq4 with the FP16 recurrence: 32K ≈ 0.8–1.0 ms, 8 × 8K ≈ 1.4–1.8, 96 heads ≈ 5–7 ms.
//   FLA chunk_kda on our H200: 0.54 / 1.94 / 7.57 / 2.90 / 10.9 ms.
//
// Shapes: Dk ∈ {32, 64, 128} (value dim = Dk); the per-CTA shared memory is sized at compile time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_internal.cuh"

namespace kestrel::cuda::kda_detail {
namespace {

// ---- 1. chunk table ------------------------------------------------------------------------------------------
// One block of 1024 threads; thread i scans sequences [i·per, (i+1)·per). If the chunks do not fit the
// workspace (T passed smaller than the tokens of cu_seqlens) every sequence gets 0 chunks: nothing is
// computed and the states stay as they were, rather than writing past the workspace.
__global__ void __launch_bounds__(1024) chunk_table_kernel(const int32_t* __restrict__ cu, int B, int cap,
                                                           int32_t* __restrict__ cs /* i32 [B+1] */,
                                                           int32_t* __restrict__ cseq /* i32 [cap] */) {
  __shared__ int warp_incl[32];
  __shared__ int s_total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (B + 1023) / 1024;
  const int b0 = min(B, tid * per), b1 = min(B, b0 + per);
  int local = 0;
  for (int b = b0; b < b1; ++b) local += nchunks(cu[b], cu[b + 1]);
  int x = local;  // inclusive scan inside the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_incl[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = warp_incl[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_incl[lane] = w;
  }
  __syncthreads();
  int excl = x - local + (warp ? warp_incl[warp - 1] : 0);
  if (tid == 1023) s_total = excl + local;
  __syncthreads();
  const int total = s_total;
  const bool fits = total <= cap;
  for (int b = b0; b < b1; ++b) {
    cs[b] = fits ? excl : 0;
    excl += nchunks(cu[b], cu[b + 1]);
  }
  if (tid == 0) cs[B] = fits ? total : 0;
  __syncthreads();  // cs visible to the whole block
  if (!fits) return;
  for (int c = tid; c < total; c += 1024) {
    int lo = 0, hi = B;  // cs[lo] ≤ c < cs[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (cs[mid] <= c) lo = mid; else hi = mid;
    }
    cseq[c] = lo;
  }
}

}  // namespace
}  // namespace kestrel::cuda::kda_detail

#ifndef KESTREL_SIMT_EMU
// ---- entry points ------------------------------------------------------------------------------------------------
namespace kestrel::cuda {
namespace {

using kda_detail::ChunkArgs;
using kda_detail::Img;
using kda_detail::kC;

size_t img_bytes(int64_t Dk) {
  switch (Dk) {
    case 32: return Img<32>::bytes;
    case 64: return Img<64>::bytes;
    case 128: return Img<128>::bytes;
    default: return 0;
  }
}
using kda_detail::capacity_chunks;
using kda_detail::table_bytes;

template <int K, typename StateT>
void launch(const ChunkArgs& a, StateT* pool, const KdaChunkedVariant& var, cudaStream_t stream) {
  if (var.launches & 1u) {
    kda_detail::chunk_table_kernel<<<1, 1024, 0, stream>>>(a.cu, a.B, int(a.cap), a.cs, a.cseq);
    KCUDA_CHECK_LAUNCH();
  }
  if (var.launches & 2u) {
    if (var.intra == 1) {
      kda_detail::launch_intra1<K>(a, stream);
    } else if (var.f16_recurrence) {
      kda_detail::launch_intra2<K, true>(a, stream);
    } else {
      kda_detail::launch_intra2<K, false>(a, stream);
    }
  }
  if (var.launches & 4u) {
    if (var.f16_recurrence) {
      switch (var.seq) {
        case 3: kda_detail::launch_seq2<K, StateT, 1, true, false>(a, pool, stream); break;
        case 4: kda_detail::launch_seq2<K, StateT, 1, true, true>(a, pool, stream); break;
        default: kda_detail::launch_seq2<K, StateT, 2, true, false>(a, pool, stream); break;
      }
      return;
    }
    switch (var.seq) {
      case 1: kda_detail::launch_seq1<K, StateT>(a, pool, stream); break;
      case 3: kda_detail::launch_seq2<K, StateT, 1, false, false>(a, pool, stream); break;
      case 4: kda_detail::launch_seq2<K, StateT, 1, false, true>(a, pool, stream); break;
      default: kda_detail::launch_seq2<K, StateT, 2, false, false>(a, pool, stream); break;
    }
  }
}

void check_args(const void* q, const void* k, const void* v, const void* g, int64_t ld, const void* beta,
                int64_t ld_beta, const void* cu, const void* slots, const void* pool, const void* o, int64_t B,
                int64_t H, int64_t Dk) {
  KCUDA_REQUIRE(q && k && v && g && beta && cu && slots && pool && o, std::string("kda_chunked: null pointer"));
  KCUDA_REQUIRE(Dk == 32 || Dk == 64 || Dk == 128,
                "kda_chunked: Dk = " + std::to_string(Dk) + " (supported: 32, 64, 128)");
  KCUDA_REQUIRE(B >= 0 && B < 65536 && H > 0 && H < 65536 && ld >= H * Dk && ld_beta >= H && ld % 4 == 0,
                std::string("kda_chunked: bad B, H or strides (ld must be a multiple of 4)"));
  for (const void* p : {q, k, v, g})
    KCUDA_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0, std::string("kda_chunked: q/k/v/g must be 16-byte aligned"));
}

template <typename StateT>
void chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
             int64_t ld_beta, const int32_t* cu, const int32_t* slots, StateT* pool, float* o, int64_t T, int64_t B,
             int64_t H, int64_t Dk, void* workspace, cudaStream_t stream, const KdaChunkedVariant& var) {
  check_args(q, k, v, g, ld, beta, ld_beta, cu, slots, pool, o, B, H, Dk);
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("kda_chunked: bad T"));
  KCUDA_REQUIRE((var.intra == 1 || var.intra == 2) && var.seq >= 0 && var.seq <= 4 && var.launches <= 7 &&
                    (!var.f16_recurrence || (var.intra == 2 && var.seq != 1)),
                "kda_chunked: bad variant intra=" + std::to_string(var.intra) + " seq=" + std::to_string(var.seq) +
                    " f16_recurrence=" + std::to_string(int(var.f16_recurrence)));
  if (B == 0) return;
  KCUDA_REQUIRE(workspace && reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                std::string("kda_chunked: workspace must be non-null and 16-byte aligned"));
  const int64_t cap = capacity_chunks(T, B);
  KCUDA_REQUIRE(cap < (int64_t(1) << 31) / 2, std::string("kda_chunked: too many chunks"));
  int32_t* cs = static_cast<int32_t*>(workspace);
  const ChunkArgs a{q,  k,      v,  g,       ld,  beta,         ld_beta, cu, slots, cs, cs + B + 1,
                    static_cast<char*>(workspace) + table_bytes(B, cap), o, int(B), int(H), cap};
  switch (Dk) {
    case 32: launch<32>(a, pool, var, stream); break;
    case 64: launch<64>(a, pool, var, stream); break;
    default: launch<128>(a, pool, var, stream); break;
  }
}

// Convenience form without T and workspace: reads cu_seqlens[0] and [B] back (a stream sync) and takes the
// workspace from the stream-ordered allocator. Not capturable in a CUDA graph.
template <typename StateT>
void chunked_alloc(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                   int64_t ld_beta, const int32_t* cu, const int32_t* slots, StateT* pool, float* o, int64_t B,
                   int64_t H, int64_t Dk, cudaStream_t stream) {
  check_args(q, k, v, g, ld, beta, ld_beta, cu, slots, pool, o, B, H, Dk);
  if (B == 0) return;
  int32_t ends[2] = {0, 0};
  KCUDA_CHECK(cudaMemcpyAsync(&ends[0], cu, 4, cudaMemcpyDeviceToHost, stream));
  KCUDA_CHECK(cudaMemcpyAsync(&ends[1], cu + B, 4, cudaMemcpyDeviceToHost, stream));
  KCUDA_CHECK(cudaStreamSynchronize(stream));
  const int64_t T = ends[1] > ends[0] ? int64_t(ends[1]) - ends[0] : 0;
  void* ws = nullptr;
  KCUDA_CHECK(cudaMallocAsync(&ws, kda_chunked_workspace_bytes(T, B, H, Dk), stream));
  try {
    chunked(q, k, v, g, ld, beta, ld_beta, cu, slots, pool, o, T, B, H, Dk, ws, stream, kda_chunked_default_variant());
  } catch (...) {
    cudaFreeAsync(ws, stream);
    throw;
  }
  KCUDA_CHECK(cudaFreeAsync(ws, stream));
}

}  // namespace

KdaChunkedVariant kda_chunked_default_variant() {
  static const KdaChunkedVariant v = [] {
    KdaChunkedVariant r;
    const char* e = std::getenv("KESTREL_KDA_CHUNKED");
    if (e == nullptr || *e == 0) return r;
    int intra = 0, seq = 0, f16 = 0;
    char tail = 0;
    KCUDA_REQUIRE(std::sscanf(e, "%d,%d,%d%c", &intra, &seq, &f16, &tail) == 3 && (f16 == 0 || f16 == 1),
                  std::string("KESTREL_KDA_CHUNKED=") + e + " (expected INTRA,SEQ,F16, e.g. 2,4,1)");
    r.intra = intra, r.seq = seq, r.f16_recurrence = f16 != 0;
    KCUDA_REQUIRE((r.intra == 1 || r.intra == 2) && r.seq >= 0 && r.seq <= 4 &&
                      (!r.f16_recurrence || (r.intra == 2 && r.seq != 1)),
                  std::string("KESTREL_KDA_CHUNKED=") + e + ": no such variant (kda.h KdaChunkedVariant)");
    return r;
  }();
  return v;
}

size_t kda_chunked_workspace_bytes(int64_t T, int64_t B, int64_t H, int64_t Dk) {
  KCUDA_REQUIRE(T >= 0 && B >= 0 && H > 0 && img_bytes(Dk) > 0,
                "kda_chunked_workspace_bytes: bad T, B, H or Dk = " + std::to_string(Dk));
  const int64_t cap = capacity_chunks(T, B);
  return table_bytes(B, cap) + size_t(cap) * size_t(H) * img_bytes(Dk);
}

void kda_chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                 int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                 int64_t T, int64_t B, int64_t H, int64_t Dk, void* workspace, cudaStream_t stream,
                 const KdaChunkedVariant& variant) {
  chunked(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, T, B, H, Dk, workspace, stream, variant);
}
void kda_chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                 int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, uint16_t* state_pool, float* o,
                 int64_t T, int64_t B, int64_t H, int64_t Dk, void* workspace, cudaStream_t stream,
                 const KdaChunkedVariant& variant) {
  chunked(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, T, B, H, Dk, workspace, stream, variant);
}
void kda_chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                 int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                 int64_t T, int64_t B, int64_t H, int64_t Dk, void* workspace, cudaStream_t stream) {
  chunked(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, T, B, H, Dk, workspace, stream,
          kda_chunked_default_variant());
}
void kda_chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                 int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, uint16_t* state_pool, float* o,
                 int64_t T, int64_t B, int64_t H, int64_t Dk, void* workspace, cudaStream_t stream) {
  chunked(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, T, B, H, Dk, workspace, stream,
          kda_chunked_default_variant());
}
void kda_chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                 int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, float* state_pool, float* o,
                 int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  chunked_alloc(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
}
void kda_chunked(const float* q, const float* k, const float* v, const float* g, int64_t ld, const float* beta,
                 int64_t ld_beta, const int32_t* cu_seqlens, const int32_t* slots, uint16_t* state_pool, float* o,
                 int64_t B, int64_t H, int64_t Dk, cudaStream_t stream) {
  chunked_alloc(q, k, v, g, ld, beta, ld_beta, cu_seqlens, slots, state_pool, o, B, H, Dk, stream);
}

}  // namespace kestrel::cuda
#endif  // KESTREL_SIMT_EMU
