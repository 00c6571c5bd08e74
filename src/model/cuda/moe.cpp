// Latent MoE on the GPU, MODEL.md §3.6 steps 1–7 in order (CPU twin: model/moe.cpp). Everything that reads
// x is one stacked GEMM (linear.h): the shared experts' gate|up with the SiTU-GLU in its epilogue (step 6's
// first half), z = Lin(routed_expert_down_proj)(x) (step 2) and, in BF16, the FP32 router logits (step 1).
// The router and the expert selection run over all rows at once (with route_in_gemm, on one rank, the selection
// rides on the in-projection's launch: gemm_skinny.h GemmRoute); the routed experts stay MXFP4
// (kernels/cuda/moe.h); on one rank step 5's norm runs in their combine launch (MoeExpertsOptions::norm_w,
// bit-identical to the separate rmsnorm). Steps 5–7 with BF16 weights and shared experts: one GEMM over
// [RMSNorm(ũ) | a_sh] with latent up and shared down side by side along K (weights.h MoeWeightsDev::out_proj;
// the combine writes the normed rows and the shared GEMM's epilogue a_sh straight into that input row), one
// launch fewer per layer than the shared down-projection plus the latent up-projection with step 7's add in
// its epilogue (the path for FP8 weights, KESTREL_MOE_STACK_OUT=0, or no shared experts).
//
// Tensor parallelism (docs/parallel.md §3, "The latent MoE needs three collectives"; CPU twin:
// model/moe_split.cpp): the rank holds X/N router rows, Lt/N latent-down rows, I/N of every expert's
// intermediate width and Is/N of the shared experts'. Its router logits and z slice are gathered to the
// whole [T, X] and [T, Lt] (every rank then routes identically, with the selection bias and the latent
// norm gathered once at attach, cuda_model.cpp); its experts give a partial ũ, all-reduced; the norm runs
// over the whole ũ, and the latent up-projection's column slice reads the rank's Lt/N of it; routed +
// shared partials are all-reduced once.
//
// Expert parallelism (--enable-expert-parallel; CPU twin: the same moe_split.cpp): the rank holds X/N whole
// experts [x_lo, x_lo + Xe) instead of I/N of every expert; everything else is as under the I split. The
// hidden states are replicated after every all-reduce, so each rank already holds every token its experts
// need (no dispatch all-to-all): it maps the global ids to its own (others → −1, which the expert kernels
// skip before grouping) and its partial ũ — the contributions of its experts only — goes into the same ũ
// all-reduce (the combine).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/norm.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void moe_forward(Context& x, const MoeWeightsDev& w, int layer, const u16* in, const Fp8Act* in8, int64_t T,
                 u16* out) {
  const TextConfig& c = x.c;
  const int64_t D = c.hidden_size, X = c.num_experts, K = c.num_experts_per_token, Lt = c.routed_expert_hidden_size,
                I = w.I, Is = w.Is, Xl = w.Xl, Ll = w.Ll;  // I, Is, Xl, Ll: this rank's (all of them on one rank)
  float* r = x.tmp<float>(T * Xl);                        // f32 [T, Xl]: router logits (this rank's experts)
  u16* z = x.tmp<u16>(T * Ll);                            // bf16 [T, Ll]: this rank's slice of z
  // Stacked out-projection (w.out_proj): its input row is [RMSNorm(ũ), this rank's Ll columns | a_sh].
  const bool stacked = w.out_proj.N > 0;
  const int64_t ldo = Ll + Is;
  u16* oin = stacked ? x.tmp<u16>(T * ldo) : nullptr;  // bf16 [T, Ll + Is]
  // bf16 [T, Is], row stride ld_sh: the shared experts' SiTU-GLU
  u16* a_sh = !w.has_shared ? nullptr : stacked ? oin + Ll : x.tmp<u16>(T * Is);
  const int64_t ld_sh = stacked ? ldo : Is;
  // Step 1's selection (below) attached to the GEMM that makes the logits when the whole router is on this rank:
  // linear() runs it in the skinny kernel's tail where it can (DecodeOptions::route_in_gemm), else right after.
  int32_t* ids = x.tmp<int32_t>(T * K);  // i32 [T, K]
  float* wts = x.tmp<float>(T * K);      // f32 [T, K]
  const bool route_in_gemm = x.opt.route_in_gemm && !x.split();
  cuda::GemmRoute route;
  if (route_in_gemm) {
    route.bias = w.router_bias, route.K = int(K), route.renormalize = c.moe_renormalize;
    route.scaling = c.routed_scaling_factor, route.ids = ids, route.weights = wts;
  }
  {
    cuda::GemmSegs sg;
    sg.glu_beta = c.situ_beta, sg.glu_linear_beta = c.situ_linear_beta;
    if (w.has_shared) sg.seg[sg.n++] = seg_glu(0, a_sh, ld_sh);
    sg.seg[sg.n++] = seg_bf16(w.off_down, z, Ll);
    if (w.off_router >= 0) {
      if (route_in_gemm) sg.route = route, sg.route.seg = sg.n;
      sg.seg[sg.n++] = seg_f32(w.off_router, r, Xl);
    }
    linear(x, w.in_proj, in, D, T, sg, in8);
    if (w.off_router < 0) {  // ptpc-fp8: the FP32 router stays a BF16 GEMM of its own
      cuda::GemmSegs rs;
      rs.seg[0] = seg_f32(0, r, Xl);
      rs.n = 1;
      if (route_in_gemm) rs.route = route, rs.route.seg = 0;
      linear(x, w.router, in, D, T, rs);
    }
  }
  if (x.split()) {  // every rank's router columns and z slice, side by side
    float* r_all = x.tmp<float>(T * X);  // f32 [T, X]
    u16* z_all = x.tmp<u16>(T * Lt);     // bf16 [T, Lt]
    tp_gather_columns(x, r, T, Xl, DType::f32, r_all);
    tp_gather_columns(x, z, T, Ll, DType::bf16, z_all);
    r = r_all, z = z_all;
  }
  // Step 1: selection on σ(logits) + bias; weights the un-biased scores, renormalised, times
  // routed_scaling_factor (already done with the logits' GEMM when route_in_gemm).
  if (!route_in_gemm)
    cuda::moe_route(r, w.router_bias, T, X, K, c.moe_renormalize, c.routed_scaling_factor, ids, wts, x.stream);
  x.caps.ids_i32(layer, "router_ids", ids, T * K, x.stream);
  x.mark("moe.router+down");
  // Steps 3–4: the selected experts on z, ũ = bf16(Σ_k w_k · y_k).
  const int32_t* eids = ids;  // i32 [T, K]: ids into w.experts
  if (w.Xe != X) {            // expert parallelism: this rank's experts only, the others' slots −1
    int32_t* local = x.tmp<int32_t>(T * K);  // i32 [T, K]
    cuda::moe_local_ids(ids, T * K, w.x_lo, w.Xe, local, x.stream);
    eids = local;
  }
  u16* ut = x.tmp<u16>(T * Lt);  // bf16 [T, Lt]
  void* ws = x.tmp<char>(int64_t(cuda::moe_experts_workspace_bytes(T, w.Xe, K, Lt, I)));
  cuda::MoeExpertsOptions eo;
  eo.lt = &x.lt;  // prefill sizes: dequantise + cuBLASLt (moe.h MoeTokenTile::dense)
  // Step 5's norm in the combine launch (bit-identical to the separate rmsnorm) when ũ is whole on this rank;
  // stacked, on one rank it writes straight into the out-projection's input.
  const bool norm_into_oin = stacked && !x.split() && c.latent_moe_use_norm;
  u16* un = !c.latent_moe_use_norm ? nullptr : norm_into_oin ? oin : x.tmp<u16>(T * Lt);  // bf16 [T, Lt], ld_un
  const int64_t ld_un = norm_into_oin ? ldo : Lt;
  const bool norm_in_combine = un && !x.split() && x.fused() && x.opt.combine_norm;
  if (norm_in_combine)
    eo.norm_w = w.latent_norm, eo.norm_eps = c.rms_norm_eps, eo.normed = un, eo.normed_ld = ld_un;
  cuda::moe_experts_mxfp4(z, eids, wts, w.experts, T, w.Xe, K, Lt, I, c.situ_beta, c.situ_linear_beta, ws, ut,
                          x.stream, eo);
  // Under TP each rank's ũ is partial: its I/N slice of every selected expert, or (EP) its own experts' whole
  // contributions; the sum over ranks is the full ũ.
  tp_all_reduce(x, ut, T * Lt);
  x.mark("moe.experts");
  // Step 5: routed = Lin(routed_expert_up_proj)(RMSNorm_{routed_expert_norm}(ũ)).
  const u16* lin = ut;
  if (un) {
    if (!norm_in_combine) cuda::rmsnorm_bf16(ut, Lt, w.latent_norm, un, ld_un, T, Lt, c.rms_norm_eps, x.stream);
    lin = un;
  }
  if (stacked) {
    // Steps 5–7 in one GEMM: out = bf16(RMSNorm(ũ)·W_upᵀ + a_sh·W_downᵀ), one FP32 sum (the unstacked path
    // below rounds the shared part to BF16 before adding it; the spec rounds both: within a BF16 rounding).
    if (lin != oin) {  // under TP the rank's Ll columns (or, without the norm, ũ itself) into the left part
      const u16* src = lin + (x.split() ? int64_t(x.tp.rank) * Ll : 0);
      KCUDA_CHECK(cudaMemcpy2DAsync(oin, size_t(ldo) * 2, src, size_t(Lt) * 2, size_t(Ll) * 2, size_t(T),
                                    cudaMemcpyDeviceToDevice, x.stream));
    }
    linear(x, w.out_proj, oin, ldo, T, out, D);
    tp_all_reduce(x, out, T * D);  // under TP: routed + shared partial sums
    x.mark("moe.up+shared");
    return;
  }
  if (x.split()) {  // the up-projection's column slice reads this rank's Lt/N columns (made contiguous)
    u16* mine = x.tmp<u16>(T * Ll);  // bf16 [T, Ll]
    KCUDA_CHECK(cudaMemcpy2DAsync(mine, size_t(Ll) * 2, lin + int64_t(x.tp.rank) * Ll, size_t(Lt) * 2, size_t(Ll) * 2,
                                  size_t(T), cudaMemcpyDeviceToDevice, x.stream));
    lin = mine;
  }
  if (!w.has_shared) {
    linear(x, w.latent_up, lin, Ll, T, out, D);
  } else {
    // Step 6: shared = Lin(down)(a_sh); step 7: out = bf16(routed + shared), the add in the up-projection's
    // epilogue (or a separate add when the fused epilogues are off).
    u16* sh = x.tmp<u16>(T * D);  // bf16 [T, D]
    linear(x, w.shared_down, a_sh, Is, T, sh, D);
    if (x.fused()) {
      cuda::GemmSegs sg;
      sg.seg[0] = seg_add(0, out, D, sh, D);
      sg.n = 1;
      linear(x, w.latent_up, lin, Ll, T, sg);
    } else {
      u16* routed = x.tmp<u16>(T * D);  // bf16 [T, D]
      linear(x, w.latent_up, lin, Ll, T, routed, D);
      cuda::add_bf16(routed, sh, out, T * D, x.stream);
    }
  }
  tp_all_reduce(x, out, T * D);  // under TP: routed + shared partial sums
  x.mark("moe.up+shared");
}

}  // namespace kestrel::model::gpu
