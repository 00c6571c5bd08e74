// Metrics: see metrics.h. Bucket bounds are vLLM's.
#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace kestrel::server {

void Histogram::observe(double v) {
  const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[i];
  sum_ += v;
  ++n_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, bounds_[i], cum);
  }
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, n_);
  out += fmt::format("{}_count{{{}}} {}\n", name, labels, n_);
  out += fmt::format("{}_sum{{{}}} {}\n", name, labels, sum_);
}

Metrics::Metrics(std::string model_name)
    : model_(std::move(model_name)),
      ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0}),
      itl_({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}),
      e2e_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0}) {}

void Metrics::on_prompt_tokens(int n) {
  std::lock_guard lk(mu_);
  prompt_tokens_ += uint64_t(n);
}
void Metrics::on_generation_tokens(int n) {
  std::lock_guard lk(mu_);
  generation_tokens_ += uint64_t(n);
}
void Metrics::on_ttft(double s) {
  std::lock_guard lk(mu_);
  ttft_.observe(s);
}
void Metrics::on_itl(double s) {
  std::lock_guard lk(mu_);
  itl_.observe(s);
}
void Metrics::on_finished(const std::string& reason, double e2e_s) {
  std::lock_guard lk(mu_);
  ++success_[reason];
  e2e_.observe(e2e_s);
}

std::string Metrics::render(const EngineStats& st) const {
  std::lock_guard lk(mu_);
  std::string model;  // label value escaping: backslash, quote, newline
  for (char c : model_) {
    if (c == '\\' || c == '"') model += '\\';
    if (c == '\n') {
      model += "\\n";
      continue;
    }
    model += c;
  }
  const std::string L = fmt::format("model_name=\"{}\"", model);
  std::string o;
  auto gauge = [&](const char* name, const char* help, double v) {
    o += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{}{{{}}} {}\n", name, help, name, name, L, v);
  };
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    o += fmt::format("# HELP {} {}\n# TYPE {} counter\n{}_total{{{}}} {}\n", name, help, name, name, L, v);
  };
  gauge("vllm:num_requests_running", "Number of requests in model execution batches.", double(st.running));
  gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", double(st.waiting));
  gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.kv_usage());
  gauge("kestrel:kv_pages_used", "KV-cache pages held by requests (0 when idle).", double(st.pages_held));
  gauge("kestrel:kv_pages_allocated", "KV-cache pages not free: held by requests or kept by the prefix cache.",
        double(st.pages_used));
  counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
          uint64_t(st.prefix_query_tokens));
  counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", uint64_t(st.prefix_hit_tokens));
  counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", uint64_t(st.preemptions));
  counter("vllm:prompt_tokens", "Number of prefill tokens processed.", prompt_tokens_);
  counter("vllm:generation_tokens", "Number of generation tokens processed.", generation_tokens_);
  // Speculative decoding (vLLM's names; 0 without --speculative-config).
  counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", uint64_t(st.spec_drafts));
  counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", uint64_t(st.spec_draft_tokens));
  counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", uint64_t(st.spec_accepted_tokens));
  // Async scheduling (0 without --async-scheduling, or with an executor that cannot run ahead).
  counter("kestrel:ahead_steps", "Engine steps launched before the previous step's tokens were known.",
          uint64_t(st.ahead_steps));
  o += "# HELP vllm:request_success Count of successfully processed requests.\n# TYPE vllm:request_success counter\n";
  for (const char* r : {"stop", "length", "abort", "error"}) {
    auto it = success_.find(r);
    o += fmt::format("vllm:request_success_total{{{},finished_reason=\"{}\"}} {}\n", L, r, it == success_.end() ? 0 : it->second);
  }
  o += "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
       "# TYPE vllm:time_to_first_token_seconds histogram\n";
  ttft_.render(o, "vllm:time_to_first_token_seconds", L);
  o += "# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.\n"
       "# TYPE vllm:inter_token_latency_seconds histogram\n";
  itl_.render(o, "vllm:inter_token_latency_seconds", L);
  o += "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.\n"
       "# TYPE vllm:e2e_request_latency_seconds histogram\n";
  e2e_.render(o, "vllm:e2e_request_latency_seconds", L);
  return o;
}

}  // namespace kestrel::server
