// The layer forwards of the GPU model, one file per layer type (kda.cpp, mla.cpp, moe.cpp, mlp.cpp,
// attn_res.cpp), each following MODEL.md §3 in order like its CPU twin in src/model/, at the same
// rounding points (BF16 activations, FP32 accumulation and state). Every forward runs over the whole
// stacked step (batch.h): rows of all sequences at once, the per-sequence work through the step's
// metadata. Scratch comes from Context::tmp.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "core/dtype.h"
#include "model/cuda/dspark.h"

#include "model/cuda/batch.h"
#include "model/cuda/cache.h"
#include "model/cuda/context.h"
#include "kernels/cuda/norm.h"
#include "model/cuda/weights.h"

namespace kestrel::model::gpu {

// §3.3 KDA over the step's rows; state in the sequences' slots of cc (layer `layer`).
// `in8`: in's PTPC FP8 codes when the producing kernel made them (ptpc-fp8), else null.
void kda_forward(Context& x, const KdaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer,
                 const u16* in /* bf16 [T, D] */, const Fp8Act* in8, u16* out /* bf16 [T, D] */);
// §3.4 MLA with the §3.5 indexer; new latent/key rows into their pages of cc (layer `layer`).
void mla_forward(Context& x, const MlaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer,
                 const u16* in /* bf16 [T, D] */, const Fp8Act* in8, u16* out /* bf16 [T, D] */);
// §3.6 latent MoE (router ids captured as "L{layer}.router_ids").
void moe_forward(Context& x, const MoeWeightsDev& w, int layer, const u16* in /* bf16 [T, D] */,
                 const Fp8Act* in8, int64_t T, u16* out /* bf16 [T, D] */);
// §3.7 gated SiTU MLP (the dense layer and the shared experts).
void mlp_forward(Context& x, const MlpWeightsDev& w, const u16* in /* bf16 [T, D] */, const Fp8Act* in8,
                 int64_t T, u16* out /* bf16 [T, D] */);

// §3.1–3.2 AttnRes stream of a step: the stored blocks and the partial sum.
struct AttnResDev {
  u16* blocks = nullptr;  // bf16 [Nb, T, D]
  u16* partial = nullptr;  // bf16 [T, D]: P
  int nb = 0;              // blocks stored so far
  int64_t T = 0, D = 0;
  // P not yet gathered (attn_res_begin with gather = false): the first attn_res_point reads it from the table.
  const u16* embed = nullptr;      // bf16 [V, D]
  const int32_t* embed_ids = nullptr;  // i32 [T]
};
// §3.1: P = embed_tokens[ids], no stored blocks. gather = false leaves the gather to the first (fused) point:
// one launch fewer on every step (not under TP, whose ranks all-reduce P first, nor with image rows).
AttnResDev attn_res_begin(Context& x, const u16* embed /* bf16 [V, D] */, const int32_t* d_ids /* i32 [T] */,
                          int64_t T, bool gather = true);
// §3.2 steps 1/5 (and the final Mix) fused with the RMSNorm that follows: out = RMSNorm_norm(Mix(B, P)).
void attn_res_mix_norm(Context& x, const AttnResDev& rs, const u16* res_norm /* bf16 [D] */,
                       const u16* res_proj /* bf16 [D] */, const u16* norm /* bf16 [D] */,
                       u16* out /* bf16 [T, D] */);
// Step 2: a write layer stores P as the next block.
void attn_res_write_block(Context& x, AttnResDev& rs);
// Step 4: P := a after a write, else P := bf16(P + a). Step 6: P := bf16(P + m) (write = false).
void attn_res_add(Context& x, AttnResDev& rs, const u16* a /* bf16 [T, D] */, bool write);
// The fused form of one AttnRes point (kernels/cuda/norm.h attn_res_step): the pending update of P by `a`
// (mode), a write layer's new block (store: P after the update becomes block nb, after this Mix), then
// out = RMSNorm_norm(Mix(B, P)) and, with out8, its PTPC FP8 codes (for the FP8 projections that read it).
void attn_res_point(Context& x, AttnResDev& rs, const u16* a /* bf16 [T, D] or null */, cuda::AttnResAdd mode,
                    bool store, const u16* res_norm /* bf16 [D] */, const u16* res_proj /* bf16 [D] */,
                    const u16* norm /* bf16 [D] */, u16* out /* bf16 [T, D] */, Fp8Act* out8);

// Tensor parallelism at the sublayer ends (tp.cpp; identity on one rank). A row-parallel projection's
// partial output bf16 [n] is summed over the ranks in place (one all-reduce). Columns other ranks computed
// come back side by side: full[t, p·w + j] = local_p[t, j] for local esz-byte elements [T, w] → [T, N·w].
void tp_all_reduce(Context& x, u16* y /* bf16 [n] */, int64_t n);
void tp_gather_columns(Context& x, const void* local /* [T, w] */, int64_t T, int64_t w, DType dt,
                       void* full /* [T, N·w] */);

// DSpark (§5) taps of a forward: P after each of layers[0..n) into out (device bf16 [T, n·D]).
struct TapsDev {
  const int* layers = nullptr;
  int64_t n = 0;
  u16* out = nullptr;
};

// The layer stack of one step (forward.cpp, §3.1–3.2, §3.8): embeddings of d_ids through every layer,
// then the final Mix, model.norm and lm_head over the nr rows d_lrows into logits (f32 [nr, V]);
// lrows_identity: d_lrows is 0, 1, .., nr−1 (every row wants logits, in order), so no gather is needed.
// taps (eager steps only): the §5 taps of every row.
void forward_layers(Context& x, const WeightsDev& w, CudaCache& cc, const BatchStep& s, const int32_t* d_ids,
                    const int32_t* d_lrows, int64_t nr, bool lrows_identity, float* logits,
                    const TapsDev* taps = nullptr);

// DSpark verification (speculative.cpp, §5). upload_verify: a step's verify metadata (s.d_iota, the
// cache's verify list) and trace capacity. kda_verify_conv / kda_verify_scan: §3.3 steps 2 and 6 of the
// verify rows one position at a time, each position's slot state copied into the cache's trace.
// keep_verified: verify sequence k's state after its position t back into its slot (2 copies per KDA
// layer); keep_verified_batch: every verify sequence k's after its position t[k], all KDA layers, in one
// launch (one small index upload). copy_tap: P into column block k of the taps.
void upload_verify(Context& x, CudaCache& cc, BatchStep& s);
void kda_verify_conv(Context& x, const KdaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer,
                     const u16* qkv /* bf16 [T, 3·HD] */, u16* conv /* bf16 [T, 3·HD] */);
void kda_verify_scan(Context& x, CudaCache& cc, const BatchStep& s, int layer, const float* q /* f32 [T, HD] */,
                     const float* k /* f32 [T, HD] */, const float* v /* f32 [T, HD] */,
                     const float* g /* f32 [T, HD] */, const float* beta /* f32 [T, H] */,
                     float* o /* f32 [T, HD] */);
void keep_verified(CudaCache& cc, int64_t k, int64_t t, cudaStream_t stream);
void keep_verified_batch(CudaCache& cc, std::span<const int64_t> t /* [verify sequences] */, cudaStream_t stream);
void copy_tap(Context& x, const AttnResDev& rs, int64_t k, int64_t n_taps, u16* taps /* bf16 [T, n·D] */);

// The GPU draft (dspark.cpp) over this model's context and target weights.
std::unique_ptr<CudaDraft> new_cuda_draft(Context& x, const WeightsDev& w, const Draft& d, int32_t num_pages,
                                          int block_size);

}  // namespace kestrel::model::gpu
