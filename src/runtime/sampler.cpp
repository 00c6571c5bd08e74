// Sampler: see sampler.h.
#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace kestrel::runtime {

Sampler::Sampler(const SamplerConfig& cfg) : cfg_(cfg), rng_(cfg.seed) {
  if (!(cfg.temperature >= 0.0f) || !std::isfinite(cfg.temperature))
    fail("temperature must be a finite number >= 0, got {}", cfg.temperature);
  if (!(cfg.top_p > 0.0f && cfg.top_p <= 1.0f)) fail("top_p must be in (0, 1], got {}", cfg.top_p);
}

int32_t Sampler::sample(std::span<const float> logits) {
  const size_t V = logits.size();
  KCHECK(V > 0, "sampling from an empty vocabulary");
  if (cfg_.temperature == 0.0f) return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
  prob_.resize(V);
  const double top = logits[size_t(order_[0])];
  double sum = 0.0;
  for (size_t i = 0; i < V; ++i) sum += (prob_[i] = std::exp((double(logits[size_t(order_[i])]) - top) / cfg_.temperature));
  // Nucleus: keep the shortest prefix whose probability mass reaches top_p.
  size_t keep = V;
  double mass = 0.0;
  for (size_t i = 0; i < V; ++i) {
    mass += prob_[i] / sum;
    if (mass >= double(cfg_.top_p)) {
      keep = i + 1;
      break;
    }
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) kept += prob_[i];
  const double u = std::uniform_real_distribution<double>(0.0, kept)(rng_);
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += prob_[i];
    if (u < acc) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace kestrel::runtime
