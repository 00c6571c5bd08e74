// See cpu_ceilings.h. Every test runs a few repeats and keeps the best (the machine may be shared).
#include "kernels/cpu/cpu_ceilings.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Best rate over repeats of fn() within `budget` seconds (at least `min_reps`); `units` per call.
template <class F>
double best_rate(double units, double budget, int min_reps, F&& fn) {
  double best = 0;
  const double end = now() + budget;
  for (int r = 0; r < min_reps || now() < end; ++r) {
    const double t0 = now();
    fn();
    best = std::max(best, units / (now() - t0));
  }
  return best;
}

// a = b over n doubles per thread slice, all threads at once (work large enough to split).
void copy_all(double* a, const double* b, int64_t n) {
  const int th = num_threads();
  parallel_for(th, int64_t(1) << 40, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = n * t / th, b1 = n * (t + 1) / th;
      std::memcpy(a + b0, b + b0, size_t(b1 - b0) * sizeof(double));
    }
  });
}

}  // namespace

CpuCeilings measure_cpu_ceilings(double seconds) {
  CpuCeilings c;
  c.threads = num_threads();
  c.isa = isa_name(isa());
  const double slice = seconds / 4;
  {
    const int64_t n = (int64_t(64) << 20) / 8;  // 64 MiB per array
    std::vector<double> a(size_t(n), 1.0), b(size_t(n), 2.0);
    c.copy_gbs = best_rate(2.0 * 8 * double(n) / 1e9, slice, 5, [&] { copy_all(a.data(), b.data(), n); });
  }
  {
    const int64_t n = (int64_t(1) << 20) / 8 * c.threads;  // 1 MiB per array per thread
    std::vector<double> a(size_t(n), 1.0), b(size_t(n), 2.0);
    c.copy_l2_gbs = best_rate(2.0 * 8 * double(n) / 1e9, slice, 50, [&] { copy_all(a.data(), b.data(), n); });
  }
  const int64_t M = 1024, N = 1024, K = 1024;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> xb(size_t(M * K)), wb(size_t(N * K));
  for (auto& v : xb) v = f32_to_bf16(nd(rng));
  for (auto& v : wb) v = f32_to_bf16(nd(rng));
  {
    std::vector<float> y(size_t(M * N));
    c.gemm_gflops = best_rate(2.0 * M * N * K / 1e9, slice, 3,
                              [&] { gemm_bf16_f32(xb.data(), K, wb.data(), y.data(), N, M, K, N); });
  }
  {
    std::vector<float> xf(size_t(M * K)), wf(size_t(N * K)), y(size_t(M * N));
    bf16_to_f32_n(xb.data(), xf.data(), M * K);
    bf16_to_f32_n(wb.data(), wf.data(), N * K);
    openblas_set_num_threads(c.threads);
    c.sgemm_gflops = best_rate(2.0 * M * N * K / 1e9, slice, 3, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), 1.0f, xf.data(), int(K), wf.data(),
                  int(K), 0.0f, y.data(), int(N));
    });
    openblas_set_num_threads(1);
  }
  return c;
}

}  // namespace kestrel::cpu
