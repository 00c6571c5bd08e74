// Gated SiTU MLP on the GPU, MODEL.md §3.7 (CPU twin: model/mlp.cpp): gate|up as one BF16 GEMM over the
// 8-interleaved stack with the FP32 SiTU-GLU rounded once in its epilogue (linear.h), then the down
// projection. Under TP each rank holds F/N of the width (w.F is the rank's), so its output is a partial
// sum, all-reduced.
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void mlp_forward(Context& x, const MlpWeightsDev& w, const u16* in, const Fp8Act* in8, int64_t T, u16* out) {
  const TextConfig& c = x.c;
  const int64_t D = c.hidden_size, F = w.F;
  u16* a = x.tmp<u16>(T * F);  // bf16 [T, F]
  cuda::GemmSegs sg;
  sg.glu_beta = c.situ_beta, sg.glu_linear_beta = c.situ_linear_beta;
  sg.seg[0] = seg_glu(0, a, F);
  sg.n = 1;
  linear(x, w.gate_up, in, D, T, sg, in8);
  linear(x, w.down, a, F, T, out, D);
  tp_all_reduce(x, out, T * D);  // under TP: F/N columns per rank (gate/up rows, down columns), a partial sum
}

}  // namespace kestrel::model::gpu
