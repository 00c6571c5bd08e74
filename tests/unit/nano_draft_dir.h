// Where the random nano DSpark draft lives in the tests: $KESTREL_NANO_DSPARK_DIR, else "$KESTREL_NANO_DIR-dspark"
// (the ctest fixture make_nano_dspark_checkpoint writes it next to the nano target). Throws when neither is set.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kestrel::testing {

inline std::string nano_draft_dir() {
  if (const char* d = std::getenv("KESTREL_NANO_DSPARK_DIR")) return d;
  if (const char* n = std::getenv("KESTREL_NANO_DIR")) return std::string(n) + "-dspark";
  throw std::runtime_error("neither KESTREL_NANO_DSPARK_DIR nor KESTREL_NANO_DIR is set "
                           "(python3 reference/make_draft.py --config nano --out DIR --seed 1)");
}

}  // namespace kestrel::testing
