// Gated SiTU MLP on the GPU, MODEL.md §3.7 / §3.6 step 6 (CPU twin: model/mlp.cpp): gate|up as one
// BF16 GEMM, the FP32 SiTU-GLU rounded once, the down projection.
#include "kernels/cuda/elementwise.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void mlp_forward(Context& x, const MlpWeightsDev& w, const u16* in, int64_t T, u16* out) {
  const TextConfig& c = x.c;
  const int64_t D = c.hidden_size, F = w.F;
  u16* gu = x.tmp<u16>(T * 2 * F);  // bf16 [T, 2F]: g | u
  u16* a = x.tmp<u16>(T * F);       // bf16 [T, F]
  x.gemm(in, D, w.gate_up, gu, 2 * F, T, D, 2 * F);
  cuda::situ_glu_bf16(gu, 2 * F, T, F, c.situ_beta, c.situ_linear_beta, a, x.stream);
  x.gemm(a, F, w.down, out, D, T, F, D);
}

}  // namespace kestrel::model::gpu
