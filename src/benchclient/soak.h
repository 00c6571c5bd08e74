// `kestrel bench --soak ROUNDS`: does a server's memory stay flat under load? (issue #24)
//
// Each round sends N streamed requests at once (or at most max_concurrency at a time) to any
// OpenAI-compatible server, each on its own connection, and a fraction of the clients leave early:
//  - "queued" drops close the socket a random moment (up to queued_drop_ms) after the response
//    head, before their first token if the server has not admitted them yet — a cancel while waiting;
//  - "stream" drops close it after k tokens (k uniform in [1, output_len − 1]) — a cancel mid-stream.
// A drop is classified by what it had seen when it closed (no token yet: queued; else: stream).
// Every other stream must end properly: completed (a finish_reason, then [DONE]; the reasons are
// counted) or failed with an error the server sent (HTTP status or an error event); anything else
// (a reset, a stream cut without a finish or [DONE], a stall) is "broken" and fails the run.
// After the round the server is given time to drain (its /metrics gauges running and waiting back
// to 0, at most drain_timeout_s) and to settle (settle_s), then the round's row is sampled:
//  - the server process's RSS (VmRSS of /proc/PID/status) and, where nvidia-smi answers, the GPU
//    memory it holds (`nvidia-smi --query-compute-apps=pid,used_memory`; where that lists no such pid,
//    as in a container, the device's memory.used, marked '*'), when server_pid is given;
//  - the gauges of /metrics: running, waiting, kv_pages_used (held by requests), kv_pages_allocated
//    (also those the prefix cache keeps), and kv_cache_usage_perc;
//  - GET /debug/integrity when the server offers it (`kestrel serve --debug-routes`): the engine's
//    page/slot/prefix-cache accounting checked after the drain ("ok"), else "-"; and, where the server
//    reports it (kestrel on glibc), heap_bytes: what its C allocator has handed out and not had back.
//    RSS moves in pages and a small leak hides in the allocator's free space for a long time; the heap
//    counts bytes, so its growth per request served after the baseline round bounds a leak to tens of
//    bytes per request (max_heap_bytes_per_request). Start the server with
//    GLIBC_TUNABLES=glibc.malloc.tcache_count=0 for that: chunks in glibc's per-thread caches count as
//    in use and move the figure by tens of KB.
// Every round uses new random prompts (seed + round), so a prefix cache keeps meeting new text; with
// shared_prefix_len > 0 each prompt starts with one of shared_prefix_groups fixed prefixes, so the
// prefix cache's sharing, checkpoints and (with a small memory budget) preemption are exercised too.
// Growth is reported from the baseline round (default 2: after warm-up) to the last.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "benchclient/client.h"
#include "benchclient/dataset.h"

namespace kestrel::bench {

struct SoakOptions {
  int rounds = 1;
  RandomDatasetOptions dataset;    // num_prompts = streams per round; seed + round per round
  int max_concurrency = 0;         // 0: all of a round's streams at once
  double drop_fraction = 0.3;      // clients that leave early
  double queued_share = 0.5;       // of those, the share that leaves soon after the response head
  int queued_drop_ms = 200;        // a queued drop closes within this long after the head
  int shared_prefix_len = 0;       // tokens (words without a tokenizer) of a shared prefix; 0: none
  int shared_prefix_groups = 4;    // distinct shared prefixes
  int server_pid = 0;              // 0: no RSS / GPU memory
  double drain_timeout_s = 300;    // waiting for running = waiting = 0 after a round
  double settle_s = 2;             // then this long before sampling
  int baseline_round = 2;          // growth is measured from after this round to after the last
  std::optional<double> max_rss_growth_mb, max_gpu_growth_mib;  // fail the run beyond these
  std::optional<double> max_heap_bytes_per_request;             // likewise: heap growth / requests sent after the baseline
};

// What a server looked like after a round (absent: not available).
struct ServerSample {
  std::optional<double> rss_mb, gpu_mib;
  bool gpu_whole_device = false;  // nvidia-smi listed no process of the pid: the device's memory in use (table: '*')
  std::optional<double> running, waiting, pages_used, pages_allocated, kv_usage;
  std::optional<double> heap_bytes;  // /debug/integrity's heap_bytes
  std::string integrity = "-";  // "ok", "-" (no /debug/integrity), or the failure
};

struct SoakRound {
  int round = 0;  // 0: before the first round
  int sent = 0, completed = 0, dropped_queued = 0, dropped_stream = 0, failed = 0;
  // Of the failed: `broken` streams ended without a proper end (no finish_reason before [DONE], a reset, a
  // stall past the client timeout); the rest got a proper error (an HTTP error status or an error event).
  int broken = 0;
  std::map<std::string, int> finish_reasons;  // of the completed streams
  double seconds = 0;        // the streams, first sent to last done
  double drain_seconds = 0;  // until running = waiting = 0
  bool drained = true;
  std::string first_error;
  ServerSample server;
};

// Pure helpers (unit-tested).
// The gauges of a Prometheus text page: vllm:num_requests_running, vllm:num_requests_waiting,
// kestrel:kv_pages_used, kestrel:kv_pages_allocated, vllm:kv_cache_usage_perc (labels ignored;
// several series of one name are summed).
void parse_metrics(const std::string& text, ServerSample& s);
// MiB that `pid` holds in `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader`
// output ("1234, 5678 MiB" per line, summed over the process's lines); absent when it is not listed.
std::optional<double> parse_gpu_mib(const std::string& csv, int pid);
// VmRSS of a /proc/PID/status text, in MB (10^6 bytes); absent when missing.
std::optional<double> parse_vm_rss_mb(const std::string& status);

struct SoakSummary {
  std::optional<double> rss_growth_mb, gpu_growth_mib;  // last round − baseline round
  std::optional<double> heap_growth_bytes;             // likewise
  int requests_after_baseline = 0;                     // sent in the rounds after the baseline round
  std::optional<double> heap_bytes_per_request;        // heap_growth_bytes / requests_after_baseline
  int baseline_round = 0;
  bool ok = true;       // within the limits asked for, every round drained, integrity never failed, no broken stream
  std::string verdict;  // one line per finding
};
SoakSummary summarize(const std::vector<SoakRound>& rounds, const SoakOptions& o);

// The per-round table: a header and one row per round (the pre-round sample is round 0).
std::string soak_table_header();
std::string soak_table_row(const SoakRound& r);
std::string format_soak_table(const std::vector<SoakRound>& rounds);
nlohmann::json soak_json(const std::vector<SoakRound>& rounds, const SoakSummary& sum, const SoakOptions& o,
                         const ClientOptions& co);

// Runs the rounds against co.base/co.endpoint; `on_round` (may be empty) sees each row as it is
// sampled, round 0 (before the first round) included. `tok` may be null.
std::vector<SoakRound> run_soak(const SoakOptions& o, const ClientOptions& co, const tok::Tokenizer* tok,
                                const std::function<void(const SoakRound&)>& on_round);

}  // namespace kestrel::bench
