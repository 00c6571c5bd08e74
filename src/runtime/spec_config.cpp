// --speculative-config parsing: see spec_config.h.
#include "runtime/spec_config.h"

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace kestrel::runtime {

SpeculativeConfig parse_speculative_config(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("--speculative-config is not valid JSON: {}", e.what());
  }
  if (!j.is_object()) fail("--speculative-config must be a JSON object");
  SpeculativeConfig c;
  auto str = [&](const char* k) -> std::string {
    if (!j[k].is_string()) fail("--speculative-config: \"{}\" must be a string, got {}", k, j[k].dump());
    return j[k].get<std::string>();
  };
  auto integer = [&](const char* k, int lo, int hi) -> int {
    if (!j[k].is_number_integer() || j[k].get<int64_t>() < lo || j[k].get<int64_t>() > hi)
      fail("--speculative-config: \"{}\" must be an integer in [{}, {}], got {}", k, lo, hi, j[k].dump());
    return int(j[k].get<int64_t>());
  };
  for (const auto& [k, v] : j.items()) {
    if (k == "method") {
      c.method = str("method");
      if (c.method != "dspark") fail("--speculative-config: method \"{}\" is not supported (only \"dspark\")", c.method);
    } else if (k == "model") {
      c.model = str("model");
    } else if (k == "num_speculative_tokens") {
      c.num_speculative_tokens = integer("num_speculative_tokens", 1, 64);
    } else if (k == "draft_sample_method") {
      const std::string s = str("draft_sample_method");
      if (s != "greedy" && s != "probabilistic")
        fail("--speculative-config: draft_sample_method must be \"probabilistic\" or \"greedy\", got \"{}\"", s);
      c.draft_greedy = s == "greedy";
    } else if (k == "rejection_sample_method") {
      c.rejection = parse_rejection_method(str("rejection_sample_method"));
    } else if (k == "dspark_draft_topk") {
      c.draft_topk = integer("dspark_draft_topk", 0, 1 << 20);
    } else if (k == "disable_by_batch_size") {
      c.disable_by_batch_size = integer("disable_by_batch_size", 1, 1 << 20);
    } else {
      fail("--speculative-config: unknown key \"{}\" (method, model, num_speculative_tokens, draft_sample_method, "
           "rejection_sample_method, dspark_draft_topk, disable_by_batch_size)", k);
    }
  }
  if (!j.contains("method")) fail("--speculative-config: \"method\" is required (\"dspark\")");
  if (c.model.empty()) fail("--speculative-config: \"model\" (the draft directory) is required");
  return c;
}

}  // namespace kestrel::runtime
