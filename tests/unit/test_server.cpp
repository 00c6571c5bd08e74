// Server tests without weights: the OpenAI protocol pieces (parameter parsing and validation, per-choice
// shaping of text-stream output into deltas) and the whole HTTP server in-process over the real
// engine with a fake executor whose greedy output is a fixed script, checked through raw sockets:
// SSE framing and chunk shapes, tool-call deltas, usage, errors, authentication, /health and /metrics.
#include <gtest/gtest.h>

#include <utility>

#include <boost/asio.hpp>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "loader/config.h"
#include "runtime/engine.h"
#include "runtime/fake_executor.h"
#include "server/http_server.h"
#include "server/openai.h"
#include "server/params.h"
#include "tokenizer/parser.h"
#include "server_harness.h"

using namespace kestrel;
using namespace kestrel::server;
using namespace kestrel::server::testing;
using nlohmann::json;

namespace {

int status_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e.status;
  } catch (const RequestError& e) {
    return api_error(e, Api::kChat).status;
  }
  return 0;
}

}  // namespace

TEST(ServerParams, TypesAndRanges) {
  auto chat = [](json j) { return parse_gen_params(ojson::parse(j.dump()), Api::kChat); };
  // Parsed, then validated as the engine does at submit (ranges are validate()'s).
  auto submit = [&](json j) {
    GenParams g = chat(j);
    Request r = g.request;
    r.prompt = {1, 2};
    if (g.max_tokens) r.max_tokens = *g.max_tokens;
    validate(r, RequestLimits{1024, 4096, {}});
  };
  GenParams g = chat({{"temperature", 0}, {"top_k", -1}, {"max_completion_tokens", 7}, {"max_tokens", 3},
                      {"stop", "x"}, {"seed", -5}, {"logprobs", true}, {"top_logprobs", 2}, {"n", 2}});
  EXPECT_EQ(g.request.sampling.temperature, 0.0f);
  EXPECT_EQ(g.request.sampling.top_k, 0);
  EXPECT_EQ(g.request.sampling.seed, uint64_t(-5));
  EXPECT_EQ(*g.max_tokens, 7);
  EXPECT_EQ(g.request.stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(g.logprobs());
  EXPECT_EQ(g.request.sampling.logprobs, 2);
  EXPECT_EQ(g.n, 2);
  EXPECT_EQ(chat(json::object()).request.sampling.temperature, 1.0f);  // OpenAI's default, not greedy
  EXPECT_FALSE(chat(json::object()).logprobs());
  EXPECT_EQ(status_of([&] { submit(json::object()); }), 0);
  for (json bad : {json{{"temperature", "hot"}}, json{{"temperature", 3}}, json{{"top_p", 0}}, json{{"n", 0}},
                   json{{"max_tokens", 1.5}}, json{{"max_tokens", -1}}, json{{"stream", "yes"}},
                   json{{"stop", json::array({1})}}, json{{"top_logprobs", 3}}, json{{"logprobs", 1}},
                   json{{"stream_options", {{"include_usage", true}}}}, json{{"seed", "1"}}, json{{"min_p", -1}},
                   json{{"presence_penalty", 9}}, json{{"model", 3}}, json{{"stop_token_ids", json::array({-1})}},
                   json{{"top_k", -2}}, json{{"logprobs", true}, {"top_logprobs", 21}}, json{{"max_tokens", 5000}}})
    EXPECT_EQ(status_of([&] { submit(bad); }), 400) << bad.dump();
  // The field at fault is the OpenAI one.
  try {
    submit({{"logprobs", true}, {"top_logprobs", 21}});
  } catch (const RequestError& e) {
    EXPECT_EQ(api_error(e, Api::kChat).param, "top_logprobs");
  }
  GenParams c = parse_gen_params(ojson::parse(R"({"logprobs": 3})"), Api::kCompletion);
  EXPECT_TRUE(c.logprobs());
  EXPECT_EQ(c.request.sampling.logprobs, 3);
  const json e = json::parse(error_body(404, "nope", "model"));
  EXPECT_EQ(e["error"]["message"], "nope");
  EXPECT_EQ(e["error"]["type"], "not_found_error");
  EXPECT_EQ(e["error"]["param"], "model");
  EXPECT_EQ(e["error"]["code"], 404);
}

namespace {
// Feeds a script through a ChoiceStream as an engine would; the last token carries `fin`.
std::vector<ChoiceStream::Delta> run_choice(ChoiceStream& c, const std::vector<int32_t>& script, FinishReason fin) {
  std::vector<ChoiceStream::Delta> out;
  for (size_t i = 0; i < script.size() && !c.done(); ++i) {
    TokenEvent ev;
    ev.token = script[i];
    ev.prompt_tokens = i == 0 ? 5 : 0;
    ev.finish = i + 1 == script.size() ? fin : FinishReason::none;
    out.push_back(c.on_event(ev));
  }
  return out;
}
// A step that throws (here: the executor's third) ends the requests in flight with the error and makes the
// server refuse everything after it with 503s that say why — not "model is loading", which is what a failed
// engine used to look like from outside.
TEST(Server, AFailedEngineStepIsReportedNotMistakenForLoading) {
  struct Throwing : runtime::StepExecutor {
    std::unique_ptr<runtime::StepExecutor> inner;
    int steps = 0;
    sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
      if (++steps == 3) throw Error("device fault in step 3");
      return inner->run(plan, hooks);
    }
    const runtime::ExecutorStats& stats() const override { return inner->stats(); }
  };
  Running r(ids("one two three"));
  // The Running engine stands; a second one over the throwing executor serves a second server.
  runtime::EngineConfig ec = engine_config();
  const int64_t V = r.cfg.text.vocab_size;
  ec.make_executor = [V](const kestrel::CacheFormats& f, const kestrel::cache::CacheConfig& c) {
    auto t = std::make_unique<Throwing>();
    t->inner = runtime::fake_executor_factory(V, {})(f, c);
    return std::unique_ptr<runtime::StepExecutor>(std::move(t));
  };
  runtime::Engine engine(r.cfg, ec);
  ServerOptions so;
  so.port = 0;
  so.served_model_name = "m";
  Server server(so, engine, T());
  server.listen();
  std::thread th([&] { server.run(); });
  EXPECT_EQ(status(raw(server.port(), request("GET", "/health", ""))), 200);
  const json req = {{"prompt", "x"}, {"max_tokens", 8}, {"ignore_eos", true}};
  const std::string first = raw(server.port(), request("POST", "/v1/completions", req.dump()));
  EXPECT_NE(first.find("device fault in step 3"), std::string::npos) << first;  // the request in flight
  const std::string health = raw(server.port(), request("GET", "/health", ""));
  EXPECT_EQ(status(health), 503);
  EXPECT_NE(health.find("the engine failed: device fault in step 3"), std::string::npos) << health;
  const std::string next = raw(server.port(), request("POST", "/v1/completions", req.dump()));
  EXPECT_EQ(status(next), 503);
  EXPECT_NE(next.find("the engine failed"), std::string::npos) << next;
  EXPECT_EQ(next.find("model is loading"), std::string::npos) << next;
  server.shutdown();
  th.join();
  engine.shutdown();
}

}  // namespace

TEST(ServerChoice, ReasoningContentAndToolCallDeltas) {
  const auto script = ids("Let me think." + C + "think" + S + O + "response" + S + "Calling." + C + "response" + S + O +
                          "tools" + S + O + "call tool=\"get_weather\" index=\"1\"" + S + O +
                          "argument key=\"city\" type=\"string\"" + S + "Paris" + C + "argument" + S + C + "call" + S +
                          C + "tools" + S + END);
  ChoiceStream c(Api::kChat, T(), ChoiceOptions{.thinking = true, .tools = {"get_weather"}, .logprobs = true});
  auto deltas = run_choice(c, script, FinishReason::stop);
  ASSERT_TRUE(c.done());
  EXPECT_EQ(c.finish_reason(), "tool_calls");
  EXPECT_EQ(c.reasoning(), "Let me think.");
  EXPECT_EQ(c.content(), "Calling.");
  EXPECT_EQ(c.prompt_tokens(), 5);
  EXPECT_EQ(c.completion_tokens(), int(script.size()));
  EXPECT_GT(c.reasoning_tokens(), 0);
  EXPECT_LT(c.reasoning_tokens(), c.completion_tokens());
  std::string name, args, id;
  int with_name = 0;
  for (const auto& d : deltas)
    for (const auto& t : d.tool_calls) {
      EXPECT_EQ(t["index"], 0);
      if (t.contains("id")) {
        ++with_name;
        id = t["id"];
        name = t["function"]["name"];
        EXPECT_EQ(t["type"], "function");
      }
      args += t["function"]["arguments"].get<std::string>();
    }
  EXPECT_EQ(with_name, 1);  // the name (and id) only on the call's first delta
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(json::parse(args), json({{"city", "Paris"}}));
  const json calls = c.tool_calls_message();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["id"], id);
  EXPECT_EQ(json::parse(calls[0]["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  EXPECT_EQ(c.logprobs_all().size(), script.size());
}

TEST(ServerChoice, StopStringEndsContentAndAsksForCancel) {
  const auto script = ids(O + "response" + S + "Hello STOP world, more text" + C + "response" + S + END);
  ChoiceStream c(Api::kChat, T(), ChoiceOptions{.stop = {"STOP"}});
  auto deltas = run_choice(c, script, FinishReason::stop);
  EXPECT_TRUE(c.done());
  EXPECT_EQ(c.content(), "Hello ");
  EXPECT_EQ(c.finish_reason(), "stop");
  EXPECT_TRUE(deltas.back().cancel_engine);
  std::string streamed;
  for (const auto& d : deltas) streamed += d.content;
  EXPECT_EQ(streamed, "Hello ");
}

TEST(ServerChoice, CompletionTextAndLength) {
  const auto script = ids("abc def");
  ChoiceStream c(Api::kCompletion, T(), ChoiceOptions{});
  run_choice(c, script, FinishReason::length);
  EXPECT_EQ(c.content(), "abc def");
  EXPECT_EQ(c.finish_reason(), "length");
}

TEST(ServerHttp, StreamingChatWithToolCallInOpenAIShape) {
  // The K3 assistant message (MODEL.md §7) the chat grammar admits: think, an empty response, the call.
  Running r(ids("Hmm." + C + "think" + S + O + "response" + S + C + "response" + S + O + "tools" + S + O +
                "call tool=\"f\" index=\"1\"" + S + O + "argument key=\"x\" type=\"number\"" + S + "3" + C +
                "argument" + S + C + "call" + S + C + "tools" + S + C + "message" + S + END));
  const json req = {{"model", "m"}, {"stream", true}, {"stream_options", {{"include_usage", true}}}, {"temperature", 0},
                    {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                    {"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", {{"type", "object"}}}}}}}}};
  const std::string resp = raw(r.port, request("POST", "/v1/chat/completions", req.dump()));
  ASSERT_EQ(status(resp), 200) << resp;
  EXPECT_NE(resp.find("Content-Type: text/event-stream"), std::string::npos);
  const auto ev = sse_events(body_of(resp));
  ASSERT_GE(ev.size(), 4u);
  EXPECT_EQ(ev.back(), "[DONE]");
  const json first = json::parse(ev[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["usage"].is_null());
  std::string reasoning, args, finish;
  int names = 0;
  for (size_t i = 0; i + 2 < ev.size(); ++i) {
    const json c = json::parse(ev[i]);
    EXPECT_EQ(c["id"], first["id"]);
    EXPECT_EQ(c["model"], "m");
    ASSERT_EQ(c["choices"].size(), 1u);
    const json& d = c["choices"][0]["delta"];
    if (d.contains("reasoning_content")) {
      reasoning += d["reasoning_content"].get<std::string>();
      EXPECT_EQ(d["reasoning"], d["reasoning_content"]);
    }
    if (d.contains("tool_calls"))
      for (const auto& t : d["tool_calls"]) {
        if (t["function"].contains("name")) ++names;
        args += t["function"]["arguments"].get<std::string>();
      }
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(reasoning, "Hmm.");
  EXPECT_EQ(names, 1);
  EXPECT_EQ(json::parse(args), json({{"x", 3}}));
  EXPECT_EQ(finish, "tool_calls");
  const json usage = json::parse(ev[ev.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_GT(usage["usage"]["prompt_tokens"].get<int>(), 0);
  EXPECT_GT(usage["usage"]["completion_tokens"].get<int>(), 0);
  EXPECT_GT(usage["usage"]["completion_tokens_details"]["reasoning_tokens"].get<int>(), 0);
}

TEST(ServerHttp, NonStreamingCompletionAndErrors) {
  // 25 ms per step: the 16 choices below are all submitted while the first step runs, so the queue fills and
  // the 13th is refused; a step of no time let the engine finish choices between submissions (a flake in CI).
  Running r(ids("one two three"), "sekrit", std::chrono::milliseconds(25));
  const std::string auth = "Authorization: Bearer sekrit\r\n";
  const json req = {{"model", "m"}, {"prompt", "hi"}, {"max_tokens", 3}, {"temperature", 0}};
  std::string resp = raw(r.port, request("POST", "/v1/completions", req.dump(), auth));
  ASSERT_EQ(status(resp), 200) << resp;
  const json b = json::parse(body_of(resp));
  EXPECT_EQ(b["object"], "text_completion");
  EXPECT_EQ(b["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(b["usage"]["completion_tokens"], 3);

  EXPECT_EQ(status(raw(r.port, request("POST", "/v1/completions", req.dump()))), 401);
  EXPECT_EQ(status(raw(r.port, request("POST", "/v1/completions", "{bad json", auth))), 400);
  EXPECT_EQ(status(raw(r.port, request("POST", "/v1/completions", R"({"prompt": "x", "model": "other"})", auth))), 404);
  EXPECT_EQ(status(raw(r.port, request("POST", "/v1/completions", R"({"prompt": "x", "max_tokens": 5000})", auth))), 400);
  EXPECT_EQ(status(raw(r.port, request("POST", "/v1/completions", std::string(70000, ' '), auth))), 413);
  EXPECT_EQ(status(raw(r.port, request("GET", "/nope", ""))), 404);
  EXPECT_EQ(status(raw(r.port, "GARBAGE\r\n\r\n")), 400);
  EXPECT_EQ(status(raw(r.port, request("GET", "/health", ""))), 200);
  const std::string m = body_of(raw(r.port, request("GET", "/metrics", "")));
  EXPECT_NE(m.find("vllm:num_requests_running{model_name=\"m\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("vllm:generation_tokens_total{model_name=\"m\"} 3"), std::string::npos) << m;
  // Without speculation the spec_decode counters are there and zero (the nano e2e test sees them count).
  EXPECT_NE(m.find("vllm:spec_decode_num_drafts_total{model_name=\"m\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 0"), std::string::npos) << m;
  // Nor without --async-scheduling any step run ahead (tests/py/test_async_serve.py sees it count).
  EXPECT_NE(m.find("kestrel:ahead_steps_total{model_name=\"m\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 1"), std::string::npos) << m;
  // n = 16 choices against 4 running + 8 waiting: the 13th is refused, the 12 before it are cancelled,
  // and their late events touch nothing; the server goes on answering.
  EXPECT_EQ(status(raw(r.port, request("POST", "/v1/completions", R"({"prompt": "x", "n": 16, "max_tokens": 3})", auth))), 429);
  resp = raw(r.port, request("POST", "/v1/completions", req.dump(), auth));
  EXPECT_EQ(status(resp), 200) << resp;
  EXPECT_EQ(json::parse(body_of(resp))["usage"]["completion_tokens"], 3);
}
