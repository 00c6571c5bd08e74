// runtime::Sampler: greedy ties, seeded reproducibility, top-p truncation, argument checks.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "core/check.h"
#include "runtime/sampler.h"

namespace kestrel {
namespace {

TEST(Sampler, GreedyTakesLowestIdOfTheMaximum) {
  runtime::Sampler s({0.0f, 1.0f, 0});
  const std::vector<float> l = {0.0f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(s.sample(l), 1);
}

TEST(Sampler, SeedReproducesAndTopPTruncates) {
  const std::vector<float> l = {3.0f, 2.9f, 0.0f, -1.0f, 1.0f};
  auto draw = [&](float top_p, uint64_t seed) {
    runtime::Sampler s({1.0f, top_p, seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(s.sample(l));
    return out;
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

TEST(Sampler, RejectsBadArguments) {
  EXPECT_THROW(runtime::Sampler({-1.0f, 1.0f, 0}), Error);
  EXPECT_THROW(runtime::Sampler({1.0f, 0.0f, 0}), Error);
  EXPECT_THROW(runtime::Sampler({1.0f, 1.5f, 0}), Error);
}

}  // namespace
}  // namespace kestrel
