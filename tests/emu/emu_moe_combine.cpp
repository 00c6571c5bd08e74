// src/kernels/cuda/moe_combine.cu (the weighted combine and combine + RMSNorm, one CTA or one cluster a token;
// launch_combine) compiled for the CPU emulation of simt.h, for test_emu_moe.cpp; with names for the launch log
// (simt_runtime.h).
#include "kernels/cuda/moe_combine.cu"
#include "simt.h"  // first: defines the CUDA surface the kernel source below is written against
//
#include <string>
#include <utility>

namespace kestrel::cuda::moe_detail {
namespace {

template <int... KT>
void name_combine(std::integer_sequence<int, KT...>) {
  auto k = [](int kt) { return kt == 0 ? std::string(" K>8") : " K=" + std::to_string(kt); };
  (simt::name_kernel(combine_kernel<KT>, "combine" + k(KT)), ...);
  (simt::name_kernel(combine_norm_kernel<KT>, "combine+norm" + k(KT)), ...);
  (simt::name_kernel(combine_norm_cluster_kernel<KT>, "combine+norm cluster" + k(KT)), ...);
}
[[maybe_unused]] const bool named = [] {
  name_combine(std::make_integer_sequence<int, 9>());
  return true;
}();

}  // namespace
}  // namespace kestrel::cuda::moe_detail
