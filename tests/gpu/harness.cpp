#include "harness.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>

#include "kernels/cuda/cuda_check.h"

namespace kestrel::gputest {
namespace {

std::vector<std::string>& rows() {
  static std::vector<std::string> r;
  return r;
}

class SummaryEnv : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("\n==== GPU op harness summary (GPU vs CPU twin) ====\n");
    std::printf("%-28s %-34s %-11s %-11s %-38s %s\n", "op", "shape", "max|err|", "rel L2", "tolerance", "result");
    for (const auto& r : rows()) std::printf("%s\n", r.c_str());
  }
};
[[maybe_unused]] ::testing::Environment* const g_env = ::testing::AddGlobalTestEnvironment(new SummaryEnv);

void add_row(const std::string& op, const std::string& shape, double max_abs, double rel_l2, const std::string& tol,
             bool ok) {
  rows().push_back(fmt::format("{:<28} {:<34} {:<11.3e} {:<11.3e} {:<38} {}", op, shape, max_abs, rel_l2, tol,
                               ok ? "PASS" : "FAIL"));
}

}  // namespace

std::string Tol::str() const { return fmt::format("atol {:.1e} rtol {:.1e} L2 {:.0e}", atol, rtol, rel_l2); }

Stats check(const std::string& op, const std::string& shape, const float* got, const float* ref, size_t n,
            const Tol& tol) {
  Stats s;
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double r = ref[i], g = got[i];
    s.max_ref = std::max(s.max_ref, std::fabs(r));
    if (!std::isfinite(g) && std::isfinite(r)) {
      if (s.nonfinite++ == 0 && s.first_bad < 0) s.first_bad = int64_t(i);
      continue;
    }
    const double d = std::fabs(g - r);
    num += d * d;
    den += r * r;
    s.max_abs = std::max(s.max_abs, d);
    if (d > tol.atol + tol.rtol * std::fabs(r)) {
      if (s.bad++ == 0 && s.first_bad < 0) s.first_bad = int64_t(i);
    }
  }
  s.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const bool ok = s.nonfinite == 0 && s.bad == 0 && s.rel_l2 <= tol.rel_l2;
  add_row(op, shape, s.max_abs, s.rel_l2, tol.str(), ok);
  EXPECT_TRUE(ok) << op << " " << shape << ": " << s.nonfinite << " unwritten/non-finite, " << s.bad
                  << " beyond tolerance (first at " << s.first_bad << ": got " << (s.first_bad >= 0 ? got[s.first_bad] : 0)
                  << " want " << (s.first_bad >= 0 ? ref[s.first_bad] : 0) << "), max abs " << s.max_abs
                  << ", rel L2 " << s.rel_l2 << " (" << tol.str() << ")";
  return s;
}

Stats check_bf16(const std::string& op, const std::string& shape, const std::vector<uint16_t>& got,
                 const std::vector<uint16_t>& ref, const Tol& tol) {
  EXPECT_EQ(got.size(), ref.size());
  const std::vector<float> g = to_f32(got), r = to_f32(ref);
  return check(op, shape, g.data(), r.data(), std::min(g.size(), r.size()), tol);
}

void check_exact(const std::string& op, const std::string& shape, const void* got, const void* ref, size_t bytes) {
  const bool ok = std::memcmp(got, ref, bytes) == 0;
  add_row(op, shape, 0.0, 0.0, "bit-exact", ok);
  // On a mismatch: how many bytes differ and the first 4-byte word that does (as hex), so that one failed run
  // tells an offset or a stale region from rounding.
  size_t diff = 0, first = bytes;
  const auto* g = static_cast<const uint8_t*>(got);
  const auto* r = static_cast<const uint8_t*>(ref);
  for (size_t i = 0; !ok && i < bytes; ++i)
    if (g[i] != r[i]) ++diff, first = std::min(first, i);
  uint32_t gw = 0, rw = 0;
  const size_t w0 = first / 4 * 4;
  if (!ok) std::memcpy(&gw, g + w0, std::min<size_t>(4, bytes - w0)), std::memcpy(&rw, r + w0, std::min<size_t>(4, bytes - w0));
  EXPECT_TRUE(ok) << op << " " << shape << ": not bit-identical to the CPU twin (" << diff << " of " << bytes
                  << " bytes differ; first at byte " << first << ": word got 0x" << std::hex << gw << " want 0x" << rw
                  << std::dec << ")";
}

void note(const std::string& line) { rows().push_back(line); }

std::vector<std::string> gpu_ckpt_dirs() {
  std::vector<std::string> out;
  const char* e = std::getenv("KESTREL_GPU_CKPTS");
  std::stringstream ss(e ? e : "");
  std::string d;
  while (std::getline(ss, d, ':'))
    if (!d.empty()) out.push_back(d);
  return out;
}

void sync() {
  KCUDA_CHECK(cudaGetLastError());
  KCUDA_CHECK(cudaDeviceSynchronize());
}

double rel_l2(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, 1e-30));
}

double rel_gap(const float* x, int64_t V) {
  std::vector<float> v(x, x + V);
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
  double scale = 0;
  for (int64_t i = 0; i < V; ++i) scale = std::max(scale, double(std::fabs(x[i])));
  return double(v[0] - v[1]) / scale;
}

}  // namespace kestrel::gputest
