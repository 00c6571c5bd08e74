// Token selection on the GPU, so a batch's logits (f32 [B, V], V up to 160K) stay on the device and
// only n ids come back. CPU twin: runtime::sample_token (runtime/sampler.h), whose rules these follow
// exactly: logit_bias, min_tokens masks and penalties on the logits → greedy argmax if temperature == 0 (ties to the lower id) →
// candidates in (logit desc, id asc) order, top-k cut → probabilities over the FULL vocabulary
// (softmax in FP64) → min-p (prob ≥ min_p · p_max) → top-p (shortest prefix whose mass reaches top_p)
// → draw u·kept along the prefix with u = sample_uniform(seed, index) (the same SplitMix64, so the
// GPU and CPU draw the same token whenever their FP64 sums agree to the last bits the draw depends on).
//
// How: one block per row. The first min(top_k or V, 1024) candidates are found by bisection on the
// order-preserving integer image of the logits (32 counting passes), gathered into shared memory and
// bitonic-sorted by (logit desc, id asc); the probability prefix sums are a block scan. When the kept
// prefix is not closed inside those 1024 candidates (no top-k ≤ 1024 and neither min-p nor top-p
// stops within them, e.g. plain temperature sampling), the top-p boundary and the draw are found in
// the rest of the row by bisection on the composite (logit, id) key, 64 mass passes each, above the
// bound a top-k > 1024 or a wide min-p sets (the L-th key, 64 counting passes); when more than 2048
// logits tie at the cut, the candidates are the first 1024 keys exactly (the same bisection). So
// every row gets a token here — none is handed back to the host, which run-ahead decoding relies on
// (the next step has overwritten the logits by the time the host could look); the rare slow paths
// cost ~64–192 passes over the row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda {

// ids[r] = argmax_v x[r, v], ties to the lower v, NaN never chosen (an all-NaN row gives 0); V ≥ 1 (argmax.cu).
// With a workspace, up to 128 rows are each split over CTAs (the last CTA of a row reduces; KESTREL_ARGMAX_SPLIT=0:
// never), else one CTA per row — the same ids. The workspace: argmax_workspace_bytes() bytes, zeroed once by the
// caller; every call leaves it zeroed; one stream at a time.
size_t argmax_workspace_bytes();
void argmax_rows(const float* x /* f32 [B, V], row stride ld */, int64_t ld, int64_t n, int64_t V,
                 int32_t* ids /* i32 [B] */, cudaStream_t stream, void* workspace = nullptr);

inline constexpr int kSampleCandidates = 1024;

struct SampleParams {  // one per sampled row
  int32_t row;         // logits row
  int32_t top_k;       // 0 = off
  float temperature;   // 0 = greedy
  float top_p, min_p;
  uint64_t seed, index;  // the draw is sample_uniform(seed, index)
};

inline constexpr int32_t kPenaltyInContext = 1;  // the token is in the prompt ∪ output: repetition applies
inline constexpr int32_t kPenaltyMasked = 2;     // min_tokens holds this stop id back: its logit is −inf

// One (row, token) whose logit the twin adjusts before sampling, in the twin's order: + bias
// (logit_bias), then −inf if masked (min_tokens), then, in context, repetition r (logit > 0 ?
// logit / r : logit · r), then frequency · count + presence subtracted when count (its occurrences in
// the output) > 0. Entries of one row name distinct tokens.
struct PenaltyEntry {
  int32_t row, token, count, flags;
  float bias, repetition, frequency, presence;
};

// In place on the logits rows named by the entries.
void apply_penalties(float* logits /* f32 [B, V], row stride ld */, int64_t ld, int64_t V,
                     const PenaltyEntry* entries /* device [m] */, int64_t m, cudaStream_t stream);

// ids[i] = the token drawn for params[i] (always a token in [0, V): see above).
void sample_rows(const float* logits /* f32 [*, V], row stride ld */, int64_t ld, int64_t V,
                 const SampleParams* params /* device [B] */, int64_t n, int32_t* ids /* i32 [B] */,
                 cudaStream_t stream);

}  // namespace kestrel::cuda
