// Where the random nano DSpark draft lives in the tests: $KESTREL_NANO_DSPARK_DIR, else "$KESTREL_NANO_DIR-dspark"
// (the ctest fixture make_nano_dspark_checkpoint writes it next to the nano target). Throws when neither is set.
// nano_draft(): that draft loaded once per process and bound to the nano target.
#pragma once

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "loader/dspark.h"
#include "loader/safetensors.h"
#include "model/dspark.h"
#include "nano_checkpoint.h"

namespace kestrel::testing {

inline std::string nano_draft_dir() {
  if (const char* d = std::getenv("KESTREL_NANO_DSPARK_DIR")) return d;
  if (const char* n = std::getenv("KESTREL_NANO_DIR")) return std::string(n) + "-dspark";
  throw std::runtime_error("neither KESTREL_NANO_DSPARK_DIR nor KESTREL_NANO_DIR is set "
                           "(python3 reference/make_draft.py --config nano --out DIR --seed 1)");
}

struct NanoDraft {
  DraftConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  DraftWeights w;
  std::unique_ptr<model::Draft> draft;
};

inline const NanoDraft& nano_draft() {
  static NanoDraft* d = [] {
    const std::string dir = nano_draft_dir();
    const auto& nano = nano_checkpoint();
    auto* p = new NanoDraft;
    p->cfg = load_draft_config(dir, nano.cfg);
    p->ckpt = std::make_unique<Checkpoint>(dir);
    p->w = bind_draft_weights(p->cfg, *p->ckpt);
    p->draft = std::make_unique<model::Draft>(p->cfg, p->w, nano.w);
    return p;
  }();
  return *d;
}

}  // namespace kestrel::testing
