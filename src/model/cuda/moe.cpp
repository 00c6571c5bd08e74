// Latent MoE on the GPU, MODEL.md §3.6 steps 1–7 in order (CPU twin: model/moe.cpp). The router and the
// expert selection run over all rows at once; the routed experts stay MXFP4 (kernels/cuda/moe.h).
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/norm.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void moe_forward(Context& x, const MoeWeightsDev& w, int layer, const u16* in, int64_t T, u16* out) {
  const TextConfig& c = x.c;
  const int64_t D = c.hidden_size, X = c.num_experts, K = c.num_experts_per_token, Lt = c.routed_expert_hidden_size,
                I = c.moe_intermediate_size;
  // Step 1: router in FP32: selection on σ(logits) + bias; weights the un-biased scores, renormalised,
  // times routed_scaling_factor.
  float* r = x.tmp<float>(T * X);        // f32 [T, X]
  int32_t* ids = x.tmp<int32_t>(T * K);  // i32 [T, K]
  float* wts = x.tmp<float>(T * K);      // f32 [T, K]
  x.lt.bf16_f32(in, D, w.router, r, X, T, D, X, x.stream);
  cuda::moe_route(r, w.router_bias, T, X, K, c.moe_renormalize, c.routed_scaling_factor, ids, wts, x.stream);
  x.caps.ids_i32(layer, "router_ids", ids, T * K, x.stream);
  // Step 2: z = Lin(routed_expert_down_proj)(x).
  u16* z = x.tmp<u16>(T * Lt);  // bf16 [T, Lt]
  x.gemm(in, D, w.latent_down, z, Lt, T, D, Lt);
  x.mark("moe.router+down");
  // Steps 3–4: the selected experts on z, ũ = bf16(Σ_k w_k · y_k).
  u16* ut = x.tmp<u16>(T * Lt);  // bf16 [T, Lt]
  void* ws = x.tmp<char>(int64_t(cuda::moe_experts_workspace_bytes(T, X, K, Lt, I)));
  cuda::moe_experts_mxfp4(z, ids, wts, w.experts, T, X, K, Lt, I, c.situ_beta, c.situ_linear_beta, ws, ut, x.stream);
  x.mark("moe.experts");
  // Step 5: routed = Lin(routed_expert_up_proj)(RMSNorm_{routed_expert_norm}(ũ)).
  const u16* lin = ut;
  if (c.latent_moe_use_norm) {
    u16* un = x.tmp<u16>(T * Lt);  // bf16 [T, Lt]
    cuda::rmsnorm_bf16(ut, Lt, w.latent_norm, un, Lt, T, Lt, c.rms_norm_eps, x.stream);
    lin = un;
  }
  u16* routed = w.has_shared ? x.tmp<u16>(T * D) : out;  // bf16 [T, D]
  x.gemm(lin, Lt, w.latent_up, routed, D, T, Lt, D);
  // Steps 6–7: out = bf16(routed + shared(x)).
  if (w.has_shared) {
    mlp_forward(x, w.shared, in, T, out);
    cuda::add_bf16(routed, out, out, T * D, x.stream);
  }
  x.mark("moe.up+shared");
}

}  // namespace kestrel::model::gpu
