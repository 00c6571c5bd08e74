// The CPU engine's AVX-512 BF16 path (kernels/cpu isa.h: vdpbf16ps GEMMs), on the machine that has it.
//
// It lives in kestrel_gpu_tests, not the unit tests, because the GPU host is where the project has an
// AVX-512 BF16 CPU (the development box is AVX2 only: there every test here skips) and this binary is
// what bench/gpu/run.sh carries there:
//   bench/gpu/run.sh test --gtest_filter='CpuAvx512.*'
// A skip says so with the ISA found, so a run that did not exercise the path cannot pass silently.
//
// Tolerances: the GEMM sums pairs inside vdpbf16ps (ORDER_K2), FP32 throughout, against a double twin:
// 2e-5 relative to the row's |x|·|w| mass, as for the other paths (tests/unit/test_kernels_cpu.cpp);
// everything else is exact (==): bf16 output = rounded f32 output, row / thread / packing invariance,
// and the model's batched and chunked logits equal its solo logits bit for bit (the engine's batch
// invariance holds on this ISA too).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "../unit/nano_model.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"
#include "model/model.h"

namespace kestrel {
namespace {

bool have_avx512bf16() { return cpu::detected_isa() >= cpu::Isa::avx512bf16; }

std::vector<uint16_t> rand_bf16(size_t n, std::mt19937_64& rng, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}

TEST(CpuAvx512, GemmMatchesTwinAndIsRowThreadAndPackingInvariant) {
  if (!have_avx512bf16())
    GTEST_SKIP() << "no AVX-512 BF16 on this CPU (detected: " << cpu::isa_name(cpu::detected_isa()) << ")";
  cpu::force_isa(cpu::Isa::avx512bf16);
  ASSERT_EQ(cpu::isa(), cpu::Isa::avx512bf16);
  std::mt19937_64 rng(41);
  // Odd K (the pair layout pads a zero), N below / past a 16-wide panel, T past the micro-tile, and
  // k3-tiny's decode and lm_head shapes.
  struct Shape {
    int64_t T, in, out;
  };
  for (const Shape s : {Shape{1, 256, 256}, {16, 256, 768}, {13, 255, 47}, {7, 33, 17}, {1, 1, 1}, {40, 128, 200},
                        {3, 256, 1000}}) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " in=" + std::to_string(s.in) + " out=" + std::to_string(s.out));
    const auto x = rand_bf16(size_t(s.T * s.in), rng);
    const auto w = rand_bf16(size_t(s.out * s.in), rng, 0.1f);
    std::vector<float> y(size_t(s.T * s.out));
    std::vector<uint16_t> yb(y.size());
    cpu::set_num_threads(2);
    cpu::gemm_bf16_f32(x.data(), s.in, w.data(), y.data(), s.out, s.T, s.in, s.out);
    cpu::gemm_bf16(x.data(), s.in, w.data(), yb.data(), s.out, s.T, s.in, s.out);
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t r = 0; r < s.out; ++r) {
        double ref = 0.0, mass = 0.0;
        for (int64_t c = 0; c < s.in; ++c) {
          const double p = double(bf16_to_f32(x[size_t(t * s.in + c)])) * bf16_to_f32(w[size_t(r * s.in + c)]);
          ref += p;
          mass += std::fabs(p);
        }
        const size_t i = size_t(t * s.out + r);
        ASSERT_NEAR(y[i], ref, 2e-5 * mass + 1e-30) << "t=" << t << " r=" << r;
        ASSERT_EQ(yb[i], f32_to_bf16(y[i])) << "bf16 output is the rounded f32 output";
      }
    // Rows alone and in groups of 3, one thread, with and without packed weights: the same bits.
    cpu::set_num_threads(1);
    for (const int64_t group : {int64_t(1), int64_t(3)}) {
      cpu::PackedWeights pw;
      const cpu::PackedScope scope(group == 3 ? &pw : nullptr);
      std::vector<float> part(y.size());
      for (int64_t t0 = 0; t0 < s.T; t0 += group) {
        const int64_t n = std::min(group, s.T - t0);
        cpu::gemm_bf16_f32(x.data() + t0 * s.in, s.in, w.data(), part.data() + t0 * s.out, s.out, n, s.in, s.out);
      }
      ASSERT_EQ(part, y) << "group " << group;
    }
    cpu::set_num_threads(0);
  }
}

TEST(CpuAvx512, ModelBatchedAndChunkedLogitsEqualSolo) {
  if (!have_avx512bf16())
    GTEST_SKIP() << "no AVX-512 BF16 on this CPU (detected: " << cpu::isa_name(cpu::detected_isa()) << ")";
  cpu::force_isa(cpu::Isa::avx512bf16);
  ASSERT_EQ(cpu::isa(), cpu::Isa::avx512bf16);
  const auto m = testing::make_random_model(13, [](nlohmann::json& t) { t["index_topk"] = 24; });
  const TextConfig& tc = m.cfg.text;
  const int64_t V = tc.vocab_size;
  auto tokens = [&](int64_t n, int32_t seed) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) t[size_t(i)] = int32_t((i * 131 + seed * 17) % V);
    return t;
  };
  const std::vector<std::vector<int32_t>> toks = {tokens(40, 31), tokens(29, 32), tokens(35, 33)};
  std::vector<std::vector<float>> solo;
  for (const auto& t : toks) {
    model::State st(m.cfg);
    solo.emplace_back(t.size() * size_t(V));
    model::prefill(m.w, m.cfg, st, t, solo.back().data());
  }
  // The token counts each sequence runs per step (0: not scheduled): prefill chunks beside decodes.
  const std::vector<std::vector<int64_t>> steps = {{7, 29, 0}, {1, 0, 30}, {20, 0, 1}, {1, 0, 1}, {11, 0, 3}};
  std::vector<model::State> st(3, model::State(m.cfg));
  std::vector<std::vector<float>> got(3);
  for (size_t i = 0; i < 3; ++i) got[i].resize(toks[i].size() * size_t(V));
  for (const auto& step : steps) {
    std::vector<model::SeqInput> in;
    std::vector<size_t> who;
    for (size_t i = 0; i < 3; ++i) {
      if (step[i] == 0) continue;
      model::SeqCacheView v;
      v.pos = st[i].pos;
      v.kda.resize(size_t(tc.num_hidden_layers));
      v.mla.resize(size_t(tc.num_hidden_layers));
      for (int L = 0; L < tc.num_hidden_layers; ++L) {
        if (tc.attn_kind[size_t(L)] == AttnKind::kda)
          v.kda[size_t(L)] = st[i].kda[size_t(L)].view();
        else
          v.mla[size_t(L)] = st[i].mla[size_t(L)].view(tc, st[i].pos + step[i]);
      }
      in.push_back({v, std::span(toks[i].data() + st[i].pos, size_t(step[i])), model::Logits::all});
      who.push_back(i);
    }
    int64_t rows = 0;
    for (const auto& s : in) rows += int64_t(s.tokens.size());
    std::vector<float> logits(size_t(rows * V));
    model::forward_batch(m.w, m.cfg, in, logits.data());
    int64_t r = 0;
    for (size_t j = 0; j < in.size(); ++j) {
      const size_t i = who[j];
      const int64_t n = int64_t(in[j].tokens.size());
      std::copy(logits.begin() + r * V, logits.begin() + (r + n) * V, got[i].begin() + st[i].pos * V);
      st[i].pos += n;
      for (int L = 0; L < tc.num_hidden_layers; ++L)
        if (tc.attn_kind[size_t(L)] != AttnKind::kda) st[i].mla[size_t(L)].len = st[i].pos;
      r += n;
    }
  }
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(got[i], solo[i]) << "sequence " << i << ": batched/chunked logits differ from its solo prefill";
}

}  // namespace
}  // namespace kestrel
