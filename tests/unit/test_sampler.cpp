// sample_token: greedy ties, seeded reproducibility, top-p truncation, and every knob of the serving
// sampler (top-k, min-p, penalties, per-index seeding, logprobs). The knobs' ranges are validate()'s
// (test_request.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "core/check.h"
#include "runtime/sampler.h"

namespace kestrel {
namespace {

using runtime::SamplingParams;
using runtime::sample_token;

// Output token i of one stream drawn with index i, as the engine does.
std::vector<int32_t> stream(const SamplingParams& p, const std::vector<float>& l, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(sample_token(p, l, {}, {}, uint64_t(i)).token);
  return out;
}

TEST(Sampler, GreedyTakesLowestIdOfTheMaximum) {
  const std::vector<float> l = {0.0f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(sample_token(SamplingParams{}, l, {}, {}, 0).token, 1);
}

TEST(Sampler, SeedReproducesAndTopPTruncates) {
  const std::vector<float> l = {3.0f, 2.9f, 0.0f, -1.0f, 1.0f};
  auto draw = [&](float top_p, uint64_t seed) {
    SamplingParams p;
    p.temperature = 1.0f, p.top_p = top_p, p.seed = seed;
    return stream(p, l, 200);
  };
  EXPECT_EQ(draw(1.0f, 7), draw(1.0f, 7));
  EXPECT_NE(draw(1.0f, 7), draw(1.0f, 8));
  const auto all = draw(1.0f, 7);
  EXPECT_GT(std::set<int32_t>(all.begin(), all.end()).size(), 2u);
  // p(0) ≈ 0.44, p(1) ≈ 0.40: top-p 0.8 keeps exactly {0, 1}; a tiny top-p keeps only the argmax.
  const auto two = draw(0.8f, 7);
  EXPECT_EQ(std::set<int32_t>(two.begin(), two.end()), (std::set<int32_t>{0, 1}));
  const auto one = draw(1e-6f, 7);
  EXPECT_EQ(std::set<int32_t>(one.begin(), one.end()), (std::set<int32_t>{0}));
}


std::set<int32_t> support(const SamplingParams& p, const std::vector<float>& l, int n = 400) {
  std::set<int32_t> seen;
  for (int i = 0; i < n; ++i) seen.insert(sample_token(p, l, {}, {}, uint64_t(i)).token);
  return seen;
}

TEST(SamplerKnobs, TopKKeepsTheKMostLikely) {
  const std::vector<float> l = {1.0f, 3.0f, 2.0f, 2.9f, 0.5f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 1;
  EXPECT_EQ(support(p, l), (std::set<int32_t>{1}));
  p.top_k = 2;
  EXPECT_EQ(support(p, l), (std::set<int32_t>{1, 3}));
  p.top_k = 0;
  EXPECT_EQ(support(p, l).size(), 5u);
}

TEST(SamplerKnobs, MinPDropsTokensBelowAFractionOfTheTop) {
  // p ∝ e^{3}, e^{2.9}, e^{1}: p2/p0 = e^-2 ≈ 0.135.
  const std::vector<float> l = {3.0f, 2.9f, 1.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.2f;
  EXPECT_EQ(support(p, l), (std::set<int32_t>{0, 1}));
  p.min_p = 0.1f;
  EXPECT_EQ(support(p, l), (std::set<int32_t>{0, 1, 2}));
  p.min_p = 0.95f;
  EXPECT_EQ(support(p, l), (std::set<int32_t>{0}));
}

TEST(SamplerKnobs, Penalties) {
  const std::vector<float> l = {2.0f, 1.9f, -1.0f};
  SamplingParams p;  // greedy
  EXPECT_EQ(sample_token(p, l, {}, {}, 0).token, 0);
  // Repetition: token 0 in the prompt → 2.0 / 2 = 1.0 < 1.9.
  p.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt0 = {0}, none = {};
  EXPECT_EQ(sample_token(p, l, prompt0, none, 0).token, 1);
  // A negative logit is multiplied: −1 · 4 = −4 stays last, tokens 0, 1 untouched.
  p.repetition_penalty = 4.0f;
  const std::vector<int32_t> prompt2 = {2};
  EXPECT_EQ(sample_token(p, l, prompt2, none, 0).token, 0);
  p.repetition_penalty = 1.0f;
  // Frequency counts occurrences in the output only: 2 − 2·0.06 = 1.88 < 1.9; one occurrence is not enough.
  p.frequency_penalty = 0.06f;
  EXPECT_EQ(sample_token(p, l, {}, std::vector<int32_t>{0, 0}, 2).token, 1);
  EXPECT_EQ(sample_token(p, l, {}, std::vector<int32_t>{0}, 1).token, 0);
  EXPECT_EQ(sample_token(p, l, prompt0, none, 0).token, 0);  // the prompt does not count
  p.frequency_penalty = 0.0f;
  // Presence: once, however often.
  p.presence_penalty = 0.2f;
  EXPECT_EQ(sample_token(p, l, {}, std::vector<int32_t>{0}, 1).token, 1);
}

TEST(SamplerKnobs, SeedAndIndexAloneDecideTheDraw) {
  std::vector<float> l(64);
  for (size_t i = 0; i < l.size(); ++i) l[i] = float(i % 7) * 0.3f;
  SamplingParams p;
  p.temperature = 1.0f, p.seed = 11;
  // The same (seed, index) gives the same token whatever was drawn before (no hidden stream state):
  // that is what makes a request's tokens independent of the batch it runs in.
  std::vector<int32_t> fwd, bwd(50);
  for (int i = 0; i < 50; ++i) fwd.push_back(sample_token(p, l, {}, {}, uint64_t(i)).token);
  for (int i = 49; i >= 0; --i) bwd[size_t(i)] = sample_token(p, l, {}, {}, uint64_t(i)).token;
  EXPECT_EQ(fwd, bwd);
  p.seed = 12;
  std::vector<int32_t> other;
  for (int i = 0; i < 50; ++i) other.push_back(sample_token(p, l, {}, {}, uint64_t(i)).token);
  EXPECT_NE(fwd, other);
  // Uniformity sanity: the draw's mean over many indices is near 1/2.
  double m = 0;
  for (int i = 0; i < 10000; ++i) m += runtime::sample_uniform(5, uint64_t(i));
  EXPECT_NEAR(m / 10000, 0.5, 0.02);
}

TEST(SamplerKnobs, LogprobsAreNormalisedAndSorted) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> l(300);
  for (float& v : l) v = nd(rng);
  SamplingParams p;
  p.temperature = 0.7f, p.top_k = 20, p.seed = 3, p.logprobs = 300;
  p.repetition_penalty = 1.3f;  // logprobs describe the raw model, not the knobs
  const auto r = sample_token(p, l, std::vector<int32_t>{1, 2, 3}, {}, 0);
  ASSERT_EQ(r.top.size(), 300u);
  double sum = 0;
  for (size_t i = 0; i < r.top.size(); ++i) {
    sum += std::exp(double(r.top[i].logprob));
    if (i) {
      EXPECT_GE(r.top[i - 1].logprob, r.top[i].logprob);
    }
    if (r.top[i].token == r.token) {
      EXPECT_EQ(r.top[i].logprob, r.logprob);
    }
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
  EXPECT_EQ(r.top[0].token, int32_t(std::max_element(l.begin(), l.end()) - l.begin()));
  // log p differences equal logit differences (raw distribution).
  EXPECT_NEAR(r.top[0].logprob - r.top[1].logprob, l[size_t(r.top[0].token)] - l[size_t(r.top[1].token)], 1e-4);
  p.logprobs = 2;
  EXPECT_EQ(sample_token(p, l, {}, {}, 0).top.size(), 2u);
  p.logprobs = -1;
  EXPECT_TRUE(sample_token(p, l, {}, {}, 0).top.empty());
}

// logit_bias is added to the raw logits before everything else: a bias decides greedy picks, ±100
// bans or forces a token under sampling, and the logprobs still describe the raw model.
TEST(SamplerKnobs, LogitBiasShiftsTheLogits) {
  const std::vector<float> l = {2.0f, 1.5f, 0.0f, -1.0f};
  SamplingParams p;  // greedy
  EXPECT_EQ(sample_token(p, l, {}, {}, 0).token, 0);
  p.logit_bias = {{1, 0.6f}};  // 1.5 + 0.6 = 2.1 > 2.0
  EXPECT_EQ(sample_token(p, l, {}, {}, 0).token, 1);
  p.logit_bias = {{1, 0.4f}};  // 1.9 < 2.0
  EXPECT_EQ(sample_token(p, l, {}, {}, 0).token, 0);
  p.logit_bias = {{0, -100.0f}, {3, 100.0f}};
  p.temperature = 1.0f, p.seed = 5, p.logprobs = 1;
  const auto forced = support(p, l);
  EXPECT_EQ(forced, (std::set<int32_t>{3}));
  const auto r = sample_token(p, l, {}, {}, 0);
  // Raw logprob of token 3: −1 − log Σ e^l.
  double z = 0;
  for (float v : l) z += std::exp(double(v));
  EXPECT_NEAR(r.logprob, -1.0 - std::log(z), 1e-5);
  ASSERT_EQ(r.top.size(), 1u);
  EXPECT_EQ(r.top[0].token, 0);  // the raw favourite, not the biased one
  p.logit_bias = {{0, -100.0f}};
  p.logprobs = -1;
  EXPECT_EQ(support(p, l).count(0), 0u);
  // Bias before repetition: (2 + 2) / 2 = 2 > 1.5 keeps token 0; without the bias 2 / 2 = 1 < 1.5.
  SamplingParams q;
  q.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt0 = {0};
  EXPECT_EQ(sample_token(q, l, prompt0, {}, 0).token, 1);
  q.logit_bias = {{0, 2.0f}};
  EXPECT_EQ(sample_token(q, l, prompt0, {}, 0).token, 0);
}

// min_tokens: the stop ids cannot be drawn while the output is shorter; from then on they can.
TEST(SamplerKnobs, MinTokensHoldsBackStopIds) {
  const std::vector<float> l = {0.0f, 5.0f, 4.0f, 1.0f};  // id 1 is the favourite
  const std::vector<int32_t> stop = {1, 3};
  SamplingParams p;
  p.min_tokens = 2;
  const std::vector<int32_t> none, one = {2}, two = {2, 2};
  EXPECT_EQ(sample_token(p, l, {}, none, 0, stop).token, 2);
  EXPECT_EQ(sample_token(p, l, {}, one, 1, stop).token, 2);
  EXPECT_EQ(sample_token(p, l, {}, two, 2, stop).token, 1);
  EXPECT_EQ(sample_token(p, l, {}, none, 0, {}).token, 1);  // no stop ids: nothing to hold back
  p.temperature = 1.5f, p.seed = 9;
  std::set<int32_t> early;
  for (int i = 0; i < 400; ++i) early.insert(sample_token(p, l, {}, one, uint64_t(i), stop).token);
  EXPECT_EQ(early.count(1) + early.count(3), 0u);
  EXPECT_TRUE(early.count(2) && early.count(0));
}

// token_logprobs (prompt logprobs): log-softmax of the raw row and the n most likely, ties by id.
TEST(SamplerKnobs, TokenLogprobsOfAnyToken) {
  const std::vector<float> l = {1.0f, 3.0f, 3.0f, -2.0f};
  double z = 0;
  for (float v : l) z += std::exp(double(v));
  const auto r = runtime::token_logprobs(l, 3, 2);
  EXPECT_EQ(r.token, 3);
  EXPECT_NEAR(r.logprob, -2.0 - std::log(z), 1e-6);
  ASSERT_EQ(r.top.size(), 2u);
  EXPECT_EQ(r.top[0].token, 1);
  EXPECT_EQ(r.top[1].token, 2);
  EXPECT_NEAR(r.top[0].logprob, 3.0 - std::log(z), 1e-6);
  EXPECT_TRUE(runtime::token_logprobs(l, 0, 0).top.empty());
}

}  // namespace
}  // namespace kestrel
