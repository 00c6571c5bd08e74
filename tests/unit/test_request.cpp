// validate(): the one check of a request (request/request.h). Every rule refuses exactly at its
// boundary and names the field at fault; a request at every edge of the allowed ranges passes.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "request/request.h"

namespace kestrel {
namespace {

const RequestLimits kLimits{100, 20, {}};  // vocabulary 100, prompt + max_tokens <= 20

Request ok() {
  Request r;
  r.prompt = {1, 2, 3};
  r.max_tokens = 4;
  return r;
}

// The field validate() names, or "" when it accepts the request.
std::string refused(const std::function<void(Request&)>& edit) {
  Request r = ok();
  edit(r);
  try {
    validate(r, kLimits);
  } catch (const RequestError& e) {
    EXPECT_FALSE(std::string(e.what()).empty());
    return e.field;
  }
  return "";
}

TEST(Validate, EdgesOfEveryRangePass) {
  EXPECT_EQ(refused([](Request&) {}), "");
  EXPECT_EQ(refused([](Request& r) {
              SamplingParams& s = r.sampling;
              s.temperature = 2.0f, s.top_p = 1.0f, s.top_k = 0, s.min_p = 1.0f, s.repetition_penalty = 10.0f;
              s.presence_penalty = -2.0f, s.frequency_penalty = 2.0f, s.logprobs = 20;
              r.prompt = {0, 99};
              r.max_tokens = 18;  // 2 + 18 = 20: exactly the context
              r.stop_token_ids = {0, 99};
              r.stop = std::vector<std::string>(16, "x");
              r.media = {{0, 2, 7}};
            }),
            "");
  EXPECT_EQ(refused([](Request& r) { r.sampling.top_p = 1e-6f, r.sampling.logprobs = -5; }), "");
}

TEST(Validate, SamplingRanges) {
  EXPECT_EQ(refused([](Request& r) { r.sampling.temperature = -0.01f; }), "temperature");
  EXPECT_EQ(refused([](Request& r) { r.sampling.temperature = 2.01f; }), "temperature");
  EXPECT_EQ(refused([](Request& r) { r.sampling.temperature = NAN; }), "temperature");
  EXPECT_EQ(refused([](Request& r) { r.sampling.top_p = 0.0f; }), "top_p");
  EXPECT_EQ(refused([](Request& r) { r.sampling.top_p = 1.01f; }), "top_p");
  EXPECT_EQ(refused([](Request& r) { r.sampling.top_k = -1; }), "top_k");
  EXPECT_EQ(refused([](Request& r) { r.sampling.min_p = 1.5f; }), "min_p");
  EXPECT_EQ(refused([](Request& r) { r.sampling.repetition_penalty = 0.0f; }), "repetition_penalty");
  EXPECT_EQ(refused([](Request& r) { r.sampling.repetition_penalty = 10.5f; }), "repetition_penalty");
  EXPECT_EQ(refused([](Request& r) { r.sampling.presence_penalty = 2.5f; }), "presence_penalty");
  EXPECT_EQ(refused([](Request& r) { r.sampling.frequency_penalty = NAN; }), "frequency_penalty");
  EXPECT_EQ(refused([](Request& r) { r.sampling.logprobs = 21; }), "logprobs");
}

TEST(Validate, PromptVocabularyAndContext) {
  EXPECT_EQ(refused([](Request& r) { r.prompt.clear(); }), "prompt");
  EXPECT_EQ(refused([](Request& r) { r.prompt = {1, 100}; }), "prompt");
  EXPECT_EQ(refused([](Request& r) { r.prompt = {-1}; }), "prompt");
  EXPECT_EQ(refused([](Request& r) { r.max_tokens = 0; }), "max_tokens");
  EXPECT_EQ(refused([](Request& r) { r.max_tokens = 18; }), "max_tokens");  // 3 + 18 = 21 > 20
  EXPECT_EQ(refused([](Request& r) { r.prompt.assign(20, 5), r.max_tokens = 1; }), "prompt");  // no room left
  Request r = ok();
  r.max_tokens = 18;
  try {
    validate(r, kLimits);
    ADD_FAILURE() << "accepted 21 tokens in a 20-token context";
  } catch (const RequestError& e) {
    EXPECT_NE(std::string(e.what()).find("maximum context length is 20 tokens"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("you requested 21 tokens (3 in the prompt, 18 for the completion)"),
              std::string::npos) << e.what();
  }
}

// Errors about the budget name the field as the client spelled it (Request::max_tokens_field).
TEST(Validate, BudgetErrorsNameTheFieldSent) {
  for (const std::string name : {"max_completion_tokens", "max_output_tokens"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(refused([&](Request& r) { r.max_tokens_field = name, r.max_tokens = 0; }), name);
    EXPECT_EQ(refused([&](Request& r) { r.max_tokens_field = name, r.max_tokens = 18; }), name);  // past the context
    Request r = ok();
    r.max_tokens_field = name;
    r.max_tokens = 18;
    try {
      validate(r, kLimits);
      ADD_FAILURE() << "accepted 21 tokens in a 20-token context";
    } catch (const RequestError& e) {
      EXPECT_NE(std::string(e.what()).find("or of " + name), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("max_tokens"), std::string::npos) << e.what();
    }
    r.max_tokens = 2;
    r.sampling.min_tokens = 3;
    try {
      validate(r, kLimits);
      ADD_FAILURE() << "accepted min_tokens above the budget";
    } catch (const RequestError& e) {
      EXPECT_EQ(e.field, "min_tokens");
      EXPECT_NE(std::string(e.what()).find(name + " = 2"), std::string::npos) << e.what();
    }
  }
}

TEST(Validate, StopsAndMedia) {
  EXPECT_EQ(refused([](Request& r) { r.stop_token_ids = {100}; }), "stop_token_ids");
  EXPECT_EQ(refused([](Request& r) { r.stop_token_ids = {-1}; }), "stop_token_ids");
  EXPECT_EQ(refused([](Request& r) { r.stop = {"a", ""}; }), "stop");
  EXPECT_EQ(refused([](Request& r) { r.stop = std::vector<std::string>(17, "x"); }), "stop");
  EXPECT_EQ(refused([](Request& r) { r.media = {{2, 9, 1}}; }), "media");  // beyond the 3-token prompt
  EXPECT_EQ(refused([](Request& r) { r.media = {{1, 1, 1}}; }), "media");  // empty span
}

TEST(Validate, LogitBiasMinTokensPromptLogprobs) {
  // Edges pass: ±100, the last id, min_tokens = max_tokens, 20 prompt alternatives.
  EXPECT_EQ(refused([](Request& r) {
              r.sampling.logit_bias = {{0, -100.0f}, {99, 100.0f}};
              r.sampling.min_tokens = r.max_tokens;
              r.sampling.prompt_logprobs = 20;
            }),
            "");
  EXPECT_EQ(refused([](Request& r) { r.sampling.logit_bias = {{100, 1.0f}}; }), "logit_bias");
  EXPECT_EQ(refused([](Request& r) { r.sampling.logit_bias = {{-1, 1.0f}}; }), "logit_bias");
  EXPECT_EQ(refused([](Request& r) { r.sampling.logit_bias = {{5, 100.5f}}; }), "logit_bias");
  EXPECT_EQ(refused([](Request& r) { r.sampling.logit_bias = {{5, NAN}}; }), "logit_bias");
  EXPECT_EQ(refused([](Request& r) { r.sampling.logit_bias = {{5, 1.0f}, {7, 2.0f}, {5, 3.0f}}; }), "logit_bias");
  EXPECT_EQ(refused([](Request& r) { r.sampling.min_tokens = -1; }), "min_tokens");
  EXPECT_EQ(refused([](Request& r) { r.sampling.min_tokens = r.max_tokens + 1; }), "min_tokens");
  EXPECT_EQ(refused([](Request& r) { r.sampling.prompt_logprobs = 21; }), "prompt_logprobs");
}

TEST(FinishReason, Names) {
  EXPECT_STREQ(finish_reason_name(FinishReason::stop), "stop");
  EXPECT_STREQ(finish_reason_name(FinishReason::length), "length");
  EXPECT_STREQ(finish_reason_name(FinishReason::cancelled), "cancelled");
  EXPECT_STREQ(finish_reason_name(FinishReason::error), "error");
}

}  // namespace
}  // namespace kestrel
