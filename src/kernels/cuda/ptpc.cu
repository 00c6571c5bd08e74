// PTPC FP8 row quantisation (see ptpc.h). One CTA of 256 threads per row: a max-reduction of |x|, then
// every element divided by the row's scale and rounded to e4m3 (quant.cuh's f32_to_e4m3_sat, the CPU's
// rule bit for bit). Reads of x after the PDL wait; x is read twice (the second time from L1/L2).
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ptpc.h"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) quant_rows_kernel(const uint16_t* __restrict__ x, int64_t ldx, int C,
                                                              uint8_t* __restrict__ q, float* __restrict__ scale) {
  __shared__ float red[32];
  dev::pdl_trigger();
  dev::pdl_wait();
  const int64_t r = blockIdx.x;
  const uint16_t* xr = x + r * ldx;
  const int nv = C / 8;
  float m = 0.0f;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[8];
    dev::unpack8(__ldcg(reinterpret_cast<const uint4*>(xr + 8 * v)), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(f[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = lane < int(blockDim.x >> 5) ? red[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float s = (m > 0.0f && isfinite(m)) ? m / 448.0f : 1.0f;
  if (threadIdx.x == 0) scale[r] = s;
  uint8_t* qr = q + r * int64_t(C);
  for (int v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[8];
    dev::unpack8(__ldcg(reinterpret_cast<const uint4*>(xr + 8 * v)), f);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) lo |= uint32_t(dev::f32_to_e4m3_sat(f[i] / s)) << (8 * i);
#pragma unroll
    for (int i = 0; i < 4; ++i) hi |= uint32_t(dev::f32_to_e4m3_sat(f[4 + i] / s)) << (8 * i);
    *reinterpret_cast<uint2*>(qr + 8 * v) = make_uint2(lo, hi);
  }
}

}  // namespace

void quantize_fp8_rows(const uint16_t* x, int64_t ldx, int64_t R, int64_t C, uint8_t* q, float* scale,
                       cudaStream_t stream) {
  KCUDA_REQUIRE(x && q && scale, std::string("quantize_fp8_rows: null pointer"));
  KCUDA_REQUIRE(R >= 0 && R < (int64_t(1) << 31) && C > 0 && C % 8 == 0 && C < (int64_t(1) << 30) && ldx >= C &&
                    ldx % 8 == 0,
                "quantize_fp8_rows: bad shape R=" + std::to_string(R) + " C=" + std::to_string(C));
  KCUDA_REQUIRE(((reinterpret_cast<uintptr_t>(x) & 15u) | (reinterpret_cast<uintptr_t>(q) & 7u)) == 0,
                std::string("quantize_fp8_rows: x must be 16-byte and q 8-byte aligned"));
  if (R == 0) return;
  launch_pdl(quant_rows_kernel, dim3(unsigned(R)), dim3(kThreads), 0, stream, x, ldx, int(C), q, scale);
}

}  // namespace kestrel::cuda
