// Benchmark statistics with the definitions `vllm bench serve` uses (vllm/benchmarks/serve.py,
// calculate_metrics), so numbers from `kestrel bench` and from vLLM's client can be compared:
//
//   TTFT   time from sending the request to the first streamed token chunk.
//   TPOT   per request, (e2e latency - TTFT) / (output tokens - 1); only requests with > 1 token.
//   ITL    per token: the gap between consecutive token-bearing chunks of a request divided among
//          the tokens the later chunk brings (the server's running usage count when it streams one,
//          vLLM's continuous_usage_stats; else the chunk's text re-encoded; else one), pooled over
//          all requests. Tokens without text (chat markup) thus count where they surface instead of
//          merging two gaps into one; against a server that streams one token per chunk this is
//          vLLM's per-chunk ITL.
//   E2EL   time from sending the request to its last streamed choice chunk.
//   Percentiles interpolate linearly between order statistics (numpy.percentile's default); std is
//   the population standard deviation (numpy.std); an empty sample gives 0 for everything, as
//   numpy does for vLLM's `np.mean(xs or 0)`.
// Throughputs divide by the whole benchmark duration; failed requests add nothing but their count.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kestrel::bench {

// What one request produced. Times are seconds; start_time is relative to the benchmark start.
struct RequestOutput {
  bool success = false;
  int prompt_len = 0;
  int output_tokens = 0;       // usage.completion_tokens, else counted (see client.h)
  double start_time = 0;       // when the request was sent
  double queue_time = 0;       // client-side wait for a concurrency slot before sending
  double ttft = 0;
  double latency = 0;          // end-to-end
  std::vector<double> itl;     // inter-token gaps, one per token after the first chunk (see ITL)
  int token_chunks = 0;        // chunks that carried output
  std::string generated_text;
  std::string error;
};

// numpy.percentile(xs, p) with linear interpolation, p in [0, 100]; 0 for an empty sample.
double percentile(std::vector<double> xs, double p);
double mean(const std::vector<double>& xs);
double stddev(const std::vector<double>& xs);  // population (ddof = 0)

// TPOT of one request, or nothing when it produced fewer than two tokens.
std::optional<double> tpot(const RequestOutput& r);

// A sample summarised in milliseconds.
struct Summary {
  double mean_ms = 0, median_ms = 0, std_ms = 0;
  std::vector<std::pair<double, double>> percentiles_ms;  // (p, value)
};
Summary summarize_ms(const std::vector<double>& seconds, const std::vector<double>& percentiles);

// The server's speculative-decoding counters (vLLM's vllm:spec_decode_num_drafts, _num_draft_tokens,
// _num_accepted_tokens), summed over label sets; absent when the server reports none of them.
struct SpecDecodeCounters {
  double drafts = 0, draft_tokens = 0, accepted_tokens = 0;
  // Mean tokens a verification step emits (accepted drafts + the target's own token).
  double acceptance_length() const { return drafts > 0 ? 1.0 + accepted_tokens / drafts : 0.0; }
  double acceptance_rate() const { return draft_tokens > 0 ? accepted_tokens / draft_tokens : 0.0; }
};
std::optional<SpecDecodeCounters> parse_spec_decode_metrics(const std::string& prometheus_text);

struct Metrics {
  int completed = 0, failed = 0;
  long long total_input = 0, total_output = 0;
  double duration_s = 0;
  double request_throughput = 0, output_throughput = 0, total_token_throughput = 0;
  Summary ttft, tpot, itl, e2el;
  double max_output_tokens_per_s = 0;  // busiest one-second bucket of token chunks
  int max_concurrent_requests = 0;     // most requests in flight at one instant
  std::optional<SpecDecodeCounters> spec;  // the run's share of the server's counters (after − before)
};

Metrics compute_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                        const std::vector<double>& percentiles);

}  // namespace kestrel::bench
