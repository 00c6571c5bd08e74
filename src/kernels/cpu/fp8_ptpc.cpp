// PTPC FP8 (per-token activation scales, per-output-channel weight scales) on the CPU: the twin of the
// GPU's quantisation kernel (kernels/cuda/quant.h) and of the FP8 skinny GEMM / cuBLASLt FP8 path
// (kernels/cuda/gemm_skinny.h). See cpu_ops.h for the contract.
#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::cpu {

void quantize_fp8_rows(const uint16_t* x, int64_t ldx, int64_t R, int64_t C, uint8_t* q, float* scale) {
#pragma omp parallel for schedule(static) if (R * C >= kParallelMinWork)
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* xr = x + r * ldx;
    float amax = 0.0f;
    for (int64_t c = 0; c < C; ++c) amax = std::max(amax, std::fabs(bf16_to_f32(xr[c])));
    const float s = amax > 0.0f && std::isfinite(amax) ? amax / 448.0f : 1.0f;
    scale[r] = s;
    for (int64_t c = 0; c < C; ++c) q[r * C + c] = f32_to_f8e4m3(bf16_to_f32(xr[c]) / s, Fp8Overflow::saturate);
  }
}

void gemm_ptpc_fp8(const uint8_t* xq, const float* xs, const uint8_t* wq, const float* ws, uint16_t* y, int64_t ldy,
                   int64_t T, int64_t K, int64_t N) {
  float lut[256];
  for (int i = 0; i < 256; ++i) lut[i] = f8e4m3_to_f32(uint8_t(i));
#pragma omp parallel for schedule(static) if (T * K * N >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wr = wq + n * K;
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* xr = xq + t * K;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += lut[xr[k]] * lut[wr[k]];  // products exact in FP32
      y[t * ldy + n] = f32_to_bf16((acc * ws[n]) * xs[t]);
    }
  }
}

}  // namespace kestrel::cpu
