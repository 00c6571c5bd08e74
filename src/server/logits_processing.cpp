// Logit processing: see logits_processing.h.
#include "server/logits_processing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

namespace kestrel::server {

void process_logits(std::span<float> logits, const SamplingParams& p, const TokenCounts& generated,
                    const std::vector<int32_t>& prompt) {
  const size_t V = logits.size();
  const float ninf = -std::numeric_limits<float>::infinity();
  if (p.repetition_penalty != 1.0f) {
    std::unordered_set<int32_t> seen(prompt.begin(), prompt.end());
    for (const auto& [t, n] : generated) seen.insert(t);
    for (int32_t t : seen) {
      if (t < 0 || size_t(t) >= V) continue;
      float& l = logits[size_t(t)];
      l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    for (const auto& [t, n] : generated) {
      if (t < 0 || size_t(t) >= V) continue;
      logits[size_t(t)] -= p.presence_penalty + p.frequency_penalty * float(n);
    }
  }
  if (p.top_k > 0 && size_t(p.top_k) < V) {
    std::vector<float> copy(logits.begin(), logits.end());
    std::nth_element(copy.begin(), copy.begin() + (p.top_k - 1), copy.end(), std::greater<float>());
    const float kth = copy[size_t(p.top_k - 1)];
    for (float& l : logits)
      if (l < kth) l = ninf;
  }
  if (p.min_p > 0.0f && p.temperature > 0.0f) {
    // p_i >= min_p * p_max  <=>  l_i >= l_max + T * ln(min_p)
    const float best = *std::max_element(logits.begin(), logits.end());
    const float cut = best + p.temperature * std::log(p.min_p);
    for (float& l : logits)
      if (l < cut) l = ninf;
  }
}

void compute_logprobs(std::span<const float> raw, int32_t token, int n, float& logprob,
                      std::vector<TokenLogprob>& top) {
  const size_t V = raw.size();
  const double mx = *std::max_element(raw.begin(), raw.end());
  double sum = 0.0;
  for (float l : raw) sum += std::exp(double(l) - mx);
  const double lse = mx + std::log(sum);
  logprob = float(double(raw[size_t(token)]) - lse);
  top.clear();
  if (n <= 0) return;
  std::vector<int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  const size_t k = std::min(V, size_t(n));
  std::partial_sort(idx.begin(), idx.begin() + ptrdiff_t(k), idx.end(), [&](int32_t a, int32_t b) {
    return raw[size_t(a)] > raw[size_t(b)] || (raw[size_t(a)] == raw[size_t(b)] && a < b);
  });
  for (size_t i = 0; i < k; ++i) top.push_back({idx[i], float(double(raw[size_t(idx[i])]) - lse)});
}

}  // namespace kestrel::server
