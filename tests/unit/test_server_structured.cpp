// Structured outputs at the server (server/structured.h): which bodies become which constraints, the
// 400s that name the keyword, the GrammarService's cache and workers, and the whole HTTP server over
// the real engine with a fake executor whose greedy output is a script that breaks the request's
// rules (a tool call without tools, the wrong tool, with tool_choice "none"): the grammar overrides
// it. The engine-level behaviour (masks, ends, errors) is test_engine_structured.cpp's.
#include <gtest/gtest.h>

#include <boost/asio.hpp>

#include <chrono>
#include <future>
#include <thread>

#include "loader/config.h"
#include "runtime/engine.h"
#include "runtime/fake_executor.h"
#include "server/http_server.h"
#include "server/structured.h"
#include "tokenizer/chat.h"
#include "chat_markers.h"

using namespace kestrel;
using namespace kestrel::server;
using nlohmann::json;

namespace {

const tok::Tokenizer& T() {
  static const tok::Tokenizer t = tok::Tokenizer::load(std::string(KESTREL_SOURCE_DIR) + "/tests/data/tok_golden");
  return t;
}

std::vector<int32_t> ids(const std::string& text) {
  std::vector<int32_t> out;
  for (auto id : T().encode(text, /*allow_special=*/true)) out.push_back(int32_t(id));
  return out;
}

using kestrel::chat_markers::C;
using kestrel::chat_markers::O;
using kestrel::chat_markers::S;
using kestrel::chat_markers::END;

ojson body(const std::string& text) { return ojson::parse(text); }

tok::ChatPrompt prompt(const ojson& b) { return tok::ChatEncoder(T()).encode_request(b); }

// The ApiError a call throws (status, param), or {0, ""}.
std::pair<int, std::string> refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return {e.status, e.param};
  }
  return {0, ""};
}

const char* kMsgs = R"("messages": [{"role": "user", "content": "hi"}])";
const char* kTool = R"({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
    "properties": {"x": {"type": "integer"}}, "required": ["x"]}}})";

TEST(ServerStructured, WhichBodiesAreConstrained) {
  using F = OutputConstraint::Format;
  using TC = OutputConstraint::ToolChoice;
  auto chat = [](const std::string& b, bool ignore_eos = false) {
    const ojson j = body(b);
    return GrammarService::chat_constraint(j, prompt(j), ignore_eos);
  };
  // A plain chat request: the chat grammar (no tools section), thinking as the prompt says.
  auto c = chat(std::string("{") + kMsgs + "}");
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->chat && c->thinking && c->tools.empty() && c->format == F::text);
  c = chat(std::string("{") + kMsgs + R"(, "chat_template_kwargs": {"thinking": false}})");
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->thinking);
  // ... but not under ignore_eos (a benchmark asking for tokens past the message's end).
  EXPECT_FALSE(chat(std::string("{") + kMsgs + "}", true));
  c = chat(std::string("{") + kMsgs + R"(, "tools": [)" + kTool + R"(], "tool_choice": "required",
      "parallel_tool_calls": false})", true);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->tool_choice, TC::required);
  EXPECT_EQ(c->max_calls, 1u);
  ASSERT_EQ(c->tools.size(), 1u);
  EXPECT_EQ(json::parse(c->tools[0].parameters)["required"][0], "x");
  c = chat(std::string("{") + kMsgs + R"(, "response_format": {"type": "json_schema", "json_schema":
      {"name": "a", "strict": true, "schema": {"type": "object", "properties": {"b": {"type": "boolean"}}}}}})");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->format, F::json_schema);
  EXPECT_EQ(json::parse(c->schema)["properties"]["b"]["type"], "boolean");
  // No generation prompt: no constraint; a JSON format or a forced tool then is a 400.
  EXPECT_FALSE(chat(std::string("{") + kMsgs + R"(, "add_generation_prompt": false})"));
  EXPECT_EQ(refusal([&] { chat(std::string("{") + kMsgs + R"(, "add_generation_prompt": false,
      "response_format": {"type": "json_object"}})"); }), std::make_pair(400, std::string("response_format")));
  EXPECT_EQ(refusal([&] { chat(std::string("{") + kMsgs + R"(, "tools": [)" + kTool + R"(],
      "parallel_tool_calls": 3})"); }).first, 400);
  // Completions: a document only with a JSON response_format.
  EXPECT_FALSE(GrammarService::completion_constraint(body(R"({"prompt": "x"})")));
  auto d = GrammarService::completion_constraint(body(R"({"prompt": "x", "response_format": {"type": "json_object"}})"));
  ASSERT_TRUE(d);
  EXPECT_FALSE(d->chat);
  EXPECT_EQ(d->format, F::json_object);
  EXPECT_EQ(refusal([&] { GrammarService::completion_constraint(body(R"({"response_format": {"type": "yaml"}})")); }),
            std::make_pair(400, std::string("response_format")));
}

// Budget-aware completion (docs/structured-outputs.md, "Finishing within max_tokens") is for answers that
// can only be JSON: on by default for json_object / json_schema, per request or server off; never for a
// text answer (a cut text is honestly "length") nor where a tool call could be forced closed.
TEST(ServerStructured, WhichAnswersCompleteWithinMaxTokens) {
  auto on = [](const std::string& extra, bool server_default = true) {
    const ojson j = body(std::string("{") + kMsgs + extra + "}");
    auto c = GrammarService::chat_constraint(j, prompt(j), false);
    GrammarService::set_completion(c, j, server_default);
    return c && c->complete_within_max_tokens;
  };
  const std::string json_object = R"(, "response_format": {"type": "json_object"})";
  const std::string schema = R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema":
      {"type": "object", "properties": {"b": {"type": "boolean"}}}}})";
  EXPECT_TRUE(on(json_object));
  EXPECT_TRUE(on(schema));
  EXPECT_FALSE(on(""));
  EXPECT_FALSE(on(std::string(R"(, "tools": [)") + kTool + "]"));
  EXPECT_FALSE(on(json_object + R"(, "tools": [)" + kTool + "]"));
  EXPECT_TRUE(on(json_object + R"(, "tools": [)" + kTool + R"(], "tool_choice": "none")"));
  EXPECT_FALSE(on(json_object + R"(, "complete_within_max_tokens": false)"));
  EXPECT_FALSE(on(json_object, false));
  EXPECT_TRUE(on(json_object + R"(, "complete_within_max_tokens": true)", false));
  EXPECT_EQ(refusal([&] { on(json_object + R"(, "complete_within_max_tokens": 1)"); }),
            std::make_pair(400, std::string("complete_within_max_tokens")));
  // Completions: the document grammar.
  const ojson j = body(R"({"prompt": "x", "response_format": {"type": "json_object"}})");
  auto d = GrammarService::completion_constraint(j);
  GrammarService::set_completion(d, j, true);
  ASSERT_TRUE(d);
  EXPECT_TRUE(d->complete_within_max_tokens);
}

TEST(ServerStructured, GrammarServiceCompilesOffTheCallerAndCachesRefusals) {
  StructuredOptions opt;
  opt.compile_threads = 1;
  GrammarService gs(T(), opt);
  const int64_t V = int64_t(T().vocab_size());
  const ojson b = body(std::string("{") + kMsgs + R"(, "response_format": {"type": "json_schema", "json_schema":
      {"schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}}})");
  auto c = GrammarService::chat_constraint(b, prompt(b), false);
  ASSERT_TRUE(c);
  EXPECT_EQ(gs.find(*c, V), nullptr) << "nothing compiled yet";
  std::promise<std::pair<bool, std::thread::id>> done;
  gs.compile_async(*c, V, [&](auto g, auto err) { done.set_value({g != nullptr && !err, std::this_thread::get_id()}); });
  const auto [ok, on] = done.get_future().get();
  EXPECT_TRUE(ok);
  EXPECT_NE(on, std::this_thread::get_id()) << "compiled on a worker";
  EXPECT_NE(gs.find(*c, V), nullptr) << "cached now";
  // An unsupported keyword: a 400 naming it, from the worker, then from the cache at once.
  const ojson bad = body(std::string("{") + kMsgs + R"(, "response_format": {"type": "json_schema", "json_schema":
      {"schema": {"type": "object", "properties": {"n": {"type": "string", "pattern": "^a"}}}}}})");
  auto cb = GrammarService::chat_constraint(bad, prompt(bad), false);
  std::promise<std::optional<ApiError>> e1;
  gs.compile_async(*cb, V, [&](auto, auto err) { e1.set_value(err); });
  const auto err = e1.get_future().get();
  ASSERT_TRUE(err);
  EXPECT_EQ(err->status, 400);
  EXPECT_EQ(err->param, "response_format");
  EXPECT_NE(std::string(err->what()).find("'pattern'"), std::string::npos) << err->what();
  EXPECT_NE(std::string(err->what()).find("/properties/n"), std::string::npos) << err->what();
  EXPECT_EQ(refusal([&] { gs.find(*cb, V); }), std::make_pair(400, std::string("response_format")));
  // A tool's parameters: param "tools".
  const ojson bt = body(std::string("{") + kMsgs + R"(, "tools": [{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}]})");
  auto ct = GrammarService::chat_constraint(bt, prompt(bt), false);
  std::promise<std::optional<ApiError>> e2;
  gs.compile_async(*ct, V, [&](auto, auto err) { e2.set_value(err); });
  const auto err2 = e2.get_future().get();
  ASSERT_TRUE(err2);
  EXPECT_EQ(err2->param, "tools");
  EXPECT_NE(std::string(err2->what()).find("'not'"), std::string::npos) << err2->what();
  EXPECT_GE(gs.stats().entries, 3u);
}

// Adversarial schemas at the service (issue #20 item 4): each is a 400 within bounded time or a
// bounded compile, never a hang or an unconstrained request; the limits are the serve flags' options.
TEST(ServerStructured, AdversarialSchemasAreBounded) {
  StructuredOptions opt;
  opt.compile_threads = 1;
  opt.limits.max_compile_seconds = 5.0;
  GrammarService gs(T(), opt);
  const int64_t V = int64_t(T().vocab_size());
  // The error (nullopt: compiled) and the seconds the compile took.
  auto outcome = [&](GrammarService& g, const ojson& schema) {
    ojson b = body(std::string("{") + kMsgs + "}");
    b["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", schema}}}};
    auto c = GrammarService::chat_constraint(b, prompt(b), false);
    EXPECT_TRUE(c);
    std::promise<std::optional<ApiError>> p;
    const auto t0 = std::chrono::steady_clock::now();
    g.compile_async(*c, V, [&](auto gr, auto err) {
      EXPECT_TRUE(bool(gr) != bool(err));
      p.set_value(err);
    });
    auto err = p.get_future().get();
    return std::make_pair(err, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  // 100,000 enum values: refused, naming the count and the limit.
  ojson big = ojson::array();
  for (int i = 0; i < 100000; ++i) big.push_back("v" + std::to_string(i));
  auto [e1, t1] = outcome(gs, {{"enum", big}});
  ASSERT_TRUE(e1);
  EXPECT_EQ(e1->status, 400);
  EXPECT_EQ(e1->param, "response_format");
  EXPECT_NE(std::string(e1->what()).find("100000 values"), std::string::npos) << e1->what();
  // Nesting far past the depth limit: refused (the limit is checked before any recursive copy).
  ojson deep = {{"type", "integer"}};
  for (int i = 0; i < 3000; ++i) deep = ojson{{"type", "array"}, {"items", deep}};
  auto [e2, t2] = outcome(gs, deep);
  ASSERT_TRUE(e2);
  EXPECT_NE(std::string(e2->what()).find("deeper than"), std::string::npos) << e2->what();
  // Recursion that reads nothing: refused (recursion through a container compiles: test_structured.cpp).
  auto [e3, t3] = outcome(gs, ojson::parse(R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
      "$ref": "#/$defs/a"})"));
  ASSERT_TRUE(e3);
  EXPECT_EQ(e3->status, 400);
  for (double t : {t1, t2, t3}) EXPECT_LT(t, opt.limits.max_compile_seconds + 2.0);
  // The limits bound a compile that would otherwise succeed: few states, or no time at all.
  const ojson wide = ojson::parse(R"({"type": "object", "properties": {"a": {"type": "string", "format": "date-time"},
      "b": {"type": "string", "format": "email"}, "c": {"type": "number", "minimum": -5.5, "maximum": 1e6}},
      "required": ["a", "b", "c"], "additionalProperties": false})");
  StructuredOptions tiny = opt;
  tiny.limits.max_states = 50;
  GrammarService gs_states(T(), tiny);
  const auto e5 = outcome(gs_states, wide).first;
  ASSERT_TRUE(e5);
  EXPECT_NE(std::string(e5->what()).find("limit"), std::string::npos) << e5->what();
  tiny = opt;
  tiny.limits.max_compile_seconds = 1e-9;
  GrammarService gs_time(T(), tiny);
  const auto e6 = outcome(gs_time, wide).first;
  ASSERT_TRUE(e6);
  EXPECT_NE(std::string(e6->what()).find("longer than"), std::string::npos) << e6->what();
}

// ---- over HTTP ------------------------------------------------------------------------------------

namespace net = boost::asio;
using tcp = net::ip::tcp;

struct Running {
  explicit Running(std::vector<int32_t> script) {
    const char* d = std::getenv("KESTREL_NANO_DIR");
    if (!d) throw std::runtime_error("KESTREL_NANO_DIR is not set");
    cfg = load_config(d);
    cfg.text.vocab_size = int(T().vocab_size());
    runtime::EngineConfig ec;
    ec.max_running = 4;
    ec.formats.block_size = 16;
    ec.memory_budget = int64_t(256) << 20;
    ec.max_model_len = 4096;
    for (tok::TokenId id : tok::end_of_turn_ids(T())) ec.eos_token_ids.push_back(int32_t(id));
    runtime::FakeExecutorOptions f;
    f.script = std::move(script);
    ec.make_executor = runtime::fake_executor_factory(cfg.text.vocab_size, f);
    engine = std::make_unique<runtime::Engine>(cfg, ec);
    ServerOptions so;
    so.port = 0;
    so.served_model_name = "m";
    server = std::make_unique<Server>(so, *engine, T());
    server->listen();
    port = server->port();
    thread = std::thread([this] { server->run(); });
  }
  ~Running() {
    server->shutdown();
    thread.join();
    engine->shutdown();
    server.reset();
  }
  ModelConfig cfg;
  std::unique_ptr<runtime::Engine> engine;
  std::unique_ptr<Server> server;
  uint16_t port = 0;
  std::thread thread;
};

// POSTs `b` (non-streaming) and returns (status, body).
std::pair<int, json> post(uint16_t port, const std::string& path, const json& b) {
  net::io_context io;
  tcp::socket s(io);
  s.connect({net::ip::make_address("127.0.0.1"), port});
  const std::string data = b.dump();
  const std::string req = "POST " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(data.size()) + "\r\n\r\n" + data;
  boost::system::error_code ec;
  net::write(s, net::buffer(req), ec);
  std::string out;
  char buf[4096];
  for (;;) {
    const size_t n = s.read_some(net::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  const int status = std::stoi(out.substr(9, 3));
  return {status, json::parse(out.substr(out.find("\r\n\r\n") + 4), nullptr, false)};
}

// What the fake model wants to say: reasoning, an empty response, then a call of `f` with x = 3.
std::string call_script(const std::string& tool) {
  return "Hmm." + C + "think" + S + O + "response" + S + C + "response" + S + O + "tools" + S + O + "call tool=\"" +
         tool + "\" index=\"1\"" + S + O + "argument key=\"x\" type=\"number\"" + S + "3" + C + "argument" + S + C +
         "call" + S + C + "tools" + S + C + "message" + S + END;
}

json chat_body(const std::string& extra) {
  return json::parse(std::string(R"({"model": "m", "temperature": 0, "max_tokens": 200, )") + kMsgs + extra + "}");
}

TEST(ServerStructured, HttpToolRulesOverrideTheModel) {
  Running r(ids(call_script("f")));
  const std::string tools = std::string(R"(, "tools": [)") + kTool + R"(, {"type": "function", "function": {"name": "g",
      "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}])";
  // Declared and allowed: the call comes through.
  auto [st, b] = post(r.port, "/v1/chat/completions", chat_body(tools));
  ASSERT_EQ(st, 200) << b.dump();
  ASSERT_EQ(b["choices"][0]["message"]["tool_calls"].size(), 1u) << b.dump();
  EXPECT_EQ(b["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(b["choices"][0]["finish_reason"], "tool_calls");
  // No tools: the tools section cannot open.
  std::tie(st, b) = post(r.port, "/v1/chat/completions", chat_body(""));
  ASSERT_EQ(st, 200) << b.dump();
  EXPECT_TRUE(b["choices"][0]["message"]["tool_calls"].empty()) << b.dump();
  EXPECT_EQ(b["choices"][0]["finish_reason"], "stop");
  // tool_choice none: neither.
  std::tie(st, b) = post(r.port, "/v1/chat/completions", chat_body(tools + R"(, "tool_choice": "none")"));
  ASSERT_EQ(st, 200) << b.dump();
  EXPECT_TRUE(b["choices"][0]["message"]["tool_calls"].empty()) << b.dump();
  // A named tool: only that one, whatever the model wanted.
  std::tie(st, b) = post(r.port, "/v1/chat/completions",
                         chat_body(tools + R"(, "tool_choice": {"type": "function", "function": {"name": "g"}})"));
  ASSERT_EQ(st, 200) << b.dump();
  ASSERT_EQ(b["choices"][0]["message"]["tool_calls"].size(), 1u) << b.dump();
  EXPECT_EQ(b["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "g");
  EXPECT_TRUE(json::parse(b["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>())["x"]
                  .is_number_integer()) << b.dump();
  // An unsupported keyword: 400 naming it.
  std::tie(st, b) = post(r.port, "/v1/chat/completions", chat_body(R"(, "response_format": {"type": "json_schema",
      "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}}})"));
  EXPECT_EQ(st, 400);
  EXPECT_EQ(b["error"]["param"], "response_format");
  EXPECT_NE(b["error"]["message"].get<std::string>().find("'pattern'"), std::string::npos) << b.dump();
}

TEST(ServerStructured, HttpJsonAnswersParseAndValidate) {
  // The model's answer is JSON already; the grammar lets it through and ends the message.
  Running r(ids("{\"a\": true, \"n\": 7}" + C + "response" + S + C + "message" + S + END));
  const std::string rf = R"(, "chat_template_kwargs": {"thinking": false}, "response_format": {"type": "json_schema",
      "json_schema": {"name": "x", "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "boolean"},
      "n": {"type": "integer"}}, "required": ["a", "n"], "additionalProperties": false}}})";
  auto [st, b] = post(r.port, "/v1/chat/completions", chat_body(rf));
  ASSERT_EQ(st, 200) << b.dump();
  EXPECT_EQ(json::parse(b["choices"][0]["message"]["content"].get<std::string>()), json({{"a", true}, {"n", 7}}));
  EXPECT_EQ(b["choices"][0]["finish_reason"], "stop");
  // Completions: one document ended by the end-of-sequence id.
  Running r2(ids("{\"a\": false}" + END));
  std::tie(st, b) = post(r2.port, "/v1/completions", json{{"model", "m"}, {"prompt", "x"}, {"temperature", 0},
                                                          {"max_tokens", 100}, {"response_format", {{"type", "json_object"}}}});
  ASSERT_EQ(st, 200) << b.dump();
  EXPECT_EQ(json::parse(b["choices"][0]["text"].get<std::string>()), json({{"a", false}}));
  EXPECT_EQ(b["choices"][0]["finish_reason"], "stop");
}

// Every engine request one body makes is constrained: chat's n choices, the Responses API, and each
// choice of each prompt of a completions batch (echo kept as the completions API has it).
TEST(ServerStructured, HttpEveryChoiceIsConstrained) {
  Running r(ids(call_script("f")));
  // No tools declared: the model's call cannot open in either choice.
  json body = chat_body("");
  body["n"] = 2;
  body["temperature"] = 1.0;
  auto [st, b] = post(r.port, "/v1/chat/completions", body);
  ASSERT_EQ(st, 200) << b.dump();
  ASSERT_EQ(b["choices"].size(), 2u) << b.dump();
  for (const auto& c : b["choices"]) {
    EXPECT_TRUE(c["message"]["tool_calls"].empty()) << b.dump();
    EXPECT_EQ(c["finish_reason"], "stop") << b.dump();
  }
  // The Responses API takes the chat path: no function_call item without tools.
  std::tie(st, b) = post(r.port, "/v1/responses", json{{"model", "m"}, {"input", "hi"}, {"max_output_tokens", 200}});
  ASSERT_EQ(st, 200) << b.dump();
  ASSERT_TRUE(b["output"].is_array()) << b.dump();
  for (const auto& item : b["output"]) EXPECT_NE(item["type"], "function_call") << b.dump();
  EXPECT_EQ(b["status"], "completed") << b.dump();

  // Completions: the model would write text after the document; the grammar ends it there.
  Running r2(ids("{\"a\": false} and more" + END));
  std::tie(st, b) = post(r2.port, "/v1/completions",
                         json{{"model", "m"}, {"prompt", {"x", "y"}}, {"n", 2}, {"echo", true}, {"temperature", 0},
                              {"max_tokens", 40}, {"response_format", {{"type", "json_object"}}}});
  ASSERT_EQ(st, 200) << b.dump();
  ASSERT_EQ(b["choices"].size(), 4u) << b.dump();
  for (size_t i = 0; i < 4; ++i) {
    const std::string text = b["choices"][i]["text"].get<std::string>(), prompt = i < 2 ? "x" : "y";
    ASSERT_EQ(text.substr(0, 1), prompt) << b.dump();  // echo: the prompt first
    EXPECT_EQ(json::parse(text.substr(1), nullptr, false), json({{"a", false}})) << b.dump();
  }
}

}  // namespace
