// Elementwise ops of the GPU forward pass (see elementwise.h); grid-stride loops, one element per step.
// add, the interleaved SiTU-GLU and the sigmoid gate sit between decode GEMMs: launched with PDL
// (kernels/cuda/launch.h), they wait for their inputs first thing and let the next GEMM's weight
// prefetch start at once.
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/launch.h"

namespace kestrel::cuda {
namespace {

using dev::bf16_to_f32;
using dev::f32_to_bf16;

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + 255) / 256, 132 * 16)); }

__global__ void embed_kernel(const uint16_t* table, const int32_t* ids, int64_t T, int64_t D, uint16_t* out) {
  const int64_t n8 = T * D / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / (D / 8), c8 = i % (D / 8);
    reinterpret_cast<uint4*>(out)[i] = dev::ld16(table + int64_t(ids[t]) * D + c8 * 8);
  }
}
__global__ void add_kernel(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  dev::pdl_trigger();
  dev::pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}
__global__ void situ_kernel(const uint16_t* gu, int64_t ld, int64_t T, int64_t F, float beta, float lbeta,
                            uint16_t* a) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * F; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / F, f = i % F;
    const float g = bf16_to_f32(gu[t * ld + f]), u = bf16_to_f32(gu[t * ld + F + f]);
    const float act = beta * tanhf(g / beta) * dev::sigmoid(g);
    a[i] = f32_to_bf16(act * (lbeta * tanhf(u / lbeta)));
  }
}
__global__ void situ_i8_kernel(const uint16_t* gu, int64_t ld, int64_t T, int64_t F, float beta, float lbeta,
                               uint16_t* a, int64_t lda) {
  dev::pdl_trigger();
  dev::pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * F; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / F, f = i % F, c = 16 * (f / 8) + f % 8;
    const float g = bf16_to_f32(gu[t * ld + c]), u = bf16_to_f32(gu[t * ld + c + 8]);
    const float act = beta * tanhf(g / beta) * dev::sigmoid(g);
    a[t * lda + f] = f32_to_bf16(act * (lbeta * tanhf(u / lbeta)));
  }
}
__global__ void gate_kernel(uint16_t* o, const uint16_t* g, int64_t n) {
  dev::pdl_trigger();
  dev::pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = f32_to_bf16(bf16_to_f32(o[i]) * dev::sigmoid(bf16_to_f32(g[i])));
}
__global__ void to_f32_kernel(const uint16_t* x, int64_t ldx, int64_t T, int64_t C, float* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * C; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = bf16_to_f32(x[(i / C) * ldx + i % C]);
}

}  // namespace

void embed_gather(const uint16_t* table, const int32_t* ids, int64_t T, int64_t D, uint16_t* out, cudaStream_t s) {
  KCUDA_REQUIRE(D % 8 == 0, std::string("embed_gather: D must be a multiple of 8"));
  if (T == 0) return;
  embed_kernel<<<grid_for(T * D / 8), 256, 0, s>>>(table, ids, T, D, out);
  KCUDA_CHECK_LAUNCH();
}
void add_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(add_kernel, dim3(grid_for(n)), dim3(256), 0, s, a, b, out, n);
}
void situ_glu_bf16(const uint16_t* gu, int64_t ld, int64_t T, int64_t F, float beta, float lbeta, uint16_t* a,
                   cudaStream_t s) {
  if (T * F == 0) return;
  situ_kernel<<<grid_for(T * F), 256, 0, s>>>(gu, ld, T, F, beta, lbeta, a);
  KCUDA_CHECK_LAUNCH();
}
void situ_glu_i8_bf16(const uint16_t* gu, int64_t ld, int64_t T, int64_t F, float beta, float lbeta, uint16_t* a,
                      int64_t lda, cudaStream_t s) {
  KCUDA_REQUIRE(F % 8 == 0 && ld >= 2 * F && lda >= F, std::string("situ_glu_i8_bf16: bad shape"));
  if (T * F == 0) return;
  launch_pdl(situ_i8_kernel, dim3(grid_for(T * F)), dim3(256), 0, s, gu, ld, T, F, beta, lbeta, a, lda);
}
void sigmoid_gate_bf16(uint16_t* o, const uint16_t* g, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(gate_kernel, dim3(grid_for(n)), dim3(256), 0, s, o, g, n);
}
void bf16_to_f32_2d(const uint16_t* x, int64_t ldx, int64_t T, int64_t C, float* y, cudaStream_t s) {
  if (T * C == 0) return;
  to_f32_kernel<<<grid_for(T * C), 256, 0, s>>>(x, ldx, T, C, y);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
