// src/kernels/cuda/moe_experts.cu (the grouping and prep kernels, moe_experts_mxfp4, mxfp4_matmul_packed) compiled
// for the CPU emulation of simt.h, for test_emu_moe.cpp: the launch log's names, the workspace accessor of emu_moe.h,
// and stand-ins for the GEMM families whose files are not compiled here (stream, wide, dense), which fail if called.
#include "kernels/cuda/moe_experts.cu"
#include "simt.h"  // first: defines the CUDA surface the kernel source below is written against
//
#include <stdexcept>

#include "emu_moe.h"

namespace kestrel::cuda {
namespace {
[[maybe_unused]] const bool named = [] {
  simt::name_kernel(group_kernel, "group");
  simt::name_kernel(prep_kernel, "prep");
  return true;
}();
}  // namespace

namespace emu_moe {
Workspace carve(void* workspace, int64_t n, int64_t X, int64_t Lt, int64_t I) {
  char* p = static_cast<char*>(workspace);  // moe_experts_mxfp4's pieces, in its order
  const Groups g = carve_groups(p, n, X);
  auto* act = reinterpret_cast<uint16_t*>(p);
  p += round256(size_t(n * I) * 2);
  auto* y = reinterpret_cast<uint16_t*>(p);
  p += round256(size_t(n * Lt) * 2);
  const StreamScratch ss = carve_stream(p);
  return {g.order, g.jobs, g.n_jobs, act, y, ss.partial, ss.counters};
}
}  // namespace emu_moe

namespace moe_detail {
[[noreturn]] void not_emulated(const char* what) {
  throw std::logic_error(std::string("tests/emu: ") + what + " (not compiled for the emulator)");
}
int stream_grid(bool, int) { not_emulated("the stream path"); }
void launch_stream(const StreamArgs&, bool, int, bool, cudaStream_t) { not_emulated("the stream path"); }
void launch_wide(const GemmArgs&, bool, int64_t, bool, cudaStream_t) { not_emulated("the wide path"); }
size_t dense_scratch_bytes(int64_t, int64_t, int64_t) { not_emulated("the dense path"); }
void run_dense(const DenseArgs&, cudaStream_t) { not_emulated("the dense path"); }
}  // namespace moe_detail

}  // namespace kestrel::cuda
