// The KDA delta-rule scan of one head (MODEL.md §3.3 step 6), in two forms that compute the same
// thing: the token-by-token recurrence (decode, and the oracle) and the chunked WY/UT form (prefill).
//
//   per token t:  S ← diag(exp(g_t)) S;  u_t = β_t (v_t − Sᵀ k_t);  S ← S + k_t u_tᵀ;  o_t = Sᵀ q_t
//
// Chunked form, for a chunk starting from state S₀ with G_t = Σ_{s≤t} g_s (cumulative log-decay inside
// the chunk, per key channel):
//   A_ts  = Σ_i k_t[i] k_s[i] e^{G_t[i]−G_s[i]}          (s < t)
//   u_t   = β_t (v_t − S₀ᵀ(e^{G_t} ⊙ k_t) − Σ_{s<t} A_ts u_s)   (unit-lower-triangular solve)
//   o_t   = S₀ᵀ(e^{G_t} ⊙ q_t) + Σ_{s≤t} (Σ_i q_t[i] k_s[i] e^{G_t[i]−G_s[i]}) u_s
//   S_end = e^{G_C} ⊙ S₀ + Σ_s (e^{G_C−G_s} ⊙ k_s) u_sᵀ
// Only differences G_t − G_s with s ≤ t are exponentiated, so every factor is ≤ 1 and nothing can
// overflow however strong the decay (g ≥ −5 per token, so G reaches −320 over a 64-token chunk).
// G is accumulated in f64; the rest is f32.
#pragma once

#include <cstdint>

namespace kestrel::cpu {

struct KdaHeadIo {
  const float* q;     // f32 [T, Dk] row stride ld: L2-normalised, scaled by Dk^-1/2
  const float* k;     // f32 [T, Dk] row stride ld: L2-normalised
  const float* v;     // f32 [T, Dk] row stride ld
  const float* g;     // f32 [T, Dk] row stride ld: log-decay per key channel, in (lower, 0)
  const float* beta;  // f32 [T] stride ld_beta
  int64_t ld = 0;
  int64_t ld_beta = 1;
  float* o;           // f32 [T, Dk] row stride ld: output
};

// S: f32 [Dk (key), Dk (value)], updated in place.
void kda_scan_recurrent(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S);
void kda_scan_chunked(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S, int64_t chunk = 64);
// The recurrence vectorised over the value index (kda_fast.cpp): the same sums over the key index in
// the same order, FMA-contracted, e^g from the vector exp; the twin above without AVX2.
void kda_scan_recurrent_fast(const KdaHeadIo& io, int64_t T, int64_t Dk, float* S);

}  // namespace kestrel::cpu
