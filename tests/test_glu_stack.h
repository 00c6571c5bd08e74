// Test helper shared by the GPU tests and the SIMT-emulator tests (no CUDA): the weight stack a stacked-epilogue
// GEMM reads — gate and up rows interleaved by 8 (the SiTU-GLU segment's layout, gemm.h GemmEpi::situ_glu8), then
// the other segments' rows in order.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace kestrel::testutil {

// bf16 [2F + Σ rows, K]: gate/up [F, K] each (F a multiple of 8) interleaved in groups of 8 rows, then `rest`.
inline std::vector<uint16_t> glu_stack(const std::vector<uint16_t>& gate, const std::vector<uint16_t>& up, int64_t F,
                                       int64_t K, std::initializer_list<const std::vector<uint16_t>*> rest) {
  std::vector<uint16_t> w;
  for (int64_t f0 = 0; f0 < F; f0 += 8) {
    w.insert(w.end(), gate.begin() + f0 * K, gate.begin() + (f0 + 8) * K);
    w.insert(w.end(), up.begin() + f0 * K, up.begin() + (f0 + 8) * K);
  }
  for (const auto* part : rest) w.insert(w.end(), part->begin(), part->end());
  return w;
}

}  // namespace kestrel::testutil
