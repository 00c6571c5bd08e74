// kestrel bench's client library: statistics with vLLM's definitions on synthetic timelines, SSE
// parsing across arbitrary byte splits, streamed-chunk interpretation, the random dataset's exact
// prompt lengths and the report's vLLM keys.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "benchclient/client.h"
#include "benchclient/dataset.h"
#include "benchclient/report.h"
#include "benchclient/sse.h"
#include "benchclient/stats.h"
#include "core/check.h"

namespace kestrel::bench {
namespace {

TEST(BenchStats, PercentileMatchesNumpyLinear) {
  // numpy.percentile([1, 2, 3, 4], p): 50 -> 2.5, 99 -> 3.97, 0 -> 1, 100 -> 4.
  const std::vector<double> xs = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(percentile(xs, 50), 2.5);
  EXPECT_NEAR(percentile(xs, 99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(percentile(xs, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(xs, 100), 4);
  EXPECT_DOUBLE_EQ(percentile({7}, 99), 7);
  EXPECT_DOUBLE_EQ(percentile({}, 99), 0);  // vLLM: np.percentile(xs or 0, p)
  // numpy.percentile(range(1, 101), 99) == 99.01
  std::vector<double> h;
  for (int i = 1; i <= 100; ++i) h.push_back(i);
  EXPECT_NEAR(percentile(h, 99), 99.01, 1e-9);
  EXPECT_NEAR(percentile(h, 90), 90.1, 1e-9);
}

TEST(BenchStats, MeanAndPopulationStd) {
  EXPECT_DOUBLE_EQ(mean({2, 4, 4, 4, 5, 5, 7, 9}), 5);
  EXPECT_DOUBLE_EQ(stddev({2, 4, 4, 4, 5, 5, 7, 9}), 2);  // ddof = 0
  EXPECT_DOUBLE_EQ(mean({}), 0);
  EXPECT_DOUBLE_EQ(stddev({}), 0);
}

RequestOutput timeline(double start, double ttft, std::vector<double> itl, int tokens, int prompt = 10) {
  RequestOutput r;
  r.success = true;
  r.prompt_len = prompt;
  r.start_time = start;
  r.ttft = ttft;
  r.itl = std::move(itl);
  r.output_tokens = tokens;
  r.latency = ttft;
  for (double g : r.itl) r.latency += g;
  return r;
}

TEST(BenchStats, TpotExcludesTheFirstToken) {
  // 5 tokens: first at 0.5 s, then four gaps of 0.1 s -> e2e 0.9 s, TPOT (0.9 - 0.5) / 4 = 0.1 s.
  RequestOutput r = timeline(0, 0.5, {0.1, 0.1, 0.1, 0.1}, 5);
  ASSERT_TRUE(tpot(r).has_value());
  EXPECT_NEAR(*tpot(r), 0.1, 1e-12);
  // Usage may count more tokens than chunks (several tokens in one chunk): TPOT uses the tokens.
  r.output_tokens = 9;
  EXPECT_NEAR(*tpot(r), 0.4 / 8, 1e-12);
  r.output_tokens = 1;
  EXPECT_FALSE(tpot(r).has_value());
}

TEST(BenchStats, MetricsOnSyntheticTimelines) {
  std::vector<RequestOutput> outs;
  outs.push_back(timeline(0.0, 0.2, {0.05, 0.05, 0.10}, 4, 100));  // e2e 0.40, tpot 0.2/3
  outs.push_back(timeline(0.1, 0.4, {0.20}, 2, 50));               // e2e 0.60, tpot 0.2
  outs.push_back(timeline(0.2, 0.3, {}, 1, 30));                   // one token: no TPOT, no ITL
  RequestOutput failed;
  failed.prompt_len = 1000;
  failed.error = "HTTP 500";
  outs.push_back(failed);

  const Metrics m = compute_metrics(outs, 2.0, {50, 99});
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 1);
  EXPECT_EQ(m.total_input, 180);  // failed requests add nothing
  EXPECT_EQ(m.total_output, 7);
  EXPECT_DOUBLE_EQ(m.request_throughput, 1.5);
  EXPECT_DOUBLE_EQ(m.output_throughput, 3.5);
  EXPECT_DOUBLE_EQ(m.total_token_throughput, 93.5);
  EXPECT_NEAR(m.ttft.mean_ms, 300, 1e-9);
  EXPECT_NEAR(m.ttft.median_ms, 300, 1e-9);
  EXPECT_NEAR(m.ttft.std_ms, std::sqrt((0.01 + 0.01 + 0) / 3) * 1000, 1e-9);
  // TPOT over the two multi-token requests only.
  EXPECT_NEAR(m.tpot.mean_ms, (200.0 / 3 + 200) / 2, 1e-9);
  // ITL pools every gap: {50, 50, 100, 200}.
  EXPECT_NEAR(m.itl.mean_ms, 100, 1e-9);
  EXPECT_NEAR(m.itl.median_ms, 75, 1e-9);
  ASSERT_EQ(m.itl.percentiles_ms.size(), 2u);
  EXPECT_EQ(m.itl.percentiles_ms[1].first, 99);
  EXPECT_NEAR(m.itl.percentiles_ms[1].second, 100 + 100 * 0.97, 1e-9);  // rank 2.97 of {50,50,100,200}
  EXPECT_NEAR(m.e2el.median_ms, 400, 1e-9);
  EXPECT_GE(m.e2el.percentiles_ms[1].second, m.e2el.median_ms);
  // Every chunk lands in the first second; all three overlap at t = 0.2.
  EXPECT_DOUBLE_EQ(m.max_output_tokens_per_s, 4 + 2 + 1);
  EXPECT_EQ(m.max_concurrent_requests, 3);
}

TEST(BenchStats, BackToBackRequestsDoNotOverlap) {
  // [0, 1) then [1, 2): a departure at the same instant as an arrival comes first.
  std::vector<RequestOutput> outs = {timeline(0, 1, {}, 1), timeline(1, 1, {}, 1)};
  EXPECT_EQ(compute_metrics(outs, 2, {99}).max_concurrent_requests, 1);
}

TEST(BenchStats, AllFailedGivesZerosNotNaN) {
  RequestOutput f;
  f.error = "connection refused";
  const Metrics m = compute_metrics({f, f}, 0.5, {99});
  EXPECT_EQ(m.completed, 0);
  EXPECT_EQ(m.failed, 2);
  EXPECT_EQ(m.ttft.mean_ms, 0);
  EXPECT_EQ(m.tpot.percentiles_ms[0].second, 0);
  EXPECT_EQ(m.max_concurrent_requests, 0);
}

TEST(BenchSse, EventsAcrossEverySplit) {
  const std::string stream =
      ": keep-alive\r\n\r\n"
      "data: {\"a\":1}\r\n\r\n"
      "event: message\nid: 7\ndata: line1\ndata:line2\n\n"
      "retry: 10\n\n"
      "data: [DONE]\r\r";
  const std::vector<std::string> want = {"{\"a\":1}", "line1\nline2", "[DONE]"};
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    for (size_t cut2 = cut; cut2 <= stream.size(); cut2 += 7) {
      SseParser p;
      std::vector<std::string> got;
      for (auto piece : {stream.substr(0, cut), stream.substr(cut, cut2 - cut), stream.substr(cut2)})
        for (auto& e : p.feed(piece)) got.push_back(e);
      EXPECT_EQ(got, want) << "cuts at " << cut << ", " << cut2;
      EXPECT_FALSE(p.pending());
    }
  }
  // One byte at a time.
  SseParser p;
  std::vector<std::string> got;
  for (char c : stream)
    for (auto& e : p.feed(std::string(1, c))) got.push_back(e);
  EXPECT_EQ(got, want);
}

TEST(BenchSse, UnfinishedEventIsPendingNotEmitted) {
  SseParser p;
  EXPECT_TRUE(p.feed("data: {\"x\":").empty());
  EXPECT_TRUE(p.pending());
  EXPECT_TRUE(p.feed("1}\n").empty());  // line done, event not yet
  EXPECT_TRUE(p.pending());
  EXPECT_EQ(p.feed("\n"), std::vector<std::string>{"{\"x\":1}"});
}

TEST(BenchSse, CompletionChunks) {
  auto c = interpret_chunk(R"({"choices":[{"index":0,"text":" hi","finish_reason":null}],"usage":null})", Api::kCompletions);
  EXPECT_TRUE(c.has_choices && c.token && !c.finished);
  EXPECT_EQ(c.text, " hi");
  EXPECT_FALSE(c.completion_tokens);
  // An empty text without a finish is a token that decodes to nothing; with a finish it is not.
  EXPECT_TRUE(interpret_chunk(R"({"choices":[{"text":"","finish_reason":null}]})", Api::kCompletions).token);
  c = interpret_chunk(R"({"choices":[{"text":"","finish_reason":"length"}]})", Api::kCompletions);
  EXPECT_TRUE(c.finished && !c.token);
  EXPECT_EQ(c.finish_reason, "length");
  c = interpret_chunk(R"({"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34}})", Api::kCompletions);
  EXPECT_FALSE(c.has_choices);
  EXPECT_EQ(c.completion_tokens, 34);
  EXPECT_EQ(c.prompt_tokens, 12);
  EXPECT_TRUE(interpret_chunk("[DONE]", Api::kCompletions).done);
  EXPECT_FALSE(interpret_chunk("{not json", Api::kCompletions).error.empty());
  c = interpret_chunk(R"({"error":{"message":"engine failed","code":500}})", Api::kCompletions);
  EXPECT_NE(c.error.find("engine failed"), std::string::npos);
}

TEST(BenchSse, ChatChunks) {
  // The role opener and a content-free finish are not tokens (TTFT would be time-to-headers).
  auto c = interpret_chunk(R"({"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]})", Api::kChat);
  EXPECT_TRUE(c.has_choices);
  EXPECT_FALSE(c.token);
  c = interpret_chunk(R"({"choices":[{"delta":{},"finish_reason":"stop"}]})", Api::kChat);
  EXPECT_TRUE(c.finished && !c.token);
  EXPECT_EQ(c.finish_reason, "stop");
  c = interpret_chunk(R"({"choices":[{"delta":{"content":"ok"},"finish_reason":null}]})", Api::kChat);
  EXPECT_TRUE(c.token);
  EXPECT_EQ(c.text, "ok");
  // Reasoning counts once even when a server sends both spellings.
  c = interpret_chunk(R"({"choices":[{"delta":{"reasoning_content":"th","reasoning":"th"}}]})", Api::kChat);
  EXPECT_TRUE(c.token);
  EXPECT_EQ(c.text, "th");
  EXPECT_TRUE(interpret_chunk(R"({"choices":[{"delta":{"tool_calls":[{"index":0}]}}]})", Api::kChat).token);
}

tok::Tokenizer test_tokenizer() {
  // Bytes, then a few " word" tokens and merges toward them.
  std::vector<std::string> ranks;
  for (int b = 0; b < 256; ++b) ranks.push_back(std::string(1, char(b)));
  for (const char* w : {" t", " th", " the", " a", " an", " and", " c", " ca", " cat", " d", " do", " dog", " s", " sa",
                        " sat", " o", " on", " m", " ma", " mat", " f", " fo", " fox", " r", " ru", " run"})
    ranks.push_back(w);
  return tok::Tokenizer::from_ranks(ranks, {{"<|im_end|>", tok::TokenId(ranks.size())}});
}

TEST(BenchDataset, ExactPromptLengthsWithTokenizer) {
  const tok::Tokenizer t = test_tokenizer();
  RandomDatasetOptions o{20, 40, 8, 0.5, 3};
  const auto reqs = random_dataset(o, &t);
  ASSERT_EQ(reqs.size(), 20u);
  bool varied = false;
  for (const auto& r : reqs) {
    EXPECT_EQ(int(t.encode(r.prompt).size()), r.prompt_len) << r.prompt;
    EXPECT_GE(r.prompt_len, 20);
    EXPECT_LE(r.prompt_len, 60);
    EXPECT_GE(r.output_len, 4);
    EXPECT_LE(r.output_len, 12);
    varied |= r.prompt_len != reqs[0].prompt_len;
  }
  EXPECT_TRUE(varied);
  // Same seed, same prompts.
  EXPECT_EQ(random_dataset(o, &t)[7].prompt, reqs[7].prompt);
  o.range_ratio = 0;
  for (const auto& r : random_dataset(o, &t)) {
    EXPECT_EQ(r.prompt_len, 40);
    EXPECT_EQ(r.output_len, 8);
  }
}

TEST(BenchDataset, WordsWithoutTokenizerAndBadInput) {
  const auto reqs = random_dataset({3, 5, 2, 0, 1}, nullptr);
  ASSERT_EQ(reqs.size(), 3u);
  EXPECT_EQ(std::count(reqs[0].prompt.begin(), reqs[0].prompt.end(), ' '), 4);
  EXPECT_THROW(random_dataset({0, 5, 2, 0, 1}, nullptr), Error);
  EXPECT_THROW(random_dataset({1, 5, 2, 1.0, 1}, nullptr), Error);
}

// A temporary JSONL file with the given lines (removed with the object).
struct TempJsonl {
  std::filesystem::path path;
  explicit TempJsonl(const std::vector<std::string>& lines, const char* name = "kestrel_custom_dataset.jsonl")
      : path(std::filesystem::temp_directory_path() / name) {
    std::ofstream f(path);
    for (const auto& l : lines) f << l << '\n';
  }
  ~TempJsonl() { std::filesystem::remove(path); }
};

TEST(BenchDataset, CustomLinesInEveryFormShuffledAndRepeated) {
  const tok::Tokenizer t = test_tokenizer();
  const TempJsonl f({R"({"prompt": " the cat sat"})", "",
                     R"({"messages": [{"role": "user", "content": " the dog"}, {"role": "assistant", "content": " on"}]})",
                     R"({"id": "x", "request": {"max_tokens": 5, "messages": [{"role": "user", "content": " a fox"}]}})"});
  const auto reqs = custom_dataset({f.path.string(), 7, 9, 5}, &t);
  ASSERT_EQ(reqs.size(), 7u);
  std::map<std::string, int> seen;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const SampleRequest& r = reqs[i];
    EXPECT_EQ(r.output_len, 9);
    const std::string key = r.messages.empty() ? r.prompt : r.messages;
    ++seen[key];
    if (i >= 3) EXPECT_EQ(key, reqs[i - 3].messages.empty() ? reqs[i - 3].prompt : reqs[i - 3].messages);  // cycles
    if (r.messages.empty()) {
      EXPECT_EQ(r.prompt, " the cat sat");
      EXPECT_EQ(r.prompt_len, int(t.encode(" the cat sat").size()));
    } else {
      const auto m = nlohmann::json::parse(r.messages);
      ASSERT_TRUE(m.is_array());
      if (m.size() == 2) {
        EXPECT_EQ(m[1]["content"], " on");
        EXPECT_EQ(r.prompt_len, int(t.encode(" the dog").size() + t.encode(" on").size()));
      } else {
        ASSERT_EQ(m.size(), 1u);
        EXPECT_EQ(m[0]["content"], " a fox");
      }
    }
  }
  EXPECT_EQ(seen.size(), 3u);  // every line used, the blank one skipped
  // The seed picks the order; the same seed the same order.
  const auto again = custom_dataset({f.path.string(), 7, 9, 5}, &t);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(again[i].messages + again[i].prompt, reqs[i].messages + reqs[i].prompt);
  // The body a chat request carries: the line's own messages, whole.
  ClientOptions co;
  co.api = Api::kChat;
  co.model = "m";
  for (const SampleRequest& r : reqs) {
    if (r.messages.empty()) continue;
    const auto j = nlohmann::json::parse(Client(co, nullptr).request_body(r));
    EXPECT_EQ(j["messages"], nlohmann::json::parse(r.messages));
    EXPECT_EQ(j["max_completion_tokens"], 9);
  }
}

TEST(BenchDataset, CustomBadLinesNameTheirLine) {
  auto msg = [](const std::vector<std::string>& lines) {
    const TempJsonl f(lines, "kestrel_custom_dataset_bad.jsonl");
    try {
      custom_dataset({f.path.string(), 2, 4, 0}, nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg({R"({"prompt": "a"})", "not json"}).find(":2: not a JSON object"), std::string::npos);
  EXPECT_NE(msg({R"({"prompt": 3})"}).find(":1: \"prompt\" must be a string"), std::string::npos);
  EXPECT_NE(msg({R"({"text": "a"})"}).find(":1: expected"), std::string::npos);
  EXPECT_NE(msg({R"({"messages": []})"}).find("non-empty array"), std::string::npos);
  EXPECT_NE(msg({R"({"messages": [{"content": "a"}]})"}).find("\"role\""), std::string::npos);
  EXPECT_NE(msg({"", "  "}).find("no requests"), std::string::npos);
  EXPECT_THROW(custom_dataset({"/nonexistent/kestrel.jsonl", 1, 1, 0}, nullptr), Error);
  EXPECT_THROW(custom_dataset({"", 1, 1, 0}, nullptr), Error);
  // Without a tokenizer a prompt's length counts its words.
  const TempJsonl f({R"({"prompt": "one two  three\nfour"})"}, "kestrel_custom_dataset_words.jsonl");
  EXPECT_EQ(custom_dataset({f.path.string(), 1, 4, 0}, nullptr)[0].prompt_len, 4);
}

TEST(BenchClient, UrlsAndRequestBodies) {
  Url u = parse_url("http://127.0.0.1:8000");
  EXPECT_EQ(u.host, "127.0.0.1");
  EXPECT_EQ(u.port, "8000");
  EXPECT_EQ(u.path, "");
  u = parse_url("http://[::1]:9/prefix/");
  EXPECT_EQ(u.host, "::1");
  EXPECT_EQ(u.port, "9");
  EXPECT_EQ(u.path, "/prefix");
  EXPECT_EQ(parse_url("http://localhost").port, "80");
  EXPECT_THROW(parse_url("https://x"), Error);
  EXPECT_THROW(parse_url("127.0.0.1:8000"), Error);
  EXPECT_THROW(parse_url("http://h:99999"), Error);

  ClientOptions o;
  o.model = "m";
  o.ignore_eos = true;
  const SampleRequest r{"hello", 1, 7};
  const auto j = nlohmann::json::parse(Client(o, nullptr).request_body(r));
  EXPECT_EQ(j["prompt"], "hello");
  EXPECT_EQ(j["max_tokens"], 7);
  EXPECT_EQ(j["stream"], true);
  EXPECT_EQ(j["stream_options"]["include_usage"], true);
  EXPECT_EQ(j["ignore_eos"], true);
  o.api = Api::kChat;
  o.ignore_eos = false;
  const auto c = nlohmann::json::parse(Client(o, nullptr).request_body(r));
  EXPECT_EQ(c["messages"][0]["content"], "hello");
  EXPECT_EQ(c["max_completion_tokens"], 7);
  EXPECT_FALSE(c.contains("ignore_eos"));
}

TEST(BenchReport, VllmKeysAndTable) {
  EXPECT_EQ(percentile_key(99, "ttft"), "p99_ttft_ms");
  EXPECT_EQ(percentile_key(99.9, "itl"), "p99.9_itl_ms");
  const Metrics m = compute_metrics({timeline(0, 0.1, {0.01, 0.02}, 3)}, 1.0, {99});
  RunInfo info;
  info.max_concurrency = 4;
  const auto j = result_json(m, info, {}, false);
  for (const char* k : {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                        "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                        "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                        "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
                        "max_output_tokens_per_s", "max_concurrent_requests"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["request_rate"], "inf");
  EXPECT_EQ(j["max_concurrency"], 4);
  const std::string t = format_table(m, info);
  EXPECT_NE(t.find("============ Serving Benchmark Result ============"), std::string::npos);
  EXPECT_NE(t.find("Mean TPOT (ms):                          15.00"), std::string::npos) << t;
  EXPECT_NE(t.find("P99 ITL (ms):"), std::string::npos);
  EXPECT_NE(t.find("Maximum request concurrency:             4"), std::string::npos) << t;
  EXPECT_EQ(t.find("Speculative Decoding"), std::string::npos) << "no section without the server's counters";
  EXPECT_FALSE(j.contains("spec_decode_acceptance_length"));
}

TEST(BenchReport, SpeculativeDecodingFromTheServersCounters) {
  // As kestrel serve writes them (server/metrics.cpp), summed over label sets; other metrics ignored.
  const std::string text =
      "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.\n"
      "# TYPE vllm:spec_decode_num_drafts counter\n"
      "vllm:spec_decode_num_drafts_total{model_name=\"m\"} 8\n"
      "vllm:spec_decode_num_drafts_total{model_name=\"other\"} 2\n"
      "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 40\n"
      "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 25\n"
      "vllm:generation_tokens_total{model_name=\"m\"} 99\n";
  const auto c = parse_spec_decode_metrics(text);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->drafts, 10);
  EXPECT_EQ(c->draft_tokens, 40);
  EXPECT_EQ(c->accepted_tokens, 25);
  EXPECT_DOUBLE_EQ(c->acceptance_length(), 3.5);
  EXPECT_DOUBLE_EQ(c->acceptance_rate(), 0.625);
  EXPECT_FALSE(parse_spec_decode_metrics("vllm:generation_tokens_total{model_name=\"m\"} 3\n").has_value());
  Metrics m = compute_metrics({timeline(0, 0.1, {0.01, 0.02}, 3)}, 1.0, {99});
  m.spec = c;
  const std::string t = format_table(m, RunInfo{});
  EXPECT_NE(t.find("---------------Speculative Decoding---------------"), std::string::npos) << t;
  EXPECT_NE(t.find("Acceptance length:                       3.50"), std::string::npos) << t;
  EXPECT_NE(t.find("Acceptance rate (%):                     62.50"), std::string::npos) << t;
  const auto j = result_json(m, RunInfo{}, {}, false);
  EXPECT_DOUBLE_EQ(j["spec_decode_acceptance_length"].get<double>(), 3.5);
  EXPECT_DOUBLE_EQ(j["spec_decode_num_drafts"].get<double>(), 10);
}

}  // namespace
}  // namespace kestrel::bench
