// Minimal token sampler for `kestrel generate`: greedy, temperature, top-p (nucleus), seeded.
//
// temperature == 0 is greedy (argmax, ties to the lower id). Otherwise logits are divided by the
// temperature, softmaxed in FP64, the smallest set of most likely tokens whose mass reaches top_p is
// kept (ties by lower id), and one token is drawn with std::mt19937_64 seeded by `seed`, so a seed
// reproduces a run exactly.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace kestrel::runtime {

struct SamplerConfig {
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerConfig& cfg);
  int32_t sample(std::span<const float> logits /* f32 [V] */);

 private:
  SamplerConfig cfg_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;
  std::vector<double> prob_;
};

}  // namespace kestrel::runtime
