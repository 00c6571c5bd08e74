// Paged cache writers (see paged.h): one block per written row, quantised exactly as MlaCacheView does
// (the same amax, the same power-of-two scale rule, the same integer RNE through kernels/cuda/quant.cuh),
// so the bytes equal the CPU writer's. amax is a max-reduction, which is exact in any order; NaN inputs
// are skipped by the comparison `amax < |x|` as in std::max on the CPU.
// At the end, mla_norms_and_writes: MLA's norms after its input projection and these writes in one launch, the
// tasks side by side (grid T × 2|3), through the same row functions (write_*_row; norm_rows.cuh).
// The paged readers are the attention kernels themselves (mla_decode.cu, mla_prefill.cu, mla_decode_simple.cu,
// indexer.cu).
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/norm_rows.cuh"
#include "kernels/cuda/paged.h"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kWriteThreads = 128;
constexpr float kFp8Max = 448.0f;

__device__ __forceinline__ float amax_step(float amax, float x) {
  const float a = fabsf(x);
  return amax < a ? a : amax;
}

// Max over the block of per-thread values (no NaN by construction). scratch: 32 floats.
__device__ __forceinline__ float block_amax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = amax_step(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float s = lane < nw ? scratch[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = amax_step(s, __shfl_xor_sync(0xffffffffu, s, o));
  return s;
}

// §3.5 FP8 scale of a group whose amax is given: 2^⌈log2(max(amax, 1e-4)/448)⌉.
__device__ __forceinline__ float fp8_scale(float amax) {
  const float m = amax < 1e-4f ? 1e-4f : amax;
  return dev::e8m0_to_f32(dev::e8m0_ceil_pow2(m / kFp8Max));
}

// One row into its latent slot (slot ≥ 0). FP8: one value per thread per 128-value group (threads past the
// first 128 of a larger block add nothing to the group's amax).
__device__ __forceinline__ void write_latent_row(LatentFormat fmt, int C, int R, int64_t tb,
                                                 const uint16_t* __restrict__ row, int64_t slot,
                                                 uint8_t* __restrict__ arena, float* scratch) {
  uint8_t* dst = arena + slot * tb;
  if (fmt == LatentFormat::bf16) {
    uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
    for (int i = threadIdx.x; i < C + R; i += blockDim.x) d16[i] = row[i];
    return;
  }
  const int groups = (C + 127) / 128;
  for (int g = 0; g < groups; ++g) {
    const int i = g * 128 + int(threadIdx.x);
    const bool in = threadIdx.x < 128 && i < C;
    const float x = in ? dev::bf16_to_f32(row[i]) : 0.0f;
    const float amax = block_amax(in ? amax_step(0.0f, x) : 0.0f, scratch);
    const float s = fp8_scale(amax);
    if (in) dst[i] = dev::f32_to_e4m3_sat(x / s);
    if (threadIdx.x == 0) *reinterpret_cast<float*>(dst + C + g * 4) = s;
  }
  uint16_t* rope = reinterpret_cast<uint16_t*>(dst + C + groups * 4);
  for (int i = threadIdx.x; i < R; i += blockDim.x) rope[i] = row[C + i];
}

template <typename SlotT>
__global__ void __launch_bounds__(kWriteThreads)
    write_latent_kernel(LatentFormat fmt, int C, int R, int64_t tb, const uint16_t* __restrict__ rows,
                        int64_t ld, const SlotT* __restrict__ slots, uint8_t* __restrict__ arena) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, slot = int64_t(slots[t]);
  if (slot < 0) return;
  write_latent_row(fmt, C, R, tb, rows + t * ld, slot, arena, scratch);
}

// One key row into its slot (slot ≥ 0): BF16, FP8 (amax over the whole row) or MXFP4 (a warp per 32-value block).
__device__ __forceinline__ void write_key_row(IndexKeyFormat fmt, int P, int Di, int64_t tb,
                                              const uint16_t* __restrict__ key, int64_t slot,
                                              uint8_t* __restrict__ arena, float* scratch) {
  const int64_t page = slot / P, prow = slot % P, K = index_key_kernel_page(P);
  uint8_t* kpage = arena + page * P * tb + (prow / K) * K * tb;
  const int64_t r = prow % K;
  if (fmt == IndexKeyFormat::bf16) {
    uint16_t* d16 = reinterpret_cast<uint16_t*>(kpage + r * tb);
    for (int i = threadIdx.x; i < Di; i += blockDim.x) d16[i] = key[i];
    return;
  }
  if (fmt == IndexKeyFormat::fp8) {
    float amax = 0.0f;
    for (int i = threadIdx.x; i < Di; i += blockDim.x) amax = amax_step(amax, dev::bf16_to_f32(key[i]));
    amax = block_amax(amax, scratch);
    const float s = fp8_scale(amax);
    uint8_t* vals = kpage + r * Di;
    for (int i = threadIdx.x; i < Di; i += blockDim.x) vals[i] = dev::f32_to_e4m3_sat(dev::bf16_to_f32(key[i]) / s);
    if (threadIdx.x == 0) *reinterpret_cast<float*>(kpage + K * Di + r * 4) = s;
    return;
  }
  // MXFP4: one warp per 32-element block (MODEL.md §0.9), lane = element.
  uint8_t* vals = kpage + r * (Di / 2);
  uint8_t* scales = kpage + K * (Di / 2) + r * (Di / 32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int b = warp; b < Di / 32; b += nw) {
    const float x = dev::bf16_to_f32(key[b * 32 + lane]);
    const bool bad = !isfinite(x);
    const bool any_bad = __any_sync(0xffffffffu, bad);
    float amax = bad ? 0.0f : fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    uint8_t code = 0;
    int k = -127;
    if (!any_bad) {
      // Smallest k with amax ≤ 6·2^k: a ceil-log2 guess corrected against the exact products.
      if (amax > 0.0f) k = int(dev::e8m0_ceil_pow2(amax / 6.0f)) - 127;
      while (k < 127 && amax > ldexpf(6.0f, k)) ++k;
      while (k > -127 && amax <= ldexpf(6.0f, k - 1)) --k;
      code = dev::f32_to_e2m1(ldexpf(x, -k));
    }
    const uint8_t hi = uint8_t(__shfl_down_sync(0xffffffffu, code, 1));
    if ((lane & 1) == 0) vals[b * 16 + lane / 2] = uint8_t(code | (hi << 4));
    if (lane == 0) scales[b] = any_bad ? uint8_t(255) : uint8_t(k + 127);
  }
}

template <typename SlotT>
__global__ void __launch_bounds__(kWriteThreads)
    write_keys_kernel(IndexKeyFormat fmt, int P, int Di, int64_t tb, const uint16_t* __restrict__ keys, int64_t ld,
                      const SlotT* __restrict__ slots, uint8_t* __restrict__ arena) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, slot = int64_t(slots[t]);
  if (slot < 0) return;
  write_key_row(fmt, P, Di, tb, keys + t * ld, slot, arena, scratch);
}

template <typename SlotT>
void write_latent(const PagedMlaCache& c, const uint16_t* rows, int64_t ld, const SlotT* slots, int64_t T,
                  cudaStream_t stream) {
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("paged_write_latent: bad T"));
  if (T == 0) return;
  KCUDA_REQUIRE(rows && slots && c.latent && c.block_size > 0, std::string("paged_write_latent: null pointer"));
  KCUDA_REQUIRE(c.C > 0 && c.C % 8 == 0 && c.R >= 0 && c.R % 8 == 0 && ld >= c.C + c.R,
                "paged_write_latent: bad shape C=" + std::to_string(c.C) + " R=" + std::to_string(c.R));
  write_latent_kernel<SlotT><<<unsigned(T), kWriteThreads, 0, stream>>>(
      c.latent_format, int(c.C), int(c.R), c.latent_token_bytes(), rows, ld, slots, c.latent);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace

void paged_write_latent(const PagedMlaCache& c, const uint16_t* rows, int64_t ld, const int64_t* slots, int64_t T,
                        cudaStream_t stream) {
  write_latent(c, rows, ld, slots, T, stream);
}

void paged_write_latent(const PagedMlaCache& c, const uint16_t* rows, int64_t ld, const int32_t* slots, int64_t T,
                        cudaStream_t stream) {
  write_latent(c, rows, ld, slots, T, stream);
}

namespace {
template <typename SlotT>
void write_keys(const PagedMlaCache& c, const uint16_t* keys, int64_t ld, const SlotT* slots, int64_t T,
                cudaStream_t stream) {
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("paged_write_keys: bad T"));
  if (T == 0) return;
  KCUDA_REQUIRE(keys && slots && c.keys && c.block_size > 0, std::string("paged_write_keys: null pointer"));
  KCUDA_REQUIRE(c.Di > 0 && c.Di % 8 == 0 && c.Di <= 4096 && ld >= c.Di &&
                    (c.key_format != IndexKeyFormat::mxfp4 || c.Di % 32 == 0),
                "paged_write_keys: bad Di " + std::to_string(c.Di));
  write_keys_kernel<SlotT><<<unsigned(T), kWriteThreads, 0, stream>>>(c.key_format, c.block_size, int(c.Di),
                                                                      c.key_token_bytes(), keys, ld, slots, c.keys);
  KCUDA_CHECK_LAUNCH();
}
}  // namespace

void paged_write_keys(const PagedMlaCache& c, const uint16_t* keys, int64_t ld, const int64_t* slots, int64_t T,
                      cudaStream_t stream) {
  write_keys(c, keys, ld, slots, T, stream);
}

void paged_write_keys(const PagedMlaCache& c, const uint16_t* keys, int64_t ld, const int32_t* slots, int64_t T,
                      cudaStream_t stream) {
  write_keys(c, keys, ld, slots, T, stream);
}

// ---- MLA's norms and cache writes after its input projection, one launch --------------------------------------
namespace {

constexpr int kNormsThreads = 256;  // = norm.cu's kThreads: rmsnorm_row's order of Σx² (bit-identical rows)

// Grid (T, 2 or 3): blockIdx.y = task, blockIdx.x = token; the tasks are independent, so their CTAs run side by side.
//   0: cq = RMSNorm_{q_a_norm}(qa)
//   1: ĉ = RMSNorm_{kv_a_norm}(c) in place in rows = [c | k_pe], then the row into its latent slot
//   2: knew = LayerNorm(kraw) (the indexer's keys), then into its key slot
__global__ void __launch_bounds__(kNormsThreads) mla_norms_kernel(const PagedMlaCache c, const MlaProjNorms a,
                                                                  const int32_t* __restrict__ slots, int64_t ltb,
                                                                  int64_t ktb) {
  __shared__ float scratch[32];
  __shared__ double scratch_d[32];
  dev::pdl_trigger();
  dev::pdl_wait();  // qa, rows and kraw come from the projection before
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  const int CW = int(c.C + c.R);
  switch (blockIdx.y) {
    case 0:
      rows_dev::rmsnorm_row(a.qa + t * a.Q, a.q_a_norm, a.cq + t * a.Q, int(a.Q), a.eps, scratch);
      return;
    case 1: {
      uint16_t* row = a.rows + t * CW;
      rows_dev::rmsnorm_row(row, a.kv_a_norm, row, int(c.C), a.eps, scratch);
      __syncthreads();  // the block's normalised values, visible to every thread that copies them
      if (slot >= 0) write_latent_row(c.latent_format, int(c.C), int(c.R), ltb, row, slot, c.latent, scratch);
      return;
    }
    default: {
      uint16_t* knew = a.knew + t * c.Di;
      rows_dev::key_norm_row(a.kraw + t * c.Di, a.k_norm, a.k_norm_bias, c.Di, knew, scratch_d);
      __syncthreads();
      if (slot >= 0) write_key_row(c.key_format, c.block_size, int(c.Di), ktb, knew, slot, c.keys, scratch);
      return;
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

void mla_norms_and_writes(const PagedMlaCache& c, const MlaProjNorms& a, const int32_t* slots, int64_t T,
                          cudaStream_t stream) {
  KCUDA_REQUIRE(T >= 0 && T < (int64_t(1) << 31), std::string("mla_norms_and_writes: bad T"));
  if (T == 0) return;
  const bool indexer = a.kraw != nullptr;
  KCUDA_REQUIRE(slots && a.qa && a.cq && a.q_a_norm && a.rows && a.kv_a_norm && c.latent && c.block_size > 0 &&
                    (!indexer || (a.knew && a.k_norm && c.keys)),
                std::string("mla_norms_and_writes: null pointer"));
  KCUDA_REQUIRE(a.Q > 0 && a.Q % 8 == 0 && c.C > 0 && c.C % 8 == 0 && c.R >= 0 && c.R % 8 == 0 && a.Q < (1 << 30),
                "mla_norms_and_writes: bad shape Q=" + std::to_string(a.Q) + " C=" + std::to_string(c.C) +
                    " R=" + std::to_string(c.R));
  KCUDA_REQUIRE(!indexer || (c.Di > 0 && c.Di % 8 == 0 && c.Di <= 1024 &&
                             (c.key_format != IndexKeyFormat::mxfp4 || c.Di % 32 == 0)),
                "mla_norms_and_writes: bad Di " + std::to_string(c.Di));
  KCUDA_REQUIRE(aligned16(a.qa) && aligned16(a.cq) && aligned16(a.q_a_norm) && aligned16(a.rows) &&
                    aligned16(a.kv_a_norm) && ((c.C + c.R) * 2) % 16 == 0,
                std::string("mla_norms_and_writes: the normalised rows must be 16-byte aligned"));
  launch_pdl(mla_norms_kernel, dim3(unsigned(T), indexer ? 3u : 2u), dim3(kNormsThreads), 0, stream, c, a, slots,
             c.latent_token_bytes(), c.key_token_bytes());
}

}  // namespace kestrel::cuda
