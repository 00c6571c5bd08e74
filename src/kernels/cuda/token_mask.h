// Structured outputs on the device: the grammar's token masks applied to the sampled logits rows before
// the sampler (kernels/cuda/sampling.h) sees them. CPU twin: runtime::apply_token_mask
// (runtime/constraints.h).
//
// Layout: masks are rows of `words` uint32, bit (id % 32) of word (id / 32) set = id allowed (the
// structured library's layout, structured/vocab.h). Sample entry i (params[i], its logits row
// params[i].row) uses mask row mask_row[i]; −1 = no mask for that entry (the per-row flag). The mask
// rows live in a device table at a fixed address (the executor copies the step's rows into it), so a
// captured graph could replay this launch unchanged.
//
// How: one thread per (entry, id), blocks of 1024 ids × entries; the 32 threads of a warp read the
// same mask word (one broadcast load) and write −inf to their disallowed ids (coalesced). Entries
// without a mask exit at once. −inf is what the sampler's rules already handle: exp(−inf) = 0 in the
// softmax, never the argmax while one id is allowed (finite), last in the candidate order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sampling.h"

namespace kestrel::cuda {

void apply_token_masks(float* logits /* f32 [*, V], row stride ld */, int64_t ld, int64_t V,
                       const SampleParams* params /* device [n] */, const int32_t* mask_row /* device i32 [n] */,
                       const uint32_t* masks /* device u32 [*, words] */, int64_t words, int64_t n,
                       cudaStream_t stream);

}  // namespace kestrel::cuda
