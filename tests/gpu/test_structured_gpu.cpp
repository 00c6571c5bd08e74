// Structured outputs on the device (issue #20): the token-mask kernel (kernels/cuda/token_mask.h)
// against its CPU twin runtime::apply_token_mask, the masked device sampler against the masked CPU
// sampler, and constrained requests through the GPU engine (runtime/executor_cuda.cpp: the engine's
// mask table pinned and copied, token_mask/check_token hooks, CUDA graphs on).
//
// gtest filter: --gtest_filter='GpuStructured.*'
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "evalclient/json_schema.h"
#include "harness.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/token_mask.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"
#include "runtime/constraints.h"
#include "runtime/engine.h"
#include "runtime/executor_cuda.h"
#include "runtime/sampler.h"
#include "structured/constraint.h"
#include "structured/json_schema_grammar.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::gputest {
namespace {

// Random masks: row kinds cycle through few allowed ids (≤ 1024: the executor cuts top-k to them),
// about half of the vocabulary, everything but a few, and no mask at all (row −1).
struct Masks {
  std::vector<uint32_t> table;  // u32 [rows, words]
  std::vector<int32_t> row_of;  // per entry
  std::vector<int64_t> allowed; // per entry (V when unmasked)
  int64_t rows = 0, words = 0;
};

Masks random_masks(int64_t n, int64_t V, Rng& r) {
  Masks m;
  m.words = (V + 31) / 32;
  for (int64_t i = 0; i < n; ++i) {
    const int kind = int(i % 4);
    if (kind == 3) {
      m.row_of.push_back(-1);
      m.allowed.push_back(V);
      continue;
    }
    std::vector<uint32_t> w(size_t(m.words), 0);
    if (kind == 0) {
      const int64_t k = 1 + int64_t(r.next() % uint64_t(std::min<int64_t>(V, 40)));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t id = int64_t(r.next() % uint64_t(V));
        w[size_t(id >> 5)] |= 1u << (id & 31);
      }
    } else {
      for (int64_t id = 0; id < V; ++id)
        if (kind == 1 ? (r.next() & 1) : (r.next() % 1000 != 0)) w[size_t(id >> 5)] |= 1u << (id & 31);
    }
    m.row_of.push_back(int32_t(m.rows++));
    m.table.insert(m.table.end(), w.begin(), w.end());
    m.allowed.push_back(runtime::mask_count(w.data(), V));
  }
  return m;
}

TEST(GpuStructured, TokenMaskKernelMatchesTwin) {
  Rng r(91);
  for (int64_t V : {1, 33, 1000, 12256, 163840}) {
    const int64_t n = 9;
    const Masks m = random_masks(n, V, r);
    // Entries name rows in reverse order and skip row 0 of the logits: untouched rows must stay so.
    const int64_t L = n + 1;
    auto x = rand_f32(size_t(L * V), r, -5.0f, 5.0f);
    std::vector<cuda::SampleParams> params;
    for (int64_t i = 0; i < n; ++i) params.push_back({int32_t(L - 1 - i), 0, 1.0f, 1.0f, 0.0f, 0, 0});
    auto dx = upload(x);
    auto dp = upload(params);
    auto dr = upload(m.row_of);
    auto dt = upload(m.table.empty() ? std::vector<uint32_t>(1, 0) : m.table);
    cuda::apply_token_masks(dx.p(), V, V, dp.p(), dr.p(), dt.p(), m.words, n, nullptr);
    sync();
    std::vector<float> ref = x;
    for (int64_t i = 0; i < n; ++i)
      if (m.row_of[size_t(i)] >= 0)
        runtime::apply_token_mask(std::span<float>(ref.data() + params[size_t(i)].row * V, size_t(V)),
                                  m.table.data() + m.row_of[size_t(i)] * m.words);
    check_exact("apply_token_masks", fmt::format("n={} V={}", n, V), dx.get().data(), ref.data(), ref.size() * 4);
  }
  EXPECT_THROW(cuda::apply_token_masks(nullptr, 10, 10, nullptr, nullptr, nullptr, 0, 1, nullptr), Error);
}

// Mask, then the device sampler, against mask + sample_token with the same knobs and seeds; top-k is
// cut to the allowed count when that is ≤ 1024, as the executor does. Every device id must be allowed.
TEST(GpuStructured, MaskedSamplingMatchesCpuTwin) {
  Rng r(92);
  for (int64_t V : {1000, 12256, 163840}) {
    const int64_t n = V > 100000 ? 40 : 120;
    const Masks m = random_masks(n, V, r);
    std::vector<float> x(size_t(n * V));
    for (int64_t i = 0; i < n; ++i) {
      const float spread = (i % 3 == 0) ? 12.0f : (i % 3 == 1) ? 3.0f : 0.5f;
      for (int64_t v = 0; v < V; ++v) x[size_t(i * V + v)] = r.uniform(-spread, spread);
    }
    std::vector<cuda::SampleParams> params;
    std::vector<runtime::SamplingParams> sp(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      runtime::SamplingParams& p = sp[size_t(i)];
      const int kind = int((i / 4) % 5);
      p.temperature = kind == 0 ? 0.0f : r.uniform(0.3f, 1.5f);
      if (kind == 2) p.top_k = int32_t(1 + r.next() % 64);
      if (kind == 3) p.top_p = r.uniform(0.2f, 0.95f);
      if (kind == 4) p.top_k = 40, p.top_p = 0.9f;
      p.seed = r.next();
      if (m.row_of[size_t(i)] >= 0 && m.allowed[size_t(i)] <= cuda::kSampleCandidates &&
          (p.top_k <= 0 || p.top_k > m.allowed[size_t(i)]))
        p.top_k = int32_t(m.allowed[size_t(i)]);
      params.push_back({int32_t(i), p.top_k, p.temperature, p.top_p, p.min_p, p.seed, 7});
    }
    auto dx = upload(x);
    auto dp = upload(params);
    auto dr = upload(m.row_of);
    auto dt = upload(m.table);
    auto got = poisoned<int32_t>(size_t(n));
    cuda::apply_token_masks(dx.p(), V, V, dp.p(), dr.p(), dt.p(), m.words, n, nullptr);
    cuda::sample_rows(dx.p(), V, V, dp.p(), n, got.p(), nullptr);
    sync();
    const auto ids = got.get();
    int64_t equal = 0;
    for (int64_t i = 0; i < n; ++i) {
      std::vector<float> row(x.begin() + i * V, x.begin() + (i + 1) * V);
      const int32_t mr = m.row_of[size_t(i)];
      if (mr >= 0) runtime::apply_token_mask(row, m.table.data() + mr * m.words);
      ASSERT_GE(ids[size_t(i)], 0) << "V=" << V << " row " << i << " was handed back";
      if (mr >= 0) {
        const uint32_t w = m.table[size_t(mr * m.words + ids[size_t(i)] / 32)];
        EXPECT_TRUE((w >> (ids[size_t(i)] % 32)) & 1u) << "V=" << V << " row " << i << ": a masked id was drawn";
      }
      const auto ref = runtime::sample_token(sp[size_t(i)], row, {}, {}, 7);
      EXPECT_EQ(ids[size_t(i)], ref.token) << "V=" << V << " row " << i << " allowed " << m.allowed[size_t(i)];
      equal += ids[size_t(i)] == ref.token;
    }
    note(fmt::format("{:<28} {:<34} {}/{} equal to the twin", "masked sample_rows", fmt::format("n={} V={}", n, V),
                     equal, n));
  }
}

// Constrained requests on the GPU engine (graphs on; a batch with unconstrained requests beside them),
// sampled: every document ends with the end token and validates; the same requests on the CPU engine
// too (the tokens may differ where the GPU's logits differ, the validity may not).
TEST(GpuStructured, EngineConstrainedRequestsAreValid) {
  const auto dirs = gpu_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "KESTREL_GPU_CKPTS is not set: run through bench/gpu/run.sh";
  const std::string dir = dirs[0];  // nano
  const ModelConfig cfg = load_config(dir);
  const Checkpoint ckpt(dir);
  const ModelWeights w = bind_weights(cfg, ckpt);
  const tok::Tokenizer tk = tok::Tokenizer::load(dir);
  auto vocab = std::make_shared<const structured::TokenVocab>(tk, size_t(cfg.text.vocab_size));
  const structured::ojson schema = structured::ojson::parse(R"({"type": "object", "properties": {
      "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]},
      "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, "required": ["a", "b", "c"],
      "additionalProperties": false})");
  OutputConstraint c = structured::document_constraint(OutputConstraint::Format::json_schema, schema);
  c.grammar = structured::compile_json_schema(vocab, schema);
  model::CudaModel gm(cfg, w);
  for (bool gpu : {true, false}) {
    const int64_t graphs_before = gm.graph_steps();
    runtime::EngineConfig ec;
    ec.memory_budget = int64_t(256) << 20;
    ec.max_running = 16;
    if (gpu)
      ec.make_executor = [&gm, &cfg](const CacheFormats& f, const cache::CacheConfig& cc) {
        return std::unique_ptr<runtime::StepExecutor>(std::make_unique<runtime::CudaExecutor>(gm, cfg, f, cc));
      };
    runtime::Engine e(w, cfg, ec);
    std::mutex mu;
    std::vector<std::vector<int32_t>> out(24);
    std::vector<FinishReason> fin(24, FinishReason::none);
    for (int i = 0; i < 24; ++i) {
      Request r;
      for (tok::TokenId t : tk.encode("JSON please " + std::to_string(i), false)) r.prompt.push_back(int32_t(t));
      r.max_tokens = 300;
      r.sampling.temperature = i % 3 == 0 ? 0.0f : 1.0f;
      r.sampling.top_k = i % 3 == 2 ? 20 : 0;
      r.sampling.seed = uint64_t(i);
      if (i % 4 != 3) r.constraint = c;  // every 4th unconstrained, in the same batch
      else r.ignore_eos = true, r.max_tokens = 20;
      e.submit(r, [&, i](TokenEvent&& ev) {
        std::lock_guard<std::mutex> lk(mu);
        if (ev.token >= 0) out[size_t(i)].push_back(ev.token);
        if (ev.finished()) fin[size_t(i)] = ev.finish;
      });
    }
    e.wait_idle();
    int valid = 0, cut = 0;
    for (int i = 0; i < 24; ++i) {
      if (i % 4 == 3) continue;
      if (fin[size_t(i)] == FinishReason::length) {
        ++cut;
        continue;
      }
      ASSERT_EQ(fin[size_t(i)], FinishReason::stop) << (gpu ? "gpu" : "cpu") << " request " << i;
      std::string text;
      for (size_t k = 0; k + 1 < out[size_t(i)].size(); ++k) text += tk.token_bytes(tok::TokenId(out[size_t(i)][k]));
      const auto doc = nlohmann::json::parse(text, nullptr, false);
      ASSERT_FALSE(doc.is_discarded()) << text;
      EXPECT_EQ(eval::JsonSchema(nlohmann::json::parse(schema.dump())).validate(doc), "") << text;
      ++valid;
    }
    const auto st = e.structured_stats();
    note(fmt::format("  engine ({}): {} constrained documents valid, {} cut by max_tokens; {} masked, {} free samples, "
                     "{} redraws", gpu ? "GPU" : "CPU", valid, cut, st.masked_samples, st.free_samples, st.redraws));
    EXPECT_EQ(cut, 0) << "the schema bounds the document well below max_tokens";
    EXPECT_EQ(valid, 18);
    if (gpu) {
      // The masks must hold on the whole-step decode graphs (decode steps replay a captured forward; the
      // mask kernel and the sampler run after it on the graph bucket's logits), not only on eager steps.
      EXPECT_GT(gm.graph_steps() - graphs_before, 0) << "no decode step went through a CUDA graph";
      EXPECT_GT(st.masked_samples, 0);
    }
  }
}

}  // namespace
}  // namespace kestrel::gputest
