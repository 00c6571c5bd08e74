// T = 1 BF16 GEMV: one warp per output row, 8 rows per 256-thread block. Each lane reads 16 bytes
// (8 bf16) of the W row per step, so a warp reads 512 contiguous bytes per step (fully coalesced);
// x is staged once per block in shared memory. FP32 accumulation, warp-shuffle reduction.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemm.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 8;

__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const uint16_t* __restrict__ x,
                                                           const uint16_t* __restrict__ w,
                                                           uint16_t* __restrict__ y_bf16, float* __restrict__ y_f32,
                                                           int K, int N) {
  extern __shared__ uint4 xs[];  // bf16 [K] as K/8 vectors
  const int nv = K / 8;
  for (int v = threadIdx.x; v < nv; v += blockDim.x) xs[v] = dev::ld16(x + 8 * v);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= N) return;
  const uint16_t* wr = w + int64_t(row) * K;
  float acc0 = 0.0f, acc1 = 0.0f;
  int v = lane;
  for (; v + 32 < nv; v += 64) {  // two independent 16-byte loads in flight per lane
    const uint4 a = dev::ld16(wr + 8 * v), b = dev::ld16(wr + 8 * (v + 32));
    float fa[8], fb[8], xa[8], xb[8];
    dev::unpack8(a, fa);
    dev::unpack8(b, fb);
    dev::unpack8(xs[v], xa);
    dev::unpack8(xs[v + 32], xb);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc0 = fmaf(fa[j], xa[j], acc0);
      acc1 = fmaf(fb[j], xb[j], acc1);
    }
  }
  for (; v < nv; v += 32) {
    float fa[8], xa[8];
    dev::unpack8(dev::ld16(wr + 8 * v), fa);
    dev::unpack8(xs[v], xa);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc0 = fmaf(fa[j], xa[j], acc0);
  }
  const float s = dev::warp_sum(acc0 + acc1);
  if (lane == 0) {
    if (y_bf16) y_bf16[row] = dev::f32_to_bf16(s);
    else y_f32[row] = s;
  }
}

}  // namespace

void gemv_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y_bf16, float* y_f32, int64_t K, int64_t N,
               cudaStream_t stream) {
  KCUDA_REQUIRE(x && w && (y_bf16 != nullptr) != (y_f32 != nullptr),
                std::string("gemv: null input or not exactly one output"));
  KCUDA_REQUIRE(K > 0 && K % 8 == 0 && K * 2 <= 160 * 1024,
                "gemv: K = " + std::to_string(K) + " must be a positive multiple of 8 (and fit shared memory)");
  KCUDA_REQUIRE(N > 0 && N < (int64_t(1) << 31), "gemv: bad N = " + std::to_string(N));
  KCUDA_REQUIRE(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15u) == 0,
                std::string("gemv: x and W must be 16-byte aligned"));
  const size_t smem = size_t(K) * 2;
  if (smem > 48 * 1024)
    KCUDA_CHECK(cudaFuncSetAttribute(gemv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int64_t blocks = (N + kWarps - 1) / kWarps;
  gemv_kernel<<<unsigned(blocks), kWarps * 32, smem, stream>>>(x, w, y_bf16, y_f32, int(K), int(N));
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
