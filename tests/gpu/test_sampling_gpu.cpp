// The device sampler's logit adjustments against the CPU twin (runtime::sample_token): logit_bias
// (OpenAI's, added to the raw logits) and min_tokens (the stop ids at −inf while the output is
// shorter), alone and mixed with the penalties and every sampling knob. The entries come from the
// executor's own builder (runtime::append_logit_adjustments), so this is the path serving takes:
// apply_penalties in place, then sample_rows. Same (seed, index) ⇒ the same token as the twin (the
// RNG is shared; see test_engine_gpu.cpp SameTokensAsCpuTwin for the rare FP64 straddle), and:
//   - a bias of +100 on one token makes it the greedy pick and (nearly) the only draw;
//   - −100 on the argmax removes it;
//   - below min_tokens no stop id is ever drawn, even when a stop id holds the row's maximum; at
//     min_tokens the same row draws it greedily again.
// gtest filter for the GPU machine: --gtest_filter='GpuSampling.LogitBias*:GpuSampling.MinTokens*'
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "harness.h"
#include "kernels/cuda/sampling.h"
#include "runtime/executor_cuda.h"
#include "runtime/sampler.h"

namespace kestrel::gputest {
namespace {

struct Row {
  runtime::SamplingParams p;
  std::vector<int32_t> prompt, output, stop;
};

// Runs the rows through the device path and the twin; returns the device ids (never −1: the sampler hands no
// row back to the host).
std::vector<int32_t> device_vs_twin(const std::vector<float>& x, int64_t V, const std::vector<Row>& rows,
                                    const std::string& what) {
  const int64_t n = int64_t(rows.size());
  std::vector<cuda::SampleParams> params;
  std::vector<cuda::PenaltyEntry> adj;
  for (int64_t i = 0; i < n; ++i) {
    const Row& r = rows[size_t(i)];
    params.push_back({int32_t(i), r.p.top_k, r.p.temperature, r.p.top_p, r.p.min_p, r.p.seed, r.output.size()});
    runtime::append_logit_adjustments(int32_t(i), {&r.p, r.prompt, r.output, r.stop}, V, adj);
  }
  auto dx = upload(x);
  auto dp = upload(params);
  auto de = upload(adj);
  auto got = poisoned<int32_t>(size_t(n));
  cuda::apply_penalties(dx.p(), V, V, de.p(), int64_t(adj.size()), nullptr);
  cuda::sample_rows(dx.p(), V, V, dp.p(), n, got.p(), nullptr);
  sync();
  const auto ids = got.get();
  int64_t equal = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Row& r = rows[size_t(i)];
    const auto ref = runtime::sample_token(r.p, std::span<const float>(x.data() + i * V, size_t(V)), r.prompt,
                                           r.output, r.output.size(), r.stop);
    EXPECT_EQ(ids[size_t(i)], ref.token) << what << " V=" << V << " row " << i;
    equal += ids[size_t(i)] == ref.token;
  }
  note(fmt::format("{:<28} {:<34} {}/{} equal to the twin", what, fmt::format("n={} V={}", n, V), equal, n));
  return ids;
}

TEST(GpuSampling, LogitBiasMatchesCpuTwin) {
  Rng r(81);
  for (int64_t V : {50, 1000, 163840}) {
    const int64_t n = V > 100000 ? 48 : 128;
    std::vector<float> x(size_t(n * V));
    for (auto& v : x) v = r.uniform(-4.0f, 4.0f);
    std::vector<Row> rows(static_cast<size_t>(n));
    std::vector<int32_t> boosted(static_cast<size_t>(n), -1), argmax(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      Row& row = rows[size_t(i)];
      runtime::SamplingParams& p = row.p;
      const float* xr = x.data() + i * V;
      argmax[size_t(i)] = int32_t(std::max_element(xr, xr + V) - xr);
      const int kind = int(i % 6);
      p.temperature = (kind == 0 || kind == 1) ? 0.0f : r.uniform(0.3f, 1.3f);
      p.seed = r.next();
      if (kind == 3) p.top_k = 20;
      if (kind == 4) p.top_p = 0.8f;
      if (kind == 5) {  // with penalties over a history
        p.repetition_penalty = 1.3f, p.frequency_penalty = 0.4f, p.presence_penalty = 0.2f;
        for (int k = 0; k < 10; ++k) row.prompt.push_back(int32_t(r.next() % uint64_t(V)));
        for (int k = 0; k < 6; ++k) row.output.push_back(int32_t(r.next() % uint64_t(V)));
      }
      // Random small biases on a few tokens, plus one decisive bias: +100 on a random token (even
      // rows) or −100 on the argmax (odd rows).
      for (int k = 0; k < 8; ++k) {
        const int32_t t = int32_t(r.next() % uint64_t(V));
        if (t != argmax[size_t(i)] &&
            std::none_of(p.logit_bias.begin(), p.logit_bias.end(), [&](auto& e) { return e.first == t; }))
          p.logit_bias.push_back({t, r.uniform(-5.0f, 5.0f)});
      }
      if (i % 2 == 0) {
        int32_t t = int32_t(r.next() % uint64_t(V));
        p.logit_bias.erase(std::remove_if(p.logit_bias.begin(), p.logit_bias.end(), [&](auto& e) { return e.first == t; }),
                           p.logit_bias.end());
        p.logit_bias.push_back({t, 100.0f});
        boosted[size_t(i)] = t;
      } else if (V > 1) {
        p.logit_bias.push_back({argmax[size_t(i)], -100.0f});
      }
    }
    const auto ids = device_vs_twin(x, V, rows, "logit_bias");
    for (int64_t i = 0; i < n; ++i) {
      if (ids[size_t(i)] < 0) continue;
      // +100 beats every other logit (range 8) by far: greedy picks it, and so does any draw at T ≤ 1.3
      // (its probability is above 1 − V·e^(−70)).
      if (boosted[size_t(i)] >= 0) {
        EXPECT_EQ(ids[size_t(i)], boosted[size_t(i)]) << "V=" << V << " row " << i;
      } else if (V > 1) {  // −100 on the argmax: it cannot be drawn
        EXPECT_NE(ids[size_t(i)], argmax[size_t(i)]) << "V=" << V << " row " << i;
      }
    }
  }
}

TEST(GpuSampling, MinTokensMatchesCpuTwin) {
  Rng r(82);
  for (int64_t V : {50, 1000, 163840}) {
    const int64_t n = V > 100000 ? 48 : 128;
    std::vector<float> x(size_t(n * V));
    for (auto& v : x) v = r.uniform(-3.0f, 3.0f);
    std::vector<Row> rows(static_cast<size_t>(n));
    std::vector<int32_t> top_stop(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      Row& row = rows[size_t(i)];
      runtime::SamplingParams& p = row.p;
      // Three stop ids; the first holds the row's maximum by a wide margin.
      for (int k = 0; k < 3; ++k) row.stop.push_back(int32_t((uint64_t(i) * 7 + uint64_t(k) * 13) % uint64_t(V)));
      std::sort(row.stop.begin(), row.stop.end());
      row.stop.erase(std::unique(row.stop.begin(), row.stop.end()), row.stop.end());
      top_stop[size_t(i)] = row.stop[0];
      x[size_t(i * V + row.stop[0])] = 9.0f;
      p.min_tokens = 5;
      const int kind = int(i % 4);
      p.temperature = kind == 0 ? 0.0f : r.uniform(0.5f, 1.5f);
      if (kind == 2) p.top_k = 10;
      if (kind == 3) p.repetition_penalty = 1.2f, p.frequency_penalty = 0.3f, p.logit_bias = {{row.stop.back(), 50.0f}};
      p.seed = r.next();
      // Half the rows are below min_tokens (the stop ids are held back), half have reached it.
      const int outputs = (i % 8 < 4) ? int(i % 5) : 5 + int(i % 3);
      for (int k = 0; k < outputs; ++k) row.output.push_back(int32_t(r.next() % uint64_t(V)));
      row.output.erase(std::remove_if(row.output.begin(), row.output.end(),
                                      [&](int32_t t) { return std::find(row.stop.begin(), row.stop.end(), t) != row.stop.end(); }),
                       row.output.end());
      while (int(row.output.size()) < outputs) row.output.push_back(int32_t((row.stop.back() + 1) % V));
    }
    const auto ids = device_vs_twin(x, V, rows, "min_tokens");
    for (int64_t i = 0; i < n; ++i) {
      const Row& row = rows[size_t(i)];
      if (ids[size_t(i)] < 0) continue;
      const bool held = int(row.output.size()) < row.p.min_tokens;
      if (held) {
        EXPECT_TRUE(std::find(row.stop.begin(), row.stop.end(), ids[size_t(i)]) == row.stop.end())
            << "V=" << V << " row " << i << " drew stop id " << ids[size_t(i)] << " before min_tokens";
      } else if (row.p.temperature == 0.0f) {
        EXPECT_EQ(ids[size_t(i)], top_stop[size_t(i)]) << "V=" << V << " row " << i;
      }
    }
  }
}

// The sampler's slow paths, against the twin, every row a token (none handed back): a top-k above the 1,024
// candidates (alone, with top-p, with min-p), a min-p that keeps more than 1,024 tokens (flat and spread rows), and
// more than 2,048 logits tied at the candidates' cut — a flat row, 3,000 ties at the maximum, a row masked to −inf
// but for five tokens (a grammar's) — under every knob. Ties are ordered by id, as the twin's sort does.
TEST(GpuSampling, WideCutsAndTiesMatchCpuTwin) {
  Rng r(83);
  for (int64_t V : {4096, 163840}) {
    const int64_t n = 48;
    std::vector<float> x(size_t(n * V));
    std::vector<Row> rows(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      float* xr = x.data() + i * V;
      const int shape = int(i % 4);  // 0 spread, 1 flat, 2 3,000 ties at the top, 3 five tokens left finite
      for (int64_t v = 0; v < V; ++v)
        xr[v] = shape == 1 ? 0.25f : shape == 3 ? -std::numeric_limits<float>::infinity() : r.uniform(-3.0f, 3.0f);
      if (shape == 2)
        for (int k = 0; k < 3000; ++k) xr[(int64_t(k) * 37 + i) % V] = 5.0f;
      if (shape == 3)
        for (int k = 0; k < 5; ++k) xr[int64_t(r.next() % uint64_t(V))] = r.uniform(-1.0f, 1.0f);
      runtime::SamplingParams& p = rows[size_t(i)].p;
      p.seed = r.next();
      p.temperature = r.uniform(0.5f, 1.5f);
      switch (int(i / 4) % 12) {
        case 0: p.top_k = 1500; break;
        case 1: p.top_k = int32_t(V - 1); break;
        case 2: p.top_k = 3000, p.top_p = 0.9f; break;
        case 3: p.min_p = 1e-3f; break;
        case 4: p.min_p = 0.05f; break;
        case 5: p.min_p = 0.02f, p.top_k = 2000; break;
        case 6: p.min_p = 0.01f, p.top_p = 0.7f; break;
        case 7: p.top_p = 0.3f; break;
        case 8: p.top_k = 10; break;
        case 9: p.temperature = 0.0f; break;
        case 10: p.min_p = 0.5f; break;
        default: break;  // plain temperature
      }
    }
    const auto ids = device_vs_twin(x, V, rows, "sample_rows (slow paths)");
    for (int64_t i = 0; i < n; ++i) {
      const int32_t id = ids[size_t(i)];
      ASSERT_TRUE(id >= 0 && id < V) << "V=" << V << " row " << i << " got " << id;
      const float* xr = x.data() + i * V;
      // Cuts that keep only the tied maxima (top-k ≤ 3,000, greedy, min-p 0.5 at T ≤ 1.5: 5 + T·ln 0.5 > 3).
      const int kase = int(i / 4) % 12;
      if (i % 4 == 2 && (kase == 0 || kase == 2 || kase == 8 || kase == 9 || kase == 10)) {
        EXPECT_EQ(xr[id], 5.0f) << "V=" << V << " row " << i << ": not one of the tied maxima";
      }
      if (i % 4 == 3) {
        EXPECT_GT(xr[id], -1.5f) << "V=" << V << " row " << i << ": a masked token was drawn";
      }
    }
  }
}

}  // namespace
}  // namespace kestrel::gputest
