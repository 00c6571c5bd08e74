// The KDA scan (MODEL.md §3.3 step 6): the chunked WY/UT form and the recurrent form against an f64
// recurrent oracle written here, over lengths around the chunk size, with a non-zero initial state
// (prefill continuation) and with extreme decay; then the whole KDA layer in both forms.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/kda_scan.h"
#include "model/kda.h"
#include "nano_model.h"

namespace kestrel {
namespace {

struct ScanInputs {
  int64_t T, Dk;
  std::vector<float> q, k, v, g, beta, S0;
};

ScanInputs random_inputs(int64_t T, int64_t Dk, uint64_t seed, float g_lo, float g_hi) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ug(g_lo, g_hi), ub(0.05f, 0.95f);
  ScanInputs in{T, Dk, {}, {}, {}, {}, {}, {}};
  auto unit_rows = [&](std::vector<float>& x, float scale) {
    x.resize(size_t(T * Dk));
    for (int64_t t = 0; t < T; ++t) {
      double n = 0;
      for (int64_t i = 0; i < Dk; ++i) n += double(x[size_t(t * Dk + i)] = nd(rng)) * x[size_t(t * Dk + i)];
      for (int64_t i = 0; i < Dk; ++i) x[size_t(t * Dk + i)] *= float(scale / std::sqrt(n));
    }
  };
  unit_rows(in.q, 1.0f / std::sqrt(float(Dk)));
  unit_rows(in.k, 1.0f);
  in.v.resize(size_t(T * Dk));
  for (auto& x : in.v) x = nd(rng);
  in.g.resize(size_t(T * Dk));
  for (auto& x : in.g) x = ug(rng);
  in.beta.resize(size_t(T));
  for (auto& x : in.beta) x = ub(rng);
  in.S0.resize(size_t(Dk * Dk));
  for (auto& x : in.S0) x = 0.3f * nd(rng);
  return in;
}

// f64 oracle: the spec's recurrence, literally.
void oracle(const ScanInputs& in, std::vector<double>& o, std::vector<double>& S) {
  const int64_t T = in.T, Dk = in.Dk;
  S.assign(in.S0.begin(), in.S0.end());
  o.assign(size_t(T * Dk), 0.0);
  std::vector<double> u(static_cast<size_t>(Dk));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dk; ++j) S[size_t(i * Dk + j)] *= std::exp(double(in.g[size_t(t * Dk + i)]));
    for (int64_t j = 0; j < Dk; ++j) {
      double sk = 0;
      for (int64_t i = 0; i < Dk; ++i) sk += S[size_t(i * Dk + j)] * in.k[size_t(t * Dk + i)];
      u[size_t(j)] = in.beta[size_t(t)] * (in.v[size_t(t * Dk + j)] - sk);
    }
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dk; ++j) S[size_t(i * Dk + j)] += in.k[size_t(t * Dk + i)] * u[size_t(j)];
    for (int64_t j = 0; j < Dk; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < Dk; ++i) acc += S[size_t(i * Dk + j)] * in.q[size_t(t * Dk + i)];
      o[size_t(t * Dk + j)] = acc;
    }
  }
}

double rel_l2(const std::vector<float>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

struct ScanResult {
  std::vector<float> o, S;
};

ScanResult run(const ScanInputs& in, bool chunked, int64_t chunk = 64) {
  ScanResult r{std::vector<float>(size_t(in.T * in.Dk), std::nanf("")), in.S0};
  const cpu::KdaHeadIo io{in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.Dk, 1, r.o.data()};
  if (chunked)
    cpu::kda_scan_chunked(io, in.T, in.Dk, r.S.data(), chunk);
  else
    cpu::kda_scan_recurrent(io, in.T, in.Dk, r.S.data());
  return r;
}

TEST(KdaScan, BothFormsMatchF64OracleAcrossChunkBoundaries) {
  // Measured: at most 3.7e-7 relative L2 against the f64 oracle over this table (outputs and final
  // states, both forms); the bound 5e-5 leaves two orders of magnitude for other compilers/CPUs.
  constexpr double kTol = 5e-5;
  for (int64_t Dk : {32, 128}) {
    for (int64_t T : {1, 5, 63, 64, 65, 150, 300}) {
      const ScanInputs in = random_inputs(T, Dk, uint64_t(T * 131 + Dk), -5.0f, 0.0f);
      std::vector<double> o_ref, S_ref;
      oracle(in, o_ref, S_ref);
      for (bool chunked : {false, true}) {
        const ScanResult r = run(in, chunked);
        const double eo = rel_l2(r.o, o_ref), es = rel_l2(r.S, S_ref);
        EXPECT_LT(eo, kTol) << (chunked ? "chunked" : "recurrent") << " T=" << T << " Dk=" << Dk;
        EXPECT_LT(es, kTol) << (chunked ? "chunked" : "recurrent") << " state T=" << T << " Dk=" << Dk;
      }
    }
  }
}

TEST(KdaScan, ExtremeAndWeakDecayStayFinite) {
  // g at the lower bound for a whole chunk gives G = −320: the chunked form must only ever
  // exponentiate differences G_t − G_s <= 0. Weak decay (g ≈ 0) keeps the state large.
  for (auto [lo, hi] : {std::pair{-5.0f, -4.999f}, std::pair{-1e-4f, 0.0f}}) {
    const ScanInputs in = random_inputs(200, 32, 9, lo, hi);
    std::vector<double> o_ref, S_ref;
    oracle(in, o_ref, S_ref);
    const ScanResult r = run(in, true);
    for (float x : r.o) ASSERT_TRUE(std::isfinite(x));
    EXPECT_LT(rel_l2(r.o, o_ref), 5e-5) << "g in [" << lo << ", " << hi << "]";
    EXPECT_LT(rel_l2(r.S, S_ref), 5e-5);
  }
}

TEST(KdaScan, ChunkSizeDoesNotChangeTheResult) {
  const ScanInputs in = random_inputs(100, 32, 4, -3.0f, -0.01f);
  std::vector<double> o_ref, S_ref;
  oracle(in, o_ref, S_ref);
  for (int64_t chunk : {1, 7, 16, 64, 128}) {
    const ScanResult r = run(in, true, chunk);
    EXPECT_LT(rel_l2(r.o, o_ref), 5e-5) << "chunk " << chunk;
    EXPECT_LT(rel_l2(r.S, S_ref), 5e-5) << "chunk " << chunk;
  }
}

TEST(KdaScan, SplitPrefillContinuesFromState) {
  // Chunked prefill of 70 then of 60 more tokens (state carried) equals one recurrent pass of 130.
  const ScanInputs in = random_inputs(130, 32, 21, -5.0f, 0.0f);
  std::vector<double> o_ref, S_ref;
  oracle(in, o_ref, S_ref);
  std::vector<float> o(size_t(130 * 32)), S = in.S0;
  const cpu::KdaHeadIo a{in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), 32, 1, o.data()};
  cpu::kda_scan_chunked(a, 70, 32, S.data());
  const int64_t off = 70 * 32;
  const cpu::KdaHeadIo b{in.q.data() + off, in.k.data() + off, in.v.data() + off, in.g.data() + off,
                         in.beta.data() + 70, 32, 1, o.data() + off};
  cpu::kda_scan_chunked(b, 60, 32, S.data());
  EXPECT_LT(rel_l2(o, o_ref), 5e-5);
  EXPECT_LT(rel_l2(S, S_ref), 5e-5);
}

TEST(KdaScan, LayerChunkedEqualsRecurrent) {
  // The whole nano KDA layer (projections, conv, gates, norm, o_proj) in both forms, 150 tokens:
  // outputs are BF16, so they may differ by an occasional 1-ulp rounding flip. Measured 1.1e-5
  // (4 of 38,400 outputs differ by one ulp), final states 7e-8.
  const auto m = testing::make_random_model(3, [](nlohmann::json&) {});
  const TextConfig& c = m.cfg.text;
  const int64_t T = 150, D = c.hidden_size;
  std::mt19937_64 rng(8);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(size_t(T * D)), a(x.size()), b(x.size());
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  model::KdaState s1, s2;
  s1.reset(c);
  s2.reset(c);
  model::kda_forward(m.w.layers[0].kda, c, s1, x.data(), T, a.data(), model::KdaForm::recurrent);
  model::kda_forward(m.w.layers[0].kda, c, s2, x.data(), T, b.data(), model::KdaForm::chunked);
  double num = 0, den = 0, sd = 0, sn = 0;
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double fa = bf16_to_f32(a[i]), fb = bf16_to_f32(b[i]);
    num += (fa - fb) * (fa - fb);
    den += fa * fa;
    differ += a[i] != b[i];
  }
  for (size_t i = 0; i < s1.S.size(); ++i) {
    sd += (double(s1.S[i]) - s2.S[i]) * (double(s1.S[i]) - s2.S[i]);
    sn += double(s1.S[i]) * s1.S[i];
  }
  EXPECT_LT(std::sqrt(num / den), 5e-3) << differ << " of " << a.size() << " outputs differ";
  EXPECT_LT(std::sqrt(sd / sn), 5e-5) << "final recurrent states";
  EXPECT_EQ(s1.conv, s2.conv);
}

}  // namespace
}  // namespace kestrel
