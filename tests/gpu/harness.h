// The GPU op-test harness: every op runs over a shape table (nano and the real per-rank `mini` shapes
// of MODEL.md Appendix A) on the GPU and is compared with its CPU twin from src/kernels/cpu (or the
// model code that owns it), never with a second CPU implementation written here.
//
// Rules every test follows: fresh random inputs per case (never zeros); every output buffer is
// poisoned with NaN bit patterns before the launch, so an element the kernel did not write shows up
// as non-finite and fails; each comparison states its tolerance as |got − ref| ≤ atol + rtol·|ref| per
// element plus a bound on the relative L2 error ‖got − ref‖/‖ref‖. Each case adds one line to the
// summary table printed at the end (op, shape, max abs error, relative L2, tolerance, verdict).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../test_rng.h"
#include "core/dtype.h"
#include "kernels/cuda/device_buffer.h"

namespace kestrel::gputest {

// One BF16 unit in the last place at 1.0 (8 significant bits): the tolerances below are written in it.
constexpr double kBf16Ulp = 1.0 / 128;

// The first line of every GPU test: fail (not skip) off the GPU machine, so a missing device is never a pass.
inline void need_gpu() { ASSERT_GT(cuda::device_count(), 0) << "no CUDA device: run this binary on the GPU machine"; }

using testutil::Rng;  // tests/test_rng.h

inline std::vector<uint16_t> rand_bf16(size_t n, Rng& r, float lo, float hi) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(r.uniform(lo, hi));
  return v;
}
inline std::vector<float> rand_f32(size_t n, Rng& r, float lo, float hi) {
  std::vector<float> v(n);
  for (auto& x : v) x = r.uniform(lo, hi);
  return v;
}
inline std::vector<uint8_t> rand_u8(size_t n, Rng& r, unsigned lo, unsigned hi) {
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = uint8_t(lo + r.next() % (hi - lo + 1));
  return v;
}
inline std::vector<float> to_f32(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_f32(b[i]);
  return f;
}

// A device copy of a host vector; `poisoned` gives a buffer of n elements filled with NaN bytes.
template <typename T>
struct Dev {
  cuda::DeviceBuffer buf;
  size_t n = 0;
  T* p() const { return static_cast<T*>(buf.data()); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    buf.copy_to_host(h.data(), n * sizeof(T));
    return h;
  }
};
template <typename T>
Dev<T> upload(const std::vector<T>& h) {
  Dev<T> d{cuda::DeviceBuffer(std::max<size_t>(h.size(), 1) * sizeof(T)), h.size()};
  if (!h.empty()) d.buf.copy_from_host(h.data(), h.size() * sizeof(T));
  return d;
}
// 0xFF bytes: NaN as bf16 and f32, −1 as i32.
template <typename T>
Dev<T> poisoned(size_t n) {
  std::vector<uint8_t> junk(std::max<size_t>(n, 1) * sizeof(T), 0xFF);
  Dev<T> d{cuda::DeviceBuffer(junk.size()), n};
  d.buf.copy_from_host(junk.data(), junk.size());
  return d;
}

struct Tol {
  double atol, rtol, rel_l2;
  std::string str() const;
};

struct Stats {
  double max_abs = 0, max_ref = 0, rel_l2 = 0;
  int64_t bad = 0, nonfinite = 0, first_bad = -1;
};

// Compares got with ref element by element; a non-finite got where ref is finite counts as
// unwritten. Records a summary row and fails the current test if the tolerance is exceeded.
Stats check(const std::string& op, const std::string& shape, const float* got, const float* ref, size_t n,
            const Tol& tol);
Stats check_bf16(const std::string& op, const std::string& shape, const std::vector<uint16_t>& got,
                 const std::vector<uint16_t>& ref, const Tol& tol);
// Bit-exact comparison (copies, ids, untouched state); records a row with max abs error 0 on success.
void check_exact(const std::string& op, const std::string& shape, const void* got, const void* ref, size_t bytes);
// A free-form line (timings) for the summary.
void note(const std::string& line);
// The checkpoint directories of KESTREL_GPU_CKPTS (colon-separated; bench/gpu/run.sh sets it), in order;
// empty when it is unset.
std::vector<std::string> gpu_ckpt_dirs();

void sync();  // cudaDeviceSynchronize + last-error check

// ‖a − b‖₂ / ‖b‖₂ over n values (in double).
double rel_l2(const float* a, const float* b, int64_t n);
// Top-2 gap of a logits row relative to its max |logit| (how near a tie its argmax is).
double rel_gap(const float* x, int64_t V);

}  // namespace kestrel::gputest
