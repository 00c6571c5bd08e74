// AttnRes Mix, MODEL.md §3.2. Scores use FP64 dot products and means (cheap at this size, and the
// Mix logits have ~0.02 margins, §3.2), the softmax and the weighted sum of raw sources run in FP32
// (kernels/cpu/attn_res_ops.cpp, all tokens of the step at once).
#include "model/attn_res.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::model {

AttnResStream::AttnResStream(int64_t T_, int64_t D_, int max_blocks)
    : T(T_), D(D_), blocks(size_t(max_blocks) * size_t(T_ * D_)), partial(size_t(T_ * D_)) {}

void AttnResStream::write_block() {
  KCHECK(size_t(num_blocks + 1) * size_t(T * D) <= blocks.size(), "AttnRes block {} exceeds the stored-block count",
         num_blocks);
  std::memcpy(blocks.data() + int64_t(num_blocks) * T * D, partial.data(), size_t(T * D) * 2);
  ++num_blocks;
}

void AttnResStream::accumulate(const uint16_t* y) { cpu::add_bf16(partial.data(), y, partial.data(), T * D); }

void attn_res_mix(const AttnResStream& s, const uint16_t* norm_w, const uint16_t* proj_w, float eps, uint16_t* out) {
  const int64_t D = s.D, n = s.num_blocks + 1;
  // u = norm_w ⊙ proj_w, fused once (§3.2).
  std::vector<float> u(static_cast<size_t>(D));
  for (int64_t i = 0; i < D; ++i) u[size_t(i)] = bf16_to_f32(norm_w[i]) * bf16_to_f32(proj_w[i]);
  // Sources [B_0..B_{n−1}, P]; per token ℓ_i = (v_i · u) · rsqrt(mean(v_i²) + ε) (the score sees the
  // normalised source, no weight on v), α = softmax(ℓ), h = Σ α_i v_i over the raw sources.
  std::vector<const uint16_t*> src(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) src[size_t(i)] = i < s.num_blocks ? s.block(int(i)) : s.partial.data();
  cpu::attn_res_mix_rows(src.data(), n, u.data(), eps, s.T, D, out);
}

}  // namespace kestrel::model
