// See kda_scan.h for the math. Scratch for one chunk lives in thread-local vectors so a parallel
// loop over heads allocates once per thread, not once per chunk.
#include "kernels/cpu/kda_scan.h"

#include <cmath>
#include <vector>

#include "core/check.h"

namespace kestrel::cpu {

void kda_scan_recurrent(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S) {
  thread_local std::vector<float> u;
  u.resize(size_t(Dk));
  for (int64_t t = 0; t < T; ++t) {
    const float* q = io.q + t * io.ld;
    const float* k = io.k + t * io.ld;
    const float* v = io.v + t * io.ld;
    const float* g = io.g + t * io.ld;
    const float beta = io.beta[t * io.ld_beta];
    float* o = io.o + t * io.ld;
    for (int64_t i = 0; i < Dk; ++i) {
      const float d = std::exp(g[i]);
      for (int64_t j = 0; j < Dk; ++j) S[i * Dk + j] *= d;
    }
    for (int64_t j = 0; j < Dk; ++j) u[size_t(j)] = 0.0f;
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dk; ++j) u[size_t(j)] += S[i * Dk + j] * k[i];
    for (int64_t j = 0; j < Dk; ++j) u[size_t(j)] = beta * (v[j] - u[size_t(j)]);
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dk; ++j) S[i * Dk + j] += k[i] * u[size_t(j)];
    for (int64_t j = 0; j < Dk; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dk; ++j) o[j] += S[i * Dk + j] * q[i];
  }
}

void kda_scan_chunked(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S, int64_t chunk) {
  KCHECK(chunk > 0, "chunk size {} must be positive", chunk);
  thread_local std::vector<double> G;    // f64 [C, Dk] cumulative log-decay
  thread_local std::vector<float> kt;    // f32 [C, Dk] e^{G_t} ⊙ k_t
  thread_local std::vector<float> qt;    // f32 [C, Dk] e^{G_t} ⊙ q_t
  thread_local std::vector<float> A;     // f32 [C, C]  A_ts (s < t)
  thread_local std::vector<float> QK;    // f32 [C, C]  q-k interaction (s <= t)
  thread_local std::vector<float> U;     // f32 [C, Dk] u_t
  thread_local std::vector<float> decay; // f32 [Dk]    scratch e^{G_t − G_s}
  const int64_t C = chunk;
  G.resize(size_t(C * Dk));
  kt.resize(size_t(C * Dk));
  qt.resize(size_t(C * Dk));
  A.resize(size_t(C * C));
  QK.resize(size_t(C * C));
  U.resize(size_t(C * Dk));
  decay.resize(size_t(Dk));

  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t n = std::min(C, T - t0);
    auto row = [&](const float* base, int64_t t) { return base + (t0 + t) * io.ld; };
    for (int64_t t = 0; t < n; ++t) {
      const float* g = row(io.g, t);
      const float* k = row(io.k, t);
      const float* q = row(io.q, t);
      for (int64_t i = 0; i < Dk; ++i) {
        const double prev = t ? G[size_t((t - 1) * Dk + i)] : 0.0;
        const double Gi = prev + double(g[i]);
        G[size_t(t * Dk + i)] = Gi;
        const float e = float(std::exp(Gi));
        kt[size_t(t * Dk + i)] = e * k[i];
        qt[size_t(t * Dk + i)] = e * q[i];
      }
    }
    // Pairwise interactions with the exact relative decay e^{G_t − G_s} (never > 1).
    for (int64_t t = 0; t < n; ++t) {
      const float* kt_row = row(io.k, t);
      const float* qt_row = row(io.q, t);
      for (int64_t s = 0; s <= t; ++s) {
        const float* ks = row(io.k, s);
        float a = 0.0f, qk = 0.0f;
        for (int64_t i = 0; i < Dk; ++i) {
          const float d = float(std::exp(G[size_t(t * Dk + i)] - G[size_t(s * Dk + i)]));
          a += kt_row[i] * ks[i] * d;
          qk += qt_row[i] * ks[i] * d;
        }
        A[size_t(t * C + s)] = a;
        QK[size_t(t * C + s)] = qk;
      }
    }
    // u_t = β_t (v_t − S₀ᵀ k̃_t − Σ_{s<t} A_ts u_s): forward substitution, one row at a time.
    for (int64_t t = 0; t < n; ++t) {
      const float* v = row(io.v, t);
      const float beta = io.beta[(t0 + t) * io.ld_beta];
      float* u = &U[size_t(t * Dk)];
      for (int64_t j = 0; j < Dk; ++j) u[j] = v[j];
      for (int64_t i = 0; i < Dk; ++i) {
        const float ki = kt[size_t(t * Dk + i)];
        for (int64_t j = 0; j < Dk; ++j) u[j] -= ki * S[i * Dk + j];
      }
      for (int64_t s = 0; s < t; ++s) {
        const float a = A[size_t(t * C + s)];
        const float* us = &U[size_t(s * Dk)];
        for (int64_t j = 0; j < Dk; ++j) u[j] -= a * us[j];
      }
      for (int64_t j = 0; j < Dk; ++j) u[j] *= beta;
    }
    // o_t = S₀ᵀ q̃_t + Σ_{s≤t} QK_ts u_s  (uses S₀, so before the state update).
    for (int64_t t = 0; t < n; ++t) {
      float* o = io.o + (t0 + t) * io.ld;
      for (int64_t j = 0; j < Dk; ++j) o[j] = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        const float qi = qt[size_t(t * Dk + i)];
        for (int64_t j = 0; j < Dk; ++j) o[j] += qi * S[i * Dk + j];
      }
      for (int64_t s = 0; s <= t; ++s) {
        const float w = QK[size_t(t * C + s)];
        const float* us = &U[size_t(s * Dk)];
        for (int64_t j = 0; j < Dk; ++j) o[j] += w * us[j];
      }
    }
    // S_end = e^{G_C} ⊙ S₀ + Σ_s (e^{G_C − G_s} ⊙ k_s) u_sᵀ.
    const double* Gend = &G[size_t((n - 1) * Dk)];
    for (int64_t i = 0; i < Dk; ++i) {
      const float e = float(std::exp(Gend[i]));
      for (int64_t j = 0; j < Dk; ++j) S[i * Dk + j] *= e;
    }
    for (int64_t s = 0; s < n; ++s) {
      const float* ks = row(io.k, s);
      for (int64_t i = 0; i < Dk; ++i) decay[size_t(i)] = float(std::exp(Gend[i] - G[size_t(s * Dk + i)])) * ks[i];
      const float* us = &U[size_t(s * Dk)];
      for (int64_t i = 0; i < Dk; ++i) {
        const float ki = decay[size_t(i)];
        for (int64_t j = 0; j < Dk; ++j) S[i * Dk + j] += ki * us[j];
      }
    }
  }
}

}  // namespace kestrel::cpu
