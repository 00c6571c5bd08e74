// Token masks on the logits rows (see token_mask.h).
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/token_mask.h"

namespace kestrel::cuda {
namespace {

constexpr int kIdsPerBlock = 1024;

__global__ void __launch_bounds__(kIdsPerBlock) token_mask_kernel(float* logits, int64_t ld, int64_t V,
                                                                  const SampleParams* params,
                                                                  const int32_t* mask_row, const uint32_t* masks,
                                                                  int64_t words) {
  const int64_t i = blockIdx.y;
  const int32_t mr = mask_row[i];
  if (mr < 0) return;  // no mask for this entry
  const int64_t v = int64_t(blockIdx.x) * kIdsPerBlock + threadIdx.x;
  if (v >= V) return;
  const uint32_t w = masks[int64_t(mr) * words + (v >> 5)];
  if (!((w >> (v & 31)) & 1u)) logits[int64_t(params[i].row) * ld + v] = -INFINITY;
}

}  // namespace

void apply_token_masks(float* logits, int64_t ld, int64_t V, const SampleParams* params, const int32_t* mask_row,
                       const uint32_t* masks, int64_t words, int64_t n, cudaStream_t stream) {
  KCUDA_REQUIRE(n >= 0 && n <= 65535 && V >= 1 && V < (int64_t(1) << 31) && ld >= V && words * 32 >= V,
                "apply_token_masks: n " + std::to_string(n) + ", V " + std::to_string(V) + ", ld " +
                    std::to_string(ld) + ", words " + std::to_string(words));
  if (n == 0) return;
  const dim3 grid(unsigned((V + kIdsPerBlock - 1) / kIdsPerBlock), unsigned(n));
  token_mask_kernel<<<grid, kIdsPerBlock, 0, stream>>>(logits, ld, V, params, mask_row, masks, words);
  KCUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda
