// Single-request DSpark speculative decoding on the CPU: see spec_decode.h.
#include "runtime/spec_decode.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"
#include "model/model.h"
#include "runtime/sampler.h"

namespace kestrel::runtime {
namespace {

// The serving executor's forward settings (runtime/executor.cpp): a row's logits do not depend on how
// many tokens share the call, so a (γ+1)-token verification equals γ+1 decode steps bit for bit.
model::ForwardOptions serving_options() {
  model::ForwardOptions o;
  o.kda_form = model::KdaForm::recurrent;
  o.mla_form_prefill = model::MlaForm::absorbed;
  o.mla_form_decode = model::MlaForm::absorbed;
  return o;
}

constexpr uint64_t kDraftSalt = 0x6473706b64726674ull;   // "dspkdrft"
constexpr uint64_t kVerifySalt = 0x6473706b76657266ull;  // "dspkverf"

void check_params(const SamplingParams& p) {
  if (p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f)
    fail("speculative decoding does not support repetition/frequency/presence penalties yet");
}

}  // namespace

void target_distribution(const SamplingParams& p, std::span<const float> logits, double* out) {
  const size_t V = logits.size();
  KCHECK(p.temperature > 0.0f, "target_distribution needs temperature > 0");
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  const double top = logits[size_t(order[0])], T = p.temperature;
  double Z = 0.0;
  for (size_t i = 0; i < V; ++i) Z += std::exp((double(logits[i]) - top) / T);
  size_t keep = p.top_k > 0 && size_t(p.top_k) < V ? size_t(p.top_k) : V;
  std::vector<double> prob(keep);
  for (size_t i = 0; i < keep; ++i) prob[i] = std::exp((double(logits[size_t(order[i])]) - top) / T) / Z;
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
  std::fill(out, out + V, 0.0);
  for (size_t i = 0; i < keep; ++i) out[order[i]] = prob[i] / kept;
}

std::vector<int32_t> plain_generate(const ModelWeights& w, const ModelConfig& c, std::span<const int32_t> prompt,
                                    int max_tokens, const SamplingParams& params, int32_t stop_token) {
  const int64_t V = c.text.vocab_size;
  model::State st(c);
  model::ForwardOptions fo = serving_options();
  fo.last_logits_only = true;
  std::vector<float> logits(static_cast<size_t>(V));
  std::vector<int32_t> out;
  model::prefill(w, c, st, prompt, logits.data(), fo);
  while (int(out.size()) < max_tokens) {
    const int32_t t = sample_token(params, logits, prompt, out, out.size()).token;
    out.push_back(t);
    if (t == stop_token || int(out.size()) >= max_tokens) break;
    model::decode(w, c, st, t, logits.data(), fo);
  }
  return out;
}

int32_t draft_pick(const SamplingParams& params, bool draft_greedy, uint64_t out_index, int i,
                   std::span<const float> lg, double* qi) {
  const int64_t V = int64_t(lg.size());
  if (params.temperature == 0.0f || draft_greedy) {
    const int32_t t = argmax(lg);
    qi[t] = 1.0;
    return t;
  }
  const double T = params.temperature, top = lg[size_t(argmax(lg))];
  double Z = 0.0;
  for (int64_t x = 0; x < V; ++x) Z += (qi[x] = std::exp((double(lg[size_t(x)]) - top) / T));
  for (int64_t x = 0; x < V; ++x) qi[x] /= Z;
  return draw_from(qi, V, sample_uniform(params.seed ^ kDraftSalt, (out_index << 8) + uint64_t(i)));
}

VerifyOutcome verify_step(const SamplingParams& params, RejectionMethod m, const float* logits, const double* q,
                          std::span<const int32_t> drafted, int64_t V, uint64_t out_index) {
  const int gamma = int(drafted.size());
  if (params.temperature == 0.0f) {
    std::vector<int32_t> am(size_t(gamma) + 1);
    for (int i = 0; i <= gamma; ++i) am[size_t(i)] = argmax({logits + int64_t(i) * V, size_t(V)});
    return verify_greedy(am, drafted);
  }
  std::vector<double> p(size_t(gamma + 1) * size_t(V));
  for (int i = 0; i <= gamma; ++i)
    target_distribution(params, {logits + int64_t(i) * V, size_t(V)}, p.data() + int64_t(i) * V);
  return verify(m, p.data(), q, drafted, V,
                [&](int k) { return sample_uniform(params.seed ^ kVerifySalt, (out_index << 8) + uint64_t(k)); });
}

bool speculation_supports(const SamplingParams& p) {
  return p.repetition_penalty == 1.0f && p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f &&
         p.logit_bias.empty() && p.min_tokens == 0 && p.logprobs < 0 && p.prompt_logprobs < 0;
}

std::vector<int32_t> spec_generate(const ModelWeights& w, const ModelConfig& c, const model::Draft& draft,
                                   std::span<const int32_t> prompt, int max_tokens, const SamplingParams& params,
                                   const SpecDecodeOptions& opt, SpecDecodeStats* stats) {
  check_params(params);
  const DraftConfig& dc = *draft.cfg;
  const TextConfig& tc = c.text;
  const int64_t V = tc.vocab_size, P = int64_t(prompt.size()), W = dc.tap_width();
  KCHECK(opt.num_speculative_tokens >= 1 && opt.num_speculative_tokens <= dc.block_size,
         "num_speculative_tokens {} must be in 1..{} (the draft's block size)", opt.num_speculative_tokens, dc.block_size);
  model::State st(c);
  model::DraftState ds(dc);
  model::ForwardOptions fo = serving_options();
  fo.tap_layers = dc.target_layer_ids;
  std::vector<float> logits;                    // f32 [rows, V]
  model::Bf16Vec taps;                          // bf16 [rows, n·Dt]
  // KDA traces of the verification forward: the state after every block position (kda.h kda_keep_position).
  const int64_t Se = model::kda_recurrent_elems(tc), Ce = model::kda_conv_elems(tc);
  std::vector<float> trace_S;                   // f32 [KDA layers, γ+1, H, Dk, Dk]
  model::Bf16Vec trace_conv;                    // bf16 [KDA layers, γ+1, 3, W−1, H·Dk]
  // One target forward at st.pos (traced: T ≤ γ+1 positions per KDA layer); st.pos is the caller's to advance.
  auto target_forward = [&](std::span<const int32_t> toks, bool traced) {
    const int64_t T = int64_t(toks.size());
    logits.resize(size_t(T * V));
    taps.resize(size_t(T * W));
    fo.taps_out = taps.data();
    model::SeqCacheView v;
    v.pos = st.pos;
    v.kda.resize(size_t(tc.num_hidden_layers));
    v.mla.resize(size_t(tc.num_hidden_layers));
    if (traced) trace_S.resize(size_t(tc.num_hidden_layers * T * Se)), trace_conv.resize(size_t(tc.num_hidden_layers * T * Ce));
    for (int L = 0; L < tc.num_hidden_layers; ++L) {
      if (tc.attn_kind[size_t(L)] == AttnKind::kda) {
        v.kda[size_t(L)] = st.kda[size_t(L)].view();
        if (traced) {
          v.kda[size_t(L)].trace_recurrent = trace_S.data() + L * T * Se;
          v.kda[size_t(L)].trace_conv = trace_conv.data() + L * T * Ce;
        }
      } else {
        v.mla[size_t(L)] = st.mla[size_t(L)].view(tc, st.pos + T);
      }
    }
    model::forward(w, c, v, toks, logits.data(), fo);
    return v;
  };
  auto advance = [&](int64_t n) {
    st.pos += n;
    for (int L = 0; L < tc.num_hidden_layers; ++L)
      if (tc.attn_kind[size_t(L)] != AttnKind::kda) st.mla[size_t(L)].len = st.pos;
  };

  std::vector<int32_t> out;
  if (max_tokens <= 0) return out;
  target_forward(prompt, false);
  advance(P);
  const std::span<const float> last(logits.data() + (P - 1) * V, size_t(V));
  int32_t anchor = sample_token(params, last, prompt, out, 0).token;
  out.push_back(anchor);
  draft.inject(ds.views(draft.mla_cfg, P), 0, taps.data() + 0, P);
  int64_t ctx = P;  // draft context positions = target positions processed

  std::vector<int32_t> d(static_cast<size_t>(dc.block_size));
  std::vector<double> q;  // f64 [γ, V] draft distributions
  while (anchor != opt.stop_token && int(out.size()) < max_tokens) {
    const int gamma = std::min(opt.num_speculative_tokens, max_tokens - int(out.size()));
    const uint64_t out_index = uint64_t(out.size());
    // Draft: the Markov chain over the block; keep q_i for verification.
    q.assign(size_t(gamma) * size_t(V), 0.0);
    auto pick = [&](int i, std::span<const float> lg) -> int32_t {
      if (i >= gamma) return argmax(lg);  // positions past γ are not verified
      double* qi = q.data() + int64_t(i) * V;
      const size_t j = out.size() + size_t(i);  // output index of the proposed token
      if (opt.oracle && j < opt.oracle->size()) {
        const int32_t t = (*opt.oracle)[j];
        qi[t] = 1.0;
        return t;
      }
      return draft_pick(params, opt.draft_greedy, out_index, i, lg, qi);
    };
    draft.draft(ds.views(draft.mla_cfg, ctx), ctx, anchor, opt.draft_topk, pick, d.data());

    // Verification: one target forward over [anchor, x̂_1..x̂_γ], KDA states traced per position.
    std::vector<int32_t> block(size_t(gamma) + 1);
    block[0] = anchor;
    std::copy(d.begin(), d.begin() + gamma, block.begin() + 1);
    const model::SeqCacheView v = target_forward(block, true);
    const std::span<const int32_t> drafted(d.data(), size_t(gamma));
    const VerifyOutcome o = verify_step(params, opt.rejection, logits.data(), q.data(), drafted, V, out_index);
    if (stats) ++stats->drafts, stats->draft_tokens += gamma, stats->accepted_tokens += o.accepted;

    // Keep anchor + τ accepted positions: the KDA states after position τ (no recompute); MLA rows past
    // the kept prefix are overwritten by the next forward.
    const int64_t kept = o.accepted + 1;
    for (int L = 0; L < tc.num_hidden_layers; ++L)
      if (tc.attn_kind[size_t(L)] == AttnKind::kda) model::kda_keep_position(tc, v.kda[size_t(L)], o.accepted);
    advance(kept);
    draft.inject(ds.views(draft.mla_cfg, ctx + kept), ctx, taps.data(), kept);
    ctx += kept;
    for (int i = 0; i < o.accepted && int(out.size()) < max_tokens; ++i) {
      out.push_back(d[size_t(i)]);
      if (d[size_t(i)] == opt.stop_token) return out;
    }
    if (int(out.size()) >= max_tokens) break;
    anchor = o.next;
    out.push_back(anchor);
  }
  return out;
}

}  // namespace kestrel::runtime
