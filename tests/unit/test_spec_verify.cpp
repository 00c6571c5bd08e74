// Speculative verification (runtime/spec_verify.h, MODEL.md §5): greedy exactness, a draft that always agrees
// accepts everything, and — the property that makes speculation lossless — the distribution of the generated
// text equals the target's, checked by a chi-square test over whole 3-token continuations of a toy Markov
// target drafted by a different Markov draft (context-dependent p and q, rejections, corrections and bonus
// tokens all exercised). The same test rejects a verifier that accepts every draft token, so it can fail.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "core/check.h"
#include "runtime/sampler.h"
#include "runtime/spec_verify.h"

namespace kestrel::runtime {
namespace {

// Deterministic uniform stream for the tests (the sampler's counter-based generator).
struct Rng {
  uint64_t seed, n = 0;
  double operator()() { return sample_uniform(seed, n++); }
};

// A first-order Markov "model" over V tokens: row c = distribution of the next token after c.
struct Markov {
  int64_t V;
  std::vector<double> P;  // [V, V]
  const double* row(int32_t c) const { return P.data() + int64_t(c) * V; }
};

Markov random_markov(int64_t V, uint64_t seed, int32_t forbidden = -1) {
  Markov m{V, std::vector<double>(size_t(V * V))};
  Rng r{seed};
  for (int64_t c = 0; c < V; ++c) {
    double s = 0;
    for (int64_t x = 0; x < V; ++x) {
      const double v = x == forbidden ? 0.0 : 0.15 + r();  // every allowed entry ≥ ~0.05 after normalising
      m.P[size_t(c * V + x)] = v;
      s += v;
    }
    for (int64_t x = 0; x < V; ++x) m.P[size_t(c * V + x)] /= s;
  }
  return m;
}

// Speculative generation of L tokens after `start`: draft γ tokens from q, verify against p, repeat.
// accept_all: a broken verifier that keeps every draft token (must fail the chi-square test).
std::vector<int32_t> generate(const Markov& p, const Markov& q, int32_t start, int gamma, int L, RejectionMethod m,
                              Rng& rng, int64_t* accepted_total, bool accept_all = false) {
  const int64_t V = p.V;
  std::vector<int32_t> out;
  int32_t last = start;
  while (int(out.size()) < L) {
    std::vector<int32_t> d(static_cast<size_t>(gamma));
    std::vector<double> P(size_t((gamma + 1) * V)), Q(size_t(gamma * V));
    int32_t c = last;
    for (int i = 0; i < gamma; ++i) {
      std::copy(q.row(c), q.row(c) + V, Q.begin() + i * V);
      std::copy(p.row(c), p.row(c) + V, P.begin() + i * V);
      d[size_t(i)] = c = draw_from(q.row(c), V, rng());
    }
    std::copy(p.row(c), p.row(c) + V, P.begin() + gamma * V);
    std::vector<double> u(size_t(gamma) + 1);
    for (double& x : u) x = rng();
    VerifyOutcome o = accept_all ? VerifyOutcome{gamma, draw_from(p.row(c), V, u[size_t(gamma)])}
                                 : verify(m, P.data(), Q.data(), d, V, [&](int k) { return u[size_t(k)]; });
    *accepted_total += o.accepted;
    for (int i = 0; i < o.accepted; ++i) out.push_back(d[size_t(i)]);
    out.push_back(o.next);
    last = o.next;
  }
  out.resize(static_cast<size_t>(L));
  return out;
}

// Pearson chi-square of observed sequence counts against the target's exact sequence probabilities, cells
// with an expected count < 5 pooled into one; returns (statistic, degrees of freedom).
std::pair<double, int> chi_square(const Markov& p, int32_t start, int L, const std::map<int64_t, int64_t>& counts,
                                  int64_t n) {
  const int64_t V = p.V;
  int64_t cells = 1;
  for (int i = 0; i < L; ++i) cells *= V;
  double stat = 0, pooled_e = 0, pooled_o = 0;
  int df = -1;
  for (int64_t k = 0; k < cells; ++k) {
    double prob = 1;
    int32_t c = start;
    int64_t r = k;
    for (int i = 0; i < L; ++i) {
      const int32_t x = int32_t(r % V);
      r /= V;
      prob *= p.row(c)[x];
      c = x;
    }
    const double e = prob * double(n);
    const auto it = counts.find(k);
    const double o = it == counts.end() ? 0.0 : double(it->second);
    if (prob == 0.0) {
      EXPECT_EQ(o, 0.0) << "a sequence the target cannot produce was generated: " << k;
      continue;
    }
    if (e < 5) {
      pooled_e += e, pooled_o += o;
      continue;
    }
    stat += (o - e) * (o - e) / e, ++df;
  }
  if (pooled_e > 0) stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e, ++df;
  return {stat, df};
}

// Upper 1e-6 critical value of chi-square(df), Wilson–Hilferty (accurate to ~1 % at df ≥ 20).
double chi_square_critical(int df) {
  const double z = 4.753, a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

struct SpecRun {
  double stat;
  int df;
  double mean_accepted;  // per step
};

SpecRun run_spec(RejectionMethod m, int32_t forbidden, bool accept_all, uint64_t seed) {
  const int64_t V = 4;
  const int gamma = 3, L = 3;
  const Markov p = random_markov(V, 11, forbidden), q = random_markov(V, 29);
  Rng rng{seed};
  std::map<int64_t, int64_t> counts;
  const int64_t n = 60000;
  int64_t acc = 0, steps_proxy = 0;
  for (int64_t s = 0; s < n; ++s) {
    const std::vector<int32_t> seq = generate(p, q, 1, gamma, L, m, rng, &acc, accept_all);
    int64_t k = 0, mul = 1;
    for (int32_t x : seq) k += x * mul, mul *= V;
    ++counts[k];
    ++steps_proxy;
  }
  const auto [stat, df] = chi_square(p, 1, L, counts, n);
  return {stat, df, double(acc) / double(steps_proxy)};
}

TEST(SpecVerify, TokenRuleKeepsTheTargetDistribution) {
  const SpecRun r = run_spec(RejectionMethod::token, -1, false, 5);
  EXPECT_GT(r.df, 30);
  EXPECT_LT(r.stat, chi_square_critical(r.df)) << "df " << r.df;
}

TEST(SpecVerify, BlockRuleKeepsTheTargetDistribution) {
  const SpecRun r = run_spec(RejectionMethod::block, -1, false, 6);
  EXPECT_GT(r.df, 30);
  EXPECT_LT(r.stat, chi_square_critical(r.df)) << "df " << r.df;
}

TEST(SpecVerify, BothRulesNeverEmitWhatTheTargetCannot) {
  // Token 3 has target probability 0 (as after a top-k cut) but the draft proposes it often.
  for (RejectionMethod m : {RejectionMethod::token, RejectionMethod::block}) {
    const SpecRun r = run_spec(m, 3, false, 7);
    EXPECT_LT(r.stat, chi_square_critical(r.df)) << int(m);
  }
}

TEST(SpecVerify, ChiSquareCatchesAVerifierThatAcceptsEverything) {
  const SpecRun r = run_spec(RejectionMethod::token, -1, true, 8);
  EXPECT_GT(r.stat, 10 * chi_square_critical(r.df));
}

TEST(SpecVerify, BlockAcceptsAtLeastAsMuchAsToken) {
  // Same p, q and number of steps; the block rule's expected acceptance is ≥ the token rule's. The
  // difference is small for a 3-token block, so the check allows 1 % sampling noise.
  const SpecRun t = run_spec(RejectionMethod::token, -1, false, 9), b = run_spec(RejectionMethod::block, -1, false, 9);
  EXPECT_GT(b.mean_accepted, t.mean_accepted * 0.99) << t.mean_accepted << " vs " << b.mean_accepted;
}

TEST(SpecVerify, AnAgreeingDraftIsAlwaysAccepted) {
  // q == p and the draft samples from it: min(1, p/q) = 1 and ρ_i = 1 = h_γ, so both rules keep all γ.
  const int64_t V = 6;
  const int gamma = 7;
  const Markov p = random_markov(V, 3);
  Rng rng{42};
  for (RejectionMethod m : {RejectionMethod::token, RejectionMethod::block}) {
    for (int trial = 0; trial < 500; ++trial) {
      std::vector<int32_t> d(static_cast<size_t>(gamma));
      std::vector<double> P(size_t((gamma + 1) * V));
      int32_t c = int32_t(trial % V);
      for (int i = 0; i < gamma; ++i) {
        std::copy(p.row(c), p.row(c) + V, P.begin() + i * V);
        d[size_t(i)] = c = draw_from(p.row(c), V, rng());
      }
      std::copy(p.row(c), p.row(c) + V, P.begin() + gamma * V);
      const VerifyOutcome o = verify(m, P.data(), P.data(), d, V, [&](int) { return rng(); });
      ASSERT_EQ(o.accepted, gamma) << int(m) << " trial " << trial;
      ASSERT_GE(o.next, 0);
    }
  }
}

TEST(SpecVerify, GreedyKeepsTheTargetsArgmaxTokens) {
  const std::vector<int32_t> target = {5, 9, 2, 7, 1};
  EXPECT_EQ(verify_greedy(target, std::vector<int32_t>{5, 9, 2, 7}).accepted, 4);
  EXPECT_EQ(verify_greedy(target, std::vector<int32_t>{5, 9, 2, 7}).next, 1);  // bonus
  const VerifyOutcome o = verify_greedy(target, std::vector<int32_t>{5, 9, 3, 7});
  EXPECT_EQ(o.accepted, 2);
  EXPECT_EQ(o.next, 2);  // the target's token at the first disagreement
  EXPECT_EQ(verify_greedy(target, std::vector<int32_t>{0, 9, 2, 7}).accepted, 0);
  EXPECT_THROW(verify_greedy(target, std::vector<int32_t>{5}), Error);
}

TEST(SpecVerify, OneHotTargetMakesTheSampledRulesGreedy) {
  // Temperature → 0: p_i one-hot on the argmax. Whatever the draft proposes, the emitted tokens are the
  // argmax chain, under both rules and any uniforms.
  const int64_t V = 5;
  const std::vector<int32_t> arg = {2, 4, 0, 1};
  std::vector<double> P(size_t(4 * V), 0.0), Q(size_t(3 * V), 0.2);
  for (int i = 0; i < 4; ++i) P[size_t(i * V + arg[size_t(i)])] = 1.0;
  Rng rng{1};
  for (RejectionMethod m : {RejectionMethod::token, RejectionMethod::block})
    for (const std::vector<int32_t>& d : {std::vector<int32_t>{2, 4, 0}, std::vector<int32_t>{2, 3, 0},
                                          std::vector<int32_t>{1, 4, 0}})
      for (int rep = 0; rep < 50; ++rep) {
        const VerifyOutcome o = verify(m, P.data(), Q.data(), d, V, [&](int) { return rng(); });
        const VerifyOutcome g = verify_greedy(arg, d);
        ASSERT_EQ(o.accepted, g.accepted) << int(m);
        ASSERT_EQ(o.next, g.next) << int(m);
      }
}

TEST(SpecVerify, BadInputIsAnError) {
  std::vector<double> P(8, 0.25), Q(4, 0.25);
  EXPECT_THROW(verify_token(P.data(), Q.data(), std::vector<int32_t>{4}, 4, [](int) { return 0.5; }), Error);
  EXPECT_THROW(parse_rejection_method("tree"), Error);
  EXPECT_EQ(parse_rejection_method("block"), RejectionMethod::block);
  const std::vector<double> zero(4, 0.0);
  EXPECT_THROW(draw_from(zero.data(), 4, 0.3), Error);
}

}  // namespace
}  // namespace kestrel::runtime
