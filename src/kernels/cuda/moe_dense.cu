// Routed MoE experts at prefill sizes (moe.h MoeTokenTile::dense): per hit expert, its MXFP4 weights are
// dequantised once into BF16 scratch and the two expert GEMMs run on cuBLASLt (GemmLt), which reaches the
// tensor cores' rate where our register-dequant kernels do not (t32: ≈ 200 TFLOP/s at thousands of tokens per
// expert, an FFMA per accumulator per 32-column block). Results equal moe_experts_mxfp4's other paths up to
// FP32 summation order: every weight w = e2m1·2^(e−127) is a BF16 exactly (2 mantissa bits), so dequantising
// first changes no product, only where the e8m0 scale enters the sum.
//
// Called by moe_experts.cu after the group kernel (one job per hit expert: ct ≥ n); the per-slot y it writes is
// combined there. Needs the job list on the host (one stream synchronisation per MoE layer), so it is
// chosen only outside CUDA-graph capture and only when each hit expert has many slots — there the sync is
// noise next to the GEMMs (kDenseMinSlots in moe_experts.cu). Per expert e with c slots at positions
// [start, start + c) of `order`:
//   Wd13 = dequant([W1_e; W3_e]) bf16 [2I, Lt], Wd2 = dequant(W2_e) bf16 [Lt, I]
//   zg   = z[order[start + i] / K]            bf16 [c, Lt]   (gather)
//   gu   = bf16(zg·Wd13ᵀ)                     bf16 [c, 2I]   (cuBLASLt, FP32 accumulation)
//   ag   = bf16(SiTU-GLU(gu[:, :I], gu[:, I:])) bf16 [c, I]
//   yg   = bf16(ag·Wd2ᵀ)                      bf16 [c, Lt]   (cuBLASLt; into zg's buffer)
//   y[order[start + i]] = yg[i]                               (scatter, slot order for the combine)
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_layout.h"
#include "kernels/cuda/moe_mma.cuh"

namespace kestrel::cuda::moe_detail {
namespace {

namespace ml = moe_layout;

size_t r256(size_t n) { return (n + 255) & ~size_t(255); }

// One warp per (row tile, column chunk) of W [R, C] in the kernels' layout (moe_layout.h) → bf16 [R, C] row-major.
// Lane (g, t) holds, per k16 step s, words whose register j / half h is element (row g + 8(j&1), column
// 32(s>>1) + 8t + 4(s&1) + 2(j>>1) + h) of the chunk: for fixed s and j&1 the four columns (j>>1, h) are
// consecutive, one 8-byte store. The value is the exact E2M1 BF16 (integer decode) times 2^(e−127).
constexpr int kDeqWarps = 8;
__global__ void __launch_bounds__(32 * kDeqWarps) dequant_kernel(const uint8_t* __restrict__ packed,
                                                                  const uint8_t* __restrict__ scale, int R, int C,
                                                                  uint16_t* __restrict__ out, int64_t ldo) {
  const int NC = C / ml::kChunkCols;
  const int64_t tc = int64_t(blockIdx.x) * kDeqWarps + (threadIdx.x >> 5);
  if (tc >= int64_t(R / ml::kTileRows) * NC) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t rt = tc / NC;
  const int c = int(tc - rt * NC);
  const uint4 wv = __ldg(reinterpret_cast<const uint4*>(packed + tc * ml::kTileChunkBytes) + lane);
  const uint32_t sw = __ldg(reinterpret_cast<const uint32_t*>(scale + tc * ml::kTileChunkScaleBytes) + g);
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sc = __uint_as_float(ml::e8m0_f32_bits<true>(sw, r + 2 * (s >> 1)));
      uint32_t o[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {  // register j = r + 2q: columns +2q, +2q+1
        const uint32_t bits = ml::e2m1_pair_bf16_exact(ml::e2m1_pair_bits(words[s], r + 2 * q));
        const float lo = __fmul_rn(dev::bf16_to_f32(uint16_t(bits & 0xFFFFu)), sc);
        const float hi = __fmul_rn(dev::bf16_to_f32(uint16_t(bits >> 16)), sc);
        o[q] = uint32_t(dev::f32_to_bf16(lo)) | (uint32_t(dev::f32_to_bf16(hi)) << 16);
      }
      const int64_t row = rt * ml::kTileRows + g + 8 * r;
      const int64_t col = int64_t(c) * ml::kChunkCols + 32 * (s >> 1) + 8 * t + 4 * (s & 1);
      *reinterpret_cast<uint2*>(out + row * ldo + col) = make_uint2(o[0], o[1]);
    }
  }
}

void dequant(const uint8_t* packed, const uint8_t* scale, int R, int C, uint16_t* out, int64_t ldo,
             cudaStream_t stream) {
  const int64_t warps = int64_t(R / ml::kTileRows) * (C / ml::kChunkCols);
  dequant_kernel<<<unsigned((warps + kDeqWarps - 1) / kDeqWarps), 32 * kDeqWarps, 0, stream>>>(packed, scale, R, C,
                                                                                             out, ldo);
  KCUDA_CHECK_LAUNCH();
}

// dst[i] = src[idx[i] / div] (gather, div = K: token of a slot) or dst[idx[i]] = src[i] (scatter), rows of
// `cols` bf16 (cols % 8 == 0), one 16-byte vector per thread.
__global__ void rows_kernel(const uint16_t* __restrict__ src, const int32_t* __restrict__ idx, int div, bool scatter,
                            uint16_t* __restrict__ dst, int64_t rows, int cols) {
  const int per = cols / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * per) return;
  const int64_t r = i / per;
  const int j = int(i - r * per) * 8;
  const int64_t from = scatter ? r : int64_t(__ldg(idx + r)) / div, to = scatter ? __ldg(idx + r) : r;
  *reinterpret_cast<uint4*>(dst + to * cols + j) = __ldg(reinterpret_cast<const uint4*>(src + from * cols + j));
}

void rows(const uint16_t* src, const int32_t* idx, int div, bool scatter, uint16_t* dst, int64_t n, int cols,
          cudaStream_t stream) {
  const int64_t work = n * (cols / 8);
  rows_kernel<<<unsigned((work + 255) / 256), 256, 0, stream>>>(src, idx, div, scatter, dst, n, cols);
  KCUDA_CHECK_LAUNCH();
}

// ag[i, j] = bf16(SiTU-GLU(gu[i, j], gu[i, I + j])), 8 columns per thread.
__global__ void glu_kernel(const uint16_t* __restrict__ gu, int64_t rows, int I, float beta, float lbeta,
                           uint16_t* __restrict__ ag) {
  const int per = I / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * per) return;
  const int64_t r = i / per;
  const int j = int(i - r * per) * 8;
  float g[8], u[8], a[8];
  dev::unpack8(dev::ld16(gu + r * 2 * I + j), g);
  dev::unpack8(dev::ld16(gu + r * 2 * I + I + j), u);
#pragma unroll
  for (int q = 0; q < 8; ++q) a[q] = moe_dev::situ_glu(g[q], u[q], beta, lbeta);
  *reinterpret_cast<uint4*>(ag + r * I + j) = dev::pack8(a);
}

}  // namespace

size_t dense_scratch_bytes(int64_t T, int64_t Lt, int64_t I) {
  return r256(size_t(3 * I * Lt) * 2) + r256(size_t(T * Lt) * 2) + r256(size_t(T * 2 * I) * 2) +
         r256(size_t(T * I) * 2);
}

void run_dense(const DenseArgs& a, cudaStream_t stream) {
  KCUDA_REQUIRE(a.lt != nullptr, std::string("moe dense path: no cuBLASLt handle"));
  // The job list: one job per hit expert (the group kernel ran with ct ≥ n).
  const int64_t jb = std::min<int64_t>(a.n, a.X);
  std::vector<int32_t> jobs(size_t(3 * jb + 1));
  KCUDA_CHECK(cudaMemcpyAsync(jobs.data(), a.n_jobs, 4, cudaMemcpyDeviceToHost, stream));
  KCUDA_CHECK(cudaMemcpyAsync(jobs.data() + 1, a.jobs, size_t(3 * jb) * 4, cudaMemcpyDeviceToHost, stream));
  KCUDA_CHECK(cudaStreamSynchronize(stream));
  const int64_t J = jobs[0];
  KCUDA_REQUIRE(J >= 0 && J <= jb, "moe dense path: " + std::to_string(J) + " jobs for at most " + std::to_string(jb) +
                                       " experts");
  const int64_t Lt = a.Lt, I = a.I;
  char* p = static_cast<char*>(a.scratch);
  uint16_t* wd13 = reinterpret_cast<uint16_t*>(p);  // bf16 [2I, Lt]: W1 rows then W3 rows
  uint16_t* wd2 = wd13 + 2 * I * Lt;                // bf16 [Lt, I]
  p += r256(size_t(3 * I * Lt) * 2);
  uint16_t* zg = reinterpret_cast<uint16_t*>(p);  // bf16 [c, Lt], then yg
  p += r256(size_t(a.T * Lt) * 2);
  uint16_t* gu = reinterpret_cast<uint16_t*>(p);  // bf16 [c, 2I]
  p += r256(size_t(a.T * 2 * I) * 2);
  uint16_t* ag = reinterpret_cast<uint16_t*>(p);  // bf16 [c, I]
  const MoeExpertWeights& w = *a.w;
  for (int64_t j = 0; j < J; ++j) {
    const int64_t e = jobs[size_t(1 + 3 * j)], start = jobs[size_t(2 + 3 * j)], c = jobs[size_t(3 + 3 * j)];
    KCUDA_REQUIRE(e >= 0 && e < a.X && start >= 0 && c > 0 && c <= a.T && start + c <= a.n,
                  std::string("moe dense path: bad job from the group kernel"));
    dequant(w.w1_packed + e * w.w13_packed_stride, w.w1_scale + e * w.w13_scale_stride, int(I), int(Lt), wd13, Lt,
            stream);
    dequant(w.w3_packed + e * w.w13_packed_stride, w.w3_scale + e * w.w13_scale_stride, int(I), int(Lt),
            wd13 + I * Lt, Lt, stream);
    dequant(w.w2_packed + e * w.w2_packed_stride, w.w2_scale + e * w.w2_scale_stride, int(Lt), int(I), wd2, I, stream);
    rows(a.z, a.order + start, a.K, false, zg, c, int(Lt), stream);
    a.lt->bf16(zg, Lt, wd13, gu, 2 * I, c, Lt, 2 * I, stream);
    const int64_t work = c * (I / 8);
    glu_kernel<<<unsigned((work + 255) / 256), 256, 0, stream>>>(gu, c, int(I), a.beta, a.lbeta, ag);
    KCUDA_CHECK_LAUNCH();
    a.lt->bf16(ag, I, wd2, zg, Lt, c, I, Lt, stream);
    rows(zg, a.order + start, 1, true, a.y, c, int(Lt), stream);
  }
}

}  // namespace kestrel::cuda::moe_detail
