// `kestrel eval`: accuracy suite (passkey retrieval, arithmetic, tool calls) against any
// OpenAI-compatible endpoint, or offline on saved responses.
//
//   kestrel eval --set FILE [--set FILE ...] --base-url http://HOST:PORT[/v1] [--model NAME]
//                [--api-key K] [--concurrency C] [--limit N] [--seed S] [--timeout SEC]
//                [--out result.json [--save-responses]] [--no-progress]
//   kestrel eval --set FILE [...] --score-responses result.json [--out rescored.json]
//
// Sets are loaded and checked whole before anything is sent (src/evalclient/eval_set.h). Each item's
// request goes, non-streamed, to /v1/chat/completions through the bench client's connection pool
// (src/benchclient/client.h); every answer, or its error, is scored by src/evalclient/scorer.h —
// the same code that scores a saved file from `--score-responses`, which is how the PyTorch
// reference's answers (reference/eval_ref.py) are judged. Per-item errors are counted and listed; the
// command exits 1 only when every item errored (after printing and writing its report).
#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "benchclient/client.h"
#include "benchclient/report.h"
#include "cli/commands.h"
#include "core/check.h"
#include "evalclient/eval_set.h"
#include "evalclient/scorer.h"

namespace kestrel::cli {

void register_eval(CLI::App& app) {
  struct Opts {
    std::vector<std::string> sets;
    std::string base_url = "http://127.0.0.1:8000", model, api_key, out, score_responses;
    int concurrency = 8, limit = 0;
    long long seed = -1;
    double timeout = 600;
    bool save_responses = false, no_progress = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("eval", "accuracy suite (passkey, arithmetic, tool calls) against an OpenAI-compatible server");
  cmd->add_option("--set", o->sets, "eval-set JSONL file (repeatable)")->required();
  cmd->add_option("--base-url", o->base_url, "server URL, http://HOST:PORT[/PREFIX] (a trailing /v1 is understood)");
  cmd->add_option("--model", o->model, "model name sent in requests (default: the server's first in /v1/models)");
  cmd->add_option("--api-key", o->api_key, "Authorization: Bearer KEY (default: $OPENAI_API_KEY)");
  cmd->add_option("--concurrency", o->concurrency, "requests in flight at most")->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--limit", o->limit, "only the first N items of each set (0: all)")->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--seed", o->seed, "sent as the request's `seed` (matters only for sets with temperature > 0)")
      ->check(CLI::Range(0LL, (1LL << 53)));
  cmd->add_option("--timeout", o->timeout, "seconds without data from the server that fail an item");
  cmd->add_option("--out", o->out, "write summary and per-item verdicts as JSON");
  cmd->add_flag("--save-responses", o->save_responses, "also write every response in --out (readable by --score-responses)");
  cmd->add_option("--score-responses", o->score_responses,
                  "score saved responses (an --out file written with --save-responses, or reference/eval_ref.py's) "
                  "instead of querying a server");
  cmd->add_flag("--no-progress", o->no_progress, "no progress bar on stderr");
  cmd->callback([o, cmd] {
    using namespace kestrel::eval;
    if (o->save_responses && o->out.empty()) fail("--save-responses needs --out FILE");
    std::vector<EvalItem> items;
    for (const auto& path : o->sets) {
      auto part = load_eval_set(path, o->limit);
      items.insert(items.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
    }
    check_unique_ids(items);

    std::vector<Response> responses;
    nlohmann::ordered_json run{{"sets", o->sets}, {"limit", o->limit}};
    if (!o->score_responses.empty()) {
      for (const char* flag : {"--base-url", "--model", "--api-key", "--concurrency", "--seed"})
        if (cmd->count(flag) > 0) fail("{} has no effect with --score-responses (nothing is sent)", flag);
      std::vector<std::string> missing;
      std::vector<Response> saved = read_saved_responses(o->score_responses, items, &missing);
      // Items without a saved answer (a run with --limit, say) are left out of the score, not failed.
      if (!missing.empty()) {
        fmt::print("{} of {} items have no saved response and are not scored (first: {})\n", missing.size(),
                   items.size(), missing[0]);
        const std::set<std::string> absent(missing.begin(), missing.end());
        std::vector<EvalItem> kept_items;
        for (size_t i = 0; i < items.size(); ++i)
          if (!absent.count(items[i].id)) {
            kept_items.push_back(std::move(items[i]));
            responses.push_back(std::move(saved[i]));
          }
        items = std::move(kept_items);
        if (items.empty()) fail("{}: no response for any item of the sets", o->score_responses);
      } else {
        responses = std::move(saved);
      }
      run["mode"] = "score-responses";
      run["responses_file"] = o->score_responses;
    } else {
      using namespace kestrel::bench;
      ClientOptions co;
      co.base = parse_url(o->base_url);
      co.endpoint = co.base.path.ends_with("/v1") ? "/chat/completions" : "/v1/chat/completions";
      co.api = Api::kChat;
      co.api_key = o->api_key;
      if (co.api_key.empty())
        if (const char* k = std::getenv("OPENAI_API_KEY")) co.api_key = k;
      co.timeout_s = o->timeout;
      if (o->model.empty()) {
        ClientOptions probe = co;
        if (co.base.path.ends_with("/v1")) probe.base.path.resize(probe.base.path.size() - 3);
        o->model = Client(probe, nullptr).first_model();
        fmt::print("model: {} (from /v1/models)\n", o->model);
      }
      co.model = o->model;
      std::vector<std::string> bodies;
      bodies.reserve(items.size());
      for (const auto& it : items) bodies.push_back(request_body(it, o->model, o->seed));
      fmt::print("Evaluating {} items from {} set(s) against {} (model {}, concurrency {})\n", items.size(),
                 o->sets.size(), o->base_url, o->model, o->concurrency);
      std::fflush(stdout);
      Client client(co, nullptr);
      ProgressBar bar(int(bodies.size()), !o->no_progress);
      const auto replies = client.post_all(bodies, o->concurrency, [&](int done, int) { bar.update(done); });
      bar.finish();
      for (const auto& r : replies) responses.push_back(response_from_http(r.status, r.body, r.error));
      run["mode"] = "endpoint";
      run["base_url"] = o->base_url;
      run["model"] = o->model;
      run["concurrency"] = o->concurrency;
      run["seed"] = o->seed >= 0 ? nlohmann::ordered_json(o->seed) : nlohmann::ordered_json(nullptr);
    }

    std::vector<Verdict> verdicts;
    verdicts.reserve(items.size());
    for (size_t i = 0; i < items.size(); ++i) verdicts.push_back(score_item(items[i], responses[i]));
    const Summary s = summarize(items, responses, verdicts);
    fmt::print("{}\n", format_tables(s));
    std::fflush(stdout);

    if (!o->out.empty()) {
      nlohmann::ordered_json j{{"format", "kestrel-eval-v1"}, {"run", run}, {"summary", summary_json(s)}};
      nlohmann::ordered_json arr = nlohmann::ordered_json::array();
      for (size_t i = 0; i < items.size(); ++i) arr.push_back(item_json(items[i], responses[i], verdicts[i], o->save_responses));
      j["items"] = std::move(arr);
      std::ofstream f(o->out);
      if (!f) fail("cannot write --out {}", o->out);
      f << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
      if (!f) fail("error writing --out {}", o->out);
      fmt::print("results written to {}\n", o->out);
    }
    if (s.errors == s.items) fail("all {} items failed (first error: {})", s.items, responses[0].error);
  });
}

}  // namespace kestrel::cli
