// The OpenAI surface of issue #23 below HTTP: which fields each endpoint takes (everything else a 400
// naming it), logit_bias shapes, reasoning_effort's mapping, per-choice output options
// (skip_special_tokens, parallel_tool_calls = false, max_tokens 0, echo with prompt logprobs), the
// Responses API's request rewrite and answer shapes, and, through the in-process server over a
// scripted fake engine, the Responses stream of a tool call and a pipelined connection.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "server/openai.h"
#include "server/params.h"
#include "server/responses.h"
#include "server_harness.h"

using namespace kestrel;
using namespace kestrel::server;
using namespace kestrel::server::testing;

namespace {

std::string refused_param(const json& body, Api api) {
  try {
    parse_gen_params(ojson::parse(body.dump()), api);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find(e.param), std::string::npos) << e.what();
    return e.param;
  }
  return "";
}

std::vector<ChoiceStream::Delta> feed(ChoiceStream& c, const std::vector<int32_t>& script, FinishReason fin,
                                      std::vector<PromptLogprob> prompt_lp = {}) {
  std::vector<ChoiceStream::Delta> out;
  for (size_t i = 0; i < script.size() && !c.done(); ++i) {
    TokenEvent ev;
    ev.token = script[i];
    ev.prompt_tokens = i == 0 ? 5 : 0;
    if (i == 0) ev.prompt_logprobs = prompt_lp;
    ev.finish = i + 1 == script.size() ? fin : FinishReason::none;
    out.push_back(c.on_event(ev));
  }
  return out;
}

}  // namespace

TEST(ServerApiParams, UnknownAndUnhonouredFieldsAreRefusedByName) {
  EXPECT_EQ(refused_param({{"guided_json", json::object()}}, Api::kChat), "guided_json");
  EXPECT_EQ(refused_param({{"functions", json::array()}}, Api::kChat), "functions");
  EXPECT_EQ(refused_param({{"echo", true}}, Api::kChat), "echo");
  EXPECT_EQ(refused_param({{"prompt", "x"}}, Api::kChat), "prompt");
  EXPECT_EQ(refused_param({{"messages", json::array()}}, Api::kCompletion), "messages");
  EXPECT_EQ(refused_param({{"user", 5}}, Api::kChat), "user");
  EXPECT_EQ(refused_param({{"model", nullptr}}, Api::kChat), "model");
  // null means absent, for a field kestrel does not know too (what a client that sends every field it
  // knows, unset ones as null, sends); the same field with a value is refused.
  EXPECT_EQ(refused_param({{"store", nullptr}, {"user", nullptr}, {"metadata", nullptr}}, Api::kChat), "");
  EXPECT_EQ(refused_param({{"suffix", nullptr}, {"service_tier", nullptr}}, Api::kCompletion), "");
  EXPECT_EQ(refused_param({{"store", false}}, Api::kChat), "store");
  EXPECT_EQ(refused_param({{"best_of", 2}}, Api::kCompletion), "best_of");
  EXPECT_EQ(refused_param({{"best_of", 2}, {"n", 2}}, Api::kCompletion), "");
  EXPECT_EQ(refused_param({{"suffix", "x"}}, Api::kCompletion), "suffix");
  EXPECT_EQ(refused_param({{"suffix", ""}}, Api::kCompletion), "");
  EXPECT_EQ(refused_param({{"logit_bias", json::array({1})}}, Api::kChat), "logit_bias");
  EXPECT_EQ(refused_param({{"logit_bias", {{"abc", 1}}}}, Api::kChat), "logit_bias");
  EXPECT_EQ(refused_param({{"logit_bias", {{"12", "x"}}}}, Api::kChat), "logit_bias");
  EXPECT_EQ(refused_param({{"min_tokens", 2}, {"max_tokens", 0}}, Api::kChat), "min_tokens");
  EXPECT_EQ(refused_param({{"stream", true}, {"stream_options", {{"x", 1}}}}, Api::kChat), "stream_options");
  // What each endpoint takes.
  EXPECT_EQ(refused_param({{"user", "u"}, {"skip_special_tokens", false}, {"min_tokens", 1}, {"parallel_tool_calls", false},
                           {"max_tokens", 5}, {"logit_bias", {{"7", -100}, {"9", 2.5}}}},
                          Api::kChat),
            "");
  const GenParams g = parse_gen_params(ojson::parse(R"({"logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 3,
      "skip_special_tokens": false, "parallel_tool_calls": false, "stream": true,
      "stream_options": {"continuous_usage_stats": true}})"), Api::kChat);
  EXPECT_EQ(g.request.sampling.logit_bias, (std::vector<std::pair<int32_t, float>>{{7, -100.0f}, {9, 2.5f}}));
  EXPECT_EQ(g.request.sampling.min_tokens, 3);
  EXPECT_TRUE(g.keep_special);
  EXPECT_FALSE(g.parallel_tool_calls);
  EXPECT_TRUE(g.continuous_usage);
  const GenParams e = parse_gen_params(ojson::parse(R"({"echo": true, "logprobs": 2})"), Api::kCompletion);
  EXPECT_TRUE(e.echo);
  EXPECT_EQ(e.request.sampling.prompt_logprobs, 2);
}

// The budget's name travels with the request (Request::max_tokens_field), so later errors about it (the
// context, the structured-output minimum) name the field the client sent.
TEST(ServerApiParams, TheBudgetKeepsTheNameTheClientGaveIt) {
  auto field_of = [](const char* body, Api api, const std::string& alias = "max_completion_tokens") {
    return parse_gen_params(ojson::parse(body), api, alias).request.max_tokens_field;
  };
  EXPECT_EQ(field_of(R"({"max_tokens": 5})", Api::kChat), "max_tokens");
  EXPECT_EQ(field_of(R"({})", Api::kChat), "max_tokens");
  EXPECT_EQ(field_of(R"({"max_completion_tokens": 5})", Api::kChat), "max_completion_tokens");
  EXPECT_EQ(field_of(R"({"max_tokens": 9, "max_completion_tokens": 5})", Api::kChat), "max_completion_tokens");
  EXPECT_EQ(field_of(R"({"max_tokens": 5})", Api::kCompletion), "max_tokens");
  // The Responses API (its max_output_tokens arrives as max_completion_tokens): its name, sent or not.
  EXPECT_EQ(field_of(R"({"max_completion_tokens": 5})", Api::kChat, "max_output_tokens"), "max_output_tokens");
  EXPECT_EQ(field_of(R"({})", Api::kChat, "max_output_tokens"), "max_output_tokens");
  EXPECT_EQ(refused_param({{"max_completion_tokens", -1}}, Api::kChat), "max_completion_tokens");
  EXPECT_EQ(refused_param({{"max_completion_tokens", "5"}}, Api::kChat), "max_completion_tokens");
  for (const char* bad : {R"({"max_completion_tokens": -1})", R"({"max_completion_tokens": 1.5})",
                          R"({"max_completion_tokens": 0, "min_tokens": 1})"}) {
    try {
      parse_gen_params(ojson::parse(bad), Api::kChat, "max_output_tokens");
      ADD_FAILURE() << bad;
    } catch (const ApiError& e) {
      EXPECT_NE(std::string(e.what()).find("max_output_tokens"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("max_completion_tokens"), std::string::npos) << e.what();
    }
  }
}

TEST(ServerApiParams, ReasoningEffortMapsOntoTheModelsLevels) {
  for (auto [sent, model] : std::vector<std::pair<std::string, std::string>>{
           {"minimal", "low"}, {"low", "low"}, {"medium", "medium"}, {"high", "high"}, {"xhigh", "max"},
           {"max", "max"}, {"none", "none"}, {"weird", "weird"}}) {
    ojson b = {{"reasoning_effort", sent}};
    map_reasoning_effort(b);
    EXPECT_EQ(b["reasoning_effort"], model) << sent;
  }
}

TEST(ServerApiChoice, SpecialTokensAreNotTextUnlessAsked) {
  // Chat output cut by the token limit inside a marker, and a stray special.
  const auto script = ids("Hi there." + C + "response" + S + O + "argument key=\"to\"");
  for (bool keep : {false, true}) {
    ChoiceStream c(Api::kChat, T(), ChoiceOptions{.keep_special = keep});
    feed(c, script, FinishReason::length);
    if (keep)
      EXPECT_NE(c.content().find("<|open|>argument"), std::string::npos) << c.content();
    else
      EXPECT_EQ(c.content(), "Hi there.");
  }
  const auto plain = ids("a" + C + "message" + S + "b");
  ChoiceStream skip(Api::kCompletion, T(), ChoiceOptions{});
  feed(skip, plain, FinishReason::length);
  EXPECT_EQ(skip.content(), "amessageb");
  ChoiceStream keep(Api::kCompletion, T(), ChoiceOptions{.keep_special = true});
  feed(keep, plain, FinishReason::length);
  EXPECT_EQ(keep.content(), "a" + C + "message" + S + "b");
}

TEST(ServerApiChoice, ParallelToolCallsFalseEndsAtTheFirstCall) {
  auto call = [](const std::string& x) {
    return O + "call tool=\"f\"" + S + O + "argument key=\"x\" type=\"number\"" + S + x + C + "argument" + S + C + "call" + S;
  };
  const auto script = ids(O + "tools" + S + call("1") + call("2") + C + "tools" + S + END);
  ChoiceStream all(Api::kChat, T(), ChoiceOptions{.tools = {"f"}});
  feed(all, script, FinishReason::stop);
  EXPECT_EQ(all.tool_calls_message().size(), 2u);
  ChoiceStream one(Api::kChat, T(), ChoiceOptions{.tools = {"f"}, .single_tool_call = true});
  const auto deltas = feed(one, script, FinishReason::stop);
  ASSERT_TRUE(one.done());
  EXPECT_EQ(one.finish_reason(), "tool_calls");
  ASSERT_EQ(one.tool_calls_message().size(), 1u);
  EXPECT_EQ(json::parse(one.tool_calls_message()[0]["function"]["arguments"].get<std::string>()), json({{"x", 1}}));
  bool cancelled = false;
  for (const auto& d : deltas) {
    cancelled = cancelled || d.cancel_engine;
    for (const auto& t : d.tool_calls) EXPECT_EQ(t["index"], 0);
  }
  EXPECT_TRUE(cancelled) << "generation stops once a second call begins";
}

TEST(ServerApiChoice, MaxTokensZeroAndEchoWithPromptLogprobs) {
  ChoiceStream z(Api::kCompletion, T(), ChoiceOptions{.discard_output = true});
  const auto d = feed(z, ids("x"), FinishReason::length);
  EXPECT_EQ(z.completion_tokens(), 0);
  EXPECT_EQ(z.content(), "");
  EXPECT_EQ(z.finish_reason(), "length");
  // Echo: the prompt's text, then the output; logprobs: null for the first prompt token, then the
  // engine's prompt logprobs, then the output's.
  const std::vector<int32_t> prompt = ids("ab cd");
  std::vector<PromptLogprob> plp;
  for (size_t i = 1; i < prompt.size(); ++i) plp.push_back({prompt[i], -float(i), {{prompt[i], -float(i)}}});
  ChoiceStream e(Api::kCompletion, T(), ChoiceOptions{.logprobs = true, .echo = "ab cd", .echo_ids = prompt});
  const auto deltas = feed(e, ids(" ef"), FinishReason::length, plp);
  EXPECT_EQ(e.content(), "ab cd ef");
  ASSERT_EQ(e.logprobs_all().size(), prompt.size() + ids(" ef").size());
  EXPECT_TRUE(e.logprobs_all()[0]["logprob"].is_null());
  EXPECT_FLOAT_EQ(e.logprobs_all()[1]["logprob"].get<float>(), -1.0f);
  const json body = response_body(ResponseHead{Api::kCompletion, "cmpl-1", "m", 0}, {e}, usage_of({e}));
  const json& lp = body["choices"][0]["logprobs"];
  EXPECT_TRUE(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
  EXPECT_EQ(lp["tokens"].size(), e.logprobs_all().size());
  EXPECT_EQ(body["choices"][0]["text"], "ab cd ef");
}

TEST(ServerApiResponses, RequestBecomesAChatRequest) {
  const ResponsesRequest rr = responses_to_chat(ojson::parse(R"({
    "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5,
    "reasoning": {"effort": "minimal"}, "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "tool_choice": {"type": "function", "name": "f"},
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
              {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
              {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
              {"type": "function_call_output", "call_id": "call_1", "output": "42"}]})"));
  const ojson& c = rr.chat;
  EXPECT_EQ(c["max_completion_tokens"], 20);
  EXPECT_EQ(c["temperature"], 0.5);
  EXPECT_EQ(c["reasoning_effort"], "minimal");
  EXPECT_EQ(c["response_format"]["type"], "json_schema");
  EXPECT_EQ(c["response_format"]["json_schema"]["name"], "w");
  EXPECT_EQ(c["tools"][0]["function"]["name"], "f");
  EXPECT_EQ(c["tool_choice"]["function"]["name"], "f");
  const ojson& m = c["messages"];
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0]["role"], "system");
  EXPECT_EQ(m[1]["content"][0]["text"], "hi");
  EXPECT_EQ(m[2]["role"], "assistant");
  EXPECT_EQ(m[2]["reasoning_content"], "think");
  EXPECT_EQ(m[2]["tool_calls"][0]["id"], "call_1");
  EXPECT_EQ(m[3]["role"], "tool");
  EXPECT_EQ(m[3]["tool_call_id"], "call_1");
  EXPECT_TRUE(rr.head.id.rfind("resp_", 0) == 0);
  for (const char* bad : {R"({"input": "x", "store": true})", R"({"input": "x", "previous_response_id": "r"})",
                          R"({"input": "x", "tools": [{"type": "web_search"}]})", R"({"input": [{"type": "item_reference"}]})",
                          R"({"input": "x", "reasoning": {"summary": "auto"}})", R"({"input": "x", "include": ["a"]})", R"({})"})
    EXPECT_THROW(responses_to_chat(ojson::parse(bad)), ApiError) << bad;
}

// Errors about the chat body a Responses request became name the fields the client sent.
TEST(ServerApiResponses, ErrorsNameTheResponsesFields) {
  const ApiError fmt = responses_error(ApiError(400, "response_format schema /pattern: unsupported keyword", "response_format"));
  EXPECT_EQ(fmt.param, "text");
  EXPECT_STREQ(fmt.what(), "text.format schema /pattern: unsupported keyword");
  EXPECT_EQ(responses_error(ApiError(400, "image input is not supported", "messages")).param, "input");
  EXPECT_EQ(responses_error(ApiError(400, "x", "reasoning_effort")).param, "reasoning");
  const ApiError same = responses_error(ApiError(429, "queue full", "tools"));
  EXPECT_EQ(same.param, "tools");
  EXPECT_EQ(same.status, 429);
  EXPECT_STREQ(same.what(), "queue full");
}

TEST(ServerApiResponses, StreamedToolCallOverHttp) {
  // The K3 assistant message (MODEL.md §7) the chat grammar admits: think, an empty response, the call.
  Running r(ids("Hmm." + C + "think" + S + O + "response" + S + C + "response" + S + O + "tools" + S + O +
                "call tool=\"f\" index=\"1\"" + S + O + "argument key=\"x\" type=\"number\"" + S + "3" + C +
                "argument" + S + C + "call" + S + C + "tools" + S + C + "message" + S + END));
  const json req = {{"model", "m"}, {"stream", true}, {"temperature", 0}, {"input", "hi"},
                    {"tools", {{{"type", "function"}, {"name", "f"}, {"parameters", {{"type", "object"}}}}}}};
  const std::string resp = raw(r.port, request("POST", "/v1/responses", req.dump()));
  ASSERT_EQ(status(resp), 200) << resp;
  const std::string body = body_of(resp);
  std::vector<json> ev;
  for (const std::string& e : sse_events(body)) ev.push_back(json::parse(e));
  ASSERT_GE(ev.size(), 8u);
  EXPECT_NE(body.find("event: response.created\ndata: "), std::string::npos);
  std::vector<std::string> types;
  for (size_t i = 0; i < ev.size(); ++i) {
    types.push_back(ev[i]["type"]);
    EXPECT_EQ(ev[i]["sequence_number"], i);
  }
  EXPECT_EQ(types.front(), "response.created");
  EXPECT_EQ(types.back(), "response.completed");
  std::string reasoning, args;
  for (const auto& e : ev) {
    if (e["type"] == "response.reasoning_text.delta") reasoning += e["delta"].get<std::string>();
    if (e["type"] == "response.function_call_arguments.delta") args += e["delta"].get<std::string>();
  }
  EXPECT_EQ(reasoning, "Hmm.");
  EXPECT_EQ(json::parse(args), json({{"x", 3}}));
  const json& fin = ev.back()["response"];
  ASSERT_EQ(fin["output"].size(), 2u);  // the reasoning item and the call (no text: no message)
  EXPECT_EQ(fin["output"][0]["type"], "reasoning");
  EXPECT_EQ(fin["output"][1]["type"], "function_call");
  EXPECT_EQ(fin["output"][1]["name"], "f");
  EXPECT_TRUE(fin["output"][1]["call_id"].get<std::string>().rfind("call_", 0) == 0);
  EXPECT_GT(fin["usage"]["output_tokens"].get<int>(), 0);
  // The same, not streamed: the same items.
  json plain = req;
  plain["stream"] = false;
  const json obj = json::parse(body_of(raw(r.port, request("POST", "/v1/responses", plain.dump()))));
  EXPECT_EQ(obj["status"], "completed");
  ASSERT_EQ(obj["output"].size(), 2u);
  EXPECT_EQ(obj["output"][1]["arguments"], fin["output"][1]["arguments"]);
}
