// Shared by the engine's structured-output tests (test_engine_structured*.cpp): the nano checkpoint and
// its vocabulary, document constraints, an event collector, a closing-bias executor wrapper, and the
// JSON-Schema-Test-Suite draft-7 schemas as generation targets.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "nano_checkpoint.h"
#include "runtime/engine.h"
#include "structured/constraint.h"
#include "structured/json_schema_grammar.h"

namespace kestrel::engine_structured_testing {

using runtime::Engine;
using runtime::EngineConfig;
using structured::ojson;
using json = nlohmann::json;

inline const testing::NanoCheckpoint& nano() { return testing::nano_checkpoint(); }

inline std::shared_ptr<const structured::TokenVocab> nano_vocab() {
  static const auto v = std::make_shared<const structured::TokenVocab>(*nano().tok, size_t(nano().cfg.text.vocab_size));
  return v;
}

inline int32_t special(const char* name) { return int32_t(nano().tok->require_special(name)); }
inline int32_t end_of_msg() { return special("<|end_of_msg|>"); }

inline structured::SchemaLimits limits(uint32_t stack = 128) {
  structured::SchemaLimits l;
  l.max_compile_seconds = 900;  // sanitizer builds
  l.max_stack_depth = stack;
  return l;
}

// A document constraint (bare JSON, ended by an end-of-sequence id).
inline OutputConstraint document(const ojson& schema, uint32_t stack = 128) {
  OutputConstraint c = structured::document_constraint(OutputConstraint::Format::json_schema, schema);
  c.grammar = structured::compile_json_schema(nano_vocab(), schema, {}, limits(stack));
  return c;
}

struct Result {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::none;
  std::string error;
};

// Collects events by key.
class Sink {
 public:
  TokenSink operator()(int key) {
    return [this, key](TokenEvent&& ev) {
      std::lock_guard<std::mutex> lk(mu_);
      Result& r = out_[key];
      if (ev.token >= 0) r.tokens.push_back(ev.token);
      if (ev.finished()) r.finish = ev.finish, r.error = ev.error;
    };
  }
  Result get(int key) {
    std::lock_guard<std::mutex> lk(mu_);
    return out_[key];
  }

 private:
  std::mutex mu_;
  std::map<int, Result> out_;
};

inline std::string text_of(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t t : ids) {
    if (nano().tok->is_special(tok::TokenId(t))) continue;
    s += nano().tok->token_bytes(tok::TokenId(t));
  }
  return s;
}

// The CPU executor with +bias on the logits of tokens that hold one of `closers`, before the engine's
// sampler sees them (a model that tends to close what it opened).
class ClosingBias : public runtime::StepExecutor {
 public:
  ClosingBias(std::unique_ptr<runtime::StepExecutor> inner, float bias, const std::string& closers)
      : inner_(std::move(inner)), bias_(size_t(nano().cfg.text.vocab_size), 0.0f) {
    for (size_t id = 0; id < nano().tok->vocab_size(); ++id)
      if (!nano().tok->is_special(tok::TokenId(id)) &&
          nano().tok->token_bytes(tok::TokenId(id)).find_first_of(closers) != std::string::npos)
        bias_[id] = bias;
  }
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    runtime::StepHooks h = hooks;
    h.sample = [&](const sched::ScheduledSeq& x, std::span<const float> logits) {
      std::vector<float> b(logits.begin(), logits.end());
      for (size_t i = 0; i < b.size(); ++i) b[i] += bias_[i];
      return hooks.sample(x, b);
    };
    return inner_->run(plan, h);
  }
  const runtime::ExecutorStats& stats() const override { return inner_->stats(); }

 private:
  std::unique_ptr<runtime::StepExecutor> inner_;
  std::vector<float> bias_;
};

inline EngineConfig nano_engine_config(int max_running, float closing_bias = 0.0f) {
  EngineConfig cfg;
  cfg.memory_budget = 256 << 20;
  cfg.max_running = max_running;
  if (closing_bias > 0.0f)
    cfg.make_executor = [closing_bias](const CacheFormats& f, const cache::CacheConfig& cc) {
      return std::unique_ptr<runtime::StepExecutor>(std::make_unique<ClosingBias>(
          std::make_unique<runtime::Executor>(nano().w, nano().cfg, f, cc), closing_bias, "\"]},"));
    };
  return cfg;
}

inline std::vector<int32_t> prompt_of(const std::string& text) {
  std::vector<int32_t> p;
  for (tok::TokenId id : nano().tok->encode(text, false)) p.push_back(int32_t(id));
  return p;
}

inline constexpr const char* kSuiteDir = "/usr/share/json-schema-test-suite/tests/draft7";

struct SuiteTarget {
  std::string name;
  json validator_schema;  // for our validator (src/evalclient/json_schema)
  OutputConstraint c;     // a document constraint
};

// Every draft-7 suite schema the compiler accepts, as a document constraint; `refused` counts the rest.
inline std::vector<SuiteTarget> suite_targets(int& refused) {
  // The files and exclusions of test_structured.cpp (the validator's draft-7 coverage).
  const std::vector<std::string> files = {
      "additionalItems", "additionalProperties", "allOf", "anyOf", "boolean_schema", "const", "contains", "default",
      "dependencies", "enum", "exclusiveMaximum", "exclusiveMinimum", "if-then-else", "items", "maxItems",
      "maxLength", "maxProperties", "maximum", "minItems", "minLength", "minProperties", "minimum", "multipleOf",
      "not", "oneOf", "pattern", "patternProperties", "properties", "propertyNames", "ref", "required", "type",
      "uniqueItems"};
  const std::set<std::string> excluded = {"ref overrides any sibling keywords", "remote ref, containing refs itself",
                                          "Recursive references between schemas"};
  std::vector<SuiteTarget> targets;
  for (const auto& f : files) {
    std::ifstream in(std::string(kSuiteDir) + "/" + f + ".json");
    if (!in) {
      ADD_FAILURE() << kSuiteDir << "/" << f << ".json missing (json-schema-test-suite)";
      continue;
    }
    for (const auto& g : ojson::parse(in)) {
      if (excluded.count(g["description"].get<std::string>())) continue;
      try {
        targets.push_back({f + " / " + g["description"].get<std::string>(), json::parse(g["schema"].dump()),
                           document(g["schema"])});
      } catch (const Error&) {
        ++refused;  // refusals and their messages: test_structured.cpp
      }
    }
  }
  return targets;
}

}  // namespace kestrel::engine_structured_testing
