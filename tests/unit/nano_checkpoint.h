// The nano checkpoint of $KESTREL_NANO_DIR (the ctest fixture generates it), loaded once per process,
// with its tokenizer. Throws when the variable is unset, so a missing checkpoint fails the test.
#pragma once

#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::testing {

struct NanoCheckpoint {
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  ModelWeights w;
  std::unique_ptr<tok::Tokenizer> tok;
};

inline const NanoCheckpoint& nano_checkpoint() {
  static NanoCheckpoint* n = [] {
    const char* dir = std::getenv("KESTREL_NANO_DIR");
    if (!dir)
      throw std::runtime_error(
          "KESTREL_NANO_DIR is not set (python3 reference/make_checkpoint.py --config nano --out DIR --seed 1)");
    auto* p = new NanoCheckpoint;
    p->cfg = load_config(dir);
    p->ckpt = std::make_unique<Checkpoint>(dir);
    p->w = bind_weights(p->cfg, *p->ckpt);
    p->tok = std::make_unique<tok::Tokenizer>(tok::Tokenizer::load(dir));
    return p;
  }();
  return *n;
}

}  // namespace kestrel::testing
