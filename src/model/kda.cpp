// KDA forward, MODEL.md §3.3, steps 1–8 in order, for a batch of sequences (kda.h). The projections
// run over all rows at once (one GEMM call); the short conv walks each sequence's tokens (its history
// is state); the delta-rule scan runs per (sequence, head) in parallel.
#include "model/kda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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
  const KdaSeq one{0, T, st};
  kda_forward(w, c, std::span<const KdaSeq>(&one, 1), x, T, out, form, sh);
}

void kda_forward(const KdaWeights& w, const TextConfig& c, std::span<const KdaSeq> seqs, const uint16_t* x,
                 int64_t rows, uint16_t* out, KdaForm form, const Shard& sh) {
  const int64_t D = c.hidden_size, H = c.kda.num_heads, Dk = c.kda.head_dim, HD = H * Dk, W = c.kda.conv_size;
  const int64_t n = int64_t(seqs.size());
  for (const KdaSeq& s : seqs) {
    KCHECK(s.state.recurrent && s.state.conv && s.row0 >= 0 && s.T > 0 && s.row0 + s.T <= rows,
           "KDA sequence rows [{}, +{}) outside the {} rows, or an empty state view", s.row0, s.T, rows);
    KCHECK(!s.state.trace_recurrent || (s.state.trace_conv && !s.state.recurrent_f16 && form != KdaForm::chunked),
           "a KDA state trace needs an f32 recurrent state, a conv trace and the recurrent scan");
  }

  // §3.3 step 1: q̃, k̃, ṽ = Lin(q/k/v_proj)(x); step 4 input Lin(f_a)(x); step 5 input Lin(b_proj)(x);
  // step 7 input Lin(g_proj)(x): one call over every row (BF16 Lin outputs). Scratch (common.h): the
  // GEMMs write every element, so no zero-fill (a serial memset per layer, issue #22).
  Scratch<uint16_t> qkv(size_t(3 * rows * HD));  // bf16 [3, rows, HD]
  Scratch<uint16_t> fa(size_t(rows * Dk)), z(size_t(rows * HD));  // bf16 [rows, Dk], bf16 [rows, HD]
  Scratch<uint16_t> bl(size_t(rows * H)), gate(size_t(rows * HD));  // bf16 [rows, H], bf16 [rows, HD]
  const cpu::GemmOut proj[] = {{bf16_ptr(w.q_proj), HD, qkv.data(), nullptr, HD},
                               {bf16_ptr(w.k_proj), HD, qkv.data() + rows * HD, nullptr, HD},
                               {bf16_ptr(w.v_proj), HD, qkv.data() + 2 * rows * HD, nullptr, HD},
                               {bf16_ptr(w.f_a_proj), Dk, fa.data(), nullptr, Dk},
                               {bf16_ptr(w.b_proj), H, bl.data(), nullptr, H},
                               {bf16_ptr(w.g_proj), HD, gate.data(), nullptr, HD}};
  cpu::gemm_bf16_multi(x, D, rows, D, proj);
  // Step 4: z = Lin(f_b)(Lin(f_a)(x)) (dt_bias is added in FP32 below).
  cpu::gemm_bf16(fa.data(), Dk, bf16_ptr(w.f_b_proj), z.data(), HD, rows, Dk, HD);

  const float* conv_w[3] = {f32_ptr(w.q_conv), f32_ptr(w.k_conv), f32_ptr(w.v_conv)};  // f32 [HD, 1, W]
  const float* a_log = f32_ptr(w.a_log);      // f32 [>= H]
  const float* dt_bias = f32_ptr(w.dt_bias);  // f32 [HD]
  const float* o_norm = f32_ptr(w.o_norm);    // f32 [Dk]
  const float lower = c.kda.gate_lower_bound, eps = c.rms_norm_eps;

  // Step 2: causal depthwise conv over [W−1 stored inputs, current], SiLU, BF16, per sequence and
  // projection; the history shifts token by token (it is the carried state). f32 from here on.
  // The traces (speculative decoding) read the history before this call's inputs enter it: first.
  for (const KdaSeq& s : seqs) {
    if (!s.state.trace_conv) continue;
    for (int64_t p = 0; p < 3; ++p) {
      // The history after token t is inputs t+1 .. t+W−1 of [W−1 stored inputs, this call's T inputs].
      const uint16_t* hist = s.state.conv + p * (W - 1) * HD;            // bf16 [W−1, HD], before this call
      const uint16_t* xin = qkv.data() + (p * rows + s.row0) * HD;       // bf16 [T, HD]
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t j = 0; j < W - 1; ++j) {
          const int64_t src = t + 1 + j;  // index into [hist, xin]
          const uint16_t* row = src < W - 1 ? hist + src * HD : xin + (src - (W - 1)) * HD;
          std::memcpy(s.state.trace_conv + ((t * 3 + p) * (W - 1) + j) * HD, row, size_t(HD) * 2);
        }
    }
  }
  // Items are (sequence, projection, channel block): the conv is depthwise, so channels split freely;
  // (sequence, projection) alone was three items for two threads, one idle for a third of the conv
  // (issue #22). Blocks are whole multiples of 8 channels from channel 0, so every channel takes the
  // same vector lane or scalar tail as in one call over all HD channels: the same bits.
  const int64_t Cb = std::max<int64_t>(8, (HD / 2 + 7) / 8 * 8), nb = (HD + Cb - 1) / Cb;  // channels per block
  Scratch<float> qkv_f(size_t(3 * rows * HD));  // f32 [3, rows, HD], post-conv q, k, v (every row written)
  cpu::parallel_for_each(3 * n * nb, 3 * rows * HD * W * 8, [&](int64_t item) {
    const KdaSeq& s = seqs[size_t(item / (3 * nb))];
    const int64_t p = item / nb % 3, c0 = item % nb * Cb, cw = std::min(Cb, HD - c0);
    uint16_t* hist = s.state.conv + p * (W - 1) * HD;  // bf16 [W−1, HD]
    thread_local std::vector<uint16_t> h;              // bf16 [W−1, cw]: this block's history, contiguous
    h.resize(size_t((W - 1) * cw));
    for (int64_t j = 0; j < W - 1; ++j) std::memcpy(h.data() + j * cw, hist + j * HD + c0, size_t(cw) * 2);
    cpu::kda_conv_silu_fast(qkv.data() + (p * rows + s.row0) * HD + c0, HD, conv_w[p] + c0 * W, h.data(),
                            qkv_f.data() + (p * rows + s.row0) * HD + c0, HD, s.T, cw, W);
    for (int64_t j = 0; j < W - 1; ++j) std::memcpy(hist + j * HD + c0, h.data() + j * cw, size_t(cw) * 2);
  });
  float* qf = qkv_f.data();
  float* kf = qkv_f.data() + rows * HD;
  const float* vf = qkv_f.data() + 2 * rows * HD;

  // Steps 3–5: L2-normalise q and k (eps inside the sqrt, q scaled by Dk^−½); log-decay
  // g = lower · σ(exp(A_log[h]) · (z + dt_bias)) ∈ (lower, 0); β = σ(b). Token-local: all rows.
  Scratch<float> g(size_t(rows * HD)), beta(size_t(rows * H));  // f32 [rows, HD], f32 [rows, H]
  cpu::parallel_for(rows, rows * HD * 16, [&](int64_t b, int64_t e) {
    cpu::kda_qk_norm_gates_fast(qf + b * HD, kf + b * HD, z.data() + b * HD, dt_bias, a_log, bl.data() + b * H, lower,
                                g.data() + b * HD, beta.data() + b * H, e - b, H, Dk);
  });

  // Step 6: the delta-rule scan per (sequence, head), through each sequence's state.
  std::vector<std::vector<float>> widened(static_cast<size_t>(n));  // f32 [H, Dk, Dk] copies of f16 states
  for (int64_t i = 0; i < n; ++i) {
    const KdaStateView& st = seqs[size_t(i)].state;
    if (!st.recurrent_f16) continue;
    const uint16_t* h16 = static_cast<const uint16_t*>(st.recurrent);
    widened[size_t(i)].resize(size_t(H * Dk * Dk));
    for (size_t j = 0; j < widened[size_t(i)].size(); ++j) widened[size_t(i)][j] = f16_to_f32(h16[j]);
  }
  Scratch<float> o(size_t(rows * HD));  // f32 [rows, HD] (every sequence and head scanned)
  cpu::parallel_for_each(n * H, 4 * rows * H * Dk * Dk, [&](int64_t item) {
    const int64_t i = item / H, h = item % H;
    const KdaSeq& s = seqs[size_t(i)];
    const int64_t r0 = s.row0;
    const cpu::KdaHeadIo io{qf + r0 * HD + h * Dk, kf + r0 * HD + h * Dk, vf + r0 * HD + h * Dk,
                            g.data() + r0 * HD + h * Dk, beta.data() + r0 * H + h, HD, H, o.data() + r0 * HD + h * Dk};
    float* S = (s.state.recurrent_f16 ? widened[size_t(i)].data() : static_cast<float*>(s.state.recurrent)) +
               h * Dk * Dk;  // f32 [Dk(key), Dk(value)]
    if (form == KdaForm::chunked) {
      cpu::kda_scan_chunked(io, s.T, Dk, S);
    } else if (s.state.trace_recurrent) {
      // Token by token (the recurrent scan is, so this is the same arithmetic), copying S after each.
      for (int64_t t = 0; t < s.T; ++t) {
        const cpu::KdaHeadIo it{io.q + t * HD, io.k + t * HD, io.v + t * HD, io.g + t * HD, io.beta + t * H,
                                HD, H, io.o + t * HD};
        cpu::kda_scan_recurrent_fast(it, 1, Dk, S);
        std::memcpy(s.state.trace_recurrent + (t * H + h) * Dk * Dk, S, size_t(Dk * Dk) * sizeof(float));
      }
    } else {
      cpu::kda_scan_recurrent_fast(io, s.T, Dk, S);
    }
  });
  for (int64_t i = 0; i < n; ++i) {
    const KdaStateView& st = seqs[size_t(i)].state;
    if (!st.recurrent_f16) continue;
    uint16_t* h16 = static_cast<uint16_t*>(st.recurrent);
    for (size_t j = 0; j < widened[size_t(i)].size(); ++j) h16[j] = f32_to_f16(widened[size_t(i)][j]);
  }

  // Step 7: ô = RMSNorm_{o_norm}(o) ⊙ σ(gate), per head, all FP32, one rounding.
  Scratch<uint16_t> ohat(size_t(rows * HD));  // bf16 [rows, HD], every row written below
  cpu::parallel_for(rows, rows * HD * 16, [&](int64_t b, int64_t e) {
    cpu::kda_out_norm_gate_fast(o.data() + b * HD, gate.data() + b * HD, o_norm, eps, ohat.data() + b * HD, e - b, H,
                                Dk);
  });
  // Step 8: out = Lin(o_proj)(ô); split over ranks: each sums its heads' columns, one all-reduce.
  if (!sh.split()) {
    cpu::gemm_bf16(ohat.data(), HD, bf16_ptr(w.o_proj), out, D, rows, HD, D);
    return;
  }
  std::vector<float> part(size_t(rows * D));  // f32 [rows, D], this rank's heads only
  cpu::gemm_bf16_f32(ohat.data(), HD, bf16_ptr(w.o_proj), part.data(), D, rows, HD, D);
  reduce_to_bf16(sh, part.data(), rows * D, out);
}

void kda_keep_position(const TextConfig& c, const KdaStateView& st, int64_t t) {
  KCHECK(st.trace_recurrent && st.trace_conv && !st.recurrent_f16 && t >= 0, "kda_keep_position: no trace");
  const int64_t S = kda_recurrent_elems(c), C = kda_conv_elems(c);
  std::memcpy(st.recurrent, st.trace_recurrent + t * S, size_t(S) * sizeof(float));
  std::memcpy(st.conv, st.trace_conv + t * C, size_t(C) * 2);
}

}  // namespace kestrel::model
