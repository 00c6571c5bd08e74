// Reporting for `kestrel bench`: the progress bar, the result table and the JSON result file,
// laid out and keyed as `vllm bench serve` does so existing tooling reads both.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "benchclient/stats.h"

namespace kestrel::bench {

// A tqdm-like bar on stderr (` 45%|#####      | 9/20 [00:02<00:03, 4.10 req/s]`), redrawn at most
// ten times a second and once at the end. Disabled: prints nothing.
class ProgressBar {
 public:
  ProgressBar(int total, bool enabled);
  void update(int done);
  void finish();

 private:
  void draw(int done);
  int total_;
  bool enabled_, finished_ = false;
  int last_done_ = 0, last_drawn_ = -1;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// What was asked for, recorded next to the results.
struct RunInfo {
  std::string endpoint_type = "openai";  // vLLM's name: "openai" (completions) or "openai-chat"
  std::string label, model_id, tokenizer_id, base_url, endpoint, dataset = "random";
  int num_prompts = 0, max_concurrency = 0, num_warmups = 0;  // max_concurrency 0: none
  double request_rate = 0, burstiness = 1;                    // rate <= 0 or inf: all at once
  int input_len = 0, output_len = 0;
  double range_ratio = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::vector<double> percentiles{99};
};

// vLLM's key for percentile p of a metric: p99_ttft_ms, p99.9_itl_ms.
std::string percentile_key(double p, const std::string& metric);

// The result table, as vLLM prints it (plus End-to-end Latency), without a trailing newline.
std::string format_table(const Metrics& m, const RunInfo& info);

// The result file. detailed: also the per-request arrays (input_lens, output_lens, ttfts, itls,
// generated_texts, errors, ...), which vLLM writes only with --save-detailed.
nlohmann::ordered_json result_json(const Metrics& m, const RunInfo& info, const std::vector<RequestOutput>& outputs,
                                   bool detailed);

}  // namespace kestrel::bench
