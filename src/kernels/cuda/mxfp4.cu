// One thread per packed byte pair-of-elements; each thread writes two bf16 values as one 32-bit
// store. The scale is applied as an exponent add on the bf16 bit pattern, which is exact because
// E2M1 magnitudes have at most 2 significant bits.
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mxfp4.h"

namespace kestrel::cuda {
namespace {

__device__ __forceinline__ uint16_t e2m1_scaled_to_bf16(uint32_t code, int exp) {
  // bf16 bit patterns of +{0, 0.5, 1, 1.5, 2, 3, 4, 6}
  constexpr uint16_t kBits[8] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0};
  const uint16_t sign = (code & 8u) ? 0x8000u : 0u;
  const uint16_t mag = kBits[code & 7u];
  if (mag == 0) return sign;
  const float v = __uint_as_float(uint32_t(mag) << 16);
  const float scaled = ldexpf(v, exp);  // exact unless it leaves the f32 range
  const uint32_t u = __float_as_uint(scaled);
  // Round-to-nearest-even to bf16 (the scale can push a value into the bf16 subnormal range).
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(sign | ((rounded >> 16) & 0x7fffu));
}

__global__ void mxfp4_dequant_kernel(const uint8_t* __restrict__ packed, int64_t ld_packed,
                                     const uint8_t* __restrict__ scale, int64_t ld_scale, uint16_t* __restrict__ out,
                                     int64_t ld_out, int64_t rows, int64_t half_cols) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * half_cols) return;
  const int64_t r = i / half_cols, j = i % half_cols;
  const uint8_t byte = packed[r * ld_packed + j];
  const uint8_t s = scale[r * ld_scale + (2 * j) / 32];
  uint32_t pair;
  if (s == 255) {
    pair = 0x7fc07fc0u;  // NaN scale: both elements NaN
  } else {
    const int exp = int(s) - 127;
    pair = uint32_t(e2m1_scaled_to_bf16(byte & 0xFu, exp)) | (uint32_t(e2m1_scaled_to_bf16(byte >> 4, exp)) << 16);
  }
  *reinterpret_cast<uint32_t*>(out + r * ld_out + 2 * j) = pair;
}

}  // namespace

void mxfp4_dequant_bf16(const uint8_t* packed, int64_t ld_packed, const uint8_t* scale, int64_t ld_scale,
                        uint16_t* out, int64_t ld_out, int64_t rows, int64_t cols, cudaStream_t stream) {
  KCUDA_REQUIRE(packed && scale && out, std::string("null pointer"));
  KCUDA_REQUIRE(rows >= 0 && cols >= 0 && cols % 32 == 0,
                "cols = " + std::to_string(cols) + " must be a non-negative multiple of 32");
  KCUDA_REQUIRE(ld_packed >= cols / 2 && ld_scale >= cols / 32 && ld_out >= cols, std::string("row strides too small"));
  KCUDA_REQUIRE(ld_out % 2 == 0 && (reinterpret_cast<uintptr_t>(out) & 3u) == 0,
                std::string("out must be 4-byte aligned per row"));
  const int64_t n = rows * (cols / 2);
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  KCUDA_REQUIRE(blocks < (int64_t(1) << 31), "too many elements: " + std::to_string(n));
  mxfp4_dequant_kernel<<<unsigned(blocks), threads, 0, stream>>>(packed, ld_packed, scale, ld_scale, out, ld_out, rows,
                                                                 cols / 2);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
