// Reference MLA kernels (see gpu_ref.h), moved here from src/kernels/cuda/mla.cu unchanged: CUDA-core,
// correct first, FP32 scores and softmax, BF16 storage, every rounding point where the CPU twin has it.
//  - naive prefill: one block per (query, head); scores in shared memory; softmax exactly as
//    cpu::softmax_inplace (max, exp, double sum, multiply by the float reciprocal); values summed in key
//    order without fused multiply-add, like the CPU.
//  - absorbed decode over contiguous per-request caches: the engine's CUDA-core decode
//    (kernels/cuda/mla_decode_simple.cuh) over ContigRows instead of the page arena.
#include <cfloat>
#include <string>

#include "gpu_ref.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/mla_decode_simple.cuh"

namespace kestrel::cuda {
namespace {

using dev::bf16_to_f32;
using dev::f32_to_bf16;

constexpr int kNaiveThreads = 256;
constexpr int64_t kNaiveMaxSmem = 200 * 1024;

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float s = lane < nw ? scratch[lane] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
  return s;
}

// ---- naive prefill -----------------------------------------------------------------------------------------
__global__ void mla_naive_kernel(MlaDims d, const uint16_t* __restrict__ q, const uint16_t* __restrict__ kv,
                                 const uint16_t* __restrict__ latent, const int32_t* __restrict__ sel, int64_t Ksel,
                                 int64_t pos0, uint16_t* __restrict__ o) {
  extern __shared__ float smem[];
  __shared__ float qs[1024];
  __shared__ float scratch[32];
  __shared__ double dscratch[32];
  const int64_t t = blockIdx.x, h = blockIdx.y, Hm = d.Hm, N = d.N, R = d.R, Dv = d.Dv, C = d.C, QK = N + R,
                CW = C + R;
  const int32_t* sel_row = sel ? sel + t * Ksel : nullptr;
  const int nk = count_keys(sel_row, Ksel, pos0 + t, scratch);
  const uint16_t* qh = q + (t * Hm + h) * QK;
  for (int64_t i = threadIdx.x; i < QK; i += blockDim.x) qs[i] = bf16_to_f32(qh[i]);
  __syncthreads();
  const float scale = 1.0f / sqrtf(float(QK));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  float* pr = smem;  // f32 [nk]
  for (int i = warp; i < nk; i += nw) {
    const int64_t j = sel_row ? sel_row[i] : i;
    const uint16_t* kn = kv + (j * Hm + h) * (N + Dv);
    const uint16_t* kpe = latent + j * CW + C;
    float s = 0.0f;
    for (int64_t e = lane; e < N; e += 32) s += qs[e] * bf16_to_f32(kn[e]);
    for (int64_t e = lane; e < R; e += 32) s += qs[N + e] * bf16_to_f32(kpe[e]);
    s = dev::warp_sum(s);
    if (lane == 0) pr[i] = s * scale;
  }
  __syncthreads();
  // softmax as cpu::softmax_inplace: max; x = exp(x − max); double sum; x *= float(1/sum).
  float m = -INFINITY;
  for (int i = threadIdx.x; i < nk; i += blockDim.x) m = fmaxf(m, pr[i]);
  m = block_max(m, scratch);
  double s = 0.0;
  for (int i = threadIdx.x; i < nk; i += blockDim.x) {
    const float e = expf(pr[i] - m);
    pr[i] = e;
    s += double(e);
  }
  s = dev::block_sum_d(s, dscratch);
  const float inv = float(1.0 / s);
  for (int i = threadIdx.x; i < nk; i += blockDim.x) pr[i] = __fmul_rn(pr[i], inv);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < Dv; e += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < nk; ++i) {
      const int64_t j = sel_row ? sel_row[i] : i;
      acc = __fadd_rn(acc, __fmul_rn(pr[i], bf16_to_f32(kv[(j * Hm + h) * (N + Dv) + N + e])));
    }
    o[(t * Hm + h) * Dv + e] = f32_to_bf16(acc);
  }
}

// Latent rows from one contiguous bf16 [S, C+R] buffer per request (MlaDecodeBatch::caches).
struct ContigRows {
  const uint16_t* const* caches;
  int CW;
  struct Row {
    const uint16_t* p;
    int CW;
    __device__ __forceinline__ uint4 load8(int64_t j, int c8) const { return dev::ld16(p + j * CW + c8 * 8); }
  };
  __device__ __forceinline__ Row bind(int b) const { return {caches[b], CW}; }
};

}  // namespace

int64_t mla_naive_max_keys() { return (kNaiveMaxSmem / 4) - 64; }

void mla_attn_naive(const MlaDims& d, const uint16_t* q, const uint16_t* kv, const uint16_t* latent, const int32_t* sel,
                    int64_t Ksel, int64_t T, int64_t pos0, uint16_t* o, cudaStream_t stream) {
  if (T == 0) return;
  KCUDA_REQUIRE(d.N + d.R <= 1024 && d.Dv <= 1024, std::string("mla_attn_naive: head too wide"));
  const int64_t max_keys = sel ? Ksel : pos0 + T;
  KCUDA_REQUIRE(max_keys <= mla_naive_max_keys(),
                "mla_attn_naive: " + std::to_string(max_keys) + " keys exceed the shared-memory score buffer");
  const size_t smem = size_t(max_keys) * 4;
  KCUDA_CHECK(cudaFuncSetAttribute(mla_naive_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kNaiveMaxSmem)));
  mla_naive_kernel<<<dim3(unsigned(T), unsigned(d.Hm)), kNaiveThreads, smem, stream>>>(d, q, kv, latent, sel, Ksel,
                                                                                        pos0, o);
  KCUDA_CHECK_LAUNCH();
}

size_t mla_decode_workspace_bytes(const MlaDims& d, int64_t B, int64_t max_keys) {
  return decode_workspace_bytes(d, B, max_keys);
}

void mla_decode_absorbed(GemmLt& lt, const MlaDims& d, const uint16_t* q, const uint16_t* kv_b,
                         const MlaDecodeBatch& bt, void* workspace, uint16_t* o, cudaStream_t stream) {
  if (bt.B == 0) return;
  KCUDA_REQUIRE(bt.caches, std::string("mla_decode_absorbed: null caches"));
  decode_run(lt, d, q, kv_b, ContigRows{bt.caches, int(d.C + d.R)}, bt.lens, bt.sel, bt.Ksel, bt.B, bt.max_keys,
             workspace, o, stream);
}

}  // namespace kestrel::cuda
