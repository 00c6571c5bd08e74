// What tests/emu/test_emu_moe.cpp needs from the MoE expert kernel files compiled for the emulator (emu_moe_*.cpp,
// one translation unit each, as in the real build: their file-local names would collide in one).
#pragma once

#include <cstdint>

namespace kestrel::cuda::emu_moe {

// moe_experts_mxfp4's workspace as its own carve functions cut it (moe_experts.cu): the grouping kernel's work list
// and the decode GEMMs' scratch.
struct Workspace {
  int32_t* order;     // i32 [n] slots grouped by expert
  int32_t* jobs;      // i32 [job_bound(n, X, 8), 3]
  int32_t* n_jobs;    // i32 [1]
  uint16_t* act;      // bf16 [n, I]
  uint16_t* y;        // bf16 [n, Lt]
  float* partial;     // the split partials
  int32_t* counters;  // i32 [2 · kMaxStreamWarps]
};
Workspace carve(void* workspace, int64_t n, int64_t X, int64_t Lt, int64_t I);

}  // namespace kestrel::cuda::emu_moe
