// `kestrel bench`'s closed loop (a fixed number of clients, each sending its next request when its stream ends)
// against the real runtime::Engine over the fake executor with a modelled device (fake_executor.h: a step takes
// --step-us + --token-us per token; the defaults are the reduced mini's on the H200: a 64-row decode step ~1 ms, a
// 2,048-token prefill step ~8.4 ms), without HTTP: the time from a stream's end to its client's next request (the
// HTTP round trip and the server's tokenization; ~1–3 ms in the H200's server logs) is --client-ms
// (± --client-jitter-ms, drawn per request); the first wave is sent at once and reaches the engine one prompt every
// --tokenize-ms. Prints, per seed, the TTFT median and the mean of each wave of `concurrency` requests (in send
// order), synchronous and with async scheduling (run-ahead) — the H200's closed-loop TTFT rise under
// --async-scheduling (bench/RESULTS.md session 36; docs/serving.md "When a new request gets in") without a GPU.
// KESTREL_AHEAD_LEAD_US=-1 gives run-ahead's launch at once (before the late launch).
//   engine_closed_loop CONFIG.json [--requests 192] [--concurrency 64] [--prompt 1024] [--output 128]
//                      [--step-us 790] [--token-us 3.7] [--client-ms 2.6] [--client-jitter-ms 0.8] [--tokenize-ms 2]
//                      [--seeds 3] [--first-seed 1] [--scale 1] [--modes sync,async]
// --scale multiplies every time (device and client) to keep the host's own share small on a slow machine.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <queue>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loader/config.h"
#include "runtime/engine.h"
#include "runtime/fake_executor.h"

using namespace kestrel;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string config;
  int requests = 192, concurrency = 64, prompt = 1024, output = 128, seeds = 3, first_seed = 1;
  double step_us = 790, token_us = 3.7, client_ms = 2.6, client_jitter_ms = 0.8, scale = 1.0, tokenize_ms = 2.0;
  std::vector<std::string> modes = {"sync", "async"};
};

struct Result {
  std::vector<double> ttft_ms;  // in send order
  double duration_s = 0, tpot_ms = 0, e2el_ms = 0;
  int64_t steps = 0, ahead = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Result run(const ModelConfig& cfg, const Options& o, bool async, uint32_t seed) {
  runtime::EngineConfig ec;
  ec.memory_budget = int64_t(8) << 30;  // bookkeeping only: the fake allocates nothing
  ec.max_running = o.concurrency;
  ec.max_num_batched_tokens = 2048;     // `kestrel serve --device cuda`'s defaults (cli/engine_flags.cpp)
  ec.long_prefill_token_threshold = 1024;
  ec.prefill_step_target_s = 0.05 * o.scale;
  ec.max_num_partial_prefills = 4;
  ec.max_long_partial_prefills = 1;
  ec.async_scheduling = async;
  runtime::FakeExecutorOptions fo;
  fo.script = {5, 6, 7, 8};  // cheap logits: the host's share stays small
  fo.device_step = std::chrono::microseconds(int64_t(o.step_us * o.scale));
  fo.device_token = std::chrono::nanoseconds(int64_t(o.token_us * 1000.0 * o.scale));
  ec.make_executor = runtime::fake_executor_factory(cfg.text.vocab_size, fo);
  runtime::Engine e(cfg, ec);

  std::mt19937_64 rng(seed);
  std::normal_distribution<double> client(o.client_ms * o.scale, o.client_jitter_ms * o.scale);
  std::mutex mu;
  std::condition_variable cv;
  // (due, request index): requests whose client has sent them, submitted to the engine when due.
  std::priority_queue<std::pair<Clock::time_point, int>, std::vector<std::pair<Clock::time_point, int>>,
                      std::greater<>> due;
  std::vector<Clock::time_point> sent(size_t(o.requests)), first(size_t(o.requests)), last(size_t(o.requests));
  std::vector<int> tokens(size_t(o.requests));
  int next = 0, done = 0;
  const Clock::time_point t0 = Clock::now();
  auto send = [&](Clock::time_point at, double delay_ms) {  // mu held
    if (next >= o.requests) return;
    const int k = next++;
    sent[size_t(k)] = at;
    due.push({at + std::chrono::microseconds(int64_t(std::max(0.05 * o.scale, delay_ms) * 1000.0)), k});
    cv.notify_all();
  };
  {
    std::lock_guard<std::mutex> lk(mu);
    // The first wave is sent at once; the server's one HTTP thread tokenizes the prompts one after another.
    for (int k = 0; k < o.concurrency; ++k) send(t0, o.tokenize_ms * o.scale * (k + 1));
  }
  std::vector<int32_t> prompt(size_t(o.prompt));
  auto submit = [&](int k) {
    Request r;
    std::mt19937 pr(uint32_t(seed * 1000003u + uint32_t(k)));
    for (int32_t& t : prompt) t = int32_t(pr() % 700) + 10;
    r.prompt = prompt;
    r.max_tokens = o.output;
    r.ignore_eos = true;
    r.sampling.temperature = 0.0f;
    // (The engine copies a sink for each event: its state lives here, not in the lambda.)
    e.submit(std::move(r), [&, k](TokenEvent&& ev) {
      const Clock::time_point now = Clock::now();
      std::lock_guard<std::mutex> lk(mu);
      if (ev.token >= 0 && tokens[size_t(k)]++ == 0) first[size_t(k)] = now;
      if (ev.finished()) {
        last[size_t(k)] = now;
        ++done;
        send(now, client(rng));  // the client's next request
        cv.notify_all();
      }
    });
  };
  std::unique_lock<std::mutex> lk(mu);
  while (done < o.requests) {
    if (!due.empty() && due.top().first <= Clock::now()) {
      const int k = due.top().second;
      due.pop();
      lk.unlock();
      submit(k);
      lk.lock();
      continue;
    }
    if (due.empty()) cv.wait(lk);
    else cv.wait_until(lk, due.top().first);
  }
  lk.unlock();
  Result res;
  Clock::time_point end = t0;
  std::vector<double> tpot;
  for (int k = 0; k < o.requests; ++k) {
    res.ttft_ms.push_back(std::chrono::duration<double, std::milli>(first[size_t(k)] - sent[size_t(k)]).count());
    tpot.push_back(std::chrono::duration<double, std::milli>(last[size_t(k)] - first[size_t(k)]).count() / (o.output - 1));
    res.e2el_ms += std::chrono::duration<double, std::milli>(last[size_t(k)] - sent[size_t(k)]).count() / o.requests;
    end = std::max(end, last[size_t(k)]);
  }
  res.duration_s = std::chrono::duration<double>(end - t0).count();
  res.tpot_ms = median(tpot);
  const EngineStats st = e.stats();
  res.steps = st.steps;
  res.ahead = st.ahead_steps;
  e.shutdown();
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--requests") o.requests = std::stoi(val());
    else if (a == "--concurrency") o.concurrency = std::stoi(val());
    else if (a == "--prompt") o.prompt = std::stoi(val());
    else if (a == "--output") o.output = std::stoi(val());
    else if (a == "--step-us") o.step_us = std::stod(val());
    else if (a == "--token-us") o.token_us = std::stod(val());
    else if (a == "--client-ms") o.client_ms = std::stod(val());
    else if (a == "--client-jitter-ms") o.client_jitter_ms = std::stod(val());
    else if (a == "--tokenize-ms") o.tokenize_ms = std::stod(val());
    else if (a == "--seeds") o.seeds = std::stoi(val());
    else if (a == "--first-seed") o.first_seed = std::stoi(val());
    else if (a == "--scale") o.scale = std::stod(val());
    else if (a == "--modes") {
      o.modes.clear();
      std::string s = val();
      for (size_t p = 0; p <= s.size();) {
        const size_t q = std::min(s.find(',', p), s.size());
        o.modes.push_back(s.substr(p, q - p));
        p = q + 1;
      }
    } else if (a[0] != '-') o.config = a;
    else {
      fmt::print(stderr, "unknown option {}\n", a);
      return 2;
    }
  }
  if (o.config.empty()) {
    fmt::print(stderr, "usage: engine_closed_loop CONFIG.json [options] (see the source)\n");
    return 2;
  }
  const ModelConfig cfg = load_config(o.config);
  for (int s = o.first_seed - 1; s < o.first_seed - 1 + o.seeds; ++s)
    for (const std::string& m : o.modes) {
      const Result r = run(cfg, o, m == "async", uint32_t(s + 1));
      std::string waves;
      for (size_t w = 0; w < r.ttft_ms.size(); w += size_t(o.concurrency)) {
        const size_t e = std::min(r.ttft_ms.size(), w + size_t(o.concurrency));
        waves += fmt::format(" {:.1f}", std::accumulate(r.ttft_ms.begin() + long(w), r.ttft_ms.begin() + long(e), 0.0) /
                                            double(e - w) / o.scale);
      }
      fmt::print("seed {} {:5}: TTFT median {:6.1f} ms, wave means{} ms; TPOT median {:.3f} ms; E2EL mean {:.1f} ms; "
                 "{:.3f} s; {} steps, {} ahead (times / scale)\n",
                 s + 1, m, median(r.ttft_ms) / o.scale, waves, r.tpot_ms / o.scale, r.e2el_ms / o.scale,
                 r.duration_s / o.scale, r.steps, r.ahead);
      std::fflush(stdout);
    }
  return 0;
}
