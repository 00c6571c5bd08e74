// BF16 GEMM with FP32 accumulation (Lin of MODEL.md §3).
//
// T == 1 (decode): a GEMV reads each W row once as bf16, widening to f32 in registers; rows are split
// over OpenMP threads. The AVX2/FMA kernel is compiled with a target attribute and chosen at run time,
// so the binary still runs on CPUs without AVX2 (portable kernel: 8 independent lanes the compiler
// can vectorise at the baseline ISA).
// T > 1 (prefill): W is widened to f32 in row blocks of ~1 M elements per thread (bounded scratch
// even for the 163840 × 7168 lm_head) and multiplied with single-threaded OpenBLAS sgemm, blocks
// spread over the OpenMP team; far faster than anything hand-written here, FP32 accumulation.
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::cpu {
namespace {

std::atomic<bool> g_force_portable{false};

bool have_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

float dot_portable(const uint16_t* w /* bf16 [n] */, const float* x /* f32 [n] */, int64_t n) {
  float lane[8] = {};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int j = 0; j < 8; ++j) lane[j] += bf16_to_f32(w[c + j]) * x[c + j];
  float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; c < n; ++c) s += bf16_to_f32(w[c]) * x[c];
  return s;
}

// bf16 -> f32 is a 16-bit left shift of the bit pattern.
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p /* bf16 [8] */) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma"))) float dot_avx2(const uint16_t* w /* bf16 [n] */, const float* x /* f32 [n] */,
                                                    int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    a0 = _mm256_fmadd_ps(load8(w + c), _mm256_loadu_ps(x + c), a0);
    a1 = _mm256_fmadd_ps(load8(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + c + 16), _mm256_loadu_ps(x + c + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + c + 24), _mm256_loadu_ps(x + c + 24), a3);
  }
  for (; c + 8 <= n; c += 8) a0 = _mm256_fmadd_ps(load8(w + c), _mm256_loadu_ps(x + c), a0);
  const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; c < n; ++c) s += bf16_to_f32(w[c]) * x[c];
  return s;
}

void gemv(const uint16_t* x /* bf16 [in] */, const uint16_t* w /* bf16 [out, in] */, float* y /* f32 [out] */,
          int64_t in, int64_t out) {
  std::vector<float> xf(static_cast<size_t>(in));
  bf16_to_f32_n(x, xf.data(), in);
  const bool avx = have_avx2_fma() && !g_force_portable.load(std::memory_order_relaxed);
  // Tiny products are not worth waking the thread team.
  const bool par = out * in >= kParallelMinWork;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t r = 0; r < out; ++r)
    y[r] = avx ? dot_avx2(w + r * in, xf.data(), in) : dot_portable(w + r * in, xf.data(), in);
}

void gemm_blas(const uint16_t* x /* bf16 [T, in] */, int64_t ldx, const uint16_t* w /* bf16 [out, in] */,
               float* y /* f32 [T, out] */, int64_t ldy, int64_t T, int64_t in, int64_t out) {
  // OpenBLAS runs single-threaded inside our OpenMP team: its own pthread pool and the OpenMP team
  // would otherwise spin against each other on the same cores (measured: 10x slower on 2 cores).
  static const bool single = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)single;
  std::vector<float> xf(static_cast<size_t>(T * in));
  for (int64_t t = 0; t < T; ++t) bf16_to_f32_n(x + t * ldx, xf.data() + t * in, in);
  // Each thread widens and multiplies its own W row blocks (~1 M elements of scratch per thread).
  const int64_t block = std::min(out, std::max<int64_t>((int64_t(1) << 20) / in, 16));
  const int64_t nblocks = (out + block - 1) / block;
  const bool par = nblocks > 1 && T * in * out >= kParallelMinWork;
#pragma omp parallel if (par)
  {
    std::vector<float> wf(static_cast<size_t>(block * in));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t r0 = b * block, nb = std::min(block, out - r0);
      for (int64_t i = 0; i < nb * in; ++i) wf[size_t(i)] = bf16_to_f32(w[r0 * in + i]);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(T), int(nb), int(in), 1.0f, xf.data(), int(in),
                  wf.data(), int(in), 0.0f, y + r0, int(ldy));
    }
  }
}

void check_args(int64_t ldx, int64_t ldy, int64_t T, int64_t in, int64_t out) {
  KCHECK(T >= 0 && in > 0 && out > 0, "bad gemm shape T={} in={} out={}", T, in, out);
  KCHECK(ldx >= in && ldy >= out, "bad gemm strides ldx={} (in {}) ldy={} (out {})", ldx, in, ldy, out);
  KCHECK(T < (int64_t(1) << 31) && in < (int64_t(1) << 31) && out < (int64_t(1) << 31), "gemm too large for BLAS");
}

}  // namespace

namespace {
thread_local bool t_row_invariant = false;
}
RowInvariantScope::RowInvariantScope(bool on) : prev_(t_row_invariant) { t_row_invariant = on; }
RowInvariantScope::~RowInvariantScope() { t_row_invariant = prev_; }

const char* gemv_isa() { return have_avx2_fma() && !g_force_portable ? "avx2-fma" : "portable"; }
void gemv_force_portable(bool on) { g_force_portable = on; }

void bf16_to_f32_n(const uint16_t* x, float* y, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(x[i]);
}

void f32_to_bf16_n(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = f32_to_bf16(x[i]);
}

void gemm_bf16_f32(const uint16_t* x, int64_t ldx, const uint16_t* w, float* y, int64_t ldy, int64_t T, int64_t in,
                   int64_t out) {
  check_args(ldx, ldy, T, in, out);
  if (T == 0) return;
  if (T == 1)
    gemv(x, w, y, in, out);
  else if (t_row_invariant)
    for (int64_t t = 0; t < T; ++t) gemv(x + t * ldx, w, y + t * ldy, in, out);
  else
    gemm_blas(x, ldx, w, y, ldy, T, in, out);
}

void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t ldy, int64_t T, int64_t in,
               int64_t out) {
  check_args(ldx, ldy, T, in, out);
  std::vector<float> yf(size_t(T * out));
  gemm_bf16_f32(x, ldx, w, yf.data(), out, T, in, out);
  for (int64_t t = 0; t < T; ++t) f32_to_bf16_n(yf.data() + t * out, y + t * ldy, out);
}

}  // namespace kestrel::cpu
