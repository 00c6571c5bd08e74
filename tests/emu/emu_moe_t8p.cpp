// src/kernels/cuda/moe_t8p.cu (the persistent t8 for one token, t8p_plan, launch_t8p) compiled for the CPU
// emulation of simt.h, for test_emu_moe.cpp; with names for the launch log (simt_runtime.h).
#include "kernels/cuda/moe_t8p.cu"
#include "simt.h"  // first: defines the CUDA surface the kernel source below is written against
//
#include <string>

namespace kestrel::cuda::moe_detail {
namespace {

template <bool G, int ST, int MB, int... SC>
void name_t8p() {
  const std::string base = std::string(ST == 4 ? "t8p" : "t8p deep") + (G ? " w1|w3 " : " w2 ");
  (simt::name_kernel(t8p_kernel<G, ST, SC, MB>, base + (SC == kScaleF32     ? "f32-scales"
                                                        : SC == kScaleFold  ? "folded"
                                                        : SC == kScaleFoldH ? "folded h*2^100"
                                                                            : "raw")),
   ...);
}
[[maybe_unused]] const bool named = [] {
  name_t8p<true, 4, 4, kScaleF32, kScaleFold, kScaleFoldH>();
  name_t8p<true, 8, 4, kScaleF32, kScaleFold, kScaleFoldH>();
  name_t8p<false, 4, 8, kScaleF32, kScaleRaw>();
  name_t8p<false, 8, 6, kScaleF32, kScaleRaw>();
  return true;
}();

}  // namespace
}  // namespace kestrel::cuda::moe_detail
