// MoE forward, MODEL.md §3.6 steps 1–7 in order.
#include "model/moe.h"

#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/mlp.h"

namespace kestrel::model {

void moe_forward(const MoeWeights& w, const TextConfig& c, const uint16_t* x, int64_t T, uint16_t* out,
                 const Probe& probe) {
  const int64_t D = c.hidden_size, X = c.num_experts, K = c.num_experts_per_token, Lt = c.routed_expert_hidden_size,
                I = c.moe_intermediate_size;
  KCHECK(int64_t(w.experts.size()) == X, "MoE layer has {} experts, config says {}", w.experts.size(), X);
  KCHECK(K > 0 && K <= X, "num_experts_per_token {} out of range (1..{})", K, X);

  // Step 1: router in FP32: s = σ(x·W_gateᵀ); selection on s + bias; weights are the un-biased s,
  // renormalised, times routed_scaling_factor.
  std::vector<float> r(size_t(T * X));  // f32 [T, X]
  cpu::gemm_bf16_f32(x, D, bf16_ptr(w.router), r.data(), X, T, D, X);
  const float* bias = f32_ptr(w.router_bias);
  std::vector<int32_t> ids(size_t(T * K));  // i32 [T, K]
  std::vector<float> wts(size_t(T * K));    // f32 [T, K]
  std::vector<float> s(static_cast<size_t>(X)), sel(static_cast<size_t>(X));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < X; ++e) {
      s[size_t(e)] = cpu::sigmoid(r[size_t(t * X + e)]);
      sel[size_t(e)] = s[size_t(e)] + bias[e];
    }
    int32_t* id = ids.data() + t * K;
    float* wt = wts.data() + t * K;
    cpu::topk(sel.data(), X, K, id);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) sum += (wt[k] = s[size_t(id[k])]);
    for (int64_t k = 0; k < K; ++k) {
      if (c.moe_renormalize) wt[k] /= (sum + 1e-20f);
      wt[k] *= c.routed_scaling_factor;
    }
  }
  probe("router_ids", ids.data(), DType::i32, {T, K});
  probe("router_weights", wts.data(), DType::f32, {T, K});

  // Step 2: z = Lin(routed_expert_down_proj)(x).
  Bf16Vec z(size_t(T * Lt));  // bf16 [T, Lt]
  cpu::gemm_bf16(x, D, bf16_ptr(w.latent_down), z.data(), Lt, T, D, Lt);

  // Step 3: per selected expert, [g | u] = z·[W1; W3]ᵀ (rounded to BF16 like any expert GEMM output),
  // a = SiTU-GLU(g, u) in BF16, y = bf16(a·W2ᵀ). y is kept per (token, slot) for the ordered combine.
  std::vector<float> y(size_t(T * K * Lt));  // f32 [T, K, Lt], BF16-valued
  std::vector<std::vector<int64_t>> users(static_cast<size_t>(X));  // expert -> flat (t*K + k) slots
  for (int64_t i = 0; i < T * K; ++i) users[size_t(ids[size_t(i)])].push_back(i);
  std::vector<float> zf, gf, uf, yf;
  Bf16Vec gb, ub, ab;
  for (int64_t e = 0; e < X; ++e) {
    const std::vector<int64_t>& slots = users[size_t(e)];
    const int64_t n = int64_t(slots.size());
    if (n == 0) continue;
    const ExpertWeights& ew = w.experts[size_t(e)];
    zf.resize(size_t(n * Lt)), gf.resize(size_t(n * I)), uf.resize(size_t(n * I)), yf.resize(size_t(n * Lt));
    gb.resize(size_t(n * I)), ub.resize(size_t(n * I)), ab.resize(size_t(n * I));
    for (int64_t i = 0; i < n; ++i) cpu::bf16_to_f32_n(z.data() + (slots[size_t(i)] / K) * Lt, zf.data() + i * Lt, Lt);
    cpu::mxfp4_gemm(ew.w1.packed.as<const uint8_t>(), ew.w1.scale.as<const uint8_t>(), zf.data(), gf.data(), n, I, Lt);
    cpu::mxfp4_gemm(ew.w3.packed.as<const uint8_t>(), ew.w3.scale.as<const uint8_t>(), zf.data(), uf.data(), n, I, Lt);
    cpu::f32_to_bf16_n(gf.data(), gb.data(), n * I);
    cpu::f32_to_bf16_n(uf.data(), ub.data(), n * I);
    cpu::situ_glu(gb.data(), ub.data(), ab.data(), n * I, c.situ_beta, c.situ_linear_beta);
    cpu::bf16_to_f32_n(ab.data(), gf.data(), n * I);
    cpu::mxfp4_gemm(ew.w2.packed.as<const uint8_t>(), ew.w2.scale.as<const uint8_t>(), gf.data(), yf.data(), n, Lt, I);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < Lt; ++j) y[size_t(slots[size_t(i)] * Lt + j)] = round_bf16(yf[size_t(i * Lt + j)]);
  }

  // Step 4: ũ = bf16(Σ_k w_k · y_k), FP32 accumulation in top-k order.
  Bf16Vec ut(size_t(T * Lt)), un(size_t(T * Lt));  // bf16 [T, Lt]
  std::vector<float> acc(static_cast<size_t>(Lt));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < Lt; ++j) acc[size_t(j)] += wts[size_t(t * K + k)] * y[size_t((t * K + k) * Lt + j)];
    cpu::f32_to_bf16_n(acc.data(), ut.data() + t * Lt, Lt);
  }
  // Step 5: routed = Lin(routed_expert_up_proj)(RMSNorm_{routed_expert_norm}(ũ)).
  const uint16_t* latent_in = ut.data();
  if (c.latent_moe_use_norm) {
    cpu::rmsnorm_bf16(ut.data(), bf16_ptr(w.latent_norm), un.data(), T, Lt, c.rms_norm_eps);
    latent_in = un.data();
  }
  Bf16Vec routed(size_t(T * D));  // bf16 [T, D]
  cpu::gemm_bf16(latent_in, Lt, bf16_ptr(w.latent_up), routed.data(), D, T, Lt, D);

  // Steps 6–7: out = bf16(routed + shared(x)).
  if (!w.has_shared) {
    std::copy(routed.begin(), routed.end(), out);
    return;
  }
  Bf16Vec sh(size_t(T * D));  // bf16 [T, D]
  mlp_forward(w.shared, c, x, T, sh.data());
  for (int64_t i = 0; i < T * D; ++i) out[i] = f32_to_bf16(bf16_to_f32(routed[size_t(i)]) + bf16_to_f32(sh[size_t(i)]));
}

}  // namespace kestrel::model
