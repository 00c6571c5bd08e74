// `--speculative-config` (vLLM's flag and keys): the JSON object that turns DSpark speculative decoding on.
//
//   {"method": "dspark", "model": "DIR", "num_speculative_tokens": 7,
//    "draft_sample_method": "probabilistic" | "greedy", "rejection_sample_method": "block" | "token",
//    "dspark_draft_topk": 0}
// method and model are required; num_speculative_tokens defaults to the draft config's block size (checked
// against it when the draft loads). Unknown keys and bad values are a kestrel::Error naming the key.
#pragma once

#include <string>

#include "runtime/spec_verify.h"

namespace kestrel::runtime {

struct SpeculativeConfig {
  std::string method = "dspark";
  std::string model;                    // draft directory
  int num_speculative_tokens = 0;       // 0: the draft's block size
  bool draft_greedy = false;            // draft_sample_method "greedy" (default "probabilistic")
  RejectionMethod rejection = RejectionMethod::block;
  int draft_topk = 0;                   // dspark_draft_topk; 0 = no pruning
  int disable_by_batch_size = 0;        // vLLM's: no drafts in a step with more decodes than this (0 = never)
};

SpeculativeConfig parse_speculative_config(const std::string& json_text);

}  // namespace kestrel::runtime
