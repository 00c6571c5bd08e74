// MXFP4 expert product (MODEL.md §4) straight from the packed storage.
//
// For each output row r and 32-block b the block is decoded once (LUT value × 2^(e−127), exact in
// FP32) into a 32-float stack array and applied to every one of the T inputs, so prefill decodes each
// expert block once per call rather than once per token, and no dequantised expert ever exists.
// The summation order (8 interleaved lanes, fixed final tree) is documented in cpu_ops.h because the
// tests reproduce it to demand bit equality with the dequantise-first product.
#include <omp.h>

#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::cpu {

void mxfp4_gemm(const uint8_t* packed, const uint8_t* scale, const float* x, float* y, int64_t T, int64_t out,
                int64_t in) {
  KCHECK(in > 0 && in % kMxBlock == 0, "MXFP4 input width {} is not a positive multiple of {}", in, kMxBlock);
  KCHECK(out > 0 && T >= 0, "bad MXFP4 shape out={} T={}", out, T);
  if (T == 0) return;
  const int64_t nblk = in / kMxBlock;
  const bool par = out * in * T >= kParallelMinWork;
#pragma omp parallel if (par)
  {
    std::vector<float> lanes(size_t(T * 8));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < out; ++r) {
      std::fill(lanes.begin(), lanes.end(), 0.0f);
      const uint8_t* prow = packed + r * (in / 2);
      const uint8_t* srow = scale + r * nblk;
      for (int64_t b = 0; b < nblk; ++b) {
        const float s = e8m0_to_f32(srow[b]);
        float wd[kMxBlock];
        for (int j = 0; j < kMxBlock / 2; ++j) {
          const uint8_t byte = prow[b * (kMxBlock / 2) + j];
          wd[2 * j] = kE2M1Values[byte & 0xF] * s;
          wd[2 * j + 1] = kE2M1Values[byte >> 4] * s;
        }
        for (int64_t t = 0; t < T; ++t) {
          const float* xb = x + t * in + b * kMxBlock;
          float* l = lanes.data() + t * 8;
          for (int c = 0; c < kMxBlock; c += 8)
            for (int j = 0; j < 8; ++j) l[j] += wd[c + j] * xb[c + j];
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        const float* l = lanes.data() + t * 8;
        y[t * out + r] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
      }
    }
  }
}

}  // namespace kestrel::cpu
