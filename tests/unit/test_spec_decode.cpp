// DSpark speculative decoding of one request on the CPU (runtime/spec_decode.h) with the random nano draft:
// greedy speculation emits exactly the tokens greedy decoding without a draft emits (a random draft is
// rejected often, so corrections, KDA rollback and incremental context injection are all exercised), for
// several prompts and block lengths; sampled speculation is reproducible from its seed and its counters add up.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "loader/dspark.h"
#include "loader/safetensors.h"
#include "model/dspark.h"
#include "nano_checkpoint.h"
#include "nano_draft_dir.h"
#include "runtime/engine_host.h"
#include "runtime/spec_config.h"
#include "runtime/spec_decode.h"

namespace kestrel::runtime {
namespace {

using testing::NanoDraft;
using testing::nano_draft;

std::vector<int32_t> prompt_of(int n, int seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(int32_t(1 + (i * 37 + seed * 101) % 700));
  return p;
}

TEST(SpecDecode, GreedyEqualsNoSpeculationTokenForToken) {
  const auto& nano = testing::nano_checkpoint();
  const NanoDraft& d = nano_draft();
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  int64_t rejected_steps = 0;
  for (int seed = 0; seed < 2; ++seed) {
    const std::vector<int32_t> prompt = prompt_of(9 + 5 * seed, seed);
    const std::vector<int32_t> plain = plain_generate(nano.w, nano.cfg, prompt, 16, greedy);
    for (int gamma : {4, 2}) {
      SpecDecodeOptions opt;
      opt.num_speculative_tokens = gamma;
      SpecDecodeStats stats;
      const std::vector<int32_t> spec = spec_generate(nano.w, nano.cfg, *d.draft, prompt, 16, greedy, opt, &stats);
      EXPECT_EQ(spec, plain) << "seed " << seed << " gamma " << gamma;
      EXPECT_LE(stats.draft_tokens, stats.drafts * gamma);
      EXPECT_LE(stats.accepted_tokens, stats.draft_tokens);
      rejected_steps += stats.accepted_tokens < stats.draft_tokens;
    }
  }
  EXPECT_GT(rejected_steps, 0) << "the random draft should be rejected sometimes (else the rollback is untested)";
}

TEST(SpecDecode, AnAgreeingDraftIsAcceptedWhole) {
  const auto& nano = testing::nano_checkpoint();
  const NanoDraft& d = nano_draft();
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  const std::vector<int32_t> prompt = prompt_of(11, 4);
  const std::vector<int32_t> plain = plain_generate(nano.w, nano.cfg, prompt, 21, greedy);
  SpecDecodeOptions opt;
  opt.num_speculative_tokens = 4;
  opt.oracle = &plain;
  SpecDecodeStats stats;
  EXPECT_EQ(spec_generate(nano.w, nano.cfg, *d.draft, prompt, 21, greedy, opt, &stats), plain);
  EXPECT_EQ(stats.accepted_tokens, stats.draft_tokens);
  EXPECT_EQ(stats.drafts, 4);  // 1 + 4 steps × (4 accepted + 1) = 21 tokens
  EXPECT_DOUBLE_EQ(stats.acceptance_length(), 5.0);
}

TEST(SpecDecode, SampledIsSeededAndCountsAddUp) {
  const auto& nano = testing::nano_checkpoint();
  const NanoDraft& d = nano_draft();
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.95f;
  p.seed = 77;
  for (RejectionMethod m : {RejectionMethod::block, RejectionMethod::token}) {
    SpecDecodeOptions opt;
    opt.num_speculative_tokens = 4;
    opt.rejection = m;
    SpecDecodeStats s1, s2;
    const std::vector<int32_t> prompt = prompt_of(12, 5);
    const auto a = spec_generate(nano.w, nano.cfg, *d.draft, prompt, 20, p, opt, &s1);
    const auto b = spec_generate(nano.w, nano.cfg, *d.draft, prompt, 20, p, opt, &s2);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a.size(), 20u);
    // Every step emits accepted + 1 tokens: 1 (prompt's token) + Σ (τ+1) ≥ 20.
    EXPECT_GE(1 + s1.accepted_tokens + s1.drafts, 20);
    for (int32_t t : a) EXPECT_TRUE(t >= 0 && t < nano.cfg.text.vocab_size);
  }
  p.repetition_penalty = 1.2f;
  EXPECT_THROW(spec_generate(nano.w, nano.cfg, *d.draft, prompt_of(5, 1), 4, p, {}, nullptr), Error);
}

TEST(SpecDecode, TargetDistributionFollowsTheSamplerKnobs) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<double> out(5);
  target_distribution(p, logits, out.data());
  double s = 0;
  for (double x : out) s += x;
  EXPECT_NEAR(s, 1.0, 1e-12);
  EXPECT_NEAR(out[1], out[3], 1e-15);
  p.top_k = 2;  // the two 3.0s
  target_distribution(p, logits, out.data());
  EXPECT_NEAR(out[1], 0.5, 1e-12);
  EXPECT_EQ(out[2], 0.0);
  p.top_k = 0;
  p.top_p = 0.5f;  // the first 3.0 alone has ~0.42 of the mass; with the second it reaches the cut
  target_distribution(p, logits, out.data());
  EXPECT_EQ(out[0], 0.0);
  EXPECT_EQ(out[2], 0.0);
  EXPECT_NEAR(out[1] + out[3], 1.0, 1e-12);
}

TEST(SpeculativeConfig, ParsesVllmKeysAndRejectsTheRest) {
  const SpeculativeConfig c = parse_speculative_config(
      R"({"method":"dspark","model":"/d","num_speculative_tokens":7,"draft_sample_method":"greedy",)"
      R"("rejection_sample_method":"token","dspark_draft_topk":8,"disable_by_batch_size":4})");
  EXPECT_EQ(c.model, "/d");
  EXPECT_EQ(c.num_speculative_tokens, 7);
  EXPECT_TRUE(c.draft_greedy);
  EXPECT_EQ(c.rejection, RejectionMethod::token);
  EXPECT_EQ(c.draft_topk, 8);
  EXPECT_EQ(c.disable_by_batch_size, 4);
  EXPECT_EQ(parse_speculative_config(R"({"method":"dspark","model":"/d"})").disable_by_batch_size, 0);
  EXPECT_EQ(parse_speculative_config(R"({"method":"dspark","model":"/d"})").rejection, RejectionMethod::block);
  for (const char* bad : {R"({"method":"eagle","model":"/d"})", R"({"model":"/d"})", R"({"method":"dspark"})",
                          R"({"method":"dspark","model":"/d","num_speculative_tokens":0})",
                          R"({"method":"dspark","model":"/d","rejection_sample_method":"tree"})",
                          R"({"method":"dspark","model":"/d","draft_sample_method":"typical"})",
                          R"({"method":"dspark","model":"/d","prompt_lookup_max":3})",
                          R"({"method":"dspark","model":"/d","disable_by_batch_size":0})", "[1]", "{"})
    EXPECT_THROW(parse_speculative_config(bad), Error) << bad;
}

TEST(SpeculativeConfig, EngineHostLoadsTheDraftAndRefusesWhatCannotSpeculate) {
  const char* nano = std::getenv("KESTREL_NANO_DIR");
  ASSERT_TRUE(nano);
  const std::string draft = testing::nano_draft_dir();
  EngineOptions o;
  o.model_dir = nano;
  o.memory_budget = int64_t(64) << 20;
  o.speculative = parse_speculative_config(fmt::format(R"({{"method":"dspark","model":"{}"}})", draft));
  {
    EngineHost host(o);
    EXPECT_TRUE(host.wait_loaded()) << host.load_error();
  }
  EngineOptions big = o;
  big.speculative->num_speculative_tokens = 99;
  EngineHost too_long(big);
  EXPECT_FALSE(too_long.wait_loaded());
  EXPECT_NE(too_long.load_error().find("block size"), std::string::npos) << too_long.load_error();
  EngineOptions tp = o;
  tp.tensor_parallel_size = 2;
  EngineHost tp_host(tp);
  EXPECT_FALSE(tp_host.wait_loaded());
  EXPECT_NE(tp_host.load_error().find("one rank"), std::string::npos) << tp_host.load_error();
  o.speculative->model = nano;  // a target checkpoint is no draft
  EngineHost bad(o);
  EXPECT_FALSE(bad.wait_loaded());
  EXPECT_NE(bad.load_error().find("k3_dspark"), std::string::npos) << bad.load_error();
}

}  // namespace
}  // namespace kestrel::runtime
