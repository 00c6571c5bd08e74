// CPU kernel rates on one thread, timed in thread CPU time (CLOCK_THREAD_CPUTIME_ID) so that a shared,
// loaded machine does not count the time the thread was descheduled; best of repeats.
//   build/bench/bench_cpu_kernels [--isa portable|avx2|avx512bf16] [--threads N]
// With --threads N > 1 the wall clock is used instead (the pool's threads all count).
#include <cblas.h>
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cpu/thread_pool.h"

using namespace kestrel;

namespace {

bool g_wall = false;

double now() {
  if (g_wall) return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double best_seconds(const std::function<void()>& fn, double budget = 0.5) {
  fn();  // warm
  double best = 1e30, spent = 0;
  for (int r = 0; r < 3 || spent < budget; ++r) {
    const double t0 = now();
    fn();
    const double dt = now() - t0;
    best = std::min(best, dt);
    spent += dt;
    if (r > 1000) break;
  }
  return best;
}

std::vector<uint16_t> rand_bf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(nd(rng));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--isa") {
      const std::string v = argv[i + 1];
      cpu::force_isa(v == "portable" ? cpu::Isa::portable : v == "avx2" ? cpu::Isa::avx2 : cpu::Isa::avx512bf16);
    }
    if (std::string(argv[i]) == "--threads") threads = std::stoi(argv[i + 1]);
  }
  cpu::set_num_threads(threads);
  g_wall = threads > 1;
  cpu::PackedWeights packed;  // as in the CPU executor: weights packed once (the first, warm-up call)
  const cpu::PackedScope scope(&packed);
  fmt::print("isa {}, {} thread(s), {} time\n", cpu::isa_name(cpu::isa()), threads, g_wall ? "wall" : "thread CPU");
  std::mt19937 rng(1);
  // GEMM shapes of k3-tiny (D 256) and a large square one.
  struct G {
    int64_t M, K, N;
  };
  for (G g : {G{1, 256, 256}, G{1, 256, 12256}, G{16, 256, 256}, G{16, 256, 768}, G{16, 256, 12256},
              G{256, 256, 256}, G{2048, 256, 256}, G{2048, 256, 768}, G{2048, 768, 256}, G{1024, 1024, 1024}}) {
    const auto x = rand_bf16(size_t(g.M * g.K), rng), w = rand_bf16(size_t(g.N * g.K), rng);
    std::vector<float> y(size_t(g.M * g.N));
    const double s = best_seconds([&] { cpu::gemm_bf16_f32(x.data(), g.K, w.data(), y.data(), g.N, g.M, g.K, g.N); });
    std::vector<float> xf(x.size()), wf(w.size());
    cpu::bf16_to_f32_n(x.data(), xf.data(), int64_t(x.size()));
    cpu::bf16_to_f32_n(w.data(), wf.data(), int64_t(w.size()));
    openblas_set_num_threads(threads);
    const double sb = best_seconds([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(g.M), int(g.N), int(g.K), 1.0f, xf.data(), int(g.K),
                  wf.data(), int(g.K), 0.0f, y.data(), int(g.N));
    });
    fmt::print("gemm_bf16 M={:5} K={:5} N={:6}: {:8.1f} GFLOP/s  {:8.1f} GB/s of W  ({:.1f} us); OpenBLAS sgemm f32 "
               "{:8.1f} GFLOP/s\n",
               g.M, g.K, g.N, 2.0 * g.M * g.N * g.K / s / 1e9, 2.0 * g.N * g.K / s / 1e9, s * 1e6,
               2.0 * g.M * g.N * g.K / sb / 1e9);
  }
  // MXFP4 expert product, k3-tiny expert (Lt 128, I 192), T tokens.
  for (int64_t T : {1, 2, 16, 256}) {
    const int64_t out = 192, in = 128;
    std::vector<uint8_t> packed(size_t(out * in / 2)), scale(size_t(out * in / 32), 127);
    for (auto& b : packed) b = uint8_t(rng());
    std::vector<float> x(size_t(T * in), 0.5f), y(size_t(T * out));
    const double s = best_seconds([&] { cpu::mxfp4_gemm(packed.data(), scale.data(), x.data(), y.data(), T, out, in); });
    fmt::print("mxfp4_gemm T={:4} [{} x {}]: {:8.1f} GFLOP/s ({:.2f} us)\n", T, out, in, 2.0 * T * out * in / s / 1e9,
               s * 1e6);
  }
  // SiTU-GLU, scalar twin vs vector.
  {
    const int64_t n = 1 << 16;
    const auto g = rand_bf16(size_t(n), rng), u = rand_bf16(size_t(n), rng);
    std::vector<uint16_t> a(static_cast<size_t>(n));
    const double s0 = best_seconds([&] { cpu::situ_glu(g.data(), u.data(), a.data(), n, 4.0f, 25.0f); });
    const double s1 = best_seconds([&] { cpu::situ_glu_fast(g.data(), u.data(), a.data(), n, 4.0f, 25.0f); });
    fmt::print("situ_glu: scalar {:.2f} ns/elem, fast {:.2f} ns/elem\n", s0 / n * 1e9, s1 / n * 1e9);
  }
  // Indexer scores + top-k, k3-tiny shapes (Hi 4, Di 32, Ki 256), one query over S keys.
  for (int64_t S : {2048, 16384}) {
    const int64_t Hi = 4, Di = 32, Ki = 256, T = 16;
    const auto qi = rand_bf16(size_t(T * Hi * Di), rng), keys = rand_bf16(size_t(S * Di), rng);
    std::vector<float> hw(size_t(T * Hi), 1.0f);
    std::vector<int32_t> sel(size_t(T * Ki));
    const double s0 = best_seconds([&] {
      cpu::indexer_select_topk(qi.data(), keys.data(), hw.data(), T, S - T, Hi, Di, Ki, sel.data());
    });
    const double s1 = best_seconds([&] {
      cpu::indexer_select_topk_fast(qi.data(), keys.data(), hw.data(), T, S - T, Hi, Di, Ki, sel.data());
    });
    fmt::print("indexer S={:6} ({} queries): twin {:.1f} us/query, fast {:.1f} us/query ({:.1f} GFLOP/s)\n", S, T,
               s0 / T * 1e6, s1 / T * 1e6, 2.0 * T * S * Hi * Di / s1 / 1e9);
  }
  // Absorbed MLA attention, k3-tiny (Hm 4, N 48, R 16, Dv 64, C 128), 256 selected keys per query.
  {
    const cpu::MlaDims d{4, 48, 16, 64, 128};
    const int64_t T = 64, S = 4096, Ks = 256;
    const auto q = rand_bf16(size_t(T * d.Hm * d.qk()), rng), kvb = rand_bf16(size_t(d.Hm * (d.N + d.Dv) * d.C), rng);
    const auto lat = rand_bf16(size_t(S * d.cw()), rng);
    std::vector<int32_t> sel(size_t(T * Ks));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < Ks; ++i) sel[size_t(t * Ks + i)] = int32_t(i * 15);
    std::vector<uint16_t> o(size_t(T * d.Hm * d.Dv));
    const double s0 = best_seconds([&] {
      cpu::mla_attn_absorbed(d, q.data(), kvb.data(), lat.data(), sel.data(), Ks, T, S - T, o.data());
    });
    const double s1 = best_seconds([&] {
      cpu::mla_attn_absorbed_fast(d, q.data(), kvb.data(), lat.data(), sel.data(), Ks, T, S - T, o.data());
    });
    fmt::print("mla absorbed ({} keys): twin {:.1f} us/query, fast {:.1f} us/query\n", Ks, s0 / T * 1e6, s1 / T * 1e6);
  }
  return 0;
}
