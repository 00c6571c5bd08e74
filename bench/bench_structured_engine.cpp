// Structured outputs in the engine: what a token mask costs per decode step (issue #20, item 3).
//
//   bench_structured_engine --model DIR [--device cpu|cuda] [--batch 1,64] [--tokens 48] [--reps 2]
//
// For each batch size B: B requests (distinct short prompts, greedy, ignore_eos, `tokens` tokens each)
// run on one engine twice — unconstrained, then each under the 30-property schema of bench_structured
// (a document grammar: every step is masked, none is free text, and no document ends within `tokens`).
// Reported per engine step: the step time of both runs (engine busy time / steps), and the constrained
// run's structured-output costs from Engine::structured_stats(): mask filling on the worker (overlapped
// with the forward), the engine thread's wait for a mask (the part the forward did not hide) and its
// own work (sync, accept, host masking or the device table hand-off). The critical path's share is
// (wait + host) / steps against the unconstrained step; the end-to-end difference of the two step times
// is shown too (noisy on a shared machine).
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/engine_host.h"
#include "structured/constraint.h"
#include "structured/json_schema_grammar.h"

using namespace kestrel;

namespace {

const char* kSchema = R"({"type": "object", "additionalProperties": false, "properties": {
  "id": {"type": "string", "format": "uuid"}, "name": {"type": "string", "maxLength": 40},
  "email": {"type": "string", "format": "email"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "height_m": {"type": "number", "minimum": 0.3, "maximum": 2.8}, "active": {"type": "boolean"},
  "role": {"enum": ["admin", "editor", "viewer", "guest"]}, "created": {"type": "string", "format": "date-time"},
  "birthday": {"type": "string", "format": "date"}, "score": {"type": "number"},
  "rank": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
  "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "country": {"type": "string", "minLength": 2, "maxLength": 2},
  "city": {"type": "string"}, "street": {"type": "string"}, "zip": {"type": "string"},
  "phone": {"type": "string"}, "website": {"type": "string", "format": "uri"}, "verified": {"type": "boolean"},
  "balance": {"type": "number", "exclusiveMinimum": -1000000}, "currency": {"enum": ["USD", "EUR", "JPY", "GBP"]},
  "notes": {"type": "string"}, "level": {"type": "integer", "minimum": 1, "maximum": 10},
  "ratios": {"type": "array", "items": {"type": "number"}}, "manager": {"anyOf": [{"type": "string"}, {"type": "null"}]},
  "address": {"type": "object", "properties": {"line": {"type": "string"}, "floor": {"type": "integer"}},
              "required": ["line", "floor"], "additionalProperties": false},
  "last_login": {"type": "string", "format": "date-time"}, "locale": {"type": "string"}, "timezone": {"type": "string"}},
  "required": ["id", "name", "email", "age", "height_m", "active", "role", "created", "birthday", "score", "rank",
    "tags", "nickname", "country", "city", "street", "zip", "phone", "website", "verified", "balance", "currency",
    "notes", "level", "ratios", "manager", "address", "last_login", "locale", "timezone"]})";

struct Run {
  double step_ms = 0;
  int64_t steps = 0, tokens = 0;
  runtime::Engine::StructuredStats s;
};

Run run(runtime::Engine& e, int B, int tokens, const std::optional<OutputConstraint>& c, int vocab) {
  const EngineStats before = e.stats();
  const auto sb = e.structured_stats();
  std::mutex mu;
  int64_t got = 0;
  for (int i = 0; i < B; ++i) {
    Request r;
    for (int k = 0; k < 12; ++k) r.prompt.push_back(int32_t((i * 131 + k * 17 + 5) % std::min(vocab, 200)));
    r.max_tokens = tokens;
    r.ignore_eos = true;
    r.constraint = c;
    e.submit(std::move(r), [&](TokenEvent&& ev) {
      std::lock_guard<std::mutex> lk(mu);
      got += ev.token >= 0;
      if (ev.finish == FinishReason::error) fmt::print(stderr, "error: {}\n", ev.error);
    });
  }
  e.wait_idle();
  const EngineStats after = e.stats();
  const auto sa = e.structured_stats();
  Run out;
  out.steps = after.steps - before.steps;
  out.tokens = got;
  out.step_ms = 1e3 * (after.busy_seconds - before.busy_seconds) / double(std::max<int64_t>(out.steps, 1));
  out.s.masked_samples = sa.masked_samples - sb.masked_samples;
  out.s.fill_seconds = sa.fill_seconds - sb.fill_seconds;
  out.s.stolen = sa.stolen - sb.stolen;
  out.s.wait_seconds = sa.wait_seconds - sb.wait_seconds;
  out.s.host_seconds = sa.host_seconds - sb.host_seconds;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, device = "cpu", batches = "1,64";
  int tokens = 48, reps = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--model") model = argv[i + 1];
    else if (a == "--device") device = argv[i + 1];
    else if (a == "--batch") batches = argv[i + 1];
    else if (a == "--tokens") tokens = std::atoi(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else {
      fmt::print(stderr, "usage: bench_structured_engine --model DIR [--device cpu|cuda] [--batch 1,64] [--tokens N] [--reps N]\n");
      return 2;
    }
  }
  if (model.empty()) {
    fmt::print(stderr, "--model is required\n");
    return 2;
  }
  std::vector<int> bs;
  for (size_t p = 0; p < batches.size();) {
    const size_t q = batches.find(',', p);
    bs.push_back(std::atoi(batches.substr(p, q - p).c_str()));
    p = q == std::string::npos ? batches.size() : q + 1;
  }
  try {
    const tok::Tokenizer tk = tok::Tokenizer::load(model);
    int maxb = 1;
    for (int b : bs) maxb = std::max(maxb, b);
    runtime::EngineOptions eo;
    eo.model_dir = model;
    eo.device = device == "cuda" ? runtime::Device::cuda : runtime::Device::cpu;
    eo.memory_budget = int64_t(2) << 30;
    eo.engine.max_running = maxb;
    eo.engine.enable_prefix_cache = false;
    eo.engine.max_num_batched_tokens = std::max(2048, maxb * 16);
    eo.tokenizer = &tk;
    runtime::EngineHost host(eo);
    if (!host.wait_loaded()) throw Error(host.load_error());
    runtime::Engine& e = host.engine();
    const int V = int(e.vocab_size());
    auto vocab = std::make_shared<const structured::TokenVocab>(tk, size_t(V));
    const auto t0 = std::chrono::steady_clock::now();
    OutputConstraint c =
        structured::document_constraint(OutputConstraint::Format::json_schema, structured::ojson::parse(kSchema));
    c.grammar = structured::compile_json_schema(vocab, structured::ojson::parse(kSchema));
    const double compile_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("model {} on {}, vocabulary {} ids, 30-property schema compiled in {:.0f} ms; {} tokens per request, "
               "{} reps\n\n", model, device, V, compile_ms, tokens, reps);
    fmt::print("| batch | step, free (ms) | step, constrained (ms) | fill / step (µs, worker) | wait / step (µs) | "
               "host / step (µs) | critical path / free step | end-to-end |\n|---|---|---|---|---|---|---|---|\n");
    run(e, 1, 4, std::nullopt, V);  // warm-up (CUDA graphs, allocator)
    run(e, 1, 4, c, V);
    for (int B : bs) {
      for (int rep = 0; rep < reps; ++rep) {
        const Run f = run(e, B, tokens, std::nullopt, V);
        const Run k = run(e, B, tokens, c, V);
        const double per = 1e6 / double(std::max<int64_t>(k.steps, 1));
        const double crit = (k.s.wait_seconds + k.s.host_seconds) * per;
        fmt::print("| {} | {:.3f} | {:.3f} | {:.1f} | {:.1f} | {:.1f} | {:.2f} % | {:+.2f} % |\n", B, f.step_ms, k.step_ms,
                   k.s.fill_seconds * per, k.s.wait_seconds * per, k.s.host_seconds * per,
                   100.0 * crit / (1e3 * f.step_ms), 100.0 * (k.step_ms - f.step_ms) / f.step_ms);
        if (k.s.stolen) fmt::print(stderr, "note: batch {}: {} of {} masks filled by the engine thread itself\n", B,
                                   k.s.stolen, k.s.masked_samples);
        if (k.s.masked_samples != k.tokens)
          fmt::print(stderr, "note: {} of {} constrained tokens were masked\n", k.s.masked_samples, k.tokens);
      }
    }
    host.shutdown();
  } catch (const std::exception& ex) {
    fmt::print(stderr, "error: {}\n", ex.what());
    return 1;
  }
  return 0;
}
