// Structured outputs in the engine: what a token mask costs per decode step (issue #20, item 3).
//
//   bench_structured_engine --model DIR [--device cpu|cuda|sim] [--batch 1,64] [--tokens 48] [--reps 2]
//                           [--sim-step-us 430,1035] [--mask-threads N]
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
//
// --device sim: no model. A simulated device executor stands in for the GPU one (runtime/executor_cuda.cpp)
// and drives the engine through the same hooks in the same order — sampling_inputs, token_mask (waits for
// each row's mask), then "the device" (sleeps until the step's simulated GPU time has passed since the
// step began: the host is free meanwhile, as while a CUDA graph runs), then per row a token drawn from the
// mask row (a pseudo-random allowed id; the end-of-sequence ids avoided), check_token and take_token. The
// step time per batch is --sim-step-us (default: the H200's k3-tiny steps, bench/RESULTS.md: 430 µs at
// batch 1, 1035 µs at 64). So on a CPU-only machine the engine's structured-output critical path is
// measured against the step it must hide behind, as the GPU engine runs it. Sim mode also reports the
// engine thread's CPU time per step (CLOCK_THREAD_CPUTIME_ID: robust on a loaded machine, where wall
// times are not; less the emulated device draws from the mask rows) and how far the mask waits ran past the simulated device time ("overrun": the only
// part of a wait on the critical path).
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <map>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "loader/config.h"
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

// The simulated device executor of --device sim (see the header).
class SimExecutor : public runtime::StepExecutor {
 public:
  SimExecutor(int64_t V, std::vector<int32_t> avoid, const std::map<int, int>* step_us)
      : V_(V), avoid_(std::move(avoid)), step_us_(step_us) {}
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    const auto t0 = std::chrono::steady_clock::now();
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    const double cpu = double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
    if (last_cpu_ >= 0) cpu_seconds += cpu - last_cpu_;  // the engine thread since the previous step began
    last_cpu_ = cpu;
    ++stats_.steps;
    std::vector<const sched::ScheduledSeq*> rows;
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const sched::ScheduledSeq& x : *list) {
        stats_.tokens_forwarded += x.end - x.start;
        if (x.sample) rows.push_back(&x);
      }
    std::vector<uint64_t> draw(rows.size());
    std::vector<runtime::StepHooks::TokenMask> tm(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto in = hooks.sampling_inputs(*rows[i]);
      draw[i] = (uint64_t(rows[i]->id) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(in.output.size()) * 0xC2B2AE3D27D4EB4Full);
      if (hooks.token_mask) tm[i] = hooks.token_mask(*rows[i]);
    }
    // The device's time for the step: from the batch size's entry (or the nearest smaller one).
    int us = 0;
    for (auto& [b, t] : *step_us_)
      if (b <= int(rows.size()) || us == 0) us = t;
    const auto device_done = t0 + std::chrono::microseconds(us);
    overrun_seconds += std::max(0.0, std::chrono::duration<double>(std::chrono::steady_clock::now() - device_done).count());
    std::this_thread::sleep_until(device_done);
    sched::StepResult result;
    for (size_t i = 0; i < rows.size(); ++i) {
      const uint64_t h = draw[i] ^ (draw[i] >> 29);
      int32_t token = int32_t(h % uint64_t(std::min<int64_t>(V_, 200)));
      if (tm[i].row >= 0) {
        // The device's draw, emulated on this thread: timed, to be left out of the engine's CPU time.
        const auto p0 = std::chrono::steady_clock::now();
        token = pick(hooks.mask_table.data + tm[i].row * hooks.mask_table.words, hooks.mask_table.words, h);
        draw_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
      }
      if (hooks.check_token && !hooks.check_token(*rows[i], token)) {
        std::fprintf(stderr, "sim: check_token refused a token drawn from its mask\n");
        std::abort();
      }
      sched::SeqResult r = hooks.take_token(*rows[i], token);
      r.id = rows[i]->id;
      result.seqs.push_back(r);
      ++stats_.samples, ++stats_.device_samples;
    }
    stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
  }
  const runtime::ExecutorStats& stats() const override { return stats_; }
  double cpu_seconds = 0.0;      // engine thread CPU time (between consecutive steps' starts)
  double overrun_seconds = 0.0;  // mask waits past the simulated device time
  double draw_seconds = 0.0;     // the emulated device draws from mask rows (not engine work)
  void idle() { last_cpu_ = -1; }  // the engine went idle: the next step starts a new interval

 private:
  double last_cpu_ = -1;
  // An allowed id: the lowest set bit of the first nonzero word from a pseudo-random word on, skipping
  // the end-of-sequence ids while anything else is allowed (so documents run the whole length).
  int32_t pick(const uint32_t* words, int64_t nw, uint64_t h) const {
    int32_t fallback = -1;
    for (int64_t k = 0; k < nw; ++k) {
      const int64_t w = (int64_t(h % uint64_t(nw)) + k) % nw;
      for (uint32_t bits = words[w]; bits; bits &= bits - 1) {
        const int32_t id = int32_t(w * 32 + std::countr_zero(bits));
        if (id >= V_) break;
        if (std::find(avoid_.begin(), avoid_.end(), id) == avoid_.end()) return id;
        fallback = id;
      }
    }
    return fallback;
  }
  int64_t V_;
  std::vector<int32_t> avoid_;
  const std::map<int, int>* step_us_;
  runtime::ExecutorStats stats_;
};

struct Run {
  double step_ms = 0;
  double wall_ms = 0;  // wall time of the whole run per engine step (loop, scheduling and sinks included)
  double cpu_us = -1, overrun_us = -1;  // sim: engine-thread CPU and mask-wait overrun per step
  int64_t steps = 0, tokens = 0;
  runtime::Engine::StructuredStats s;
};

SimExecutor* g_sim = nullptr;  // --device sim: the engine's executor

Run run(runtime::Engine& e, int B, int tokens, const std::optional<OutputConstraint>& c, int vocab) {
  if (g_sim) g_sim->idle();
  const double cpu0 = g_sim ? g_sim->cpu_seconds - g_sim->draw_seconds : 0, over0 = g_sim ? g_sim->overrun_seconds : 0;
  const EngineStats before = e.stats();
  const auto sb = e.structured_stats();
  std::mutex mu;
  int64_t got = 0;
  const auto w0 = std::chrono::steady_clock::now();
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
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  const EngineStats after = e.stats();
  const auto sa = e.structured_stats();
  Run out;
  out.steps = after.steps - before.steps;
  out.tokens = got;
  out.step_ms = 1e3 * (after.busy_seconds - before.busy_seconds) / double(std::max<int64_t>(out.steps, 1));
  out.wall_ms = 1e3 * wall / double(std::max<int64_t>(out.steps, 1));
  if (g_sim) {
    out.cpu_us = 1e6 * (g_sim->cpu_seconds - g_sim->draw_seconds - cpu0) / double(std::max<int64_t>(out.steps - 1, 1));
    out.overrun_us = 1e6 * (g_sim->overrun_seconds - over0) / double(std::max<int64_t>(out.steps, 1));
  }
  out.s.masked_samples = sa.masked_samples - sb.masked_samples;
  out.s.fill_seconds = sa.fill_seconds - sb.fill_seconds;
  out.s.stolen = sa.stolen - sb.stolen;
  out.s.wait_seconds = sa.wait_seconds - sb.wait_seconds;
  out.s.host_seconds = sa.host_seconds - sb.host_seconds;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, device = "cpu", batches = "1,64", sim_steps = "430,1035";
  int tokens = 48, reps = 2;
  [[maybe_unused]] int mask_threads = 0;  // --mask-threads (engines with the MaskPool)
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--model") model = argv[i + 1];
    else if (a == "--device") device = argv[i + 1];
    else if (a == "--batch") batches = argv[i + 1];
    else if (a == "--tokens") tokens = std::atoi(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--sim-step-us") sim_steps = argv[i + 1];
    else if (a == "--mask-threads") mask_threads = std::atoi(argv[i + 1]);
    else {
      fmt::print(stderr, "usage: bench_structured_engine --model DIR [--device cpu|cuda|sim] [--batch 1,64] [--tokens N] [--reps N] [--sim-step-us 430,1035] [--mask-threads N]\n");
      return 2;
    }
  }
  if (model.empty()) {
    fmt::print(stderr, "--model is required\n");
    return 2;
  }
  auto ints = [](const std::string& list) {
    std::vector<int> v;
    for (size_t p = 0; p < list.size();) {
      const size_t q = list.find(',', p);
      v.push_back(std::atoi(list.substr(p, q - p).c_str()));
      p = q == std::string::npos ? list.size() : q + 1;
    }
    return v;
  };
  const std::vector<int> bs = ints(batches), sim_us = ints(sim_steps);
  std::map<int, int> step_us;  // batch → simulated device step (--device sim)
  for (size_t i = 0; i < bs.size(); ++i) step_us[bs[i]] = sim_us.empty() ? 1000 : sim_us[std::min(i, sim_us.size() - 1)];
  try {
    const tok::Tokenizer tk = tok::Tokenizer::load(model);
    int maxb = 1;
    for (int b : bs) maxb = std::max(maxb, b);
    std::unique_ptr<runtime::EngineHost> host;
    std::unique_ptr<runtime::Engine> sim;
    ModelConfig cfg;
    if (device == "sim") {
      // No weights: the engine over the model's config, with the simulated device executor.
      cfg = load_config(model);
      runtime::EngineConfig ec;
      ec.memory_budget = int64_t(2) << 30;
      ec.max_running = maxb;
      ec.enable_prefix_cache = false;
      ec.max_num_batched_tokens = std::max(2048, maxb * 16);
      if (cfg.text.eos_token_id >= 0) ec.eos_token_ids.push_back(cfg.text.eos_token_id);
      for (const char* name : {"<|end_of_msg|>", "[EOS]", "[EOT]"})
        if (auto id = tk.special_id(name); id && int32_t(*id) != cfg.text.eos_token_id) ec.eos_token_ids.push_back(int32_t(*id));
      const int64_t V = cfg.text.vocab_size;
#ifdef KESTREL_MASK_POOL
      ec.mask_threads = mask_threads;
#endif
      ec.make_executor = [V, avoid = ec.eos_token_ids, &step_us](const CacheFormats&, const cache::CacheConfig&) {
        auto x = std::make_unique<SimExecutor>(V, avoid, &step_us);
        g_sim = x.get();
        return std::unique_ptr<runtime::StepExecutor>(std::move(x));
      };
      sim = std::make_unique<runtime::Engine>(cfg, ec);
    } else {
      runtime::EngineOptions eo;
      eo.model_dir = model;
      eo.device = device == "cuda" ? runtime::Device::cuda : runtime::Device::cpu;
      eo.memory_budget = int64_t(2) << 30;
      eo.engine.max_running = maxb;
      eo.engine.enable_prefix_cache = false;
      eo.engine.max_num_batched_tokens = std::max(2048, maxb * 16);
#ifdef KESTREL_MASK_POOL
      eo.engine.mask_threads = mask_threads;
#endif
      eo.tokenizer = &tk;
      host = std::make_unique<runtime::EngineHost>(eo);
      if (!host->wait_loaded()) throw Error(host->load_error());
    }
    runtime::Engine& e = sim ? *sim : host->engine();
    const int V = int(e.vocab_size());
    auto vocab = std::make_shared<const structured::TokenVocab>(tk, size_t(V));
    const auto t0 = std::chrono::steady_clock::now();
    OutputConstraint c =
        structured::document_constraint(OutputConstraint::Format::json_schema, structured::ojson::parse(kSchema));
    c.grammar = structured::compile_json_schema(vocab, structured::ojson::parse(kSchema));
    const double compile_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("model {} on {}, vocabulary {} ids, 30-property schema compiled in {:.0f} ms; {} tokens per request, "
               "{} reps; mask pool {} threads\n\n", model, device, V, compile_ms, tokens, reps,
#ifdef KESTREL_MASK_POOL
               runtime::MaskPool::auto_threads(mask_threads));
#else
               "1 (a single worker: before the pool)");
#endif
    fmt::print("| batch | step, free (ms) | step, constrained (ms) | fill / step (µs, worker) | wait / step (µs) | "
               "host / step (µs) | critical path / free step | end-to-end (step) | wall / step, free → constrained (ms) | "
               "end-to-end (wall) |\n|---|---|---|---|---|---|---|---|---|---|\n");
    run(e, 1, 4, std::nullopt, V);  // warm-up (CUDA graphs, allocator)
    run(e, 1, 4, c, V);
    std::map<int, std::vector<double>> e2e_step, e2e_wall, crit_share;  // per batch, over reps
    for (int B : bs) {
      for (int rep = 0; rep < reps; ++rep) {
        const Run f = run(e, B, tokens, std::nullopt, V);
        const Run k = run(e, B, tokens, c, V);
        e2e_step[B].push_back(100.0 * (k.step_ms - f.step_ms) / f.step_ms);
        e2e_wall[B].push_back(100.0 * (k.wall_ms - f.wall_ms) / f.wall_ms);
        const double per = 1e6 / double(std::max<int64_t>(k.steps, 1));
        const double crit = (k.s.wait_seconds + k.s.host_seconds) * per;
        crit_share[B].push_back(100.0 * crit / (1e3 * f.step_ms));
        fmt::print("| {} | {:.3f} | {:.3f} | {:.1f} | {:.1f} | {:.1f} | {:.2f} % | {:+.2f} % | {:.3f} → {:.3f} | {:+.2f} % |\n",
                   B, f.step_ms, k.step_ms, k.s.fill_seconds * per, k.s.wait_seconds * per, k.s.host_seconds * per,
                   100.0 * crit / (1e3 * f.step_ms), 100.0 * (k.step_ms - f.step_ms) / f.step_ms, f.wall_ms, k.wall_ms,
                   100.0 * (k.wall_ms - f.wall_ms) / f.wall_ms);
        if (f.cpu_us >= 0)
          fmt::print("|   | sim: engine-thread CPU / step {:.1f} → {:.1f} µs (Δ {:+.1f} µs = {:.2f} % of the {} µs device step); "
                     "mask-wait overrun {:.1f} µs / step | | | | | | | | |\n",
                     f.cpu_us, k.cpu_us, k.cpu_us - f.cpu_us, 100.0 * (k.cpu_us - f.cpu_us) / double(step_us[B]), step_us[B],
                     k.overrun_us);
        if (k.s.stolen) fmt::print(stderr, "note: batch {}: {} of {} masks filled by the engine thread itself\n", B,
                                   k.s.stolen, k.s.masked_samples);
        if (k.s.masked_samples != k.tokens)
          fmt::print(stderr, "note: {} of {} constrained tokens were masked\n", k.s.masked_samples, k.tokens);
      }
    }
    // The summary the target reads (issue #20 point 3: ≤ 5 % of the decode step at batch 1 and 64): medians
    // over the reps, as the free and constrained runs alternate (a disturbed run moves one rep only).
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    };
    fmt::print("\n");
    for (int B : bs)
      fmt::print("SUMMARY batch {}: constrained vs free, median of {} reps: end-to-end (step) {:+.2f} %, (wall) {:+.2f} %; "
                 "critical path {:.2f} % of the free step\n", B, reps, median(e2e_step[B]), median(e2e_wall[B]),
                 median(crit_share[B]));
    if (host) host->shutdown();
    if (sim) sim->shutdown();
  } catch (const std::exception& ex) {
    fmt::print(stderr, "error: {}\n", ex.what());
    return 1;
  }
  return 0;
}
