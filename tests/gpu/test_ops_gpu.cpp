// GPU ops against their CPU twins over nano and mini (one TP8 rank, MODEL.md Appendix A) shapes.
// See harness.h for the rules (random inputs, NaN-poisoned outputs, stated tolerances).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "harness.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/kda_ops.h"
#include "kernels/cpu/kda_scan.h"
#include "kernels/cpu/moe_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/norm.h"
#include "model/attn_res.h"

namespace kestrel::gputest {
namespace {

constexpr float kEps = 1e-5f;
// One BF16 rounding of the same f32 value computed in a different order can land one ulp apart;
// a BF16 ulp is at most 2^-7 of the value. Two such roundings in a row: 2^-6.

// ---- 1. RMSNorm ------------------------------------------------------------------------------------------
TEST(GpuOps, RmsNorm) {
  need_gpu();
  struct Case {
    int64_t T, n, ldx;
    const char* what;
  };
  Rng rng(11);
  for (Case c : {Case{1, 256, 256, "nano hidden"}, Case{5, 256, 256, "nano hidden"}, Case{3, 64, 64, "nano kv_lora"},
                 Case{1, 7168, 7168, "mini hidden"}, Case{64, 7168, 7168, "mini hidden"},
                 Case{17, 3584, 3584, "mini routed_expert_norm"}, Case{33, 1536, 1536, "mini q_a_layernorm"},
                 Case{8, 512, 576, "mini kv_a_layernorm (strided)"}}) {
    const auto x = rand_bf16(size_t(c.T * c.ldx), rng, -3.0f, 3.0f);
    const auto w = rand_bf16(size_t(c.n), rng, 0.5f, 1.5f);
    std::vector<uint16_t> xc(size_t(c.T * c.n)), ref(size_t(c.T * c.n));
    for (int64_t t = 0; t < c.T; ++t) std::copy_n(&x[size_t(t * c.ldx)], c.n, &xc[size_t(t * c.n)]);
    cpu::rmsnorm_bf16(xc.data(), w.data(), ref.data(), c.T, c.n, kEps);
    auto dx = upload(x);
    auto dw = upload(w);
    auto dy = poisoned<uint16_t>(size_t(c.T * c.n));
    cuda::rmsnorm_bf16(dx.p(), c.ldx, dw.p(), dy.p(), c.n, c.T, c.n, kEps, nullptr);
    sync();
    check_bf16("rmsnorm_bf16", fmt::format("{} T={} n={}", c.what, c.T, c.n), dy.get(), ref,
               {1e-6, 2 * kBf16Ulp, 1e-3});
  }
}

// ---- 1b. AttnRes Mix fused with the following RMSNorm ----------------------------------------------------
TEST(GpuOps, AttnResMixRmsNorm) {
  need_gpu();
  struct Case {
    int64_t T, D;
    int nb;
  };
  Rng rng(12);
  for (Case c : {Case{3, 256, 0}, Case{3, 256, 2}, Case{1, 7168, 8}, Case{16, 7168, 3}, Case{64, 7168, 1}}) {
    model::AttnResStream s(c.T, c.D, std::max(c.nb, 1));
    // Sources at different scales so the softmax weights differ visibly.
    for (int i = 0; i <= c.nb; ++i) {
      const float sc = 0.5f + float(i % 4);
      auto v = rand_bf16(size_t(c.T * c.D), rng, -sc, sc);
      std::copy(v.begin(), v.end(), i < c.nb ? s.blocks.begin() + int64_t(i) * c.T * c.D : s.partial.begin());
    }
    s.num_blocks = c.nb;
    const auto norm_w = rand_bf16(size_t(c.D), rng, 0.5f, 1.5f), proj_w = rand_bf16(size_t(c.D), rng, -0.05f, 0.05f);
    const auto rms_w = rand_bf16(size_t(c.D), rng, 0.5f, 1.5f);
    std::vector<uint16_t> h_ref(size_t(c.T * c.D)), y_ref(size_t(c.T * c.D));
    model::attn_res_mix(s, norm_w.data(), proj_w.data(), kEps, h_ref.data());
    cpu::rmsnorm_bf16(h_ref.data(), rms_w.data(), y_ref.data(), c.T, c.D, kEps);

    auto dblocks = upload(s.blocks);
    auto dpartial = upload(s.partial);
    auto dnw = upload(norm_w);
    auto dpw = upload(proj_w);
    auto drw = upload(rms_w);
    auto dh = poisoned<uint16_t>(size_t(c.T * c.D)), dy = poisoned<uint16_t>(size_t(c.T * c.D));
    cuda::attn_res_mix_rmsnorm(dblocks.p(), c.T * c.D, c.nb, dpartial.p(), c.D, dnw.p(), dpw.p(), drw.p(), kEps, dh.p(),
                               dy.p(), c.D, c.T, c.D, nullptr);
    sync();
    const std::string shape = fmt::format("T={} D={} sources={}", c.T, c.D, c.nb + 1);
    const Tol tol{1e-3, 2 * kBf16Ulp, 2e-3};
    check_bf16("attn_res_mix (h)", shape, dh.get(), h_ref, tol);
    check_bf16("attn_res_mix+rmsnorm (y)", shape, dy.get(), y_ref, tol);
  }
}

// ---- 2. BF16 GEMM (cuBLASLt) and the T = 1 GEMV --------------------------------------------------------------
float time_us(const std::function<void()>& fn, int reps = 50) {
  cudaEvent_t a, b;
  KCUDA_CHECK(cudaEventCreate(&a));
  KCUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) fn();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    KCUDA_CHECK(cudaEventRecord(a));
    fn();
    KCUDA_CHECK(cudaEventRecord(b));
    KCUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000.0f);
  }
  KCUDA_CHECK(cudaEventDestroy(a));
  KCUDA_CHECK(cudaEventDestroy(b));
  std::nth_element(ts.begin(), ts.begin() + reps / 2, ts.end());
  return ts[size_t(reps / 2)];
}

TEST(GpuOps, GemmBf16) {
  need_gpu();
  struct Case {
    int64_t T, K, N;
    const char* what;
  };
  Rng rng(21);
  cuda::GemmLt lt;
  const Tol tol_bf16{0, kBf16Ulp, 2e-3};  // plus atol below, relative to the output scale
  for (Case c : {Case{1, 256, 128, "nano"}, Case{5, 256, 512, "nano"}, Case{7, 128, 64, "nano"},
                 Case{1, 7168, 1536, "mini q/k/v/g_proj"}, Case{64, 7168, 1536, "mini q/k/v/g_proj"},
                 Case{300, 7168, 1536, "mini q/k/v/g_proj"}, Case{1, 1536, 7168, "mini o_proj"},
                 Case{64, 1536, 7168, "mini o_proj"}, Case{1, 7168, 3584, "mini latent down"},
                 Case{33, 3584, 7168, "mini latent up"}, Case{16, 7168, 128, "mini f_a_proj"},
                 Case{1, 128, 1536, "mini f_b_proj"}, Case{4, 7168, 12, "mini b_proj"}}) {
    const auto x = rand_bf16(size_t(c.T * c.K), rng, -1.0f, 1.0f);
    const auto w = rand_bf16(size_t(c.N * c.K), rng, -0.02f, 0.02f);
    std::vector<uint16_t> ref(size_t(c.T * c.N));
    cpu::gemm_bf16(x.data(), c.K, w.data(), ref.data(), c.N, c.T, c.K, c.N);
    double scale = 0;
    for (uint16_t v : ref) scale = std::max(scale, double(std::fabs(bf16_to_f32(v))));
    Tol tol = tol_bf16;
    tol.atol = 2e-3 * scale;  // cancellation: a sum near zero has no relative accuracy
    auto dx = upload(x);
    auto dw = upload(w);
    auto dy = poisoned<uint16_t>(size_t(c.T * c.N));
    lt.bf16(dx.p(), c.K, dw.p(), dy.p(), c.N, c.T, c.K, c.N, nullptr);
    sync();
    const std::string shape = fmt::format("{} T={} K={} N={}", c.what, c.T, c.K, c.N);
    check_bf16("gemm_bf16 (cuBLASLt)", shape, dy.get(), ref, tol);
    if (c.T == 1) {
      auto dg = poisoned<uint16_t>(size_t(c.N));
      cuda::gemv_bf16(dx.p(), dw.p(), dg.p(), nullptr, c.K, c.N, nullptr);
      sync();
      check_bf16("gemv_bf16 (T=1 kernel)", shape, dg.get(), ref, tol);
      if (c.K * c.N >= 1000000) {
        const float t_lt = time_us([&] { lt.bf16(dx.p(), c.K, dw.p(), dy.p(), c.N, 1, c.K, c.N, nullptr); });
        const float t_gv = time_us([&] { cuda::gemv_bf16(dx.p(), dw.p(), dg.p(), nullptr, c.K, c.N, nullptr); });
        const double gb = double(c.K * c.N * 2) / 1e9;
        note(fmt::format("  timing T=1 K={} N={}: cuBLASLt {:.1f} us ({:.2f} TB/s of W), gemv {:.1f} us ({:.2f} TB/s)",
                         c.K, c.N, t_lt, gb / (t_lt * 1e-6) / 1e3, t_gv, gb / (t_gv * 1e-6) / 1e3));
      }
    }
  }
  // FP32 output (router, lm_head).
  for (Case c : {Case{3, 256, 16, "nano router"}, Case{1, 7168, 112, "mini router"}, Case{64, 7168, 112, "mini router"},
                 Case{8, 7168, 896, "full router"}}) {
    const auto x = rand_bf16(size_t(c.T * c.K), rng, -1.0f, 1.0f);
    const auto w = rand_bf16(size_t(c.N * c.K), rng, -0.02f, 0.02f);
    std::vector<float> ref(size_t(c.T * c.N));
    cpu::gemm_bf16_f32(x.data(), c.K, w.data(), ref.data(), c.N, c.T, c.K, c.N);
    double scale = 0;
    for (float v : ref) scale = std::max(scale, double(std::fabs(v)));
    const Tol tol{1e-5 * scale, 1e-4, 1e-5};
    auto dx = upload(x);
    auto dw = upload(w);
    auto dy = poisoned<float>(size_t(c.T * c.N));
    lt.bf16_f32(dx.p(), c.K, dw.p(), dy.p(), c.N, c.T, c.K, c.N, nullptr);
    sync();
    const std::string shape = fmt::format("{} T={} K={} N={}", c.what, c.T, c.K, c.N);
    check("gemm_bf16_f32 (cuBLASLt)", shape, dy.get().data(), ref.data(), ref.size(), tol);
    if (c.T == 1) {
      auto dg = poisoned<float>(size_t(c.N));
      cuda::gemv_bf16(dx.p(), dw.p(), nullptr, dg.p(), c.K, c.N, nullptr);
      sync();
      check("gemv_bf16_f32 (T=1 kernel)", shape, dg.get().data(), ref.data(), ref.size(), tol);
    }
  }
}

// ---- 3. KDA ------------------------------------------------------------------------------------------------
struct KdaShape {
  int64_t H, Dk;
  const char* what;
};
const KdaShape kKdaShapes[] = {{4, 32, "nano"}, {12, 128, "mini"}};
constexpr int64_t kConvW = 4;

TEST(GpuOps, KdaConvPrefill) {
  need_gpu();
  Rng rng(31);
  for (const KdaShape& s : kKdaShapes) {
    const int64_t C = 3 * s.H * s.Dk;  // q|k|v convolved in one launch
    for (int64_t T : {1, 2, 5, 64}) {
      const auto x = rand_bf16(size_t(T * C), rng, -2.0f, 2.0f);
      const auto w = rand_f32(size_t(C * kConvW), rng, -0.7f, 0.7f);
      auto hist = rand_bf16(size_t((kConvW - 1) * C), rng, -2.0f, 2.0f);
      auto dx = upload(x);
      auto dw = upload(w);
      auto dh = upload(hist);
      auto dy = poisoned<uint16_t>(size_t(T * C));
      cuda::kda_conv_prefill(dx.p(), C, dw.p(), dh.p(), dy.p(), C, T, C, kConvW, nullptr);
      sync();
      std::vector<float> ref(size_t(T * C));
      cpu::kda_conv_silu(x.data(), C, w.data(), hist.data(), ref.data(), C, T, C, kConvW);
      const std::string shape = fmt::format("{} T={} C={} W={}", s.what, T, C, kConvW);
      const auto y = to_f32(dy.get());
      check("kda_conv_prefill (y)", shape, y.data(), ref.data(), ref.size(), {1e-6, kBf16Ulp, 1e-3});
      const auto hist_gpu = dh.get();
      check_exact("kda_conv_prefill (history)", shape, hist_gpu.data(), hist.data(), hist.size() * 2);
    }
  }
}

// Distinct slot ids drawn from a pool larger than the batch, in random order.
std::vector<int32_t> random_slots(int64_t B, int64_t n_slots, Rng& rng) {
  std::vector<int32_t> all(static_cast<size_t>(n_slots));
  std::iota(all.begin(), all.end(), 0);
  for (size_t i = all.size(); i > 1; --i) std::swap(all[i - 1], all[rng.next() % i]);
  all.resize(size_t(B));
  return all;
}

TEST(GpuOps, KdaConvDecode) {
  need_gpu();
  Rng rng(32);
  for (const KdaShape& s : kKdaShapes) {
    const int64_t C = 3 * s.H * s.Dk;
    for (int64_t B : {1, 8, 64}) {
      const int64_t n_slots = 2 * B + 5;
      const auto x = rand_bf16(size_t(B * C), rng, -2.0f, 2.0f);
      const auto w = rand_f32(size_t(C * kConvW), rng, -0.7f, 0.7f);
      auto pool = rand_bf16(size_t(n_slots * (kConvW - 1) * C), rng, -2.0f, 2.0f);
      const auto slots = random_slots(B, n_slots, rng);
      auto dx = upload(x);
      auto dw = upload(w);
      auto dpool = upload(pool);
      auto dslots = upload(slots);
      auto dy = poisoned<uint16_t>(size_t(B * C));
      cuda::kda_conv_decode(dx.p(), C, dw.p(), dpool.p(), dslots.p(), dy.p(), C, B, C, kConvW, nullptr);
      sync();
      std::vector<float> ref(size_t(B * C));
      for (int64_t b = 0; b < B; ++b)
        cpu::kda_conv_silu(x.data() + b * C, C, w.data(), pool.data() + slots[size_t(b)] * (kConvW - 1) * C,
                           ref.data() + b * C, C, 1, C, kConvW);
      const std::string shape = fmt::format("{} B={} C={} slots={}", s.what, B, C, n_slots);
      const auto y = to_f32(dy.get());
      check("kda_conv_decode (y)", shape, y.data(), ref.data(), ref.size(), {1e-6, kBf16Ulp, 1e-3});
      const auto pool_gpu = dpool.get();
      check_exact("kda_conv_decode (state pool)", shape, pool_gpu.data(), pool.data(), pool.size() * 2);
    }
  }
}

// Random post-conv q, k (bf16) and gate inputs, through the CPU twin of steps 3–5.
struct KdaGateInputs {
  std::vector<uint16_t> q, k, z, b;
  std::vector<float> dt_bias, a_log;
};
KdaGateInputs random_gate_inputs(int64_t T, const KdaShape& s, Rng& rng) {
  const int64_t HD = s.H * s.Dk;
  return {rand_bf16(size_t(T * HD), rng, -1.0f, 1.0f), rand_bf16(size_t(T * HD), rng, -1.0f, 1.0f),
          rand_bf16(size_t(T * HD), rng, -3.0f, 3.0f), rand_bf16(size_t(T * s.H), rng, -3.0f, 3.0f),
          rand_f32(size_t(HD), rng, -1.0f, 1.0f), rand_f32(size_t(s.H), rng, -1.0f, 1.5f)};
}

TEST(GpuOps, KdaQkNormGates) {
  need_gpu();
  Rng rng(33);
  const float lower = -5.0f;
  for (const KdaShape& s : kKdaShapes) {
    const int64_t HD = s.H * s.Dk;
    for (int64_t T : {1, 33}) {
      const KdaGateInputs in = random_gate_inputs(T, s, rng);
      std::vector<float> q = to_f32(in.q), k = to_f32(in.k), g(size_t(T * HD)), beta(size_t(T * s.H));
      cpu::kda_qk_norm_gates(q.data(), k.data(), in.z.data(), in.dt_bias.data(), in.a_log.data(), in.b.data(), lower,
                             g.data(), beta.data(), T, s.H, s.Dk);
      auto dq = upload(in.q);
      auto dk = upload(in.k);
      auto dz = upload(in.z);
      auto db = upload(in.b);
      auto ddt = upload(in.dt_bias);
      auto dal = upload(in.a_log);
      auto oq = poisoned<float>(size_t(T * HD)), ok = poisoned<float>(size_t(T * HD)),
           og = poisoned<float>(size_t(T * HD)), obeta = poisoned<float>(size_t(T * s.H));
      cuda::kda_qk_norm_gates(dq.p(), dk.p(), HD, dz.p(), ddt.p(), dal.p(), db.p(), lower, oq.p(), ok.p(), og.p(),
                              obeta.p(), T, s.H, s.Dk, nullptr);
      sync();
      const std::string shape = fmt::format("{} T={} H={} Dk={}", s.what, T, s.H, s.Dk);
      const Tol tol{1e-6, 1e-5, 1e-6};
      check("kda_qk_norm_gates (q)", shape, oq.get().data(), q.data(), q.size(), tol);
      check("kda_qk_norm_gates (k)", shape, ok.get().data(), k.data(), k.size(), tol);
      check("kda_qk_norm_gates (g)", shape, og.get().data(), g.data(), g.size(), tol);
      check("kda_qk_norm_gates (beta)", shape, obeta.get().data(), beta.data(), beta.size(), tol);
    }
  }
}

// Recurrent scan: decode (one token per request) and varlen prefill through the same kernel.
TEST(GpuOps, KdaRecurrent) {
  need_gpu();
  Rng rng(34);
  struct Batch {
    std::vector<int32_t> lens;
    const char* what;
  };
  for (const KdaShape& s : kKdaShapes) {
    const int64_t HD = s.H * s.Dk, DD = s.Dk * s.Dk;
    for (const Batch& bt : {Batch{{1}, "decode"}, Batch{std::vector<int32_t>(8, 1), "decode"},
                            Batch{std::vector<int32_t>(64, 1), "decode"}, Batch{{1, 17, 130}, "varlen prefill"}}) {
      const int64_t B = int64_t(bt.lens.size());
      std::vector<int32_t> cu(size_t(B + 1), 0);
      for (int64_t b = 0; b < B; ++b) cu[size_t(b + 1)] = cu[size_t(b)] + bt.lens[size_t(b)];
      const int64_t T = cu.back(), n_slots = B + 3;
      const KdaGateInputs in = random_gate_inputs(T, s, rng);
      std::vector<float> q = to_f32(in.q), k = to_f32(in.k), g(size_t(T * HD)), beta(size_t(T * s.H));
      cpu::kda_qk_norm_gates(q.data(), k.data(), in.z.data(), in.dt_bias.data(), in.a_log.data(), in.b.data(), -5.0f,
                             g.data(), beta.data(), T, s.H, s.Dk);
      const auto v = rand_f32(size_t(T * HD), rng, -1.0f, 1.0f);
      auto pool = rand_f32(size_t(n_slots * s.H * DD), rng, -0.1f, 0.1f);
      const auto pool0 = pool;
      const auto slots = random_slots(B, n_slots, rng);
      auto dq = upload(q);
      auto dk = upload(k);
      auto dv = upload(v);
      auto dg = upload(g);
      auto dbeta = upload(beta);
      auto dcu = upload(cu);
      auto dslots = upload(slots);
      auto dpool = upload(pool);
      auto dout = poisoned<float>(size_t(T * HD));
      cuda::kda_recurrent(dq.p(), dk.p(), dv.p(), dg.p(), HD, dbeta.p(), s.H, dcu.p(), dslots.p(), dpool.p(), dout.p(), B,
                          s.H, s.Dk, nullptr);
      sync();
      std::vector<float> o(size_t(T * HD));
      for (int64_t b = 0; b < B; ++b) {
        const int64_t t0 = cu[size_t(b)];
        for (int64_t h = 0; h < s.H; ++h) {
          const cpu::KdaHeadIo io{q.data() + t0 * HD + h * s.Dk, k.data() + t0 * HD + h * s.Dk,
                                  v.data() + t0 * HD + h * s.Dk, g.data() + t0 * HD + h * s.Dk,
                                  beta.data() + t0 * s.H + h, HD, s.H, o.data() + t0 * HD + h * s.Dk};
          cpu::kda_scan_recurrent(io, bt.lens[size_t(b)], s.Dk, pool.data() + (slots[size_t(b)] * s.H + h) * DD);
        }
      }
      const std::string shape = fmt::format("{} {} B={} T={} H={} Dk={}", s.what, bt.what, B, T, s.H, s.Dk);
      double so = 0, ss = 0;
      for (float x : o) so = std::max(so, double(std::fabs(x)));
      for (float x : pool) ss = std::max(ss, double(std::fabs(x)));
      check("kda_recurrent (o)", shape, dout.get().data(), o.data(), o.size(), {1e-5 * so, 1e-4, 2e-5});
      // The whole pool: slots nobody used must come back unchanged.
      check("kda_recurrent (state pool)", shape, dpool.get().data(), pool.data(), pool.size(), {1e-5 * ss, 1e-4, 2e-5});
      // FP16 pool: the launch widens each state exactly, runs the same FP32 scan and rounds back once, so
      // from an FP16-representable start it must give the FP32 launch's outputs bit for bit and its final
      // states rounded to FP16 (RNE) bit for bit.
      std::vector<float> p32(pool0.size());
      std::vector<uint16_t> p16(pool0.size());
      for (size_t i = 0; i < pool0.size(); ++i) p16[i] = f32_to_f16(pool0[i]), p32[i] = f16_to_f32(p16[i]);
      auto dp32 = upload(p32);
      auto dp16 = upload(p16);
      auto do32 = poisoned<float>(size_t(T * HD));
      auto do16 = poisoned<float>(size_t(T * HD));
      cuda::kda_recurrent(dq.p(), dk.p(), dv.p(), dg.p(), HD, dbeta.p(), s.H, dcu.p(), dslots.p(), dp32.p(), do32.p(), B,
                          s.H, s.Dk, nullptr);
      cuda::kda_recurrent(dq.p(), dk.p(), dv.p(), dg.p(), HD, dbeta.p(), s.H, dcu.p(), dslots.p(), dp16.p(), do16.p(), B,
                          s.H, s.Dk, nullptr);
      sync();
      const auto o32 = do32.get(), o16 = do16.get();
      check_exact("kda_recurrent f16 state (o)", shape, o16.data(), o32.data(), o32.size() * 4);
      const auto s32 = dp32.get();
      std::vector<uint16_t> want16(s32.size());
      for (size_t i = 0; i < s32.size(); ++i) want16[i] = f32_to_f16(s32[i]);
      const auto s16 = dp16.get();
      check_exact("kda_recurrent f16 state (pool)", shape, s16.data(), want16.data(), want16.size() * 2);
    }
  }
}

// The chunked (prefill) and decode-specialised scans are tested in test_kda_gpu.cpp.

TEST(GpuOps, KdaOutNormGate) {
  need_gpu();
  Rng rng(35);
  for (const KdaShape& s : kKdaShapes) {
    const int64_t HD = s.H * s.Dk;
    for (int64_t T : {1, 33}) {
      const auto o = rand_f32(size_t(T * HD), rng, -0.5f, 0.5f);
      const auto gate = rand_bf16(size_t(T * HD), rng, -4.0f, 4.0f);
      const auto onw = rand_f32(size_t(s.Dk), rng, 0.5f, 1.5f);
      std::vector<uint16_t> ref(size_t(T * HD));
      cpu::kda_out_norm_gate(o.data(), gate.data(), onw.data(), kEps, ref.data(), T, s.H, s.Dk);
      auto d_o = upload(o);
      auto dgate = upload(gate);
      auto donw = upload(onw);
      auto dy = poisoned<uint16_t>(size_t(T * HD));
      cuda::kda_out_norm_gate(d_o.p(), dgate.p(), donw.p(), kEps, dy.p(), T, s.H, s.Dk, nullptr);
      sync();
      check_bf16("kda_out_norm_gate", fmt::format("{} T={} H={} Dk={}", s.what, T, s.H, s.Dk), dy.get(), ref,
                 {1e-6, kBf16Ulp, 1e-3});
    }
  }
}

// ---- 4. MoE --------------------------------------------------------------------------------------------------
// The four router kernels (moe.cu: a block-wide arg-max a round at any X; two levels of warp arg-maxes, or of
// sorting networks, or a radix select, at X ≤ 2048) vs the twin, and vs the block kernel bit for bit; the emulation
// (tests/emu/test_emu_route.cpp) covers more cases on the CPU.
TEST(GpuOps, MoeRoute) {
  need_gpu();
  struct Case {
    int64_t T, X, K;
    int kind;  // 0 random, 1 exact ties, 2 more picks than numbers (the rest NaN, ranked lowest)
    const char* what;
  };
  Rng rng(41);
  const cuda::MoeRouteKernel saved = cuda::moe_route_kernel();
  for (Case c : {Case{5, 16, 4, 0, "nano"}, Case{64, 112, 2, 0, "mini"}, Case{8, 896, 16, 0, "full"},
                 Case{8, 896, 16, 1, "full, exact ties"}, Case{3, 16, 4, 1, "nano, exact ties"},
                 Case{6, 1024, 64, 0, "1024 experts, top-64"}, Case{3, 2050, 8, 0, "past the two-level kernel's 2048"},
                 Case{5, 72, 40, 2, "mostly NaN"}}) {
    std::vector<float> logits = rand_f32(size_t(c.T * c.X), rng, -4.0f, 4.0f);
    std::vector<float> bias = rand_f32(size_t(c.X), rng, -0.1f, 0.1f);
    if (c.kind == 1) {  // few distinct values and no bias: most selections are decided by the index rule
      for (auto& l : logits) l = float(rng.next() % 3) - 1.0f;
      std::fill(bias.begin(), bias.end(), 0.0f);
    } else if (c.kind == 2) {
      for (size_t i = 0; i < logits.size(); ++i)
        if (i % 4 != 1) logits[i] = std::nanf("");
    }
    std::vector<int32_t> ids(size_t(c.T * c.K));
    std::vector<float> wts(size_t(c.T * c.K));
    cpu::moe_route(logits.data(), bias.data(), c.T, c.X, c.K, true, 1.0f, ids.data(), wts.data());
    auto dl = upload(logits);
    auto db = upload(bias);
    std::vector<int32_t> first_ids;
    std::vector<float> first_w;
    for (const auto kind : {cuda::MoeRouteKernel::block, cuda::MoeRouteKernel::two_level, cuda::MoeRouteKernel::sort,
                            cuda::MoeRouteKernel::radix, cuda::MoeRouteKernel::automatic}) {
      cuda::set_moe_route_kernel(kind);
      auto dids = poisoned<int32_t>(ids.size());
      auto dw = poisoned<float>(wts.size());
      cuda::moe_route(dl.p(), db.p(), c.T, c.X, c.K, true, 1.0f, dids.p(), dw.p(), nullptr);
      sync();
      const std::string shape = fmt::format("{} T={} X={} K={} ({})", c.what, c.T, c.X, c.K, kind == cuda::MoeRouteKernel::radix ? "radix" : kind == cuda::MoeRouteKernel::sort ? "sort" : kind == cuda::MoeRouteKernel::two_level ? "two-level" : kind == cuda::MoeRouteKernel::block ? "block" : "auto");
      const auto gids = dids.get();
      const auto gw = dw.get();
      check_exact("moe_route (ids)", shape, gids.data(), ids.data(), ids.size() * 4);
      if (c.kind == 2) {  // NaN experts picked: σ(NaN) makes Σ, so every weight of the token, NaN, as in the twin
        for (size_t i = 0; i < wts.size(); ++i)
          EXPECT_EQ(std::isnan(gw[i]), std::isnan(wts[i])) << shape << " weight " << i;
      } else {
        check("moe_route (weights)", shape, gw.data(), wts.data(), wts.size(), {1e-7, 1e-5, 1e-6});
      }
      if (first_ids.empty()) {
        first_ids = gids, first_w = gw;
      } else {
        check_exact("moe_route vs the block kernel (ids)", shape, gids.data(), first_ids.data(), gids.size() * 4);
        check_exact("moe_route vs the block kernel (weights)", shape, gw.data(), first_w.data(), gw.size() * 4);
      }
    }
  }
  cuda::set_moe_route_kernel(saved);
}

// The routed experts (moe_experts_mxfp4) are tested in test_moe_gpu.cpp.

}  // namespace
}  // namespace kestrel::gputest
