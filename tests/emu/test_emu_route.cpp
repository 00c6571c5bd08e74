// The MoE router kernels (src/kernels/cuda/moe.cu: the block kernel, and the two-level, sorting and radix ones at X ≤ 2048)
// on the CPU emulation of simt.h against cpu::moe_route: ids exact (selection order, ties to the lower expert,
// NaN ranking lowest), weights bit-exact (the emulation's expf is the twin's, the sums run in the same order),
// and the kernels bit-identical to each other. tests/gpu (GpuOps.MoeRoute) runs the same kernels on the
// device, where expf may differ from the host's by an ulp.
#include <gtest/gtest.h>

#include "simt.h"  // first: defines the CUDA surface the kernel source below is written against

#include "kernels/cuda/moe.cu"
//
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../test_rng.h"
#include "kernels/cpu/moe_ops.h"

namespace kestrel {
namespace {

using testutil::Rng;

enum class Logits { random, ties, specials, mostly_nan };

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> wts;
};

// The block kernel (which = 0), the two-level one (1) or the sorting one (2), launched as moe_route launches them.
Routed run_kernel(int which, const std::vector<float>& logits, const std::vector<float>& bias, int64_t T, int64_t X,
                  int64_t K, bool renorm, float scaling) {
  Routed r{std::vector<int32_t>(size_t(T * K), -7), std::vector<float>(size_t(T * K), std::nanf(""))};
  if (which == 3) {
    const int J = cuda::route_2l_slots(X);
    auto go = [&](auto kernel) {
      simt::launch(dim3(unsigned(T)), dim3(cuda::kRadixThreads), 0, [&] {
        kernel(logits.data(), bias.data(), int(X), int(K), renorm, scaling, r.ids.data(), r.wts.data());
      });
    };
    if (J == 1) go(cuda::route_radix_kernel<1>);
    else if (J == 2) go(cuda::route_radix_kernel<2>);
    else if (J == 4) go(cuda::route_radix_kernel<4>);
    else go(cuda::route_radix_kernel<8>);
  } else if (which == 2) {
    const int J = cuda::route_2l_slots(X), J2 = cuda::route_sort_slots2(K);
    auto go = [&](auto kernel) {
      simt::launch(dim3(unsigned(T)), dim3(32 * cuda::kRoute2Warps), 0, [&] {
        kernel(logits.data(), bias.data(), int(X), int(K), renorm, scaling, r.ids.data(), r.wts.data());
      });
    };
    auto by_j2 = [&]<int JJ>() {
      if (J2 == 1) go(cuda::route_sort_kernel<JJ, 1>);
      else if (J2 == 2) go(cuda::route_sort_kernel<JJ, 2>);
      else if (J2 == 4) go(cuda::route_sort_kernel<JJ, 4>);
      else if (J2 == 8) go(cuda::route_sort_kernel<JJ, 8>);
      else go(cuda::route_sort_kernel<JJ, 16>);
    };
    if (J == 1) by_j2.template operator()<1>();
    else if (J == 2) by_j2.template operator()<2>();
    else if (J == 4) by_j2.template operator()<4>();
    else by_j2.template operator()<8>();
  } else if (which == 1) {
    const int J = cuda::route_2l_slots(X);
    EXPECT_GT(J, 0) << "X = " << X;
    auto go = [&](auto kernel) {
      simt::launch(dim3(unsigned(T)), dim3(32 * cuda::kRoute2Warps), 0, [&] {
        kernel(logits.data(), bias.data(), int(X), int(K), renorm, scaling, r.ids.data(), r.wts.data());
      });
    };
    if (J == 1) go(cuda::route_2l_kernel<1>);
    else if (J == 2) go(cuda::route_2l_kernel<2>);
    else if (J == 4) go(cuda::route_2l_kernel<4>);
    else go(cuda::route_2l_kernel<8>);
  } else {
    simt::launch(dim3(unsigned(T)), dim3(cuda::kRouteThreads), size_t(2 * X) * 4, [&] {
      cuda::route_kernel(logits.data(), bias.data(), int(X), int(K), renorm, scaling, r.ids.data(), r.wts.data());
    });
  }
  return r;
}

void check_case(int64_t T, int64_t X, int64_t K, Logits kind, bool renorm, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> logits(static_cast<size_t>(T * X)), bias(static_cast<size_t>(X));
  for (auto& l : logits) l = rng.uniform(-4.0f, 4.0f);
  for (auto& b : bias) b = rng.uniform(-0.1f, 0.1f);
  if (kind == Logits::ties) {  // few distinct values and no bias: most picks are decided by the index rule
    for (auto& l : logits) l = float(rng.next() % 3) - 1.0f;
    std::fill(bias.begin(), bias.end(), 0.0f);
  } else if (kind == Logits::specials) {  // NaN ranks below every number, ±inf saturate the sigmoid
    const float inf = std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < logits.size(); i += 5) logits[i] = i % 3 == 0 ? std::nanf("") : i % 3 == 1 ? inf : -inf;
  } else if (kind == Logits::mostly_nan) {  // more picks than numbers: the NaN experts follow, lowest index first
    for (size_t i = 0; i < logits.size(); ++i)
      if (i % 4 != 1) logits[i] = std::nanf("");
  }
  const float scaling = 2.5f;
  Routed ref{std::vector<int32_t>(size_t(T * K)), std::vector<float>(size_t(T * K))};
  cpu::moe_route(logits.data(), bias.data(), T, X, K, renorm, scaling, ref.ids.data(), ref.wts.data());
  const std::string shape = "T=" + std::to_string(T) + " X=" + std::to_string(X) + " K=" + std::to_string(K) +
                            (kind == Logits::ties ? " ties" : kind == Logits::specials ? " NaN/inf" : kind == Logits::mostly_nan ? " mostly NaN" : "") +
                            (renorm ? "" : " unnormalised");
  for (int which : {0, 1, 2, 3}) {
    if (which > 0 && cuda::route_2l_slots(X) == 0) continue;
    const Routed got = run_kernel(which, logits, bias, T, X, K, renorm, scaling);
    const std::string what = shape + (which == 3 ? " radix kernel" : which == 2 ? " sort kernel" : which == 1 ? " two-level kernel" : " block kernel");
    EXPECT_EQ(got.ids, ref.ids) << what << ": ids";
    EXPECT_EQ(0, std::memcmp(got.wts.data(), ref.wts.data(), ref.wts.size() * 4)) << what << ": weights not bit-exact";
  }
}

TEST(EmuRoute, EveryKernelMatchesTheTwin) {
  check_case(5, 16, 4, Logits::random, true, 1);     // nano
  check_case(9, 112, 2, Logits::random, true, 2);    // mini (warps 4..7 hold no experts)
  check_case(3, 896, 16, Logits::random, true, 3);   // the real shape
  check_case(2, 896, 16, Logits::ties, true, 4);
  check_case(3, 16, 4, Logits::ties, true, 5);
  check_case(2, 100, 7, Logits::specials, true, 6);  // NaN and ±inf logits; X not a multiple of 32
  check_case(2, 1024, 64, Logits::random, true, 7);  // 4 slots a lane, 64 picks
  check_case(2, 2048, 64, Logits::ties, true, 12);   // the two-level kernel's bound: 8 slots a lane
  check_case(1, 300, 40, Logits::random, false, 8);  // no renormalisation; picks past lane 31
  check_case(2, 1030, 8, Logits::random, true, 9);   // 5 slot rows, the last partial
  check_case(1, 2050, 16, Logits::random, true, 13); // past 2048: the block kernel only
  check_case(1, 5, 5, Logits::random, true, 10);     // every expert chosen
  check_case(3, 72, 40, Logits::mostly_nan, true, 11);
}

// The two-level kernel's lists cross a barrier between its levels, the block kernel's scores and picks several:
// every schedule gives the same bits.
TEST(EmuRoute, ScheduleOrderDoesNotMatter) {
  Rng rng(21);
  const int64_t T = 2, X = 896, K = 16;
  std::vector<float> logits(static_cast<size_t>(T * X)), bias(static_cast<size_t>(X));
  for (auto& l : logits) l = rng.uniform(-4.0f, 4.0f);
  for (auto& b : bias) b = rng.uniform(-0.1f, 0.1f);
  for (int which : {0, 1, 2, 3}) {
    const Routed first = run_kernel(which, logits, bias, T, X, K, true, 1.0f);
    for (const simt::Schedule sch : {simt::Schedule::threads_reverse, simt::Schedule::warps,
                                     simt::Schedule::warps_reverse, simt::Schedule::ctas}) {
      simt::g_schedule = sch;
      const Routed r = run_kernel(which, logits, bias, T, X, K, true, 1.0f);
      simt::g_schedule = simt::Schedule::threads;
      EXPECT_EQ(r.ids, first.ids) << "kernel " << which << " schedule " << int(sch);
      EXPECT_EQ(0, std::memcmp(r.wts.data(), first.wts.data(), r.wts.size() * 4)) << int(sch);
    }
  }
}

}  // namespace
}  // namespace kestrel
