// Speculative verification rules: see spec_verify.h.
#include "runtime/spec_verify.h"

#include <algorithm>
#include <vector>

#include "core/check.h"

namespace kestrel::runtime {

RejectionMethod parse_rejection_method(std::string_view s) {
  if (s == "token") return RejectionMethod::token;
  if (s == "block") return RejectionMethod::block;
  fail("rejection_sample_method must be \"block\" or \"token\", got \"{}\"", s);
}

int32_t draw_from(const double* w, int64_t V, double u) {
  double total = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < V; ++i) {
    KCHECK(w[i] >= 0.0, "negative probability {} at {}", w[i], i);
    total += w[i];
    if (w[i] > 0.0) last = i;
  }
  KCHECK(last >= 0 && total > 0.0, "drawing from a distribution with no mass");
  const double target = u * total;
  double acc = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    acc += w[i];
    if (w[i] > 0.0 && target < acc) return int32_t(i);
  }
  return int32_t(last);
}

namespace {

void check_draft(std::span<const int32_t> draft, int64_t V) {
  for (size_t i = 0; i < draft.size(); ++i)
    KCHECK(draft[i] >= 0 && draft[i] < V, "draft token {} at slot {} outside [0, {})", draft[i], i, V);
}

// norm(max(a·p − q, 0)) drawn with u; falls back to p when the residual has no mass (then p ≤ q/a
// everywhere, which for a ≤ 1 and normalised rows means a·p = q and the draw is never needed exactly).
int32_t residual_draw(const double* p, const double* q, double a, int64_t V, double u) {
  std::vector<double> r(static_cast<size_t>(V));
  double mass = 0.0;
  for (int64_t x = 0; x < V; ++x) mass += (r[size_t(x)] = std::max(a * p[x] - q[x], 0.0));
  return mass > 0.0 ? draw_from(r.data(), V, u) : draw_from(p, V, u);
}

}  // namespace

VerifyOutcome verify_token(const double* p, const double* q, std::span<const int32_t> draft, int64_t V,
                           const Uniform& u) {
  check_draft(draft, V);
  const int g = int(draft.size());
  for (int i = 0; i < g; ++i) {
    const int32_t x = draft[size_t(i)];
    const double px = p[int64_t(i) * V + x], qx = q[int64_t(i) * V + x];
    // accept with probability min(1, p/q): u < p/q without dividing (q may be 0 for a forced token).
    if (u(i) * qx < px) continue;
    return {i, residual_draw(p + int64_t(i) * V, q + int64_t(i) * V, 1.0, V, u(g))};
  }
  return {g, draw_from(p + int64_t(g) * V, V, u(g))};
}

VerifyOutcome verify_block(const double* p, const double* q, std::span<const int32_t> draft, int64_t V,
                           const Uniform& u) {
  check_draft(draft, V);
  const int g = int(draft.size());
  std::vector<double> rho(size_t(g) + 1, 1.0);  // ρ_0 = 1
  int tau = 0;
  for (int i = 1; i <= g; ++i) {
    const int32_t x = draft[size_t(i - 1)];
    const double px = p[int64_t(i - 1) * V + x], qx = q[int64_t(i - 1) * V + x];
    // ρ_i = min(1, ρ_{i−1}·p_i(x̂_i)/q_i(x̂_i)); q = 0 with p > 0 saturates at 1, p = 0 gives 0.
    const double num = rho[size_t(i - 1)] * px;
    rho[size_t(i)] = num >= qx ? 1.0 : num / qx;
    double h;
    if (i == g) {
      h = rho[size_t(i)];
    } else {
      const double* pn = p + int64_t(i) * V;  // p_{i+1}
      const double* qn = q + int64_t(i) * V;  // q_{i+1}
      double s = 0.0;
      for (int64_t y = 0; y < V; ++y) s += std::max(rho[size_t(i)] * pn[y] - qn[y], 0.0);
      const double den = s + 1.0 - rho[size_t(i)];
      h = den > 0.0 ? s / den : 1.0;  // den = 0 only when ρ_i = 1 and ρ_i p_{i+1} ≤ q_{i+1}: continue
    }
    if (u(i - 1) <= h) tau = i;
  }
  if (tau == g) return {g, draw_from(p + int64_t(g) * V, V, u(g))};
  return {tau, residual_draw(p + int64_t(tau) * V, q + int64_t(tau) * V, rho[size_t(tau)], V, u(g))};
}

VerifyOutcome verify(RejectionMethod m, const double* p, const double* q, std::span<const int32_t> draft, int64_t V,
                     const Uniform& u) {
  return m == RejectionMethod::block ? verify_block(p, q, draft, V, u) : verify_token(p, q, draft, V, u);
}

VerifyOutcome verify_greedy(std::span<const int32_t> target_argmax, std::span<const int32_t> draft) {
  KCHECK(target_argmax.size() == draft.size() + 1, "greedy verification needs γ+1 target tokens, got {} for γ={}",
         target_argmax.size(), draft.size());
  int i = 0;
  while (size_t(i) < draft.size() && draft[size_t(i)] == target_argmax[size_t(i)]) ++i;
  return {i, target_argmax[size_t(i)]};
}

}  // namespace kestrel::runtime
