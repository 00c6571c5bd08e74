// Gated SiTU MLP, MODEL.md §3.7 / §3.6 step 6: three BF16 Lins around one FP32 SiTU-GLU.
#include "model/mlp.h"

#include "kernels/cpu/cpu_ops.h"
#include "model/common.h"

namespace kestrel::model {

namespace {

// a = SiTU-GLU(Lin(gate)(x), Lin(up)(x)), bf16 [T, F].
Scratch<uint16_t> mlp_hidden(const MlpWeights& w, const TextConfig& c, const uint16_t* x, int64_t T) {
  const int64_t D = c.hidden_size, F = w.gate_proj.shape[0];
  Scratch<uint16_t> g(size_t(T * F)), u(size_t(T * F));  // bf16 [T, F] each, written by the GEMM
  Scratch<uint16_t> a(size_t(T * F));                     // bf16 [T, F], written by the SiTU-GLU
  // g = Lin(gate_proj)(x), u = Lin(up_proj)(x): one call, one input.
  const cpu::GemmOut gu[] = {{bf16_ptr(w.gate_proj), F, g.data(), nullptr, F},
                             {bf16_ptr(w.up_proj), F, u.data(), nullptr, F}};
  cpu::gemm_bf16_multi(x, D, T, D, gu);
  cpu::situ_glu_fast(g.data(), u.data(), a.data(), T * F, c.situ_beta, c.situ_linear_beta);
  return a;
}

}  // namespace

void mlp_forward(const MlpWeights& w, const TextConfig& c, const uint16_t* x, int64_t T, uint16_t* out) {
  const int64_t D = c.hidden_size, F = w.gate_proj.shape[0];
  const Scratch<uint16_t> a = mlp_hidden(w, c, x, T);
  cpu::gemm_bf16(a.data(), F, bf16_ptr(w.down_proj), out, D, T, F, D);
}

void mlp_forward_partial(const MlpWeights& w, const TextConfig& c, const uint16_t* x, int64_t T, float* out) {
  const int64_t D = c.hidden_size, F = w.gate_proj.shape[0];
  const Scratch<uint16_t> a = mlp_hidden(w, c, x, T);
  cpu::gemm_bf16_f32(a.data(), F, bf16_ptr(w.down_proj), out, D, T, F, D);
}

}  // namespace kestrel::model
