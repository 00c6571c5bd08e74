// MoE forward of one tensor-parallel rank, MODEL.md §3.6 steps 1–7 in order, with the collectives of
// docs/parallel.md §3 ("The latent MoE needs three collectives"). Kept apart from moe.cpp so the
// one-rank forward stays the spec's plain sequence. Numerics against one rank: the router logits, z
// and the routing are bit-identical (each row is a whole dot product on its owner); ũ sums the same
// products in another order (and under the I split each y_k is rounded once after the sum, not per
// rank); the output is rounded once from routed + shared instead of twice. BF16 noise, no more.
#include <algorithm>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/moe_ops.h"
#include "model/mlp.h"
#include "model/moe.h"
#include "parallel/comm.h"

namespace kestrel::model {

void moe_forward_split(const MoeWeights& w, const TextConfig& c, const uint16_t* x, int64_t T, uint16_t* out,
                       const Probe& probe, const Shard& sh) {
  const int N = sh.size(), rank = sh.rank();
  const int64_t D = c.hidden_size, X = c.num_experts, K = c.num_experts_per_token, Lt = c.routed_expert_hidden_size;
  const int64_t Xl = w.router.shape[0], Ll = w.latent_down.shape[0];  // this rank's router rows, latent slice
  KCHECK(Xl * N == X && Ll * N == Lt, "MoE shard: {} router rows and {} latent rows on each of {} ranks for X={} Lt={}",
         Xl, Ll, N, X, Lt);
  KCHECK(int64_t(w.experts.size()) == X, "MoE layer has {} experts, config says {}", w.experts.size(), X);

  // Step 1 (router) and step 2 (z = Lin(routed_expert_down_proj)(x)) on this rank's rows, then one
  // all-gather each: logits f32 [T, X] (with the selection bias as an extra row) and z bf16 [T, Lt].
  std::vector<float> rl(size_t((T + 1) * Xl)), r(size_t((T + 1) * X));  // f32 [T+1, Xl], [T+1, X]
  cpu::gemm_bf16_f32(x, D, bf16_ptr(w.router), rl.data(), Xl, T, D, Xl);
  std::copy_n(f32_ptr(w.router_bias), Xl, rl.data() + T * Xl);
  gather_columns(sh, rl.data(), T + 1, Xl, DType::f32, r.data());
  Bf16Vec zl(size_t(T * Ll)), z(size_t(T * Lt));  // bf16 [T, Ll], [T, Lt]
  cpu::gemm_bf16(x, D, bf16_ptr(w.latent_down), zl.data(), Ll, T, D, Ll);
  gather_columns(sh, zl.data(), T, Ll, DType::bf16, z.data());

  std::vector<int32_t> ids(size_t(T * K));  // i32 [T, K]
  std::vector<float> wts(size_t(T * K));    // f32 [T, K]
  cpu::moe_route(r.data(), r.data() + T * X, T, X, K, c.moe_renormalize, c.routed_scaling_factor, ids.data(),
                 wts.data());
  probe("router_ids", ids.data(), DType::i32, {T, K});
  probe("router_weights", wts.data(), DType::f32, {T, K});

  // Steps 3–4 on this rank's experts: I/N columns of every expert (rows of w1/w3, columns of w2), or
  // whole experts under expert parallelism (the others are empty views). ũ all-reduced in f32.
  std::vector<cpu::ExpertPtrs> ex(static_cast<size_t>(X));
  int64_t Il = 0;  // this rank's intermediate width
  for (int64_t e = 0; e < X; ++e) {
    const ExpertWeights& ew = w.experts[size_t(e)];
    if (ew.w1.packed.empty()) continue;
    Il = ew.w1.rows();
    ex[size_t(e)] = {{ew.w1.packed.as<const uint8_t>(), ew.w1.scale.as<const uint8_t>()},
                     {ew.w3.packed.as<const uint8_t>(), ew.w3.scale.as<const uint8_t>()},
                     {ew.w2.packed.as<const uint8_t>(), ew.w2.scale.as<const uint8_t>()}};
  }
  const bool whole_experts = Il == c.moe_intermediate_size;  // expert parallelism: y_k complete here
  std::vector<float> uf(size_t(T * Lt));  // f32 [T, Lt]
  if (Il > 0)
    cpu::moe_experts_f32(z.data(), ids.data(), wts.data(), ex.data(), T, X, K, Lt, Il, c.situ_beta,
                         c.situ_linear_beta, whole_experts, uf.data());
  Bf16Vec ut(size_t(T * Lt));  // bf16 [T, Lt]
  reduce_to_bf16(sh, uf.data(), T * Lt, ut.data());

  // Step 5: routed = Lin(routed_expert_up_proj)(RMSNorm_{routed_expert_norm}(ũ)). The norm's mean runs
  // over the whole ũ (unit weight: RMSNorm rounds x·rsqrt once, and ×1 changes nothing), then this
  // rank's slice of the weight; the up-projection takes that slice (its columns) → partial [T, D].
  Bf16Vec un(size_t(T * Lt));  // bf16 [T, Lt]
  const uint16_t* latent = ut.data();
  if (c.latent_moe_use_norm) {
    const Bf16Vec ones(size_t(Lt), f32_to_bf16(1.0f));
    cpu::rmsnorm_bf16(ut.data(), ones.data(), un.data(), T, Lt, c.rms_norm_eps);
    const uint16_t* nw = bf16_ptr(w.latent_norm);  // bf16 [Ll], columns [rank·Ll, (rank+1)·Ll)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < Ll; ++j) {
        uint16_t& v = un[size_t(t * Lt + rank * Ll + j)];
        v = f32_to_bf16(bf16_to_f32(nw[j]) * bf16_to_f32(v));
      }
    latent = un.data();
  }
  std::vector<float> part(size_t(T * D));  // f32 [T, D]
  cpu::gemm_bf16_f32(latent + rank * Ll, Lt, bf16_ptr(w.latent_up), part.data(), D, T, Ll, D);

  // Steps 6–7: + this rank's shared-expert partial (gate/up rows, down columns); one all-reduce.
  if (w.has_shared) {
    std::vector<float> sp(size_t(T * D));  // f32 [T, D]
    mlp_forward_partial(w.shared, c, x, T, sp.data());
    for (size_t i = 0; i < part.size(); ++i) part[i] += sp[i];
  }
  reduce_to_bf16(sh, part.data(), T * D, out);
}

}  // namespace kestrel::model
