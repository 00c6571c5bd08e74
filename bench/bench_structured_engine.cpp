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
// and drives the engine through the same hooks in the same order — sampling_inputs, "the launch" (the
// device's forward starts; forward_launched, where the engine has it), token_mask (waits for each row's
// mask), then "the device" (sleeps until the step's simulated GPU time has passed since the launch: the
// host is free meanwhile, as while a CUDA graph runs), then per row a token drawn from the mask row (a
// pseudo-random allowed id; the end-of-sequence ids avoided), check_token and take_token. The device time
// per batch is --sim-step-us (default: the H200's k3-tiny steps, bench/RESULTS.md: 430 µs at batch 1, 1035 µs
// at 64). So on a CPU-only machine the engine's structured-output critical path is measured against the
// step it must hide behind, as the GPU engine runs it. Sim mode also reports the engine thread's CPU time
// (CLOCK_THREAD_CPUTIME_ID: robust on a loaded machine, where wall times are not; less the emulated device
// draws from the mask rows) per step and within the **device-idle window** — from the device's forward done
// to the next step's launch: taking the tokens, the engine's bookkeeping, scheduling, starting the next
// step's masks where that comes before the launch —, which is what the device waits for: with the mask
// waits past the simulated device time ("overrun", also a wait the device sees), the structured outputs'
// critical path is the idle window's difference, constrained − free, plus the overrun.
//
// --device cuda reports where the GPU executor's step goes (ExecutorStats, engines with forward_launched):
// the device's forward done from the step's start (two CUDA events), the tail after it (sampling, masks
// applied, tokens taken), masks late past the forward; the constrained tail − the free tail is the
// structured outputs' device-side cost, and a different forward time means the tokens changed the
// model's work (k3-tiny's MoE routes constrained JSON differently from free text), not the masks.
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
  static double thread_cpu() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  }
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu = thread_cpu();
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
    }
    // The launch: the device starts the forward; the window it sat idle since the last step's forward ended closes.
    const auto launch = std::chrono::steady_clock::now();
    if (done_cpu_ >= 0) {
      idle_cpu_seconds += thread_cpu() - done_cpu_ - draws_since_done_;
      idle_wall_seconds += std::chrono::duration<double>(launch - done_wall_).count() - draws_since_done_;
      ++idle_windows;
    }
#ifdef KESTREL_FORWARD_LAUNCHED
    if (hooks.forward_launched) hooks.forward_launched();
#endif
    for (size_t i = 0; i < rows.size(); ++i)
      if (hooks.token_mask) tm[i] = hooks.token_mask(*rows[i]);
    // The device's time for the step: from the batch size's entry (or the nearest smaller one).
    int us = 0;
    for (auto& [b, t] : *step_us_)
      if (b <= int(rows.size()) || us == 0) us = t;
    const auto device_done = launch + std::chrono::microseconds(us);
    overrun_seconds += std::max(0.0, std::chrono::duration<double>(std::chrono::steady_clock::now() - device_done).count());
    std::this_thread::sleep_until(device_done);
    // The device-idle window opens when the forward is done (the sleep's late wake-up on a loaded machine is
    // the machine's, not the engine's: the window starts when this thread runs again).
    done_wall_ = std::chrono::steady_clock::now();
    done_cpu_ = thread_cpu();
    draws_since_done_ = 0.0;
    // The device's draws, emulated on this thread: timed as a whole (two clock reads a step, not a row), to
    // be left out of the engine's CPU time. Then, as the GPU executor: every row's token checked, then taken.
    std::vector<int32_t> tokens(rows.size());
    const auto p0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < rows.size(); ++i) {
      const uint64_t h = draw[i] ^ (draw[i] >> 29);
      tokens[i] = int32_t(h % uint64_t(std::min<int64_t>(V_, 200)));
      if (tm[i].row >= 0) tokens[i] = pick(hooks.mask_table.data + tm[i].row * hooks.mask_table.words, hooks.mask_table.words, h);
    }
    const double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
    draw_seconds += d, draws_since_done_ += d;
    for (size_t i = 0; i < rows.size(); ++i)
      if (hooks.check_token && !hooks.check_token(*rows[i], tokens[i])) {
        std::fprintf(stderr, "sim: check_token refused a token drawn from its mask\n");
        std::abort();
      }
    sched::StepResult result;
    for (size_t i = 0; i < rows.size(); ++i) {
      sched::SeqResult r = hooks.take_token(*rows[i], tokens[i]);
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
  // The device-idle windows (forward done → next launch), less the emulated draws in them: engine-thread CPU, wall.
  double idle_cpu_seconds = 0.0, idle_wall_seconds = 0.0;
  int64_t idle_windows = 0;
  void idle() { last_cpu_ = -1, done_cpu_ = -1; }  // the engine went idle: the next step starts a new interval

 private:
  double last_cpu_ = -1;
  double done_cpu_ = -1, draws_since_done_ = 0.0;
  std::chrono::steady_clock::time_point done_wall_;
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
  double idle_cpu_us = -1, idle_wall_us = -1;  // sim: per device-idle window (forward done → next launch)
  // cuda (ExecutorStats): per step, the device's forward done from the step's start, the host's launch, the
  // masks late past the forward (and in how many steps); the tail is step_ms − forward_done.
  double forward_done_us = -1, launch_us = -1, late_us = -1;
  int64_t late_steps = 0;
  int64_t steps = 0, tokens = 0;
  runtime::Engine::StructuredStats s;
};

SimExecutor* g_sim = nullptr;  // --device sim: the engine's executor

Run run(runtime::Engine& e, int B, int tokens, const std::optional<OutputConstraint>& c, int vocab) {
  if (g_sim) g_sim->idle();
  const double cpu0 = g_sim ? g_sim->cpu_seconds - g_sim->draw_seconds : 0, over0 = g_sim ? g_sim->overrun_seconds : 0;
  const double icpu0 = g_sim ? g_sim->idle_cpu_seconds : 0, iwall0 = g_sim ? g_sim->idle_wall_seconds : 0;
  const int64_t iwin0 = g_sim ? g_sim->idle_windows : 0;
#ifdef KESTREL_FORWARD_LAUNCHED
  const runtime::ExecutorStats xb = e.executor_stats();
#endif
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
    const double windows = double(std::max<int64_t>(g_sim->idle_windows - iwin0, 1));
    out.idle_cpu_us = 1e6 * (g_sim->idle_cpu_seconds - icpu0) / windows;
    out.idle_wall_us = 1e6 * (g_sim->idle_wall_seconds - iwall0) / windows;
  }
#ifdef KESTREL_FORWARD_LAUNCHED
  const runtime::ExecutorStats xa = e.executor_stats();
  if (xa.forward_done_seconds > 0) {
    const double per = 1e6 / double(std::max<int64_t>(out.steps, 1));
    out.forward_done_us = (xa.forward_done_seconds - xb.forward_done_seconds) * per;
    out.launch_us = (xa.launch_seconds - xb.launch_seconds) * per;
    out.late_us = (xa.mask_late_seconds - xb.mask_late_seconds) * per;
    out.late_steps = xa.mask_late_steps - xb.mask_late_steps;
  }
#endif
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
               "host / step (µs) | (wait + host) / free step | end-to-end (step) | wall / step, free → constrained (ms) | "
               "end-to-end (wall) |\n|---|---|---|---|---|---|---|---|---|---|\n");
    run(e, 1, 4, std::nullopt, V);  // warm-up (CUDA graphs, allocator)
    run(e, 1, 4, c, V);
    std::map<int, std::vector<double>> e2e_step, e2e_wall, crit_share;  // per batch, over reps
    std::map<int, std::vector<double>> sim_crit, sim_idle_cpu, dev_tail, dev_fwd;  // Δ per step, % of the free step
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
        if (f.cpu_us >= 0) {
          fmt::print("|   | sim: engine-thread CPU / step {:.1f} → {:.1f} µs (Δ {:+.1f} µs = {:.2f} % of the {} µs device step); "
                     "mask-wait overrun {:.1f} µs / step | | | | | | | | |\n",
                     f.cpu_us, k.cpu_us, k.cpu_us - f.cpu_us, 100.0 * (k.cpu_us - f.cpu_us) / double(step_us[B]), step_us[B],
                     k.overrun_us);
          // The critical path: what the device waits for — the idle window's growth (engine CPU) plus late masks.
          const double crit_us = (k.idle_cpu_us - f.idle_cpu_us) + k.overrun_us;
          fmt::print("|   | sim: device-idle window / step, engine CPU {:.1f} → {:.1f} µs (Δ {:+.1f}), wall {:.1f} → {:.1f} µs "
                     "(Δ {:+.1f}); critical path (Δ idle CPU + overrun) {:+.1f} µs = {:.2f} % of the device step | | | | | | | | |\n",
                     f.idle_cpu_us, k.idle_cpu_us, k.idle_cpu_us - f.idle_cpu_us, f.idle_wall_us, k.idle_wall_us,
                     k.idle_wall_us - f.idle_wall_us, crit_us, 100.0 * crit_us / double(step_us[B]));
          sim_crit[B].push_back(100.0 * crit_us / double(step_us[B]));
          sim_idle_cpu[B].push_back(k.idle_cpu_us - f.idle_cpu_us);
        }
        if (f.forward_done_us >= 0 && k.forward_done_us >= 0) {
          const double ft = 1e3 * f.step_ms - f.forward_done_us, kt = 1e3 * k.step_ms - k.forward_done_us;
          fmt::print("|   | device: forward done {:.1f} → {:.1f} µs after the step's start (launch {:.1f} → {:.1f} µs); tail "
                     "(sampling, masks, takes) {:.1f} → {:.1f} µs (Δ {:+.1f} = {:.2f} % of the free step); masks late in "
                     "{} of {} steps, {:.2f} µs / step | | | | | | | | |\n",
                     f.forward_done_us, k.forward_done_us, f.launch_us, k.launch_us, ft, kt, kt - ft,
                     100.0 * (kt - ft) / (1e3 * f.step_ms), k.late_steps, k.steps, k.late_us);
          dev_tail[B].push_back(100.0 * (kt - ft + k.late_us) / (1e3 * f.step_ms));
          dev_fwd[B].push_back(100.0 * (k.forward_done_us - f.forward_done_us) / (1e3 * f.step_ms));
        }
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
    for (int B : bs) {
      fmt::print("SUMMARY batch {}: constrained vs free, median of {} reps: end-to-end (step) {:+.2f} %, (wall) {:+.2f} %; "
                 "(wait + host) {:.2f} % of the free step", B, reps, median(e2e_step[B]), median(e2e_wall[B]),
                 median(crit_share[B]));
      if (!sim_crit[B].empty())
        fmt::print("; sim critical path (Δ device-idle engine CPU + overrun) {:+.2f} % of the device step (Δ idle CPU "
                   "{:+.1f} µs)", median(sim_crit[B]), median(sim_idle_cpu[B]));
      if (!dev_tail[B].empty())
        fmt::print("; device: Δ tail + late masks {:+.2f} %, Δ forward done {:+.2f} % of the free step", median(dev_tail[B]),
                   median(dev_fwd[B]));
      fmt::print("\n");
    }
    if (host) host->shutdown();
    if (sim) sim->shutdown();
  } catch (const std::exception& ex) {
    fmt::print(stderr, "error: {}\n", ex.what());
    return 1;
  }
  return 0;
}
