// AVX2 versions of the KDA per-token ops (kda_ops.h) and of the recurrent delta-rule scan
// (kda_scan.h), the CPU engine's path for prefill and decode alike: the recurrence is token by token,
// so a chunked prefill and any batch give a token exactly the result it gets alone.
//
// The scan keeps S [Dk(key), Dk(value)] row-major and vectorises over the value index j, in two passes
// per token: (1) S_i ← e^{g_i}·S_i and u += S_i·k_i, (2) S_i += k_i·u and o += S_i·q_i (u = β(v − u) in
// between). Column chunks of 16 run all of a call's tokens (columns are independent), pass 2 of token
// t fused with pass 1 of token t+1 into one sweep over S (scan_cols), so u, o stay in registers and
// S is stored once per token. A token's result is the same whether it is scanned alone or in a run
// (tested bit for bit). The twins' sums over i run in the same order; they differ by FMA contraction
// and the vector exp (simd_avx2.h), a few ulps (tests/unit/test_kernels_cpu.cpp). Without AVX2 every
// function here calls its twin.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kda_ops.h"
#include "kernels/cpu/kda_scan.h"
#include "kernels/cpu/simd_avx2.h"

namespace kestrel::cpu {
namespace {

KESTREL_AVX2 float sum_sq(const float* x, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), a);
  float s = simd::reduce8(a);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

KESTREL_AVX2 void scale(float* x, float f, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(f)));
  for (; i < n; ++i) x[i] *= f;
}

// Token t's taps read rows t .. t+W−1 of [W−1 stored inputs, this call's T inputs] where they are
// (hist or x), and the last W−1 of those rows become the new history once at the end: shifting the
// history token by token was a memmove and a memcpy per token (issue #22). The same values in the
// same order, so the same bits.
KESTREL_AVX2 void conv_avx2(const uint16_t* x, int64_t ldx, const float* w, uint16_t* hist, float* y, int64_t ldy,
                            int64_t T, int64_t C, int64_t W) {
  std::vector<float> wt(size_t(W * C));  // f32 [W, C]: the taps transposed so channels are contiguous
  for (int64_t ch = 0; ch < C; ++ch)
    for (int64_t j = 0; j < W; ++j) wt[size_t(j * C + ch)] = w[ch * W + j];
  auto row = [&](int64_t src) { return src < W - 1 ? hist + src * C : x + (src - (W - 1)) * ldx; };  // bf16 [C]
  std::vector<const uint16_t*> tap(static_cast<size_t>(W));  // the W rows token t reads
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < W; ++j) tap[size_t(j)] = row(t + j);  // tap W−1 is token t itself
    float* dst = y + t * ldy;
    int64_t ch = 0;
    for (; ch + 8 <= C; ch += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < W; ++j) {
        const __m256 wj = _mm256_loadu_ps(&wt[size_t(j * C + ch)]);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(wj, simd::load_bf16(tap[size_t(j)] + ch)));
      }
      _mm256_storeu_ps(dst + ch, simd::round_bf16(_mm256_mul_ps(acc, simd::sigmoid(acc))));
    }
    for (; ch < C; ++ch) {
      float acc = 0.0f;
      for (int64_t j = 0; j < W; ++j) acc += w[ch * W + j] * bf16_to_f32(tap[size_t(j)][ch]);
      dst[ch] = round_bf16(silu(acc));
    }
  }
  if (W > 1 && T > 0) {  // the new history: rows T .. T+W−2 (some may still be old history rows)
    std::vector<uint16_t> next(size_t((W - 1) * C));  // bf16 [W−1, C]
    for (int64_t j = 0; j < W - 1; ++j) std::memcpy(next.data() + j * C, row(T + j), size_t(C) * 2);
    std::memcpy(hist, next.data(), next.size() * 2);
  }
}

KESTREL_AVX2 void gates_avx2(float* qf, float* kf, const uint16_t* z, const float* dt_bias, const float* a_log,
                             const uint16_t* bl, float lower, float* g, float* beta, int64_t T, int64_t H, int64_t Dk) {
  const int64_t HD = H * Dk;
  const float q_scale = 1.0f / std::sqrt(float(Dk));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* q = qf + t * HD + h * Dk;
      float* k = kf + t * HD + h * Dk;
      scale(q, q_scale / std::sqrt(sum_sq(q, Dk) + 1e-6f), Dk);
      scale(k, 1.0f / std::sqrt(sum_sq(k, Dk) + 1e-6f), Dk);
      const __m256 a = _mm256_set1_ps(std::exp(a_log[h])), lo = _mm256_set1_ps(lower);
      const int64_t o = t * HD + h * Dk;
      int64_t i = 0;
      for (; i + 8 <= Dk; i += 8) {
        const __m256 zi = _mm256_add_ps(simd::load_bf16(z + o + i), _mm256_loadu_ps(dt_bias + h * Dk + i));
        _mm256_storeu_ps(g + o + i, _mm256_mul_ps(lo, simd::sigmoid(_mm256_mul_ps(a, zi))));
      }
      for (; i < Dk; ++i) g[o + i] = lower * sigmoid(std::exp(a_log[h]) * (bf16_to_f32(z[o + i]) + dt_bias[h * Dk + i]));
      beta[t * H + h] = sigmoid(bf16_to_f32(bl[t * H + h]));
    }
}

KESTREL_AVX2 void out_norm_avx2(const float* o, const uint16_t* gate, const float* o_norm, float eps, uint16_t* ohat,
                                int64_t T, int64_t H, int64_t Dk) {
  const int64_t HD = H * Dk;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = t * HD + h * Dk;
      const float r = 1.0f / std::sqrt(sum_sq(o + off, Dk) / float(Dk) + eps);
      int64_t j = 0;
      for (; j + 8 <= Dk; j += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(o + off + j), _mm256_set1_ps(r)),
                                       _mm256_loadu_ps(o_norm + j));
        simd::store_bf16(ohat + off + j, _mm256_mul_ps(v, simd::sigmoid(simd::load_bf16(gate + off + j))));
      }
      for (; j < Dk; ++j)
        ohat[off + j] = f32_to_bf16(o[off + j] * r * o_norm[j] * sigmoid(bf16_to_f32(gate[off + j])));
    }
}

// Columns [j0, j0 + 8·NV) of S through all T tokens (value columns are independent in the
// recurrence, so a chunk can run every token before the next chunk starts). Pass 2 of token t and
// pass 1 of token t+1 share one sweep over the rows: S_i is loaded and stored once per token instead
// of twice (the stores, one 256-bit per cycle, had bound the two-sweep form). Per element the same
// ops in the same order: s = fma(k_t, u_t, S) and o += s·q_t, then s·e^{g_{t+1}} and u_{t+1} += s·k_{t+1}.
// d: f32 [T, Dk] = e^g of every token.
template <int NV>
KESTREL_AVX2 void scan_cols(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S, int64_t j0, const float* d) {
  __m256 u[NV];
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c) u[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < Dk; ++i) {  // pass 1 of token 0
    float* row = S + i * Dk + j0;
    const __m256 di = _mm256_set1_ps(d[i]), ki = _mm256_set1_ps(io.k[i]);
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * c), di);
      _mm256_storeu_ps(row + 8 * c, s);
      u[c] = _mm256_fmadd_ps(s, ki, u[c]);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    const float* k = io.k + t * io.ld;
    const float* q = io.q + t * io.ld;
    const float* v = io.v + t * io.ld;
    const __m256 b = _mm256_set1_ps(io.beta[t * io.ld_beta]);
    __m256 acc[NV], un[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      u[c] = _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(v + j0 + 8 * c), u[c]));
      acc[c] = un[c] = _mm256_setzero_ps();
    }
    if (t + 1 < T) {
      const float* kn = io.k + (t + 1) * io.ld;
      const float* dn = d + (t + 1) * Dk;
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = S + i * Dk + j0;
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
        const __m256 di = _mm256_set1_ps(dn[i]), kni = _mm256_set1_ps(kn[i]);
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) {
          __m256 s = _mm256_fmadd_ps(ki, u[c], _mm256_loadu_ps(row + 8 * c));
          acc[c] = _mm256_fmadd_ps(s, qi, acc[c]);
          s = _mm256_mul_ps(s, di);
          _mm256_storeu_ps(row + 8 * c, s);
          un[c] = _mm256_fmadd_ps(s, kni, un[c]);
        }
      }
    } else {  // the last token: pass 2 only
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = S + i * Dk + j0;
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) {
          const __m256 s = _mm256_fmadd_ps(ki, u[c], _mm256_loadu_ps(row + 8 * c));
          _mm256_storeu_ps(row + 8 * c, s);
          acc[c] = _mm256_fmadd_ps(s, qi, acc[c]);
        }
      }
    }
    float* o = io.o + t * io.ld;
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      _mm256_storeu_ps(o + j0 + 8 * c, acc[c]);
      u[c] = un[c];
    }
  }
}

KESTREL_AVX2 void scan_avx2(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S) {
  thread_local std::vector<float> dv;  // f32 [T, Dk]: e^g per token, as the per-token form computed it
  dv.resize(size_t(T * Dk));
  float* d = dv.data();
  for (int64_t t = 0; t < T; ++t) {
    const float* g = io.g + t * io.ld;
    int64_t i = 0;
    for (; i + 8 <= Dk; i += 8) _mm256_storeu_ps(d + t * Dk + i, simd::exp(_mm256_loadu_ps(g + i)));
    for (; i < Dk; ++i) d[t * Dk + i] = std::exp(g[i]);
  }
  // Chunks of 16 columns: u, o and u_{t+1} (6 registers) and four broadcasts fit in the 16 registers.
  int64_t j = 0;
  for (; j + 16 <= Dk; j += 16) scan_cols<2>(io, T, Dk, S, j, d);
  for (; j + 8 <= Dk; j += 8) scan_cols<1>(io, T, Dk, S, j, d);
  for (int64_t jj = j; jj < Dk; ++jj)  // value columns past the last multiple of 8, scalar, token by token
    for (int64_t t = 0; t < T; ++t) {
      const float* k = io.k + t * io.ld;
      const float* q = io.q + t * io.ld;
      const float* dt = d + t * Dk;
      const float beta = io.beta[t * io.ld_beta];
      float u = 0.0f;
      for (int64_t r = 0; r < Dk; ++r) u += (S[r * Dk + jj] *= dt[r]) * k[r];
      u = beta * (io.v[t * io.ld + jj] - u);
      float acc = 0.0f;
      for (int64_t r = 0; r < Dk; ++r) acc += (S[r * Dk + jj] += k[r] * u) * q[r];
      io.o[t * io.ld + jj] = acc;
    }
}

}  // namespace

void kda_conv_silu_fast(const uint16_t* x, int64_t ldx, const float* w, uint16_t* hist, float* y, int64_t ldy,
                        int64_t T, int64_t C, int64_t W) {
  KCHECK(W >= 1 && C > 0 && T >= 0 && ldx >= C && ldy >= C, "bad KDA conv shape T={} C={} W={}", T, C, W);
  if (isa() < Isa::avx2) return kda_conv_silu(x, ldx, w, hist, y, ldy, T, C, W);
  conv_avx2(x, ldx, w, hist, y, ldy, T, C, W);
}

void kda_qk_norm_gates_fast(float* q, float* k, const uint16_t* z, const float* dt_bias, const float* a_log,
                            const uint16_t* b, float lower, float* g, float* beta, int64_t T, int64_t H, int64_t Dk) {
  if (isa() < Isa::avx2) return kda_qk_norm_gates(q, k, z, dt_bias, a_log, b, lower, g, beta, T, H, Dk);
  gates_avx2(q, k, z, dt_bias, a_log, b, lower, g, beta, T, H, Dk);
}

void kda_out_norm_gate_fast(const float* o, const uint16_t* gate, const float* o_norm, float eps, uint16_t* ohat,
                            int64_t T, int64_t H, int64_t Dk) {
  if (isa() < Isa::avx2) return kda_out_norm_gate(o, gate, o_norm, eps, ohat, T, H, Dk);
  out_norm_avx2(o, gate, o_norm, eps, ohat, T, H, Dk);
}

void kda_scan_recurrent_fast(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S) {
  if (isa() < Isa::avx2) return kda_scan_recurrent(io, T, Dk, S);
  scan_avx2(io, T, Dk, S);
}

}  // namespace kestrel::cpu
