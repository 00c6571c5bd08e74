// Lossless verification of a speculative draft (MODEL.md §5 "Verification"), as pure functions of the
// target's and the draft's distributions and a source of uniform draws.
//
// A step drafted γ tokens x̂_1..x̂_γ; the target's single forward over [anchor, x̂_1..x̂_γ] gives γ+1
// distributions p_1..p_{γ+1} (p_i is the target's distribution for the token at draft slot i, after the
// request's sampling knobs), and the draft sampled x̂_i from q_i. The outcome is the number of accepted draft
// tokens τ and one more token drawn from the target side (the correction at the first rejection or the bonus
// token): the step emits x̂_1..x̂_τ then `next`, so every step emits τ+1 ≥ 1 tokens.
//
//  - token rule (Leviathan et al. / Chen et al.): accept x̂_i with probability min(1, p_i(x̂_i)/q_i(x̂_i)); at
//    the first rejection draw from norm(max(0, p_i − q_i)); all accepted: draw the bonus from p_{γ+1}.
//  - block rule (Sun et al., arXiv 2403.10444): ρ_0 = 1, ρ_i = min(1, ρ_{i−1}·p_i(x̂_i)/q_i(x̂_i)); for i < γ
//    h_i = Σ_x max(ρ_i p_{i+1}(x) − q_{i+1}(x), 0) / (that sum + 1 − ρ_i), h_γ = ρ_γ; τ = the largest i with
//    η_i ≤ h_i (0 if none); then draw from norm(max(ρ_τ p_{τ+1} − q_{τ+1}, 0)), or from p_{γ+1} if τ = γ.
//    Same output distribution as the token rule, and at least its expected acceptance.
//  - greedy (temperature 0): accept while x̂_i equals the target's argmax (ties to the lower id), then the
//    argmax of the first disagreeing (or the bonus) row: exactly the tokens greedy decoding without a draft
//    produces.
// Both sampled rules are tested for the exact output distribution by a chi-square test
// (tests/unit/test_spec_verify.cpp). Probabilities are FP64; a row may hold zeros (top-k/top-p cut).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>

namespace kestrel::runtime {

enum class RejectionMethod : uint8_t { token, block };
RejectionMethod parse_rejection_method(std::string_view s);  // "token" | "block"; throws kestrel::Error

struct VerifyOutcome {
  int accepted = 0;    // τ: draft tokens kept, 0..γ
  int32_t next = -1;   // the token that follows them (correction or bonus)
};

// u(k) is the k-th uniform draw in [0, 1) of this step: k in [0, γ) decides acceptance at slot k+1 (token
// rule) or η_{k+1} (block rule); k = γ is the final draw.
using Uniform = std::function<double(int k)>;

// p: f64 [γ+1, V] rows summing to 1; q: f64 [γ, V]; draft: [γ] the tokens the draft sampled from q.
VerifyOutcome verify_token(const double* p, const double* q, std::span<const int32_t> draft, int64_t V,
                           const Uniform& u);
VerifyOutcome verify_block(const double* p, const double* q, std::span<const int32_t> draft, int64_t V,
                           const Uniform& u);
VerifyOutcome verify(RejectionMethod m, const double* p, const double* q, std::span<const int32_t> draft, int64_t V,
                     const Uniform& u);
// target_argmax: [γ+1] the target's greedy token of every row.
VerifyOutcome verify_greedy(std::span<const int32_t> target_argmax, std::span<const int32_t> draft);

// Inverse-CDF draw from an unnormalised non-negative row w [V] with u in [0, 1); the last positive entry
// when rounding leaves u beyond the total. Throws when the row has no mass.
int32_t draw_from(const double* w, int64_t V, double u);

}  // namespace kestrel::runtime
