// KDA on the GPU, MODEL.md §3.3 steps 1–8 in order (CPU twin: model/kda.cpp). The projections run over
// every row of the step at once; the short conv runs one decode launch over the T = 1 rows (their
// histories by slot) and one prefill launch per longer sequence; the delta-rule scan is one decode launch
// over the T = 1 rows (kda_decode) and one chunk-parallel launch over every prefill (kda_chunked, §3.3's
// WY/UT form on the tensor cores: TF32 recurrence, BF16 output products — o within ~3e-3 rel L2 of the
// FP32 CPU twin). An FP16 state is widened to FP32 and rounded back once per launch, as the CPU does per
// layer call.
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/kda.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void kda_forward(Context& x, const KdaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer, const u16* in,
                 u16* out) {
  const TextConfig& c = x.c;
  const int64_t T = s.T, D = c.hidden_size, H = c.kda.num_heads, Dk = c.kda.head_dim, HD = H * Dk,
                W = c.kda.conv_size;
  // Step 1: q̃ | k̃ | ṽ = Lin(q|k|v_proj)(x), one GEMM.
  u16* qkv = x.tmp<u16>(T * 3 * HD);  // bf16 [T, 3·HD]
  x.gemm(in, D, w.qkv, qkv, 3 * HD, T, D, 3 * HD);
  // Step 4 input z = Lin(f_b)(Lin(f_a)(x)); step 5 input Lin(b_proj)(x); step 7 input Lin(g_proj)(x).
  u16* fa = x.tmp<u16>(T * Dk);    // bf16 [T, Dk]
  u16* z = x.tmp<u16>(T * HD);     // bf16 [T, HD]
  u16* bl = x.tmp<u16>(T * H);     // bf16 [T, H]
  u16* gate = x.tmp<u16>(T * HD);  // bf16 [T, HD]
  x.gemm(in, D, w.f_a, fa, Dk, T, D, Dk);
  x.gemm(fa, Dk, w.f_b, z, HD, T, Dk, HD);
  x.gemm(in, D, w.b_proj, bl, H, T, D, H);
  x.gemm(in, D, w.g_proj, gate, HD, T, D, HD);
  x.mark("kda.proj");
  // Step 2 over q|k|v at once, SiLU, BF16: the decode rows in one launch over their slots, then each prefill.
  u16* conv = x.tmp<u16>(T * 3 * HD);  // bf16 [T, 3·HD]
  u16* hist = cc.kda_conv[size_t(layer)];  // bf16 [slots+1, W−1, 3·HD]
  if (s.nd > 0) cuda::kda_conv_decode(qkv, 3 * HD, w.conv, hist, s.d_slots, conv, 3 * HD, s.nd, 3 * HD, W, x.stream);
  for (int64_t b = s.nd; b < s.n; ++b) {
    const int64_t r = s.row0[size_t(b)];
    cuda::kda_conv_prefill(qkv + r * 3 * HD, 3 * HD, w.conv, hist + int64_t(s.slot[size_t(b)]) * (W - 1) * 3 * HD,
                           conv + r * 3 * HD, 3 * HD, s.len[size_t(b)], 3 * HD, W, x.stream);
  }
  // Steps 3–5: L2-normalised q (scaled by Dk^−½) and k, log-decay g, β = σ(b), all FP32.
  float* qf = x.tmp<float>(T * HD);    // f32 [T, HD]
  float* kf = x.tmp<float>(T * HD);    // f32 [T, HD]
  float* vf = x.tmp<float>(T * HD);    // f32 [T, HD]
  float* g = x.tmp<float>(T * HD);     // f32 [T, HD]
  float* beta = x.tmp<float>(T * H);   // f32 [T, H]
  cuda::kda_qk_norm_gates(conv, conv + HD, 3 * HD, z, w.dt_bias, w.a_log, bl, c.kda.gate_lower_bound, qf, kf, g, beta,
                          T, H, Dk, x.stream);
  cuda::bf16_to_f32_2d(conv + 2 * HD, 3 * HD, T, HD, vf, x.stream);
  // Step 6: the delta-rule scan. The T = 1 rows (decodes, listed first) in one decode-shaped launch; every
  // prefill sequence in one chunk-parallel launch over the rest of the packed rows (cu_seqlens from nd on).
  float* o = x.tmp<float>(T * HD);  // f32 [T, HD]
  const int64_t np = s.n - s.nd;   // prefill sequences
  void* ws = np > 0 ? x.tmp<char>(int64_t(cuda::kda_chunked_workspace_bytes(T - s.nd, np, H, Dk))) : nullptr;
  auto scan = [&](auto* pool) {
    if (s.nd > 0) cuda::kda_decode(qf, kf, vf, g, HD, beta, H, s.d_cu, s.d_slots, pool, o, s.nd, H, Dk, x.stream);
    if (np > 0)
      cuda::kda_chunked(qf, kf, vf, g, HD, beta, H, s.d_cu + s.nd, s.d_slots + s.nd, pool, o, T - s.nd, np, H, Dk, ws,
                        x.stream);
  };
  if (cc.kda_state_f16())
    scan(reinterpret_cast<uint16_t*>(cc.kda_S[size_t(layer)]));
  else
    scan(reinterpret_cast<float*>(cc.kda_S[size_t(layer)]));
  // Step 7: ô = RMSNorm_{o_norm}(o) ⊙ σ(gate), per head in FP32, one rounding.
  u16* ohat = x.tmp<u16>(T * HD);  // bf16 [T, HD]
  cuda::kda_out_norm_gate(o, gate, w.o_norm, c.rms_norm_eps, ohat, T, H, Dk, x.stream);
  x.mark("kda.core");
  // Step 8: out = Lin(o_proj)(ô).
  x.gemm(ohat, HD, w.o_proj, out, D, T, HD, D);
  x.mark("kda.o_proj");
}

}  // namespace kestrel::model::gpu
