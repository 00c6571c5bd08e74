// AttnRes Mix, MODEL.md §3.2. Scores use FP64 dot products and means (cheap at this size, and the
// Mix logits have ~0.02 margins, §3.2), the softmax and the weighted sum of raw sources run in FP32.
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

void AttnResStream::accumulate(const uint16_t* y) {
  for (int64_t i = 0; i < T * D; ++i) partial[size_t(i)] = f32_to_bf16(bf16_to_f32(partial[size_t(i)]) + bf16_to_f32(y[i]));
}

void attn_res_mix(const AttnResStream& s, const uint16_t* norm_w, const uint16_t* proj_w, float eps, uint16_t* out) {
  const int64_t D = s.D, n = s.num_blocks + 1;
  // u = norm_w ⊙ proj_w, fused once (§3.2).
  std::vector<float> u(static_cast<size_t>(D));
  for (int64_t i = 0; i < D; ++i) u[size_t(i)] = bf16_to_f32(norm_w[i]) * bf16_to_f32(proj_w[i]);
  std::vector<const uint16_t*> src(static_cast<size_t>(n));
  std::vector<float> logit(static_cast<size_t>(n)), acc(static_cast<size_t>(D));
  for (int64_t t = 0; t < s.T; ++t) {
    for (int64_t i = 0; i < n; ++i) src[size_t(i)] = (i < s.num_blocks ? s.block(int(i)) : s.partial.data()) + t * D;
    uint16_t* o = out + t * D;
    if (n == 1) {  // single source: h is that source exactly
      std::memcpy(o, src[0], size_t(D) * 2);
      continue;
    }
    // ℓ_i = (v_i · u) · rsqrt(mean(v_i²) + ε): the score sees the normalised source, no weight on v.
    for (int64_t i = 0; i < n; ++i) {
      double dot = 0.0, ss = 0.0;
      for (int64_t k = 0; k < D; ++k) {
        const double v = bf16_to_f32(src[size_t(i)][k]);
        dot += v * u[size_t(k)];
        ss += v * v;
      }
      logit[size_t(i)] = float(dot / std::sqrt(ss / double(D) + double(eps)));
    }
    cpu::softmax_inplace(logit.data(), n);
    // h = Σ α_i v_i over the raw sources.
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < D; ++k) acc[size_t(k)] += logit[size_t(i)] * bf16_to_f32(src[size_t(i)][k]);
    cpu::f32_to_bf16_n(acc.data(), o, D);
  }
}

}  // namespace kestrel::model
