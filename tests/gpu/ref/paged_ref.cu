// The paged latent gather (see gpu_ref.h), moved here from src/kernels/cuda/paged.cu unchanged: it fed the naive
// prefill's contiguous context, which the engine no longer has; the tests and bench_mla still use it to build
// contiguous inputs for the reference kernels from a paged cache.
#include <cstring>
#include <string>

#include "gpu_ref.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/quant.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kWriteThreads = 128;

// Row n of out = the token at pool row rows[n], dequantised to BF16 like MlaCacheView::read_latent: an e4m3
// value times its power-of-two scale is exact in BF16 (3 mantissa bits, exponent in range), so the bytes
// equal the CPU's.
__global__ void __launch_bounds__(kWriteThreads)
    gather_latent_kernel(LatentFormat fmt, int C, int R, int64_t tb, const uint8_t* __restrict__ arena,
                         const int32_t* __restrict__ rows, uint16_t* __restrict__ out) {
  const int64_t n = blockIdx.x;
  const uint8_t* src = arena + int64_t(rows[n]) * tb;
  uint16_t* y = out + n * (C + R);
  if (fmt == LatentFormat::bf16) {
    const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
    for (int i = threadIdx.x; i < C + R; i += blockDim.x) y[i] = s16[i];
    return;
  }
  const int groups = (C + 127) / 128;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float s;
    memcpy(&s, src + C + (i / 128) * 4, 4);
    y[i] = dev::f32_to_bf16(dev::e4m3_to_f32(src[i]) * s);
  }
  const uint8_t* rope = src + C + groups * 4;
  for (int i = threadIdx.x; i < R; i += blockDim.x) memcpy(y + C + i, rope + 2 * i, 2);
}

}  // namespace

void paged_gather_latent(const PagedMlaCache& c, const int32_t* rows, int64_t n, uint16_t* out, cudaStream_t stream) {
  KCUDA_REQUIRE(n >= 0 && n < (int64_t(1) << 31), std::string("paged_gather_latent: bad n"));
  if (n == 0) return;
  KCUDA_REQUIRE(rows && out && c.latent, std::string("paged_gather_latent: null pointer"));
  KCUDA_REQUIRE(c.C > 0 && c.C % 8 == 0 && c.R >= 0 && c.R % 8 == 0,
                "paged_gather_latent: bad shape C=" + std::to_string(c.C) + " R=" + std::to_string(c.R));
  gather_latent_kernel<<<unsigned(n), kWriteThreads, 0, stream>>>(c.latent_format, int(c.C), int(c.R),
                                                                  c.latent_token_bytes(), c.latent, rows, out);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
