// src/kernels/cuda/moe_t8.cu (the fixed-grid t8 / t32 expert GEMMs and plan_t8) compiled for the CPU emulation of
// simt.h, for test_emu_moe.cpp; with names for the launch log (simt_runtime.h) of every instantiation launch_gemm
// can take.
#include "kernels/cuda/moe_t8.cu"
#include "simt.h"  // first: defines the CUDA surface the kernel source below is written against
//
#include <string>

namespace kestrel::cuda::moe_detail {
namespace {

const char* scale_name(int s) {
  return s == kScaleF32       ? "f32-scales"
         : s == kScaleSpecial ? "special-scales"
         : s == kScaleFold    ? "folded"
         : s == kScaleFoldH   ? "folded h*2^100"
                              : "raw";
}
template <bool G, int NT, int ST, bool J, int MB, bool ID, int... SC>
void name_family(const char* family) {
  (simt::name_kernel(
       expert_gemm_kernel<G, NT, ST, SC, J, MB, ID>,
       std::string(family) + (G ? " w1|w3" : " w2") + (ID ? " ungrouped " : " grouped ") + scale_name(SC)),
   ...);
}
template <bool ID>
void name_t8() {
  name_family<true, 1, kT8DeepStages, true, 0, ID, kScaleF32, kScaleSpecial, kScaleFold, kScaleFoldH>("t8 deep");
  name_family<true, 1, 4, true, 0, ID, kScaleF32, kScaleSpecial, kScaleFold, kScaleFoldH>("t8 jit");
  name_family<true, 1, 4, false, 0, ID, kScaleF32, kScaleSpecial, kScaleFold, kScaleFoldH>("t8 staged");
  name_family<false, 1, 4, true, kT8W2MinCtas, ID, kScaleF32, kScaleSpecial, kScaleFold, kScaleRaw>("t8 jit");
  name_family<false, 1, 4, false, 0, ID, kScaleF32, kScaleSpecial, kScaleFold, kScaleRaw>("t8 staged");
}
[[maybe_unused]] const bool named = [] {
  name_t8<false>();
  name_t8<true>();
  name_family<true, 4, 2, false, 0, false, kScaleF32, kScaleSpecial, kScaleFold>("t32");
  name_family<false, 4, 2, false, 0, false, kScaleF32, kScaleSpecial, kScaleFold>("t32");
  return true;
}();

}  // namespace
}  // namespace kestrel::cuda::moe_detail
