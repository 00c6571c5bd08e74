// Progress bar, result table and result JSON: see report.h.
#include "benchclient/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>

namespace kestrel::bench {

namespace {

using Clock = std::chrono::steady_clock;

std::string mmss(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = long(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60) : fmt::format("{:02}:{:02}", t / 60, t % 60);
}

bool paced(double rate) { return rate > 0 && std::isfinite(rate); }

}  // namespace

ProgressBar::ProgressBar(int total, bool enabled)
    : total_(total), enabled_(enabled), start_(Clock::now()), last_draw_(start_) {
  if (enabled_) draw(0);
}

void ProgressBar::update(int done) {
  last_done_ = done;
  if (!enabled_) return;
  const auto now = Clock::now();
  if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  draw(done);
}

void ProgressBar::finish() {
  if (!enabled_ || finished_) return;
  finished_ = true;
  if (last_drawn_ != last_done_) draw(last_done_);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

void ProgressBar::draw(int done) {
  last_drawn_ = done;
  constexpr int kWidth = 30;
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const double frac = total_ > 0 ? double(done) / total_ : 1;
  const int fill = int(frac * kWidth);
  const double rate = elapsed > 0 ? done / elapsed : 0;
  const double eta = rate > 0 ? (total_ - done) / rate : NAN;
  fmt::print(stderr, "\r{:3}%|{}{}| {}/{} [{}<{}, {:.2f} req/s]", int(frac * 100), std::string(size_t(fill), '#'),
             std::string(size_t(kWidth - fill), ' '), done, total_, mmss(elapsed), mmss(eta), rate);
  std::fflush(stderr);
}

std::string percentile_key(double p, const std::string& metric) { return fmt::format("p{}_{}_ms", p, metric); }

std::string format_table(const Metrics& m, const RunInfo& info) {
  std::string s;
  auto line = [&](const std::string& label, const std::string& value) { s += fmt::format("{:<40} {:<10}\n", label, value); };
  auto num = [](double v) { return fmt::format("{:.2f}", v); };
  auto rule = [&](const std::string& title, char c) {  // Python's "{:c^50}": extra padding goes right
    const size_t pad = title.size() < 50 ? 50 - title.size() : 0;
    s += std::string(pad / 2, c) + title + std::string(pad - pad / 2, c) + "\n";
  };
  rule(" Serving Benchmark Result ", '=');
  line("Successful requests:", std::to_string(m.completed));
  line("Failed requests:", std::to_string(m.failed));
  if (info.max_concurrency > 0) line("Maximum request concurrency:", std::to_string(info.max_concurrency));
  if (paced(info.request_rate)) line("Request rate configured (RPS):", num(info.request_rate));
  line("Benchmark duration (s):", num(m.duration_s));
  line("Total input tokens:", std::to_string(m.total_input));
  line("Total generated tokens:", std::to_string(m.total_output));
  line("Request throughput (req/s):", num(m.request_throughput));
  line("Output token throughput (tok/s):", num(m.output_throughput));
  line("Peak output token throughput (tok/s):", num(m.max_output_tokens_per_s));
  line("Peak concurrent requests:", num(m.max_concurrent_requests));
  line("Total Token throughput (tok/s):", num(m.total_token_throughput));
  auto section = [&](const char* title, const char* abbr, const Summary& x) {
    rule(title, '-');
    line(fmt::format("Mean {} (ms):", abbr), num(x.mean_ms));
    line(fmt::format("Median {} (ms):", abbr), num(x.median_ms));
    for (const auto& [p, v] : x.percentiles_ms) line(fmt::format("P{} {} (ms):", p, abbr), num(v));
  };
  section("Time to First Token", "TTFT", m.ttft);
  section("Time per Output Token (excl. 1st token)", "TPOT", m.tpot);
  section("Inter-token Latency", "ITL", m.itl);
  section("End-to-end Latency", "E2EL", m.e2el);
  if (m.spec) {  // vLLM's section, from the server's counters over the run
    rule("Speculative Decoding", '-');
    line("Acceptance rate (%):", num(100.0 * m.spec->acceptance_rate()));
    line("Acceptance length:", num(m.spec->acceptance_length()));
    line("Drafts:", fmt::format("{:.0f}", m.spec->drafts));
    line("Draft tokens:", fmt::format("{:.0f}", m.spec->draft_tokens));
    line("Accepted tokens:", fmt::format("{:.0f}", m.spec->accepted_tokens));
  }
  s += std::string(50, '=');
  return s;
}

nlohmann::ordered_json result_json(const Metrics& m, const RunInfo& info, const std::vector<RequestOutput>& outputs,
                                   bool detailed) {
  using J = nlohmann::ordered_json;
  J j;
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y%m%d-%H%M%S", std::localtime(&now));
  j["date"] = date;
  j["endpoint_type"] = info.endpoint_type;
  j["backend"] = info.endpoint_type;
  j["label"] = info.label.empty() ? J(nullptr) : J(info.label);
  j["model_id"] = info.model_id;
  j["tokenizer_id"] = info.tokenizer_id.empty() ? J(nullptr) : J(info.tokenizer_id);
  j["num_prompts"] = info.num_prompts;
  j["request_rate"] = paced(info.request_rate) ? J(info.request_rate) : J("inf");
  j["burstiness"] = info.burstiness;
  j["max_concurrency"] = info.max_concurrency > 0 ? J(info.max_concurrency) : J(nullptr);
  // Ours, beyond vLLM's keys: enough to rerun the same benchmark.
  j["client"] = "kestrel bench";
  j["base_url"] = info.base_url;
  j["endpoint"] = info.endpoint;
  j["dataset_name"] = info.dataset;
  j["random_input_len"] = info.input_len;
  j["random_output_len"] = info.output_len;
  j["random_range_ratio"] = info.range_ratio;
  j["seed"] = info.seed;
  j["num_warmups"] = info.num_warmups;
  j["ignore_eos"] = info.ignore_eos;

  j["duration"] = m.duration_s;
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["total_input_tokens"] = m.total_input;
  j["total_output_tokens"] = m.total_output;
  j["request_throughput"] = m.request_throughput;
  j["request_goodput"] = nullptr;
  j["output_throughput"] = m.output_throughput;
  j["total_token_throughput"] = m.total_token_throughput;
  if (detailed) {
    J in = J::array(), outl = J::array(), ttfts = J::array(), itls = J::array(), lat = J::array(),
      starts = J::array(), queue = J::array(), texts = J::array(), errors = J::array();
    for (const auto& r : outputs) {
      in.push_back(r.prompt_len);
      outl.push_back(r.success ? r.output_tokens : 0);
      ttfts.push_back(r.ttft);
      itls.push_back(r.itl);
      lat.push_back(r.latency);
      starts.push_back(r.start_time);
      queue.push_back(r.queue_time);
      texts.push_back(r.generated_text);
      errors.push_back(r.error);
    }
    j["input_lens"] = in;
    j["output_lens"] = outl;
    j["ttfts"] = ttfts;
    j["itls"] = itls;
    j["latencies"] = lat;
    j["start_times"] = starts;
    j["queue_times"] = queue;
    j["generated_texts"] = texts;
    j["errors"] = errors;
  } else {
    // Not vLLM's: the first few distinct errors, so a failed run explains itself without --save-detailed.
    J errs = J::array();
    for (const auto& r : outputs)
      if (!r.success && errs.size() < 10 && std::find(errs.begin(), errs.end(), r.error) == errs.end()) errs.push_back(r.error);
    j["error_samples"] = errs;
  }
  j["max_output_tokens_per_s"] = m.max_output_tokens_per_s;
  j["max_concurrent_requests"] = m.max_concurrent_requests;
  if (m.spec) {
    j["spec_decode_acceptance_rate"] = 100.0 * m.spec->acceptance_rate();
    j["spec_decode_acceptance_length"] = m.spec->acceptance_length();
    j["spec_decode_num_drafts"] = m.spec->drafts;
    j["spec_decode_draft_tokens"] = m.spec->draft_tokens;
    j["spec_decode_accepted_tokens"] = m.spec->accepted_tokens;
  }
  auto put = [&](const char* name, const Summary& x) {
    j[fmt::format("mean_{}_ms", name)] = x.mean_ms;
    j[fmt::format("median_{}_ms", name)] = x.median_ms;
    j[fmt::format("std_{}_ms", name)] = x.std_ms;
    for (const auto& [p, v] : x.percentiles_ms) j[percentile_key(p, name)] = v;
  };
  put("ttft", m.ttft);
  put("tpot", m.tpot);
  put("itl", m.itl);
  put("e2el", m.e2el);
  return j;
}

}  // namespace kestrel::bench
