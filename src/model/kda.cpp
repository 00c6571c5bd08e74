// KDA forward, MODEL.md §3.3, steps 1–8 in order. The projections run over all T tokens at once
// (one GEMM each); the short conv walks the tokens (its history is state); the delta-rule scan runs
// per head in parallel, chunked (WY/UT, kernels/cpu/kda_scan.h) for prefill and recurrent for decode.
#include "model/kda.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/kda_ops.h"
#include "kernels/cpu/kda_scan.h"

namespace kestrel::model {

void KdaState::reset(const TextConfig& c) {
  const int64_t H = c.kda.num_heads, Dk = c.kda.head_dim;
  S.assign(size_t(H * Dk * Dk), 0.0f);
  conv.assign(size_t(3 * (c.kda.conv_size - 1) * H * Dk), 0);
}

void kda_forward(const KdaWeights& w, const TextConfig& c, KdaState& st, const uint16_t* x, int64_t T, uint16_t* out,
                 KdaForm form) {
  KCHECK(st.S.size() == size_t(kda_recurrent_elems(c)) && st.conv.size() == size_t(kda_conv_elems(c)),
         "KDA state not initialised");
  kda_forward(w, c, st.view(), x, T, out, form);
}

void kda_forward(const KdaWeights& w, const TextConfig& c, const KdaStateView& st, const uint16_t* x, int64_t T,
                 uint16_t* out, KdaForm form, const Shard& sh) {
  const int64_t D = c.hidden_size, H = c.kda.num_heads, Dk = c.kda.head_dim, HD = H * Dk, W = c.kda.conv_size;
  KCHECK(st.recurrent && st.conv, "KDA state view is empty");
  // f32 [H, Dk, Dk]: the state itself, or a widened copy of an f16 state written back at the end.
  std::vector<float> widened;
  float* Sbase = static_cast<float*>(st.recurrent);
  if (st.recurrent_f16) {
    const uint16_t* h16 = static_cast<const uint16_t*>(st.recurrent);
    widened.resize(size_t(H * Dk * Dk));
    for (size_t i = 0; i < widened.size(); ++i) widened[i] = f16_to_f32(h16[i]);
    Sbase = widened.data();
  }
  using cpu::gemm_bf16;

  // §3.3 step 1: q̃, k̃, ṽ = Lin(q/k/v_proj)(x).
  Bf16Vec qkv(size_t(3 * T * HD));  // bf16 [3, T, HD]
  const TensorView* proj[3] = {&w.q_proj, &w.k_proj, &w.v_proj};
  for (int p = 0; p < 3; ++p) gemm_bf16(x, D, bf16_ptr(*proj[p]), qkv.data() + p * T * HD, HD, T, D, HD);

  // Step 4 inputs: z = Lin(f_b)(Lin(f_a)(x)) (both BF16 Lin outputs; dt_bias added in FP32 below).
  Bf16Vec fa(size_t(T * Dk)), z(size_t(T * HD));  // bf16 [T, Dk], bf16 [T, HD]
  gemm_bf16(x, D, bf16_ptr(w.f_a_proj), fa.data(), Dk, T, D, Dk);
  gemm_bf16(fa.data(), Dk, bf16_ptr(w.f_b_proj), z.data(), HD, T, Dk, HD);
  // Step 5 input: Lin(b_proj)(x); step 7 input: Lin(g_proj)(x).
  Bf16Vec bl(size_t(T * H)), gate(size_t(T * HD));  // bf16 [T, H], bf16 [T, HD]
  gemm_bf16(x, D, bf16_ptr(w.b_proj), bl.data(), H, T, D, H);
  gemm_bf16(x, D, bf16_ptr(w.g_proj), gate.data(), HD, T, D, HD);

  const float* conv_w[3] = {f32_ptr(w.q_conv), f32_ptr(w.k_conv), f32_ptr(w.v_conv)};  // f32 [HD, 1, W]
  const float* a_log = f32_ptr(w.a_log);    // f32 [>= H]
  const float* dt_bias = f32_ptr(w.dt_bias);  // f32 [HD]
  const float* o_norm = f32_ptr(w.o_norm);    // f32 [Dk]
  const float lower = c.kda.gate_lower_bound, eps = c.rms_norm_eps;

  // Step 2: causal depthwise conv over [W−1 stored inputs, current], SiLU, BF16; the history shifts
  // token by token (it is the carried state). q, k, v stay f32 from here on.
  std::vector<float> qkv_f(size_t(3 * T * HD));  // f32 [3, T, HD], post-conv q, k, v
  for (int p = 0; p < 3; ++p)
    cpu::kda_conv_silu(qkv.data() + p * T * HD, HD, conv_w[p], st.conv + p * (W - 1) * HD,
                       qkv_f.data() + p * T * HD, HD, T, HD, W);
  float* qf = qkv_f.data();
  float* kf = qkv_f.data() + T * HD;
  const float* vf = qkv_f.data() + 2 * T * HD;

  // Steps 3–5: L2-normalise q and k (eps inside the sqrt, q scaled by Dk^−½); log-decay
  // g = lower · σ(exp(A_log[h]) · (z + dt_bias)) ∈ (lower, 0); β = σ(b).
  std::vector<float> g(size_t(T * HD)), beta(size_t(T * H));  // f32 [T, HD], f32 [T, H]
  cpu::kda_qk_norm_gates(qf, kf, z.data(), dt_bias, a_log, bl.data(), lower, g.data(), beta.data(), T, H, Dk);

  // Step 6: the delta-rule scan per head — recurrent for single tokens, chunked (C = 64) otherwise.
  const bool chunked = form == KdaForm::chunked || (form == KdaForm::automatic && T > 1);
  std::vector<float> o(size_t(T * HD));  // f32 [T, HD]
#pragma omp parallel for schedule(static) if (4 * T * H * Dk * Dk >= cpu::kParallelMinWork)
  for (int64_t h = 0; h < H; ++h) {
    const cpu::KdaHeadIo io{qf + h * Dk, kf + h * Dk, vf + h * Dk, g.data() + h * Dk, beta.data() + h, HD, H,
                            o.data() + h * Dk};
    float* S = Sbase + h * Dk * Dk;  // f32 [Dk(key), Dk(value)]
    if (chunked)
      cpu::kda_scan_chunked(io, T, Dk, S);
    else
      cpu::kda_scan_recurrent(io, T, Dk, S);
  }

  if (st.recurrent_f16) {
    uint16_t* h16 = static_cast<uint16_t*>(st.recurrent);
    for (size_t i = 0; i < widened.size(); ++i) h16[i] = f32_to_f16(widened[i]);
  }

  // Step 7: ô = RMSNorm_{o_norm}(o) ⊙ σ(gate), per head, all FP32, one rounding.
  Bf16Vec ohat(size_t(T * HD));  // bf16 [T, HD]
  cpu::kda_out_norm_gate(o.data(), gate.data(), o_norm, eps, ohat.data(), T, H, Dk);
  // Step 8: out = Lin(o_proj)(ô); split over ranks: each sums its heads' columns, one all-reduce.
  if (!sh.split()) {
    gemm_bf16(ohat.data(), HD, bf16_ptr(w.o_proj), out, D, T, HD, D);
    return;
  }
  std::vector<float> part(size_t(T * D));  // f32 [T, D], this rank's heads only
  cpu::gemm_bf16_f32(ohat.data(), HD, bf16_ptr(w.o_proj), part.data(), D, T, HD, D);
  reduce_to_bf16(sh, part.data(), T * D, out);
}

}  // namespace kestrel::model
