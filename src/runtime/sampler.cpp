// Sampler: see sampler.h.
#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "core/check.h"

namespace kestrel::runtime {

double sample_uniform(uint64_t seed, uint64_t index) {
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const uint64_t r = mix(mix(seed) ^ index);
  return double(r >> 11) * 0x1.0p-53;
}

namespace {

// Ids of x by decreasing value, equal values by increasing id (−0 equals +0; NaN last): an LSD radix
// sort, 3 passes of 11 bits over an order-preserving image of the floats, stable, so ids that tie
// keep their ascending order.
std::vector<int32_t> sort_desc(std::span<const float> x) {
  const size_t n = x.size();
  std::vector<uint32_t> key(n), key2(n);
  std::vector<int32_t> id(n), id2(n);
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i] + 0.0f;  // −0 → +0
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending in the value
    key[i] = std::isnan(v) ? 0xFFFFFFFFu : ~u;        // ascending key = descending value
    id[i] = int32_t(i);
  }
  for (int shift = 0; shift < 33; shift += 11) {
    size_t count[2049] = {};
    for (size_t i = 0; i < n; ++i) ++count[((key[i] >> shift) & 2047u) + 1];
    for (size_t b = 1; b < 2049; ++b) count[b] += count[b - 1];
    for (size_t i = 0; i < n; ++i) {
      const size_t d = count[(key[i] >> shift) & 2047u]++;
      key2[d] = key[i];
      id2[d] = id[i];
    }
    key.swap(key2);
    id.swap(id2);
  }
  return id;
}

}  // namespace

// std::max_element's answer (the first largest; NaN never wins unless it comes first) in two passes
// the compiler can keep in registers: the largest value with 8 independent maxima (no loop-carried
// branch per element), then its first position. At c = 16 the greedy argmax over k3-tiny's 12,256
// logits was 5.5 % of a decode-heavy server profile, serially on the engine thread.
int32_t argmax(std::span<const float> x) {
  const size_t n = x.size();
  if (std::isnan(x[0])) return 0;
  float m8[8];
  for (float& v : m8) v = x[0];
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) m8[j] = x[i + size_t(j)] > m8[j] ? x[i + size_t(j)] : m8[j];  // NaN: keeps m
  float m = m8[0];
  for (int j = 1; j < 8; ++j) m = m8[j] > m ? m8[j] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  for (i = 0; i < n; ++i)
    if (x[i] == m) return int32_t(i);  // −0 == +0: the first zero, as max_element keeps
  return 0;
}

PromptLogprob token_logprobs(std::span<const float> raw, int32_t token, int32_t n_top) {
  const size_t V = raw.size();
  KCHECK(V > 0 && token >= 0 && size_t(token) < V, "logprobs of token {} over {} logits", token, V);
  PromptLogprob res;
  res.token = token;
  // log-softmax of the raw logits in FP64.
  const double mx = *std::max_element(raw.begin(), raw.end());
  double Z = 0.0;
  for (float v : raw) Z += std::exp(double(v) - mx);
  const double lz = mx + std::log(Z);
  res.logprob = float(double(raw[size_t(token)]) - lz);
  const size_t n = std::min(V, size_t(std::max(n_top, 0)));
  if (n == 0) return res;
  std::vector<int32_t> ids(V);
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + std::ptrdiff_t(n), ids.end(), [&](int32_t a, int32_t b) {
    return raw[size_t(a)] > raw[size_t(b)] || (raw[size_t(a)] == raw[size_t(b)] && a < b);
  });
  for (size_t i = 0; i < n; ++i) res.top.push_back({ids[i], float(double(raw[size_t(ids[i])]) - lz)});
  return res;
}

SampleResult sample_token(const SamplingParams& p, std::span<const float> raw, std::span<const int32_t> prompt,
                          std::span<const int32_t> output, uint64_t index, std::span<const int32_t> stop_ids) {
  const size_t V = raw.size();
  KCHECK(V > 0, "sampling from an empty vocabulary");
  SampleResult res;
  auto ok = [&](int32_t t) { return t >= 0 && size_t(t) < V; };

  // Bias, min_tokens and penalties on a copy of the logits; untouched when all are off.
  const bool rep = p.repetition_penalty != 1.0f, freq = p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
  const bool hold = output.size() < size_t(std::max(p.min_tokens, 0)) && !stop_ids.empty();
  std::vector<float> adj;
  std::span<const float> logits = raw;
  if (rep || freq || hold || !p.logit_bias.empty()) {
    adj.assign(raw.begin(), raw.end());
    for (auto [t, b] : p.logit_bias)
      if (ok(t)) adj[size_t(t)] += b;
    if (hold)
      for (int32_t t : stop_ids)
        if (ok(t)) adj[size_t(t)] = -std::numeric_limits<float>::infinity();
    if (rep) {
      std::vector<bool> seen(V, false);
      for (auto list : {prompt, output})
        for (int32_t t : list)
          if (ok(t)) seen[size_t(t)] = true;
      for (size_t i = 0; i < V; ++i)
        if (seen[i]) adj[i] = adj[i] > 0.0f ? adj[i] / p.repetition_penalty : adj[i] * p.repetition_penalty;
    }
    if (freq) {
      std::unordered_map<int32_t, int32_t> count;
      for (int32_t t : output)
        if (ok(t)) ++count[t];
      for (auto [t, n] : count) adj[size_t(t)] -= p.frequency_penalty * float(n) + p.presence_penalty;
    }
    logits = adj;
  }

  if (p.temperature == 0.0f) {
    res.token = argmax(logits);
  } else {
    // Candidates by decreasing logit, ties by lower id: a stable radix sort (sort_desc), the order a
    // comparison sort by (logit desc, id asc) gives, several times faster over a 160K vocabulary; the
    // first top_k of it are what a partial sort would give.
    const std::vector<int32_t> order = sort_desc(logits);
    size_t keep = V;
    if (p.top_k > 0 && size_t(p.top_k) < V) keep = size_t(p.top_k);
    const double top = logits[size_t(order[0])], T = p.temperature;
    // Softmax over the whole vocabulary (min-p and top-p see the full distribution's probabilities);
    // each term computed once, summed in id order.
    std::vector<double> e(V);
    double Z = 0.0;
    for (size_t i = 0; i < V; ++i) Z += (e[i] = std::exp((double(logits[i]) - top) / T));
    std::vector<double> prob(keep);
    for (size_t i = 0; i < keep; ++i) prob[i] = e[size_t(order[i])] / Z;
    if (p.min_p > 0.0f) {
      const double cut = double(p.min_p) * prob[0];
      size_t k = 1;
      while (k < keep && prob[k] >= cut) ++k;
      keep = k;
    }
    if (p.top_p < 1.0f) {
      double mass = 0.0;
      for (size_t i = 0; i < keep; ++i) {
        mass += prob[i];
        if (mass >= double(p.top_p)) {
          keep = i + 1;
          break;
        }
      }
    }
    double kept = 0.0;
    for (size_t i = 0; i < keep; ++i) kept += prob[i];
    const double u = sample_uniform(p.seed, index) * kept;
    res.token = order[keep - 1];
    double acc = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      acc += prob[i];
      if (u < acc) {
        res.token = order[i];
        break;
      }
    }
  }

  if (p.logprobs >= 0) {
    PromptLogprob lp = token_logprobs(raw, res.token, p.logprobs);
    res.logprob = lp.logprob;
    res.top = std::move(lp.top);
  }
  return res;
}

}  // namespace kestrel::runtime
