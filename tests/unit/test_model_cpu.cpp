// CPU forward of the K3.1 text model on a random-weight nano model (MODEL.md Appendix A).
//
// Tolerances, and why:
//  - Exact (==) where the same arithmetic runs in the same order: interleaved vs separate requests,
//    indexer selecting every key vs no indexer, repeated runs.
//  - Relative L2 ≤ 1e-2 on one layer's output where only summation order or BF16 rounding points
//    differ (BLAS prefill vs GEMV decode, naive vs absorbed MLA): such differences flip single BF16
//    roundings of activations (2^-8 relative). The nano model follows the generator's conditioned
//    initialisation (small layer output gains, reference/README.md "Conditioning"), so such flips do
//    not compound through the 8 layers: ~1e-3 on logits (bound 5e-3, plus the same greedy token).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "model/attn_res.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/model.h"
#include "nano_model.h"

namespace kestrel {
namespace {

using model::ForwardOptions;
using model::MlaForm;
using model::State;

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

std::vector<int32_t> tokens(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % 1024);
  return t;
}

const testing::RandomModel& nano() {
  static const testing::RandomModel m = testing::make_random_model(11);
  return m;
}

// Logits of every position: prefill of the first n tokens, then decode of the rest one at a time.
std::vector<float> run_split(const testing::RandomModel& m, const std::vector<int32_t>& toks, size_t n,
                             const ForwardOptions& opt = {}) {
  const int64_t V = m.cfg.text.vocab_size;
  State st(m.cfg);
  std::vector<float> logits(toks.size() * size_t(V));
  model::prefill(m.w, m.cfg, st, std::span(toks.data(), n), logits.data(), opt);
  for (size_t i = n; i < toks.size(); ++i) model::decode(m.w, m.cfg, st, toks[i], logits.data() + i * size_t(V), opt);
  EXPECT_EQ(st.pos, int64_t(toks.size()));
  return logits;
}

TEST(ModelCpu, LogitsFiniteAndDeterministic) {
  const auto toks = tokens(10, 1);
  const auto a = run_split(nano(), toks, toks.size());
  const auto b = run_split(nano(), toks, toks.size());
  for (float v : a) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(a, b);
  double ss = 0;
  for (float v : a) ss += double(v) * v;
  EXPECT_GT(ss / double(a.size()), 1e-3) << "logits are not degenerate";
}

TEST(ModelCpu, PrefillThenDecodeMatchesLongerPrefill) {
  // KDA recurrent + conv state and the MLA caches must carry exactly what a longer prefill sees.
  // The nano model's real top-4-of-16 routing is used: with the conditioned initialisation a router
  // decision that BF16 noise (BLAS vs GEMV order) flips at a near-tie costs ≲ 1 % of that row (the
  // routed experts' output gain is 0.01), where the old 1/fan_in init moved the logits by ~20 %.
  const auto& m = nano();
  const auto toks = tokens(12, 2);
  const auto full = run_split(m, toks, toks.size());
  ForwardOptions naive_decode;
  naive_decode.mla_form_decode = MlaForm::naive;
  const auto split_naive = run_split(m, toks, 7, naive_decode);
  const auto split = run_split(m, toks, 7);  // absorbed decode
  const double e1 = rel_l2(split_naive, full), e2 = rel_l2(split, full);
  // Measured 9.7e-4 (naive decode) and 9.0e-4 (absorbed decode): single BF16 flips (2^-8) from the
  // BLAS-vs-GEMV order, not amplified through the layers (16 of 16 experts selected: 1.1e-3 for both;
  // the old 1/fan_in init: 2.0e-2). The layer-level KDA test below is the tight check of the state
  // hand-off.
  EXPECT_LT(e1, 5e-3);
  EXPECT_LT(e2, 5e-3);
  const size_t V = 1024;
  for (size_t t = 0; t < toks.size(); ++t) {
    auto arg = [&](const std::vector<float>& l) {
      return std::max_element(l.begin() + long(t * V), l.begin() + long((t + 1) * V)) - l.begin();
    };
    EXPECT_EQ(arg(split), arg(full)) << "greedy token at position " << t;
  }
  RecordProperty("rel_l2_naive_decode", std::to_string(e1));
  RecordProperty("rel_l2_absorbed_decode", std::to_string(e2));
}

TEST(KdaCpu, PrefillThenDecodeMatchesLongerPrefillAtLayerLevel) {
  // Layer 1 (KDA) alone, so no router flips: split vs single call differ only by GEMM order.
  const TextConfig& c = nano().cfg.text;
  const int64_t T = 16, D = c.hidden_size;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(size_t(T * D)), a(x.size()), b(x.size());
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  model::KdaState s1, s2;
  s1.reset(c), s2.reset(c);
  model::kda_forward(nano().w.layers[1].kda, c, s1, x.data(), T, a.data());
  model::kda_forward(nano().w.layers[1].kda, c, s2, x.data(), 9, b.data());
  for (int64_t t = 9; t < T; ++t) model::kda_forward(nano().w.layers[1].kda, c, s2, x.data() + t * D, 1, b.data() + t * D);
  std::vector<float> fa(a.size()), fb(b.size());
  for (size_t i = 0; i < a.size(); ++i) fa[i] = bf16_to_f32(a[i]), fb[i] = bf16_to_f32(b[i]);
  EXPECT_LT(rel_l2(fb, fa), 1e-2);
  double sd = 0;
  for (size_t i = 0; i < s1.S.size(); ++i) sd = std::max(sd, std::fabs(double(s1.S[i]) - s2.S[i]));
  EXPECT_LT(sd, 1e-2) << "recurrent states agree";
  EXPECT_EQ(s1.conv, s2.conv) << "conv history holds the same last W-1 inputs";
}

// A State's caches as a forward_batch view for its next T tokens (what model::prefill does).
model::SeqCacheView view_of(State& st, const TextConfig& tc, int64_t T) {
  model::SeqCacheView v;
  v.pos = st.pos;
  v.kda.resize(size_t(tc.num_hidden_layers));
  v.mla.resize(size_t(tc.num_hidden_layers));
  for (int L = 0; L < tc.num_hidden_layers; ++L) {
    if (tc.attn_kind[size_t(L)] == AttnKind::kda)
      v.kda[size_t(L)] = st.kda[size_t(L)].view();
    else
      v.mla[size_t(L)] = st.mla[size_t(L)].view(tc, st.pos + T);
  }
  return v;
}
void advance(State& st, const TextConfig& tc, int64_t T) {
  st.pos += T;
  for (int L = 0; L < tc.num_hidden_layers; ++L)
    if (tc.attn_kind[size_t(L)] != AttnKind::kda) st.mla[size_t(L)].len = st.pos;
}

TEST(ModelCpu, BatchedAndChunkedSequencesGetTheirSoloLogitsBitForBit) {
  // The CPU engine's batch invariance: three sequences, each run alone in one prefill, then together
  // in steps that chunk them differently (a prefill chunk next to decodes of the others). With a small
  // index_topk the indexer really selects (positions past 24), so its scores and top-k are covered too.
  const auto m = testing::make_random_model(13, [](nlohmann::json& t) { t["index_topk"] = 24; });
  const TextConfig& tc = m.cfg.text;
  const int64_t V = tc.vocab_size;
  const std::vector<std::vector<int32_t>> toks = {tokens(40, 31), tokens(29, 32), tokens(35, 33)};
  std::vector<std::vector<float>> solo;
  for (const auto& t : toks) {
    State st(m.cfg);
    solo.emplace_back(t.size() * size_t(V));
    model::prefill(m.w, m.cfg, st, t, solo.back().data());
  }
  // Steps: the token counts each sequence runs in each step (0: not scheduled).
  const std::vector<std::vector<int64_t>> steps = {{7, 29, 0}, {1, 0, 30}, {20, 0, 1}, {1, 0, 1}, {11, 0, 3}};
  std::vector<State> st(3, State(m.cfg));
  std::vector<std::vector<float>> got(3);
  for (size_t i = 0; i < 3; ++i) got[i].resize(toks[i].size() * size_t(V));
  for (const auto& step : steps) {
    std::vector<model::SeqInput> in;
    std::vector<size_t> who;
    for (size_t i = 0; i < 3; ++i) {
      if (step[i] == 0) continue;
      in.push_back({view_of(st[i], tc, step[i]), std::span(toks[i].data() + st[i].pos, size_t(step[i])), model::Logits::all});
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
      advance(st[i], tc, n);
      r += n;
    }
  }
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_EQ(st[i].pos, int64_t(toks[i].size()));
    EXPECT_EQ(got[i], solo[i]) << "sequence " << i << ": batched/chunked logits differ from its solo prefill";
  }
}

TEST(ModelCpu, InterleavedRequestsMatchAlone) {
  const auto a = tokens(6, 3), b = tokens(9, 4);
  const auto alone_a = run_split(nano(), a, 3), alone_b = run_split(nano(), b, 4);
  const int64_t V = 1024;
  State sa(nano().cfg), sb(nano().cfg);
  std::vector<float> la(a.size() * V), lb(b.size() * V);
  model::prefill(nano().w, nano().cfg, sb, std::span(b.data(), 4), lb.data());
  model::prefill(nano().w, nano().cfg, sa, std::span(a.data(), 3), la.data());
  for (size_t i = 0; i < 6; ++i) {
    if (3 + i < a.size()) model::decode(nano().w, nano().cfg, sa, a[3 + i], la.data() + (3 + i) * V);
    if (4 + i < b.size()) model::decode(nano().w, nano().cfg, sb, b[4 + i], lb.data() + (4 + i) * V);
  }
  EXPECT_EQ(la, alone_a);
  EXPECT_EQ(lb, alone_b);
}

TEST(ModelCpu, ObserverSeesEveryNamedActivation) {
  std::map<std::string, Shape> seen;
  ForwardOptions opt;
  opt.observer = [&](std::string_view name, const TensorView& t) { seen[std::string(name)] = t.shape; };
  State st(nano().cfg);
  const auto toks = tokens(5, 5);
  std::vector<float> logits(5 * 1024);
  model::prefill(nano().w, nano().cfg, st, toks, logits.data(), opt);
  for (int L = 0; L < 8; ++L)
    for (const char* what : {"attn_in", "attn_out", "mlp_in", "mlp_out"})
      EXPECT_EQ(seen.at("L" + std::to_string(L) + "." + what), (Shape{5, 256}));
  EXPECT_EQ(seen.at("L3.index_topk"), (Shape{5, 64}));
  EXPECT_EQ(seen.at("L7.index_topk"), (Shape{5, 64}));
  EXPECT_FALSE(seen.count("L2.index_topk"));
  EXPECT_EQ(seen.at("L1.router_ids"), (Shape{5, 4}));
  EXPECT_EQ(seen.at("L1.router_weights"), (Shape{5, 4}));
  EXPECT_FALSE(seen.count("L0.router_ids")) << "layer 0 is dense";
  EXPECT_EQ(seen.at("final_hidden"), (Shape{5, 256}));
  EXPECT_EQ(seen.at("logits"), (Shape{5, 1024}));
  EXPECT_EQ(seen.at("embed"), (Shape{5, 256}));
}

TEST(ModelCpu, RouterWeightsRenormalisedAndIdsDistinct) {
  ForwardOptions opt;
  int checked = 0;
  opt.observer = [&](std::string_view name, const TensorView& t) {
    if (name.ends_with("router_weights")) {
      for (int64_t r = 0; r < t.shape[0]; ++r) {
        float s = 0;
        for (int64_t k = 0; k < t.shape[1]; ++k) s += t.as<float>()[r * t.shape[1] + k];
        EXPECT_NEAR(s, 1.0f, 1e-6);
      }
      ++checked;
    }
    if (name.ends_with("router_ids"))
      for (int64_t r = 0; r < t.shape[0]; ++r) {
        std::set<int32_t> ids(t.as<int32_t>() + r * t.shape[1], t.as<int32_t>() + (r + 1) * t.shape[1]);
        EXPECT_EQ(int64_t(ids.size()), t.shape[1]);
      }
  };
  State st(nano().cfg);
  model::prefill(nano().w, nano().cfg, st, tokens(4, 6), nullptr, opt);
  EXPECT_EQ(checked, 7);
}

TEST(ModelCpu, LastLogitsOnlyMatchesLastRow) {
  const auto toks = tokens(6, 7);
  const auto all = run_split(nano(), toks, toks.size());
  State st(nano().cfg);
  ForwardOptions opt;
  opt.last_logits_only = true;
  std::vector<float> last(1024);
  model::prefill(nano().w, nano().cfg, st, toks, last.data(), opt);
  // One row runs the GEMV, many rows BLAS: same math, different summation order.
  EXPECT_LT(rel_l2(last, std::vector<float>(all.end() - 1024, all.end())), 1e-5);
}

TEST(ModelCpu, RejectsBadTokens) {
  State st(nano().cfg);
  const std::vector<int32_t> bad = {1, 1024};
  EXPECT_THROW(model::prefill(nano().w, nano().cfg, st, bad, nullptr), Error);
  EXPECT_THROW(model::prefill(nano().w, nano().cfg, st, std::span<const int32_t>(), nullptr), Error);
}

// ---- AttnRes --------------------------------------------------------------------------------------

TEST(AttnResCpu, MixSingleSourceIsExactAndTwoSourcesMatchFormula) {
  const int64_t D = 8;
  model::AttnResStream s(1, D, 2);
  std::vector<uint16_t> nw(D), pw(D), out(D);
  for (int64_t i = 0; i < D; ++i) {
    nw[size_t(i)] = f32_to_bf16(1.0f + 0.1f * float(i));
    pw[size_t(i)] = f32_to_bf16(0.5f - 0.2f * float(i));
    s.partial[size_t(i)] = f32_to_bf16(float(i) - 3.3f);
  }
  model::attn_res_mix(s, nw.data(), pw.data(), 1e-5f, out.data());
  EXPECT_EQ(out, s.partial);
  s.write_block();
  for (int64_t i = 0; i < D; ++i) s.partial[size_t(i)] = f32_to_bf16(2.0f * std::sin(float(i)));
  model::attn_res_mix(s, nw.data(), pw.data(), 1e-5f, out.data());
  double l[2];
  const uint16_t* src[2] = {s.block(0), s.partial.data()};
  for (int k = 0; k < 2; ++k) {
    double dot = 0, ss = 0;
    for (int64_t i = 0; i < D; ++i) {
      const double v = bf16_to_f32(src[k][i]);
      dot += v * bf16_to_f32(nw[size_t(i)]) * bf16_to_f32(pw[size_t(i)]);
      ss += v * v;
    }
    l[k] = dot / std::sqrt(ss / D + 1e-5);
  }
  const double a0 = 1.0 / (1.0 + std::exp(l[1] - l[0]));
  for (int64_t i = 0; i < D; ++i) {
    const double ref = a0 * bf16_to_f32(src[0][i]) + (1 - a0) * bf16_to_f32(src[1][i]);
    EXPECT_NEAR(bf16_to_f32(out[size_t(i)]), ref, std::fabs(ref) * 4e-3 + 1e-6) << i;
  }
}

// ---- MLA + indexer, layer level -----------------------------------------------------------------------

struct MlaRun {
  std::vector<uint16_t> out;
  std::vector<int32_t> topk;
};

// Runs an MLA layer (layer 3 of the nano model) over T random normed inputs, in `chunks` calls.
MlaRun run_mla(const testing::RandomModel& m, bool indexer, MlaForm form, int64_t T, std::vector<int64_t> chunks) {
  const TextConfig& c = m.cfg.text;
  MlaWeights w = m.w.layers[3].mla;
  w.has_indexer = indexer;
  std::mt19937_64 rng(99);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(size_t(T * c.hidden_size));
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  MlaRun r;
  r.out.resize(x.size());
  model::MlaCache cache;
  model::Observer obs = [&](std::string_view, const TensorView& t) {
    r.topk.insert(r.topk.end(), t.as<int32_t>(), t.as<int32_t>() + t.numel());
  };
  int64_t t0 = 0;
  for (int64_t n : chunks) {
    model::mla_forward(w, c, cache, x.data() + t0 * c.hidden_size, n, r.out.data() + t0 * c.hidden_size, form,
                       model::Probe{&obs, 3});
    t0 += n;
  }
  EXPECT_EQ(t0, T);
  EXPECT_EQ(cache.len, T);
  return r;
}

double rel_l2_bf16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  std::vector<float> fa(a.size()), fb(b.size());
  for (size_t i = 0; i < a.size(); ++i) fa[i] = bf16_to_f32(a[i]), fb[i] = bf16_to_f32(b[i]);
  return rel_l2(fa, fb);
}

TEST(MlaCpu, NaiveEqualsAbsorbed) {
  // Same math; the absorbed form skips the BF16 rounding of k_nope and v (kv_b_proj outputs), so
  // outputs agree to a few BF16 ulps: bound 1e-2 relative L2, measured ~3e-3.
  for (bool idx : {false, true}) {
    const auto naive = run_mla(nano(), idx, MlaForm::naive, 20, {20});
    const auto absorbed = run_mla(nano(), idx, MlaForm::absorbed, 20, {20});
    const double e = rel_l2_bf16(absorbed.out, naive.out);
    EXPECT_LT(e, 1e-2) << "indexer " << idx;
    EXPECT_GT(e, 0.0) << "the two forms really are different code paths";
    // Decoding one token at a time in the absorbed form gives the same per-token result as one call.
    const auto stepwise = run_mla(nano(), idx, MlaForm::absorbed, 20, std::vector<int64_t>(20, 1));
    EXPECT_LT(rel_l2_bf16(stepwise.out, absorbed.out), 1e-2);
  }
}

TEST(IndexerCpu, TopkCoveringContextEqualsDense) {
  // index_topk 64 ≥ 40 tokens: every query selects all visible keys, ascending, so the output is
  // bit-identical to MLA without an indexer.
  const auto dense = run_mla(nano(), false, MlaForm::naive, 40, {25, 15});
  const auto idx = run_mla(nano(), true, MlaForm::naive, 40, {25, 15});
  EXPECT_EQ(idx.out, dense.out);
  ASSERT_EQ(idx.topk.size(), size_t(40 * 64));
  for (int64_t t = 0; t < 40; ++t)
    for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(idx.topk[size_t(t * 64 + i)], i <= t ? i : -1);
}

TEST(IndexerCpu, SmallTopkSelectsSubsetAndDiffers) {
  const auto small = testing::make_random_model(11, [](nlohmann::json& t) { t["index_topk"] = 4; });
  const int64_t T = 24;
  const auto dense = run_mla(small, false, MlaForm::naive, T, {T});
  const auto sel = run_mla(small, true, MlaForm::naive, T, {10, 14});
  const auto sel_abs = run_mla(small, true, MlaForm::absorbed, T, std::vector<int64_t>(T, 1));
  ASSERT_EQ(sel.topk.size(), size_t(T * 4));
  EXPECT_EQ(sel.topk, sel_abs.topk) << "selection does not depend on the MLA form or on chunking";
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* row = sel.topk.data() + t * 4;
    for (int64_t i = 0; i < 4; ++i) {
      if (i <= t) {
        EXPECT_GE(row[i], 0);
        EXPECT_LE(row[i], t);
        if (i) {
          EXPECT_LT(row[i - 1], row[i]) << "ascending, distinct";
        }
      } else {
        EXPECT_EQ(row[i], -1);
      }
    }
  }
  const size_t D = 256;
  // The first 4 queries see ≤ 4 keys: identical to dense. Later ones attend to a subset: different.
  EXPECT_TRUE(std::equal(sel.out.begin(), sel.out.begin() + 4 * D, dense.out.begin()));
  EXPECT_GT(rel_l2_bf16(std::vector<uint16_t>(sel.out.begin() + 4 * D, sel.out.end()),
                        std::vector<uint16_t>(dense.out.begin() + 4 * D, dense.out.end())),
            1e-2);
}

}  // namespace
}  // namespace kestrel
