// AttnRes (MODEL.md §3.2): the stored-block list B and the partial sum P that replace the residual
// stream, and Mix, the softmax-weighted read over them. Token-local: one stream per step holds the
// vectors of all T tokens of that step, nothing carries over between steps.
#pragma once

#include <cstdint>

#include "model/common.h"

namespace kestrel::model {

struct AttnResStream {
  int64_t T = 0, D = 0;
  Bf16Vec blocks;   // bf16 [Nb, T, D], the first `num_blocks` filled
  int num_blocks = 0;
  Bf16Vec partial;  // bf16 [T, D], P

  AttnResStream(int64_t T, int64_t D, int max_blocks);
  const uint16_t* block(int i) const { return blocks.data() + int64_t(i) * T * D; }
  // §3.2 step 2: append P as the next stored block and empty P.
  void write_block();
  // §3.2 steps 4 and 6: P := bf16(P + y) for a layer output y (bf16 [T, D]). Step 4 on a write layer
  // is P := a instead (P was just emptied): assign `partial` directly.
  void accumulate(const uint16_t* y);
};

// h = Mix([B_0..B_{n-1}, P]; norm_w, proj_w) for every token, rounded to BF16 (the reference rounds
// the mix before the following RMSNorm, §3.2 "Precision").
void attn_res_mix(const AttnResStream& s, const uint16_t* norm_w /* bf16 [D] */,
                  const uint16_t* proj_w /* bf16 [D] (the [1, D] tensor) */, float eps,
                  uint16_t* out /* bf16 [T, D] */);

}  // namespace kestrel::model
