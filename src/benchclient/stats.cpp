// Benchmark statistics: see stats.h for the definitions (they follow `vllm bench serve`).
#include "benchclient/stats.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <sstream>

namespace kestrel::bench {

double percentile(std::vector<double> xs, double p) {
  if (xs.empty()) return 0;
  std::sort(xs.begin(), xs.end());
  // numpy's "linear" method: rank (n - 1) * p / 100, interpolated between its neighbours.
  const double rank = (double(xs.size()) - 1) * std::clamp(p, 0.0, 100.0) / 100.0;
  const size_t lo = size_t(std::floor(rank));
  const size_t hi = std::min(lo + 1, xs.size() - 1);
  const double frac = rank - double(lo);
  return xs[lo] + (xs[hi] - xs[lo]) * frac;
}

double mean(const std::vector<double>& xs) {
  if (xs.empty()) return 0;
  return std::accumulate(xs.begin(), xs.end(), 0.0) / double(xs.size());
}

double stddev(const std::vector<double>& xs) {
  if (xs.empty()) return 0;
  const double m = mean(xs);
  double s = 0;
  for (double x : xs) s += (x - m) * (x - m);
  return std::sqrt(s / double(xs.size()));
}

std::optional<double> tpot(const RequestOutput& r) {
  if (r.output_tokens <= 1) return std::nullopt;
  return (r.latency - r.ttft) / double(r.output_tokens - 1);
}

Summary summarize_ms(const std::vector<double>& seconds, const std::vector<double>& percentiles) {
  Summary s;
  s.mean_ms = mean(seconds) * 1000;
  s.median_ms = percentile(seconds, 50) * 1000;
  s.std_ms = stddev(seconds) * 1000;
  for (double p : percentiles) s.percentiles_ms.emplace_back(p, percentile(seconds, p) * 1000);
  return s;
}

Metrics compute_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                        const std::vector<double>& percentiles) {
  Metrics m;
  m.duration_s = duration_s;
  std::vector<double> ttfts, tpots, itls, e2els;
  for (const auto& r : outputs) {
    if (!r.success) {
      ++m.failed;
      continue;
    }
    ++m.completed;
    m.total_input += r.prompt_len;
    m.total_output += r.output_tokens;
    if (auto t = tpot(r)) tpots.push_back(*t);
    itls.insert(itls.end(), r.itl.begin(), r.itl.end());
    ttfts.push_back(r.ttft);
    e2els.push_back(r.latency);
  }
  if (duration_s > 0) {
    m.request_throughput = m.completed / duration_s;
    m.output_throughput = double(m.total_output) / duration_s;
    m.total_token_throughput = double(m.total_input + m.total_output) / duration_s;
  }
  m.ttft = summarize_ms(ttfts, percentiles);
  m.tpot = summarize_ms(tpots, percentiles);
  m.itl = summarize_ms(itls, percentiles);
  m.e2el = summarize_ms(e2els, percentiles);

  // Peak output rate: token chunks bucketed by whole seconds since the earliest successful start
  // (a chunk's time is start + TTFT + the ITLs so far, as vLLM reconstructs it).
  double t0 = 0;
  bool any = false;
  for (const auto& r : outputs)
    if (r.success) t0 = any ? std::min(t0, r.start_time) : r.start_time, any = true;
  if (any) {
    std::vector<double> buckets;
    auto add = [&](double t) {
      const double rel = t - t0;
      if (rel < 0) return;
      const size_t b = size_t(rel);
      if (b >= buckets.size()) buckets.resize(b + 1, 0);
      buckets[b] += 1;
    };
    for (const auto& r : outputs) {
      if (!r.success) continue;
      double t = r.start_time + r.ttft;
      add(t);
      for (double gap : r.itl) add(t += gap);
    }
    m.max_output_tokens_per_s = buckets.empty() ? 0 : *std::max_element(buckets.begin(), buckets.end());

    // Peak concurrency over half-open intervals [start, end): at equal times a departure comes first.
    std::vector<std::pair<double, int>> events;
    for (const auto& r : outputs) {
      if (!r.success) continue;
      events.emplace_back(r.start_time, +1);
      events.emplace_back(r.start_time + r.latency, -1);
    }
    std::sort(events.begin(), events.end());
    int cur = 0;
    for (const auto& [t, d] : events) m.max_concurrent_requests = std::max(m.max_concurrent_requests, cur += d);
  }
  return m;
}

std::optional<SpecDecodeCounters> parse_spec_decode_metrics(const std::string& text) {
  SpecDecodeCounters c;
  bool any = false;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    const size_t sp = line.rfind(' ');
    if (name_end == std::string::npos || sp == std::string::npos || sp + 1 >= line.size()) continue;
    std::string name = line.substr(0, name_end);
    if (name.size() > 6 && name.compare(name.size() - 6, 6, "_total") == 0) name.resize(name.size() - 6);
    double* dst = name == "vllm:spec_decode_num_drafts"            ? &c.drafts
                  : name == "vllm:spec_decode_num_draft_tokens"    ? &c.draft_tokens
                  : name == "vllm:spec_decode_num_accepted_tokens" ? &c.accepted_tokens
                                                                   : nullptr;
    if (!dst) continue;
    char* e = nullptr;
    const double v = std::strtod(line.c_str() + sp + 1, &e);
    if (e == line.c_str() + sp + 1) continue;
    *dst += v;
    any = true;
  }
  if (!any) return std::nullopt;
  return c;
}

}  // namespace kestrel::bench
