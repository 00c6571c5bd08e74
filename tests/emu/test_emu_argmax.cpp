// The greedy argmax kernels (src/kernels/cuda/argmax.cu: one CTA per row, and the row split over CTAs whose
// last one reduces) on the CPU emulation of simt.h, against the contract of cuda::argmax_rows (sampling.h):
// the first position of the row's largest non-NaN value, 0 for an all-NaN row. (The CPU twin runtime::argmax
// agrees wherever the row does not start with NaN; it lives in kestrel_runtime, which this target does not
// link.) Both kernels must give the same ids; the split kernel must
// leave its counters at zero (the next launch depends on it), including when one workspace serves launches of
// different shapes in turn. Shapes cross the split geometry: rows shorter than a chunk, a chunk's last float4,
// tails of 1–3 logits, an unaligned row stride (the scalar path), 128 rows (the split's limit).
// tests/gpu (GpuEngine's argmax_rows check and the engine's greedy tokens) runs them on the device.
#include <gtest/gtest.h>

#include "simt.h"  // first: defines the CUDA surface the kernel source below is written against

#include "kernels/cuda/argmax.cu"
//
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../test_rng.h"

namespace kestrel {
namespace {

using cuda::argmax_detail::SplitWs;
using testutil::Rng;

// The contract, written out: lowest index of the largest non-NaN value; 0 when every value is NaN.
int32_t contract_argmax(const float* x, int64_t V) {
  int32_t best = -1;
  for (int64_t v = 0; v < V; ++v) {
    if (std::isnan(x[v])) continue;
    if (best < 0 || x[v] > x[best]) best = int32_t(v);
  }
  return best < 0 ? 0 : best;
}

enum class Fill { random, ties, nan_some, nan_all, neg_inf, pos_inf_twice, constant };

std::vector<float> make_rows(int64_t n, int64_t V, int64_t ld, Fill f, Rng& rng) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> x(size_t(n * ld), 12345.0f);  // the gap past V in each row is larger than any logit
  for (int64_t r = 0; r < n; ++r) {
    float* row = x.data() + r * ld;
    for (int64_t v = 0; v < V; ++v) row[v] = rng.uniform(-8.0f, 8.0f);
    switch (f) {
      case Fill::random:
        break;
      case Fill::ties: {  // the maximum at several positions, in different chunks
        const int64_t a = int64_t(rng.next() % uint64_t(V)), b = int64_t(rng.next() % uint64_t(V));
        row[a] = row[b] = 9.0f;
        row[V - 1] = 9.0f;
        break;
      }
      case Fill::nan_some:
        for (int64_t v = 0; v < V; v += 3) row[v] = nan;
        row[int64_t(rng.next() % uint64_t(V))] = nan;
        break;
      case Fill::nan_all:
        for (int64_t v = 0; v < V; ++v) row[v] = nan;
        break;
      case Fill::neg_inf:
        for (int64_t v = 0; v < V; ++v) row[v] = -inf;
        break;
      case Fill::pos_inf_twice:
        row[V - 1] = inf;
        row[(V - 1) / 2] = inf;
        break;
      case Fill::constant:
        for (int64_t v = 0; v < V; ++v) row[v] = 0.25f;
        break;
    }
  }
  return x;
}

std::vector<int32_t> run_row(const std::vector<float>& x, int64_t n, int64_t V, int64_t ld) {
  std::vector<int32_t> ids(size_t(n), -7);
  simt::launch(dim3(unsigned(n)), dim3(cuda::argmax_detail::kRowThreads), 0,
               [&] { cuda::argmax_detail::argmax_row_kernel(x.data(), ld, V, ids.data()); });
  return ids;
}

// As argmax_rows launches it with a workspace; S = 0 when the plan keeps the row kernel.
std::vector<int32_t> run_split(const std::vector<float>& x, int64_t n, int64_t V, int64_t ld, SplitWs& ws, int& S) {
  const auto p = cuda::argmax_detail::split_plan(n, V);
  S = p.S > 1 ? p.S : 0;
  std::vector<int32_t> ids(size_t(n), -7);
  if (!S) return ids;
  const bool vec = ld % 4 == 0 && (reinterpret_cast<uintptr_t>(x.data()) & 15u) == 0;
  simt::launch(dim3(unsigned(p.S), unsigned(n)), dim3(cuda::argmax_detail::kSplitThreads), 0, [&] {
    cuda::argmax_detail::argmax_split_kernel(x.data(), ld, V, p.chunk, vec, &ws, ids.data());
  });
  return ids;
}

bool counters_zero(const SplitWs& ws) {
  for (unsigned c : ws.counters)
    if (c != 0) return false;
  return true;
}

TEST(EmuArgmax, SplitPlanCoversTheRow) {
  // Every chunk non-empty, a multiple of 4, the chunks covering [0, V), within the workspace.
  for (int64_t V : {1, 4, 4095, 4096, 4097, 8191, 12256, 163840, 163843}) {
    for (int64_t n : {1, 2, 7, 64, 128, 129}) {
      const auto p = cuda::argmax_detail::split_plan(n, V);
      if (p.S <= 1) continue;
      EXPECT_LE(n, cuda::argmax_detail::kSplitMaxRows);
      EXPECT_LE(n * p.S, cuda::argmax_detail::kSplitMaxCtas);
      EXPECT_EQ(p.chunk % 4, 0);
      EXPECT_LT(int64_t(p.S - 1) * p.chunk, V) << "an empty last chunk at V = " << V << ", n = " << n;
      EXPECT_GE(int64_t(p.S) * p.chunk, V);
    }
  }
  EXPECT_EQ(cuda::argmax_detail::split_plan(1, 163840).S, 40);  // the mini's vocabulary: one load round a CTA
  EXPECT_EQ(cuda::argmax_detail::split_plan(129, 163840).S, 1);
  EXPECT_EQ(cuda::argmax_detail::split_plan(1, 4096).S, 1);
}

struct Shape {
  int64_t n, V, ld;
};

TEST(EmuArgmax, BothKernelsMatchTheContract) {
  Rng rng(20261204);
  SplitWs ws{};
  std::memset(&ws, 0, sizeof ws);
  const Shape shapes[] = {{1, 1, 1},        {1, 3, 3},         {2, 4097, 4097},  {1, 8193, 8196}, {3, 8195, 8197},
                          {1, 12256, 12256}, {1, 163840, 163840}, {2, 20001, 20004}, {128, 4100, 4100},
                          {5, 16384, 16385}};
  const Fill fills[] = {Fill::random, Fill::ties, Fill::nan_some, Fill::nan_all, Fill::neg_inf, Fill::pos_inf_twice,
                        Fill::constant};
  int split_runs = 0;
  for (const Shape& s : shapes) {
    for (Fill f : fills) {
      // Emulation time: the large shapes with two fills only, the 128 rows with one.
      if (s.n * s.V > 100'000 && f != Fill::ties && (f != Fill::nan_some || s.n > 100)) continue;
      const auto x = make_rows(s.n, s.V, s.ld, f, rng);
      const std::string what = "n " + std::to_string(s.n) + " V " + std::to_string(s.V) + " ld " +
                               std::to_string(s.ld) + " fill " + std::to_string(int(f));
      std::vector<int32_t> want(size_t(s.n));
      for (int64_t r = 0; r < s.n; ++r) want[size_t(r)] = contract_argmax(x.data() + r * s.ld, s.V);
      EXPECT_EQ(run_row(x, s.n, s.V, s.ld), want) << "row kernel, " << what;
      int S = 0;
      const auto got = run_split(x, s.n, s.V, s.ld, ws, S);
      if (S) {
        ++split_runs;
        EXPECT_EQ(got, want) << "split kernel (S = " << S << "), " << what;
        EXPECT_TRUE(counters_zero(ws)) << "split kernel left a counter set, " << what;
      }
    }
  }
  EXPECT_EQ(split_runs, 45);  // the split shapes above did take the split kernel
}

TEST(EmuArgmax, SplitCountsEveryChunk) {
  // The winner in each chunk in turn (and nowhere else): a chunk the last CTA failed to read would lose it.
  Rng rng(7);
  SplitWs ws{};
  std::memset(&ws, 0, sizeof ws);
  const int64_t V = 5 * 4096 + 2, n = 2;
  const auto p = cuda::argmax_detail::split_plan(n, V);
  ASSERT_GT(p.S, 2);
  for (int s = 0; s < p.S; ++s) {
    auto x = make_rows(n, V, V, Fill::random, rng);
    const int64_t at = std::min<int64_t>(V - 1, int64_t(s) * p.chunk + p.chunk / 2);
    x[size_t(at)] = 100.0f;                  // row 0
    x[size_t(V + int64_t(s) * p.chunk)] = 50.0f;  // row 1: the chunk's first logit
    int S = 0;
    const auto got = run_split(x, n, V, V, ws, S);
    ASSERT_EQ(S, p.S);
    EXPECT_EQ(got[0], int32_t(at)) << "chunk " << s;
    EXPECT_EQ(got[1], int32_t(int64_t(s) * p.chunk)) << "chunk " << s;
    EXPECT_TRUE(counters_zero(ws));
  }
}

}  // namespace
}  // namespace kestrel
