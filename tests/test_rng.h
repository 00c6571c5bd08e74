// The tests' random numbers (splitmix64; tests/gpu, tests/emu, tests/unit): deterministic per seed, the same stream
// on every machine, fast enough for the 51 M-element weights of the mini shapes.
#pragma once

#include <cstdint>

namespace kestrel::testutil {

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * float(next() >> 40) * (1.0f / 16777216.0f); }
};

}  // namespace kestrel::testutil
