// See moe_ops.h. moe_route and moe_experts are the loops of the original model/moe.cpp, unchanged in
// order and precision; moe_experts_fast is the engine's version: experts in parallel (each decoded
// once for all its tokens), vector SiTU, and the products in ORDER16 (gemm_detail::mxfp4_rows) or,
// on avx512bf16, in ORDER_B32 from the bf16 rows (mxfp4_rows_bf16: twice the multiply rate).
#include "kernels/cpu/moe_ops.h"

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {

void moe_route(const float* r, const float* bias, int64_t T, int64_t X, int64_t K, bool renormalize, float scaling,
               int32_t* ids, float* wts) {
  KCHECK(K > 0 && K <= X, "top-{} of {} experts", K, X);
  // Rows are independent (each its own sigmoid, top-k and weights), so they split over the team: at a
  // 2K prefill this loop ran on the engine thread alone while the other core waited (issue #22). The
  // weight of a row: X sigmoids (an exp each) and a top-k over X, about 64 operations per expert.
  parallel_for(T, T * X * 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(static_cast<size_t>(X)), sel(static_cast<size_t>(X));
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t e = 0; e < X; ++e) {
        s[size_t(e)] = sigmoid(r[t * X + e]);
        sel[size_t(e)] = s[size_t(e)] + bias[e];
      }
      int32_t* id = ids + t * K;
      float* wt = wts + t * K;
      topk(sel.data(), X, K, id);
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += (wt[k] = s[size_t(id[k])]);
      for (int64_t k = 0; k < K; ++k) {
        if (renormalize) wt[k] /= (sum + 1e-20f);
        wt[k] *= scaling;
      }
    }
  });
}

void moe_experts(const uint16_t* z, const int32_t* ids, const float* wts, const ExpertPtrs* experts, int64_t T,
                 int64_t X, int64_t K, int64_t Lt, int64_t I, float beta, float linear_beta, uint16_t* ut) {
  std::vector<float> acc(size_t(T * Lt));  // f32 [T, Lt]
  moe_experts_f32(z, ids, wts, experts, T, X, K, Lt, I, beta, linear_beta, true, acc.data());
  f32_to_bf16_n(acc.data(), ut, T * Lt);
}

void moe_experts_f32(const uint16_t* z, const int32_t* ids, const float* wts, const ExpertPtrs* experts, int64_t T,
                     int64_t X, int64_t K, int64_t Lt, int64_t I, float beta, float linear_beta, bool round_y,
                     float* ut) {
  std::vector<float> y(size_t(T * K * Lt), 0.0f);  // f32 [T, K, Lt], BF16-valued when round_y
  std::vector<std::vector<int64_t>> users(static_cast<size_t>(X));  // expert -> flat (t*K + k) slots
  for (int64_t i = 0; i < T * K; ++i) {
    KCHECK(ids[i] >= 0 && ids[i] < X, "expert id {} out of range (X = {})", ids[i], X);
    users[size_t(ids[i])].push_back(i);
  }
  std::vector<float> zf, gf, uf, yf;
  std::vector<uint16_t> gb, ub, ab;
  for (int64_t e = 0; e < X; ++e) {
    const std::vector<int64_t>& slots = users[size_t(e)];
    const int64_t n = int64_t(slots.size());
    const ExpertPtrs& ew = experts[e];
    if (n == 0 || !ew.w1.packed) continue;  // unused, or another rank's expert
    zf.resize(size_t(n * Lt)), gf.resize(size_t(n * I)), uf.resize(size_t(n * I)), yf.resize(size_t(n * Lt));
    gb.resize(size_t(n * I)), ub.resize(size_t(n * I)), ab.resize(size_t(n * I));
    for (int64_t i = 0; i < n; ++i) bf16_to_f32_n(z + (slots[size_t(i)] / K) * Lt, zf.data() + i * Lt, Lt);
    mxfp4_gemm(ew.w1.packed, ew.w1.scale, zf.data(), gf.data(), n, I, Lt);
    mxfp4_gemm(ew.w3.packed, ew.w3.scale, zf.data(), uf.data(), n, I, Lt);
    f32_to_bf16_n(gf.data(), gb.data(), n * I);
    f32_to_bf16_n(uf.data(), ub.data(), n * I);
    situ_glu(gb.data(), ub.data(), ab.data(), n * I, beta, linear_beta);
    bf16_to_f32_n(ab.data(), gf.data(), n * I);
    mxfp4_gemm(ew.w2.packed, ew.w2.scale, gf.data(), yf.data(), n, Lt, I);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < Lt; ++j) y[size_t(slots[size_t(i)] * Lt + j)] = round_y ? round_bf16(yf[size_t(i * Lt + j)]) : yf[size_t(i * Lt + j)];
  }
  // Step 4: ũ = Σ_k w_k · y_k, FP32 accumulation in top-k order (moe_experts rounds it).
  for (int64_t t = 0; t < T; ++t) {
    float* acc = ut + t * Lt;
    std::fill(acc, acc + Lt, 0.0f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < Lt; ++j) acc[j] += wts[t * K + k] * y[size_t((t * K + k) * Lt + j)];
  }
}

void moe_experts_fast(const uint16_t* z, const int32_t* ids, const float* wts, const ExpertPtrs* experts, int64_t T,
                      int64_t X, int64_t K, int64_t Lt, int64_t I, float beta, float linear_beta, uint16_t* ut) {
  std::vector<float> acc(size_t(T * Lt));  // f32 [T, Lt]
  moe_experts_fast_f32(z, ids, wts, experts, T, X, K, Lt, I, beta, linear_beta, true, acc.data());
  // The rounding to bf16 over rows in parallel (element-wise: the same bits on any thread; the scalar
  // f32_to_bf16 is about 8 operations an element).
  parallel_for(T, T * Lt * 8, [&](int64_t t0, int64_t t1) {
    f32_to_bf16_n(acc.data() + t0 * Lt, ut + t0 * Lt, (t1 - t0) * Lt);
  });
}

void moe_experts_fast_f32(const uint16_t* z, const int32_t* ids, const float* wts, const ExpertPtrs* experts,
                          int64_t T, int64_t X, int64_t K, int64_t Lt, int64_t I, float beta, float linear_beta,
                          bool round_y, float* ut) {
  std::vector<float> y(size_t(T * K * Lt), 0.0f);  // f32 [T, K, Lt], BF16-valued when round_y
  std::vector<std::vector<int64_t>> users(static_cast<size_t>(X));  // expert -> flat (t*K + k) slots
  for (int64_t i = 0; i < T * K; ++i) {
    KCHECK(ids[i] >= 0 && ids[i] < X, "expert id {} out of range (X = {})", ids[i], X);
    users[size_t(ids[i])].push_back(i);
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < X; ++e)
    if (!users[size_t(e)].empty() && experts[e].w1.packed) active.push_back(e);  // null: another rank's expert
  const bool avx2 = isa() >= Isa::avx2, bf16dot = isa() >= Isa::avx512bf16;
  // Steps 3: one expert per task (uneven token counts: handed out one at a time). Few tokens (decode)
  // are weighed as 8, as the GEMM does (gemm_bf16.cpp), so the step's two experts run on both cores.
  parallel_for_each(int64_t(active.size()), std::max<int64_t>(T, 8) * K * 3 * Lt * I, [&](int64_t a) {
    const int64_t e = active[size_t(a)];
    const std::vector<int64_t>& slots = users[size_t(e)];
    const int64_t n = int64_t(slots.size());
    const ExpertPtrs& ew = experts[e];
    thread_local std::vector<float> zp, ap, yf;
    thread_local std::vector<uint16_t> zb, gb, ub, ab;
    yf.resize(size_t(n * Lt));
    gb.resize(size_t(n * I)), ub.resize(size_t(n * I)), ab.resize(size_t(n * I));
    // [g | u] = bf16(z·W1ᵀ), bf16(z·W3ᵀ); a = SiTU-GLU(g, u); y = bf16(a·W2ᵀ).
    if (bf16dot) {  // each product in ORDER_B32 from the bf16 rows as they are
      zb.resize(size_t(n * Lt));  // bf16 [n, Lt]: this expert's tokens' z rows
      for (int64_t i = 0; i < n; ++i) std::copy_n(z + (slots[size_t(i)] / K) * Lt, Lt, zb.data() + i * Lt);
      gemm_detail::mxfp4_rows_bf16(ew.w1.packed, ew.w1.scale, zb.data(), Lt, n, I, Lt, nullptr, gb.data(), I);
      gemm_detail::mxfp4_rows_bf16(ew.w3.packed, ew.w3.scale, zb.data(), Lt, n, I, Lt, nullptr, ub.data(), I);
      situ_glu_fast(gb.data(), ub.data(), ab.data(), n * I, beta, linear_beta);
      gemm_detail::mxfp4_rows_bf16(ew.w2.packed, ew.w2.scale, ab.data(), I, n, Lt, I, yf.data(), nullptr, Lt);
    } else {
      zp.resize(size_t(n * Lt)), ap.resize(size_t(n * I));
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t* zr = z + (slots[size_t(i)] / K) * Lt;
        if (avx2)
          gemm_detail::permute_row_bf16_avx2(zr, Lt, zp.data() + i * Lt);
        else
          gemm_detail::permute_row_bf16(zr, Lt, zp.data() + i * Lt);
      }
      gemm_detail::mxfp4_rows(ew.w1.packed, ew.w1.scale, zp.data(), n, I, Lt, nullptr, gb.data(), I);
      gemm_detail::mxfp4_rows(ew.w3.packed, ew.w3.scale, zp.data(), n, I, Lt, nullptr, ub.data(), I);
      situ_glu_fast(gb.data(), ub.data(), ab.data(), n * I, beta, linear_beta);
      for (int64_t i = 0; i < n; ++i) {
        if (avx2)
          gemm_detail::permute_row_bf16_avx2(ab.data() + i * I, I, ap.data() + i * I);
        else
          gemm_detail::permute_row_bf16(ab.data() + i * I, I, ap.data() + i * I);
      }
      gemm_detail::mxfp4_rows(ew.w2.packed, ew.w2.scale, ap.data(), n, Lt, I, yf.data(), nullptr, Lt);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < Lt; ++j) {
        const float v = yf[size_t(i * Lt + j)];
        y[size_t(slots[size_t(i)] * Lt + j)] = round_y ? round_bf16(v) : v;
      }
  });
  // Step 4: ũ = Σ_k w_k · y_k, FP32 accumulation in top-k order (moe_experts_fast rounds it). Rows
  // split over the team (each row's sum in the same order on any thread): serial, it kept the other
  // core waiting at every MoE layer of a prefill. Weight: a multiply-add and a load of y (not in
  // cache: written by the expert tasks) per element, about 4 operations.
  parallel_for(T, T * K * Lt * 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* acc = ut + t * Lt;
      std::fill(acc, acc + Lt, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float wk = wts[t * K + k];
        const float* yk = y.data() + (t * K + k) * Lt;
        for (int64_t j = 0; j < Lt; ++j) acc[j] += wk * yk[j];
      }
    }
  });
}

}  // namespace kestrel::cpu
