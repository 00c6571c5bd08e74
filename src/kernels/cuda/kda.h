// KDA (MODEL.md §3.3) on the GPU: short conv + SiLU (prefill and decode), q/k L2-norm and gates,
// the delta-rule scan over a state pool (token by token: kda_recurrent, and its decode-specialised
// layout kda_decode; chunk-parallel on the tensor cores for prefill: kda_chunked), and the output
// RMSNorm ⊙ gate.
// CPU twins: cpu::kda_conv_silu, kda_qk_norm_gates, kda_out_norm_gate (kernels/cpu/kda_ops.h) and
// cpu::kda_scan_recurrent (kernels/cpu/kda_scan.h).
//
// Layouts: q/k/v channels are head-major (c = h·Dk + i). The conv runs on any channel count C, so the
// caller may convolve q|k|v concatenated ([T, 3·H·Dk] with weights [3·H·Dk, W]) in one launch.
// State pools are indexed by a per-request slot id; the slots of one launch must be distinct.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

// Prefill of one request: y[t, c] = bf16(SiLU(Σ_{j<W-1} w[c, j]·hist[j, c] (for the first tokens) /
// x[t-W+1+j, c] + w[c, W-1]·x[t, c])), then the history becomes the last W−1 inputs. W ≤ 8.
void kda_conv_prefill(const uint16_t* x /* bf16 [T, C], row stride ldx */, int64_t ldx,
                      const float* w /* f32 [C, W] */, uint16_t* hist /* bf16 [W-1, C], in/out */,
                      uint16_t* y /* bf16 [T, C], row stride ldy */, int64_t ldy, int64_t T, int64_t C, int64_t W,
                      cudaStream_t stream);

// Decode: one token for each of B requests; request b uses and shifts hist_pool[slots[b]].
void kda_conv_decode(const uint16_t* x /* bf16 [B, C], row stride ldx */, int64_t ldx, const float* w /* f32 [C, W] */,
                     uint16_t* hist_pool /* bf16 [n_slots, W-1, C], in/out */, const int32_t* slots /* i32 [B] */,
                     uint16_t* y /* bf16 [B, C], row stride ldy */, int64_t ldy, int64_t B, int64_t C, int64_t W,
                     cudaStream_t stream);

// DSpark verification (model/cuda/speculative.cpp): kda_conv_decode over a run of tokens per request —
// request b's tokens cu_seqlens[b] .. cu_seqlens[b+1], one after the other with the same per-token arithmetic —
// also storing the history after each token t at trace[t − trace_row0] (bf16 [W−1, C] per token, a slot's
// layout). Bit-identical to one kda_conv_decode launch per token followed by a copy of the slot. W ≥ 2.
void kda_conv_decode_traced(const uint16_t* x /* bf16 [T, C], row stride ldx */, int64_t ldx,
                            const float* w /* f32 [C, W] */, uint16_t* hist_pool /* bf16 [n_slots, W-1, C], in/out */,
                            const int32_t* cu_seqlens /* i32 [B+1] */, const int32_t* slots /* i32 [B] */,
                            uint16_t* y /* bf16 [T, C], row stride ldy */, int64_t ldy, int64_t B, int64_t C, int64_t W,
                            uint16_t* trace /* bf16 [rows, W-1, C] */, int64_t trace_row0, cudaStream_t stream);

// Steps 3–5: q_out = q/√(Σq² + 1e-6)·Dk^−½, k_out = k/√(Σk² + 1e-6) per (token, head);
// g = lower·σ(exp(a_log[h])·(z + dt_bias)); beta = σ(b). Dk ≤ 1024 and a multiple of 32.
void kda_qk_norm_gates(const uint16_t* q /* bf16 [T, H*Dk], row stride ld_in */,
                       const uint16_t* k /* bf16 [T, H*Dk], row stride ld_in */, int64_t ld_in,
                       const uint16_t* z /* bf16 [T, H*Dk], contiguous */, const float* dt_bias /* f32 [H*Dk] */,
                       const float* a_log /* f32 [>= H] */, const uint16_t* b /* bf16 [T, H], contiguous */,
                       float lower, float* q_out /* f32 [T, H*Dk] */, float* k_out /* f32 [T, H*Dk] */,
                       float* g /* f32 [T, H*Dk] */, float* beta /* f32 [T, H] */, int64_t T, int64_t H, int64_t Dk,
                       cudaStream_t stream);

// Step 6, recurrent form, B requests at once: request b owns tokens cu_seqlens[b] .. cu_seqlens[b+1]
// (decode: cu_seqlens = 0, 1, .., B) and the state S = state_pool[slots[b]] (f32 [H, Dk(key), Dk(value)]),
// updated in place. Per token: S ← diag(exp g) S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀq.
// q, k, v, g, o share the row stride ld (elements); beta has row stride ld_beta. Dk ∈ {32, 64, 128}.
void kda_recurrent(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                   const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                   const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                   const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                   float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);
// The same over an FP16 state pool (--kda-state-dtype f16): each request's state is widened to FP32 when
// the launch reads it and rounded to nearest even when it writes it back, as model/kda.cpp does.
void kda_recurrent(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                   const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                   const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                   const int32_t* slots /* i32 [B] */, uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */,
                   float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);

// Step 6, decode-specialised recurrent scan: the contract of kda_recurrent (any row lengths), laid out for
// one token per request: 128-thread blocks of 32 value columns (Dk/32 blocks per (head, request)), 16-byte
// state loads and stores. Results equal kda_recurrent's up to FP32 summation order. Falls back to
// kda_recurrent when the pool is not 16-byte (f32) / 8-byte (f16) aligned. Dk ∈ {32, 64, 128}.
// Kernels (kda.cu): kKdaDecodeBlocks, one block per (32 value columns, head, request), the latency form
// for small batches; kKdaDecodePrefetch, the blocks kernel that also prefetches into L2 the slice of the block
// 3/8 of a wave later in launch order, the bandwidth form for large batches; kKdaDecodeStream, persistent blocks
// that walk those work items and copy the next item's state slice into shared memory (cp.async) while they
// compute the current one; kKdaDecodeRegs, persistent blocks that load the next item's slice straight into a
// second register set. kKdaDecodeAuto: blocks, or prefetch when the items outnumber four waves of blocks. All
// give the same results bit for bit (same arithmetic in the same order).
enum KdaDecodeVariant : int {
  kKdaDecodeAuto = 0,
  kKdaDecodeBlocks = 1,
  kKdaDecodeStream = 2,
  kKdaDecodeRegs = 3,
  kKdaDecodePrefetch = 4
};
// The kernel of the overloads without a variant (the engine's): kKdaDecodeAuto (H200, bench_kda, FP32 state,
// H = 12, B = 1024: prefetch 3.98–4.00 TB/s, blocks 3.87, regs 3.62, stream 3.09; B = 64: blocks 2.98, prefetch
// 2.75–2.89; bench/RESULTS.md, session 11); KESTREL_KDA_DECODE=auto|blocks|stream|regs|prefetch overrides it
// (read once; any other value is an error).
KdaDecodeVariant kda_decode_default_variant();
void kda_decode(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);
void kda_decode(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                const int32_t* slots /* i32 [B] */, uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */,
                float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);
// The same with an explicit kernel choice (benchmarks, tests).
void kda_decode(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream,
                KdaDecodeVariant variant);
void kda_decode(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                const int32_t* slots /* i32 [B] */, uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */,
                float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream,
                KdaDecodeVariant variant);

// kda_decode's kKdaDecodeBlocks kernel over runs of tokens (DSpark verification) that also stores the state
// after each token t at trace[t − trace_row0] ([H, Dk, Dk] per token: a slot's layout). FP32 pools only (an
// FP16 pool is rounded per launch, so one launch per token is what the verification must mirror there):
// bit-identical to one kda_decode launch per token followed by a copy of the slot — the same per-token
// arithmetic, the state kept in registers between tokens where per-token launches store and reload it
// exactly. Pool and trace 16-byte aligned. Dk ∈ {32, 64, 128}.
void kda_decode_traced(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                       const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                       const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                       const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                       float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk,
                       float* trace /* f32 [rows, H, Dk, Dk] */, int64_t trace_row0, cudaStream_t stream);

// Step 6, chunk-parallel WY/UT form for prefill (MODEL.md §3.3, chunk 64; kda_chunked.cu has the design;
// CPU twin cpu::kda_scan_chunked, oracle cpu::kda_scan_recurrent). The contract of kda_recurrent: request b
// owns rows cu_seqlens[b] .. cu_seqlens[b+1] (varlen, packed) and the state state_pool[slots[b]]
// (f32 or f16 [H, Dk(key), Dk(value)]), read at the start and written back at the end (f16: widened on read,
// rounded to nearest even on write). Requests of length 0 leave their state untouched.
// Tensor cores: TF32 for the recurrence (FP16 with KdaChunkedVariant::f16_recurrence), BF16 for the output
// products, FP32 accumulation: against the FP32 CPU twin, o has a relative L2 error of 2–3.5e-3 (about one
// BF16 rounding) and the final state 3–6e-4.
// T: the packed row count, T >= cu_seqlens[B] - cu_seqlens[0] (sizes the workspace; if the rows of
// cu_seqlens need more chunks than the workspace holds, nothing is computed). workspace: device memory of
// kda_chunked_workspace_bytes(T, B, H, Dk) bytes (≈ 2.1 KB per token and head at Dk 128), 16-byte aligned,
// used only by this call (stream-ordered). No host synchronisation: capturable in a CUDA graph.
// Dk ∈ {32, 64, 128}; q, k, v, g 16-byte aligned and ld a multiple of 4; g ≥ −5 per token (the §3.3 gate
// bound keeps e^{16·5} in f32 range; see kda_chunked.cu).
size_t kda_chunked_workspace_bytes(int64_t T, int64_t B, int64_t H, int64_t Dk);
// Kernel variants of kda_chunked's two main launches (kda_chunked.cu describes them). All variants meet the
// same contract and tolerances; benchmarks time them against each other and, through `launches`, time the
// launches apart. KdaChunkedVariant{} is intra 1 + seq 1, the first kernels; the overloads without a variant
// (the engine's) take kda_chunked_default_variant(), intra 2 + seq 3 (fastest TF32 pair measured on the H200).
struct KdaChunkedVariant {
  // Intra-chunk products: 1 = one 512-thread CTA holds a whole (chunk, head) (190 KB of shared memory, one
  // CTA per SM); 2 = the chunk's channels stream through in quarters (106 KB, two CTAs per SM).
  int intra = 1;
  // Sequential pass: 1 = 2 warps per 32 value columns, each warp all keys; 2 = 4 warps per 32 value columns,
  // the keys split between the two warps of each 16-column tile; 3 = 2 warps per 16 value columns, keys
  // split; 4 = 3 with the Dk/16 CTAs of a (head, sequence) in one cluster, whose leader copies the shared
  // part of each chunk image into all of them at once (multicast: 1/8 of the L2 reads); 0 = 2.
  int seq = 1;
  // FP16 recurrence: the intra launch stores W, K̂ and U0 (the operands of u = U0 − W·S and of the state
  // update) in FP16 instead of TF32-rounded f32, and the seq launch multiplies them as FP16 (m16n8k16): the
  // same 11 significant bits, 40 % smaller chunk images, half the recurrence's mma instructions; values beyond
  // FP16's range (|x| > 65504 in the state or these operands) are not representable, the range of the FP16
  // state of the day-0 recipe (MODEL.md §2). Needs intra = 2 and seq ∈ {0, 2, 3, 4}.
  bool f16_recurrence = false;
  // Launches to run: bit 0 the chunk table, bit 1 intra, bit 2 seq. Running seq without intra needs a
  // workspace that an earlier call with the same arguments filled (benchmarks only).
  unsigned launches = 7;
};
// Intra 2 + seq 3, or KESTREL_KDA_CHUNKED=INTRA,SEQ,F16 (e.g. "2,4,1": intra 2, seq 4, FP16 recurrence),
// read once and checked like an explicit variant: how a benchmark of the engine picks another variant.
KdaChunkedVariant kda_chunked_default_variant();
void kda_chunked(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                 const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                 const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                 const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                 float* o /* f32 [T, H*Dk], row stride ld */, int64_t T, int64_t B, int64_t H, int64_t Dk,
                 void* workspace, cudaStream_t stream);
void kda_chunked(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                 const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                 const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                 const int32_t* slots /* i32 [B] */, uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */,
                 float* o /* f32 [T, H*Dk], row stride ld */, int64_t T, int64_t B, int64_t H, int64_t Dk,
                 void* workspace, cudaStream_t stream);
void kda_chunked(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                 const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                 const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                 const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                 float* o /* f32 [T, H*Dk], row stride ld */, int64_t T, int64_t B, int64_t H, int64_t Dk,
                 void* workspace, cudaStream_t stream, const KdaChunkedVariant& variant);
void kda_chunked(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                 const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                 const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                 const int32_t* slots /* i32 [B] */, uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */,
                 float* o /* f32 [T, H*Dk], row stride ld */, int64_t T, int64_t B, int64_t H, int64_t Dk,
                 void* workspace, cudaStream_t stream, const KdaChunkedVariant& variant);
// Convenience forms (tests, benchmarks): read cu_seqlens[0] and [B] back (a stream synchronisation) and take
// the workspace from cudaMallocAsync on the stream. Not capturable in a CUDA graph.
void kda_chunked(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                 const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                 const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                 const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                 float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);
void kda_chunked(const float* q /* f32 [T, H*Dk] */, const float* k /* f32 [T, H*Dk] */,
                 const float* v /* f32 [T, H*Dk] */, const float* g /* f32 [T, H*Dk] */, int64_t ld,
                 const float* beta /* f32 [T, H] */, int64_t ld_beta, const int32_t* cu_seqlens /* i32 [B+1] */,
                 const int32_t* slots /* i32 [B] */, uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */,
                 float* o /* f32 [T, H*Dk], row stride ld */, int64_t B, int64_t H, int64_t Dk, cudaStream_t stream);

// Step 7: ohat = bf16(RMSNorm_{o_norm, eps}(o) ⊙ σ(gate)) per (token, head). Dk ≤ 1024, multiple of 32.
void kda_out_norm_gate(const float* o /* f32 [T, H*Dk] */, const uint16_t* gate /* bf16 [T, H*Dk] */,
                       const float* o_norm /* f32 [Dk] */, float eps, uint16_t* ohat /* bf16 [T, H*Dk] */, int64_t T,
                       int64_t H, int64_t Dk, cudaStream_t stream);

}  // namespace kestrel::cuda

namespace kestrel::cuda {

// Steps 2–7 for decode rows in one launch (the fused decode chain; CPU twins as above, composed): row b
// (one token of the sequence in slot slots[b]) reads its projections — q̃|k̃|ṽ (bf16 [3·H·Dk]), the output
// gate (bf16 [H·Dk]), f_a's output (bf16 [Dk]) and b (bf16 [H]) — and per head h: the short conv + SiLU of
// its q/k/v channels (history in hist_pool[slots[b]], shifted), z = bf16(f_b·f_a(x)) for its channels (the
// FP32 dot product rounded once, as the f_b GEMM), the L2 norms and gates, the delta-rule update of
// state_pool[slots[b]] (f32 or f16, as kda_decode), and ô = bf16(RMSNorm_{o_norm}(o) ⊙ σ(gate)).
// One CTA of 4·Dk threads per (head, row); PDL launch. Dk ∈ {32, 64, 128}, W ≤ 8. Equal to conv_decode →
// f_b GEMM → kda_qk_norm_gates → kda_decode → kda_out_norm_gate up to FP32 summation order.
struct KdaDecodeIn {
  const uint16_t* qkv;  // bf16 [B, 3·H·Dk], row stride ld_qkv
  int64_t ld_qkv;
  const uint16_t* gate;  // bf16 [B, H·Dk], row stride ld_gate
  int64_t ld_gate;
  const uint16_t* fa;  // bf16 [B, Dk], row stride ld_fa
  int64_t ld_fa;
  const uint16_t* bl;  // bf16 [B, H], row stride ld_bl
  int64_t ld_bl;
  const int32_t* cu;   // i32 [B+1] or null: rows with cu[b+1] − cu[b] ≠ 1 (a graph bucket's padding) are skipped
};
struct KdaDecodeWeights {
  const float* conv;     // f32 [3·H·Dk, W]
  const uint16_t* f_b;   // bf16 [H·Dk, Dk]
  const float* dt_bias;  // f32 [H·Dk]
  const float* a_log;    // f32 [≥ H]
  const float* o_norm;   // f32 [Dk]
  float lower, eps;
};
void kda_decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool /* bf16 [n_slots, W-1, 3·H·Dk] */,
                      const int32_t* slots /* i32 [B] */, float* state_pool /* f32 [n_slots, H, Dk, Dk] */,
                      uint16_t* ohat /* bf16 [B, H·Dk] */, int64_t B, int64_t H, int64_t Dk, int64_t W,
                      cudaStream_t stream);
void kda_decode_fused(const KdaDecodeIn& in, const KdaDecodeWeights& w, uint16_t* hist_pool, const int32_t* slots,
                      uint16_t* state_pool /* f16 [n_slots, H, Dk, Dk] */, uint16_t* ohat, int64_t B, int64_t H,
                      int64_t Dk, int64_t W, cudaStream_t stream);

}  // namespace kestrel::cuda
