// Prometheus text exposition (format 0.0.4) with vLLM's metric names and label (model_name), so
// dashboards and scrapers built for `vllm serve` work unchanged. Counters follow prometheus_client's
// convention, as vLLM's do: `# TYPE vllm:prompt_tokens counter` with the sample named
// `vllm:prompt_tokens_total`. Gauges come from the engine's stats at scrape time; counters and
// histograms are fed by the server as requests progress. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "request/request.h"

namespace kestrel::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  void render(std::string& out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, last = +Inf
  double sum_ = 0.0;
  uint64_t n_ = 0;
};

class Metrics {
 public:
  explicit Metrics(std::string model_name);
  void on_prompt_tokens(int n);
  void on_generation_tokens(int n);
  void on_ttft(double s);
  void on_itl(double s);
  void on_finished(const std::string& finish_reason, double e2e_s);  // "stop" | "length" | "abort" | ...
  std::string render(const EngineStats& st) const;

 private:
  std::string model_;
  mutable std::mutex mu_;
  uint64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  std::map<std::string, uint64_t> success_;  // by finished_reason
  Histogram ttft_, itl_, e2e_;
};

}  // namespace kestrel::server
