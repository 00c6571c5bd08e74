// The machine's limits the CPU engine is read against (kestrel bench --cpu-ceilings):
//   copy  — STREAM "Copy" (a[i] = b[i] over two 64 MiB double arrays, far beyond any L3), bytes read +
//           written per second, as STREAM counts them, with the pool's threads; best of the repeats;
//   copy_l2 — the same over 1 MiB arrays per thread (cache-resident: what a model that fits in
//           cache can stream at);
//   gemm  — the bf16 GEMM of the engine (gemm_bf16, this machine's ISA) at M = N = K = 1024;
//   sgemm — OpenBLAS sgemm (f32, its own threads, as many) at the same shape: the reference rate.
// The floor of a decode step is bytes it reads ÷ copy; prefill is read against max(gemm, sgemm).
#pragma once

#include <string>

namespace kestrel::cpu {

struct CpuCeilings {
  int threads = 1;
  std::string isa;
  double copy_gbs = 0, copy_l2_gbs = 0;  // GB/s (1e9 bytes), read + write
  double gemm_gflops = 0, sgemm_gflops = 0;
};

// Takes about `seconds` (at least a few repeats of each test).
CpuCeilings measure_cpu_ceilings(double seconds = 4.0);

}  // namespace kestrel::cpu
