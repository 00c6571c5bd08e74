// KDA on the GPU, MODEL.md §3.3 steps 1–8 in order (CPU twin: model/kda.cpp). The projections run over
// every row of the step at once, as one stacked GEMM (q|k|v|g|f_a|b, linear.h). A pure-decode step runs
// steps 2–7 as one fused launch over all rows (kda_decode_fused: conv, f_b, norms and gates, the
// delta-rule update, the output norm and gate). Otherwise, step by step: the short conv as one decode
// launch over the T = 1 rows (their histories by slot) and one prefill launch per longer sequence; the
// delta-rule scan as one decode launch over the T = 1 rows (kda_decode) and one chunk-parallel launch over
// every prefill (kda_chunked, §3.3's WY/UT form on the tensor cores: TF32 recurrence, BF16 output products
// — o within ~3e-3 rel L2 of the FP32 CPU twin). An FP16 state is widened to FP32 and rounded back once
// per launch, as the CPU does per layer call. Both scans take their kernel variant from kda.h's defaults
// (KESTREL_KDA_CHUNKED / KESTREL_KDA_DECODE select another for benchmarks).
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/kda.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void kda_forward(Context& x, const KdaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer, const u16* in,
                 const Fp8Act* in8, u16* out) {
  const TextConfig& c = x.c;
  const int64_t T = s.T, D = c.hidden_size, H = c.kda.num_heads, Dk = c.kda.head_dim, HD = H * Dk,
                W = c.kda.conv_size;
  // Step 1: q̃ | k̃ | ṽ = Lin(q|k|v_proj)(x); the inputs of steps 4, 5, 7: Lin(f_a)(x), Lin(b_proj)(x),
  // Lin(g_proj)(x) — one stacked GEMM.
  u16* qkv = x.tmp<u16>(T * 3 * HD);  // bf16 [T, 3·HD]
  u16* gate = x.tmp<u16>(T * HD);     // bf16 [T, HD]
  u16* fa = x.tmp<u16>(T * Dk);       // bf16 [T, Dk]
  u16* bl = x.tmp<u16>(T * H);        // bf16 [T, H]
  {
    cuda::GemmSegs sg;
    sg.seg[0] = seg_bf16(0, qkv, 3 * HD);
    sg.seg[1] = seg_bf16(3 * HD, gate, HD);
    sg.seg[2] = seg_bf16(4 * HD, fa, Dk);
    sg.seg[3] = seg_bf16(4 * HD + Dk, bl, H);
    sg.n = 4;
    linear(x, w.in_proj, in, D, T, sg, in8);
  }
  x.mark("kda.proj");
  u16* hist = cc.kda_conv[size_t(layer)];  // bf16 [slots+1, W−1, 3·HD]
  u16* ohat = x.tmp<u16>(T * HD);          // bf16 [T, HD]
  if (x.fused() && s.nd == s.n && T <= x.opt.kda_fused_max_t) {
    // Steps 2–7 for every (one-token) row in one launch, up to kda_fused_max_t rows (16). At batch 64 the
    // separate launches (f_b as a GEMM) keep more of the GPU busy: the whole fused step was ~110 µs slower
    // there in session 9 (2,892 vs 3,002 µs), and with the 16-byte state stores and the loads before the PDL
    // wait still no faster in session 29 (graph 1,113–1,119 against 1,105–1,118 µs; KESTREL_KDA_FUSED_MAX_T).
    const cuda::KdaDecodeIn di{qkv, 3 * HD, gate, HD, fa, Dk, bl, H, s.d_cu};
    const cuda::KdaDecodeWeights dw{w.conv, w.f_b_bf16, w.dt_bias, w.a_log, w.o_norm, c.kda.gate_lower_bound,
                                    c.rms_norm_eps};
    if (cc.kda_state_f16())
      cuda::kda_decode_fused(di, dw, hist, s.d_slots, reinterpret_cast<uint16_t*>(cc.kda_S[size_t(layer)]), ohat, T,
                             H, Dk, W, x.stream);
    else
      cuda::kda_decode_fused(di, dw, hist, s.d_slots, reinterpret_cast<float*>(cc.kda_S[size_t(layer)]), ohat, T, H,
                             Dk, W, x.stream);
  } else {
    // Step 4 input z = Lin(f_b)(Lin(f_a)(x)).
    u16* z = x.tmp<u16>(T * HD);  // bf16 [T, HD]
    linear(x, w.f_b, fa, Dk, T, z, HD);
    // Step 2 over q|k|v at once, SiLU, BF16: the decode rows in one launch over their slots, then each prefill.
    u16* conv = x.tmp<u16>(T * 3 * HD);  // bf16 [T, 3·HD]
    if (s.nd > 0) cuda::kda_conv_decode(qkv, 3 * HD, w.conv, hist, s.d_slots, conv, 3 * HD, s.nd, 3 * HD, W, x.stream);
    // DSpark verify sequences (§5): the decode conv one position at a time, each history traced.
    if (s.nv > 0) kda_verify_conv(x, w, cc, s, layer, qkv, conv);
    for (int64_t b = s.nd + s.nv; b < s.n; ++b) {
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
    cuda::kda_qk_norm_gates(conv, conv + HD, 3 * HD, z, w.dt_bias, w.a_log, bl, c.kda.gate_lower_bound, qf, kf, g,
                            beta, T, H, Dk, x.stream);
    cuda::bf16_to_f32_2d(conv + 2 * HD, 3 * HD, T, HD, vf, x.stream);
    // Step 6: the delta-rule scan. The T = 1 rows (decodes, listed first) in one decode-shaped launch; the
    // verify rows (§5) one position at a time, each state traced; every prefill sequence in one chunk-parallel
    // launch over the rest of the packed rows (cu_seqlens from nd + nv on).
    float* o = x.tmp<float>(T * HD);  // f32 [T, HD]
    const int64_t pf = s.nd + s.nv, Tp = T - s.nd - s.nvr;  // first prefill sequence, prefill rows
    const int64_t np = s.n - pf;                               // prefill sequences
    void* ws = np > 0 ? x.tmp<char>(int64_t(cuda::kda_chunked_workspace_bytes(Tp, np, H, Dk))) : nullptr;
    auto scan = [&](auto* pool) {
      if (s.nd > 0) cuda::kda_decode(qf, kf, vf, g, HD, beta, H, s.d_cu, s.d_slots, pool, o, s.nd, H, Dk, x.stream);
      if (s.nv > 0) kda_verify_scan(x, cc, s, layer, qf, kf, vf, g, beta, o);
      if (np > 0)
        cuda::kda_chunked(qf, kf, vf, g, HD, beta, H, s.d_cu + pf, s.d_slots + pf, pool, o, Tp, np, H, Dk, ws,
                          x.stream);
    };
    if (cc.kda_state_f16())
      scan(reinterpret_cast<uint16_t*>(cc.kda_S[size_t(layer)]));
    else
      scan(reinterpret_cast<float*>(cc.kda_S[size_t(layer)]));
    // Step 7: ô = RMSNorm_{o_norm}(o) ⊙ σ(gate), per head in FP32, one rounding.
    cuda::kda_out_norm_gate(o, gate, w.o_norm, c.rms_norm_eps, ohat, T, H, Dk, x.stream);
  }
  x.mark("kda.core");
  // Step 8: out = Lin(o_proj)(ô). Under TP: this rank's H/N heads through its o_proj columns, a partial
  // sum over heads, all-reduced.
  linear(x, w.o_proj, ohat, HD, T, out, D);
  tp_all_reduce(x, out, T * D);
  x.mark("kda.o_proj");
}

}  // namespace kestrel::model::gpu
