// Structured outputs on the trained k3-tiny (models/k3-tiny) through the CPU engine, the way the
// server builds requests (chat encoder → OutputConstraint → GrammarCache → engine):
//  - strict json_schema answers: many sampled requests (temperature 1, one seed each), short strict
//    schemas, thinking off; every answer must end the message, parse and validate. CI runs
//    KESTREL_K3TINY_REQUESTS (half as many tool requests). CI's default is 5 schema requests (one per
//    schema) and 2 tool requests (one "required", one named): the CPU executor decodes one sequence
//    after another, and 40 took 300-700 s per test on CI's 2 cores, past its 30-minute budget; the
//    big run is in bench/RESULTS.md
//    (KESTREL_K3TINY_REQUESTS=1000 build/tests/unit/kestrel_unit_tests --gtest_filter='K3TinyStructured.*');
//    KESTREL_K3TINY_DEVICE=cuda runs the same requests on the GPU engine (CUDA graphs on) instead — the
//    1,000-request run on the H200 is `K3TINY_REQUESTS=1000 bench/gpu/run.sh structured`;
//  - tool_choice "required" with the eval set's tools: every call names a declared tool and its
//    arguments validate against the tool's parameters (100 %), and a named tool_choice calls only it.
// All requests of a test share one engine at high concurrency; prompts repeat (a few per schema, one
// seed per request) so the prefix cache serves their heads and the time goes to decoding.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>

#include "evalclient/json_schema.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "runtime/engine.h"
#include "runtime/engine_host.h"
#include "structured/constraint.h"
#include "tokenizer/chat.h"
#include "tokenizer/text_stream.h"

namespace kestrel {
namespace {

using structured::ojson;
using json = nlohmann::json;

struct K3Tiny {
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  ModelWeights w;
  std::unique_ptr<tok::Tokenizer> tok;
  std::unique_ptr<structured::GrammarCache> cache;
};

const K3Tiny& k3() {
  static K3Tiny* m = [] {
    const std::string dir = std::string(KESTREL_SOURCE_DIR) + "/models/k3-tiny";
    auto* p = new K3Tiny;
    p->cfg = load_config(dir);
    p->ckpt = std::make_unique<Checkpoint>(dir);
    p->w = bind_weights(p->cfg, *p->ckpt);
    p->tok = std::make_unique<tok::Tokenizer>(tok::Tokenizer::load(dir));
    auto vocab = std::make_shared<const structured::TokenVocab>(*p->tok, size_t(p->cfg.text.vocab_size));
    p->cache = std::make_unique<structured::GrammarCache>(vocab);
    return p;
  }();
  return *m;
}

// KESTREL_K3TINY_REQUESTS divided by `share` (at least 1), or CI's small default.
int requests_wanted(int ci_default, int share = 1) {
  const char* v = std::getenv("KESTREL_K3TINY_REQUESTS");
  return v ? std::max(1, std::atoi(v) / share) : ci_default;
}

// One chat request as the server builds it.
struct Built {
  Request r;
  bool thinking = true;
  std::vector<std::string> tools;
};

Built build(const ojson& body, uint64_t seed, int32_t max_tokens) {
  const tok::ChatEncoder enc(*k3().tok);
  const tok::ChatPrompt p = enc.encode_request(body);
  Built b;
  b.r.prompt.assign(p.ids.begin(), p.ids.end());
  b.r.max_tokens = max_tokens;
  b.r.sampling.temperature = 1.0f;
  b.r.sampling.seed = seed;
  b.thinking = p.thinking;
  b.tools = p.tool_names;
  b.r.constraint = structured::constraint_of(structured::chat_grammar_spec(body, p.thinking),
                                             structured::response_format_of(body));
  b.r.constraint->grammar = structured::compile(*k3().cache, *b.r.constraint);
  return b;
}

struct Out {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::none;
  std::string error;
};

// Runs every request on one engine; returns the outputs in order.
std::vector<Out> run_all(std::vector<Built>& reqs, int concurrency) {
  runtime::EngineConfig cfg;
  cfg.memory_budget = int64_t(512) << 20;
  cfg.max_running = concurrency;
  cfg.formats.block_size = 16;  // prefix-cache hits down to the last 16 tokens of a repeated prompt
  std::unique_ptr<runtime::EngineHost> host;  // KESTREL_K3TINY_DEVICE=cuda: the GPU engine, built as serve builds it
  std::unique_ptr<runtime::Engine> cpu;
  const char* dev = std::getenv("KESTREL_K3TINY_DEVICE");
  if (dev != nullptr && std::string(dev) == "cuda") {
    runtime::EngineOptions o;
    o.model_dir = std::string(KESTREL_SOURCE_DIR) + "/models/k3-tiny";
    o.device = runtime::Device::cuda;
    o.memory_budget = cfg.memory_budget;
    o.engine = cfg;
    host = std::make_unique<runtime::EngineHost>(o);
    if (!host->wait_loaded()) {
      ADD_FAILURE() << "the GPU engine did not load: " << host->load_error();
      return std::vector<Out>(reqs.size());  // unfinished: every request's check then fails
    }
  } else {
    cpu = std::make_unique<runtime::Engine>(k3().w, k3().cfg, cfg);
  }
  runtime::Engine& e = host ? host->engine() : *cpu;
  std::mutex mu;
  std::vector<Out> out(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto s = e.submit(reqs[i].r, [&, i](TokenEvent&& ev) {
      std::lock_guard<std::mutex> lk(mu);
      if (ev.token >= 0) out[i].tokens.push_back(ev.token);
      if (ev.finished()) out[i].finish = ev.finish, out[i].error = ev.error;
    });
    EXPECT_TRUE(s.accepted());
  }
  e.wait_idle();
  const auto st = e.structured_stats();
  const auto es = e.stats();
  std::printf("  engine: %lld steps, %lld tokens generated, %.1f s busy; masks: %lld masked / %lld free samples, "
              "%lld redraws, fill %.3f s (worker), wait %.3f s + host %.3f s (engine thread)\n",
              (long long)es.steps, (long long)es.generation_tokens, es.busy_seconds, (long long)st.masked_samples,
              (long long)st.free_samples, (long long)st.redraws, st.fill_seconds, st.wait_seconds, st.host_seconds);
  return out;
}

// The message as the server's text stream parses it.
tok::TextStream parse(const Built& b, const Out& o) {
  tok::TextStream ts = tok::TextStream::chat(*k3().tok, b.thinking, b.tools, {});
  for (size_t i = 0; i < o.tokens.size(); ++i) {
    if (i + 1 == o.tokens.size() && o.finish == FinishReason::stop) break;  // the stop token is not text
    ts.push(tok::TokenId(o.tokens[i]));
  }
  ts.finish(o.finish == FinishReason::length ? tok::FinishCause::kLength : tok::FinishCause::kStop);
  return ts;
}

const char* kSchemas[] = {
    R"({"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 1000},
        "unit": {"enum": ["apples", "books", "coins", "none"]}}, "required": ["answer", "unit"],
        "additionalProperties": false})",
    R"({"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
        "sunny": {"type": "boolean"}, "celsius": {"type": "number", "minimum": -50, "maximum": 60}},
        "required": ["city", "sunny", "celsius"], "additionalProperties": false})",
    R"({"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 8},
        "minItems": 1, "maxItems": 3}, "done": {"type": "boolean"}}, "required": ["items", "done"],
        "additionalProperties": false})",
    R"({"type": "object", "properties": {"label": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["label", "score"],
        "additionalProperties": false})",
    R"({"type": "object", "properties": {"date": {"type": "string", "format": "date"},
        "kind": {"const": "event"}, "who": {"type": "array", "items": {"enum": ["Ann", "Bo", "Cy"]}, "maxItems": 3}},
        "required": ["date", "kind", "who"], "additionalProperties": false})",
};
const char* kQuestions[] = {"Sam has 4 books. Then Sam gets 3 more. How many books does Sam have now?",
                            "What is the weather in Oslo?", "Hello", "List two fruits."};

TEST(K3TinyStructured, StrictSchemaAnswersAllValidate) {
  const int n = requests_wanted(5);
  std::vector<Built> reqs;
  std::vector<int> schema_of;
  for (int i = 0; i < n; ++i) {
    const int s = i % 5, q = (i / 5) % 4;
    ojson body = {{"messages", ojson::array({ojson{{"role", "user"}, {"content", kQuestions[q]}}})},
                  {"chat_template_kwargs", {{"thinking", false}}},
                  {"response_format", {{"type", "json_schema"},
                                       {"json_schema", {{"name", "answer"}, {"strict", true},
                                                        {"schema", ojson::parse(kSchemas[s])}}}}}};
    reqs.push_back(build(body, uint64_t(5000 + i), 400));
    schema_of.push_back(s);
  }
  const auto out = run_all(reqs, 64);
  int valid = 0;
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    ASSERT_EQ(out[size_t(i)].finish, FinishReason::stop) << out[size_t(i)].error;
    const tok::TextStream ts = parse(reqs[size_t(i)], out[size_t(i)]);
    EXPECT_TRUE(ts.tool_calls().empty());
    const json doc = json::parse(ts.content(), nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << "not JSON: " << ts.content();
    const std::string err = eval::JsonSchema(json::parse(kSchemas[schema_of[size_t(i)]])).validate(doc);
    EXPECT_EQ(err, "") << ts.content();
    valid += err.empty();
  }
  std::printf("k3-tiny strict json_schema: %d requests, %d valid documents\n", n, valid);
}

// The eval set's tool requests with tool_choice "required" (every 3rd, from the 2nd: a named tool instead).
TEST(K3TinyStructured, RequiredAndNamedToolCallsAreSchemaValid) {
  std::ifstream f(std::string(KESTREL_SOURCE_DIR) + "/models/k3-tiny/eval/tool.jsonl");
  ASSERT_TRUE(f);
  const int n = requests_wanted(2, 2);
  std::vector<Built> reqs;
  std::vector<ojson> tools_of;
  std::vector<std::string> named;
  std::string line;
  for (int i = 0; i < n && std::getline(f, line); ++i) {
    ojson body = ojson::parse(line)["request"];
    body["reasoning_effort"] = "low";
    named.push_back("");
    if (i % 3 == 1) {
      named.back() = body["tools"][size_t(i) % body["tools"].size()]["function"]["name"].get<std::string>();
      body["tool_choice"] = {{"type", "function"}, {"function", {{"name", named.back()}}}};
    } else {
      body["tool_choice"] = "required";
    }
    tools_of.push_back(body["tools"]);
    reqs.push_back(build(body, uint64_t(9000 + i), 400));
  }
  const auto out = run_all(reqs, 64);
  int calls = 0, finished = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(i);
    const Out& o = out[i];
    ASSERT_TRUE(o.finish == FinishReason::stop || o.finish == FinishReason::length) << o.error;
    const tok::TextStream ts = parse(reqs[i], o);
    if (o.finish == FinishReason::length) continue;  // reasoning ran to max_tokens: no call yet
    ++finished;
    ASSERT_FALSE(ts.tool_calls().empty()) << "tool_choice forces a call: " << ts.content();
    if (!named[i].empty()) {
      EXPECT_EQ(ts.tool_calls().size(), 1u);
    }
    for (const auto& c : ts.tool_calls()) {
      ++calls;
      EXPECT_TRUE(c.complete && c.error.empty()) << c.name << ": " << c.error;
      if (!named[i].empty()) {
        EXPECT_EQ(c.name, named[i]);
      }
      const ojson* params = nullptr;
      for (const auto& t : tools_of[i])
        if (t["function"]["name"] == c.name) params = &t["function"]["parameters"];
      ASSERT_NE(params, nullptr) << "undeclared tool " << c.name;
      const json args = json::parse(c.arguments, nullptr, false);
      ASSERT_FALSE(args.is_discarded()) << c.arguments;
      EXPECT_EQ(eval::JsonSchema(json::parse(params->dump())).validate(args), "") << c.name << " " << c.arguments;
    }
  }
  std::printf("k3-tiny tool_choice required/named: %zu requests, %d finished, %d calls, all checked\n", reqs.size(),
              finished, calls);
  EXPECT_GE(finished, int(reqs.size()) * 9 / 10);
}

}  // namespace
}  // namespace kestrel
