// MoE forward, MODEL.md §3.6 steps 1–7 in order.
#include "model/moe.h"

#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/moe_ops.h"
#include "model/mlp.h"

namespace kestrel::model {

void moe_forward(const MoeWeights& w, const TextConfig& c, const uint16_t* x, int64_t T, uint16_t* out,
                 const Probe& probe, const Shard& shard) {
  if (shard.split()) return moe_forward_split(w, c, x, T, out, probe, shard);
  const int64_t D = c.hidden_size, X = c.num_experts, K = c.num_experts_per_token, Lt = c.routed_expert_hidden_size,
                I = c.moe_intermediate_size;
  KCHECK(int64_t(w.experts.size()) == X, "MoE layer has {} experts, config says {}", w.experts.size(), X);
  KCHECK(K > 0 && K <= X, "num_experts_per_token {} out of range (1..{})", K, X);

  // Step 1: router in FP32: s = σ(x·W_gateᵀ); selection on s + bias; weights are the un-biased s,
  // renormalised, times routed_scaling_factor. (Step 2's z = Lin(routed_expert_down_proj)(x) shares
  // the input, so both products run in one call.)
  // Scratch (common.h): every buffer below is written in full by the call that fills it.
  Scratch<float> r(size_t(T * X));     // f32 [T, X]
  Scratch<uint16_t> z(size_t(T * Lt));  // bf16 [T, Lt]
  const cpu::GemmOut proj[] = {{bf16_ptr(w.router), X, nullptr, r.data(), X},
                               {bf16_ptr(w.latent_down), Lt, z.data(), nullptr, Lt}};
  cpu::gemm_bf16_multi(x, D, T, D, proj);
  std::vector<int32_t> ids(size_t(T * K));  // i32 [T, K]
  std::vector<float> wts(size_t(T * K));    // f32 [T, K]
  cpu::moe_route(r.data(), f32_ptr(w.router_bias), T, X, K, c.moe_renormalize, c.routed_scaling_factor, ids.data(),
                 wts.data());
  probe("router_ids", ids.data(), DType::i32, {T, K});
  probe("router_weights", wts.data(), DType::f32, {T, K});

  // Step 2: z (above).

  // Steps 3–4: per selected expert [g | u] = z·[W1; W3]ᵀ, a = SiTU-GLU(g, u), y = bf16(a·W2ᵀ); then
  // ũ = bf16(Σ_k w_k · y_k) in top-k order.
  std::vector<cpu::ExpertPtrs> ex(static_cast<size_t>(X));
  for (int64_t e = 0; e < X; ++e) {
    const ExpertWeights& ew = w.experts[size_t(e)];
    ex[size_t(e)] = {{ew.w1.packed.as<const uint8_t>(), ew.w1.scale.as<const uint8_t>()},
                     {ew.w3.packed.as<const uint8_t>(), ew.w3.scale.as<const uint8_t>()},
                     {ew.w2.packed.as<const uint8_t>(), ew.w2.scale.as<const uint8_t>()}};
  }
  Scratch<uint16_t> ut(size_t(T * Lt)), un(size_t(T * Lt));  // bf16 [T, Lt]
  cpu::moe_experts_fast(z.data(), ids.data(), wts.data(), ex.data(), T, X, K, Lt, I, c.situ_beta, c.situ_linear_beta,
                   ut.data());
  // Step 5: routed = Lin(routed_expert_up_proj)(RMSNorm_{routed_expert_norm}(ũ)).
  const uint16_t* latent_in = ut.data();
  if (c.latent_moe_use_norm) {
    cpu::rmsnorm_bf16(ut.data(), bf16_ptr(w.latent_norm), un.data(), T, Lt, c.rms_norm_eps);
    latent_in = un.data();
  }
  Scratch<uint16_t> routed(size_t(T * D));  // bf16 [T, D]
  cpu::gemm_bf16(latent_in, Lt, bf16_ptr(w.latent_up), routed.data(), D, T, Lt, D);

  // Steps 6–7: out = bf16(routed + shared(x)).
  if (!w.has_shared) {
    std::copy(routed.begin(), routed.end(), out);
    return;
  }
  Scratch<uint16_t> sh(size_t(T * D));  // bf16 [T, D]
  mlp_forward(w.shared, c, x, T, sh.data());
  cpu::add_bf16(routed.data(), sh.data(), out, T * D);
}

}  // namespace kestrel::model
