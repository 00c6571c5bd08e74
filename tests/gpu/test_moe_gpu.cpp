// Routed MoE experts on tensor cores (kernels/cuda/moe_experts.cu) against their CPU twins.
//
// MoeLayout.* run without a GPU (on the build machine too): they check the repacked weight layout
// (moe_layout.h, cuda::pack_mxfp4_matrix) by emulating, lane by lane, what the kernel does with it — the
// E2M1 decode, the e8m0 scale words, the activation loads and mma.m16n8k16 as the PTX ISA defines its
// fragments — and comparing with cpu::mxfp4_gemm on the checkpoint layout.
// GpuMoe.* run the kernels: the single-matrix stage (every E2M1 code, e8m0 scales over the whole range
// 0..255, every GEMM family: t8, t32, stream, wide) against cpu::mxfp4_gemm, and moe_experts_mxfp4 against
// cpu::moe_experts over nano, mini and real expert shapes, T = 1 … 4096, experts with zero, one and hundreds
// (skewed: thousands) of tokens, tied routing weights, out-of-range ids, one expert-parallel rank's experts
// (moe_local_ids; fewer local experts than K) and CUDA-graph replay; the decode
// GEMM also with its work split over 1, 3 and 7 CTAs (tiles cut by up to dozens of warps), ungrouped and
// grouped, with and without programmatic dependent launch. Outputs and scratch are NaN-poisoned first.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "harness.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/moe_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_layout.h"
#include "kernels/cuda/norm.h"

namespace kestrel::gputest {
namespace {

namespace ml = cuda::moe_layout;

// ---- host helpers ---------------------------------------------------------------------------------------
// One checkpoint-layout MXFP4 matrix W [R, C].
struct Mx {
  int64_t R = 0, C = 0;
  std::vector<uint8_t> packed, scale;  // u8 [R, C/2], e8m0 [R, C/32]
};
Mx random_mx(int64_t R, int64_t C, Rng& rng, unsigned e_lo, unsigned e_hi) {
  Mx m{R, C, rand_u8(size_t(R * C / 2), rng, 0, 255), rand_u8(size_t(R * C / 32), rng, e_lo, e_hi)};
  return m;
}
// Kernel layout of a checkpoint matrix.
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> pack(const Mx& m) {
  std::vector<uint8_t> p(m.packed.size()), s(m.scale.size());
  cuda::pack_mxfp4_matrix(m.packed.data(), m.scale.data(), m.R, m.C, p.data(), s.data());
  return {p, s};
}
// y = x·Wᵀ by the CPU twin (f32 [T, R]).
std::vector<float> cpu_matmul(const Mx& m, const std::vector<float>& x, int64_t T) {
  std::vector<float> y(size_t(T * m.R));
  cpu::mxfp4_gemm(m.packed.data(), m.scale.data(), x.data(), y.data(), T, m.R, m.C);
  return y;
}
// Σ|w|·|x| per output, by the same twin on |W| (sign bits cleared) and |x|: the scale of rounding differences.
std::vector<float> cpu_abs_matmul(const Mx& m, const std::vector<float>& x, int64_t T) {
  Mx a = m;
  for (auto& b : a.packed) b &= 0x77;
  std::vector<float> ax(x.size());
  for (size_t i = 0; i < x.size(); ++i) ax[i] = std::fabs(x[i]);
  return cpu_matmul(a, ax, T);
}
float bf16_bits_to_f32(uint32_t b) { return bf16_to_f32(uint16_t(b)); }

// ---- the kernel, emulated on the host ---------------------------------------------------------------------
// mma.sync.m16n8k16 (row.col, FP32 accumulate) from the PTX ISA fragment tables: lane (g = lane/4,
// t = lane%4) holds A a0,a1 = (g, 2t..2t+1), a2,a3 = (g+8, 2t..), a4,a5 = (g, 2t+8..), a6,a7 = (g+8, 2t+8..)
// in registers 0..3 (low half first); B b0,b1 = (k 2t..2t+1, n g), b2,b3 = (k 2t+8.., n g); C c0,c1 = (g, 2t..),
// c2,c3 = (g+8, 2t..). Values are given as floats (already BF16); the sum is exact (double) then rounded.
void emulate_mma(float (&d)[32][4], const float (&a)[32][4][2], const float (&b)[32][2][2], const float (&c)[32][4]) {
  double A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = a[l][0][h];
      A[g + 8][2 * t + h] = a[l][1][h];
      A[g][2 * t + 8 + h] = a[l][2][h];
      A[g + 8][2 * t + 8 + h] = a[l][3][h];
      B[2 * t + h][g] = b[l][0][h];
      B[2 * t + 8 + h][g] = b[l][1][h];
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int m = g + 8 * (i / 2), n = 2 * t + i % 2;
      double s = c[l][i];
      for (int k = 0; k < 16; ++k) s += A[m][k] * B[k][n];
      d[l][i] = float(s);
    }
  }
}

// y [T, R] from the kernel-layout bytes, following expert_gemm_kernel step by step for 8-token tiles; with
// `fold`, the stream/wide kernels instead (moe_mma.cuh): each A register multiplied by the bf16 pair
// ((e + 126) << 7) of its row's scale byte, the MMAs accumulating straight into one accumulator. With `raw`
// (moe_t8.cu kScaleRaw, FP32 scales): A as decoded (v·2^-126, subnormal for ±0.5), x scaled by 2^100, the
// accumulators multiplied by 2^26 at the end.
std::vector<float> emulate_kernel(const std::vector<uint8_t>& kp, const std::vector<uint8_t>& ks, bool special,
                                  const std::vector<float>& x /* [T, C], BF16 values */, int64_t T, int64_t R,
                                  int64_t C, bool fold = false, bool raw = false) {
  const int64_t RT = R / 16, NC = C / 64;
  std::vector<float> y(size_t(T * R), std::nanf(""));
  for (int64_t n0 = 0; n0 < T; n0 += 8) {
    const int64_t count = std::min<int64_t>(8, T - n0);
    for (int64_t rt = 0; rt < RT; ++rt) {
      float acc[32][4] = {};
      for (int64_t c = 0; c < NC; ++c) {
        float A[4][32][4][2];  // [step][lane][register][half]
        float Bv[4][32][2][2];
        uint32_t sw[32];
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          const uint8_t* lp = &kp[size_t((rt * NC + c) * 512 + l * 16)];
          for (int s = 0; s < 4; ++s) {
            const uint32_t w = uint32_t(lp[4 * s]) | uint32_t(lp[4 * s + 1]) << 8 | uint32_t(lp[4 * s + 2]) << 16 |
                               uint32_t(lp[4 * s + 3]) << 24;
            for (int j = 0; j < 4; ++j) {
              const uint32_t bits = ml::e2m1_pair_bits(w, j);
              for (int h = 0; h < 2; ++h) A[s][l][j][h] = bf16_bits_to_f32(bits >> (16 * h)) * (raw ? 1.0f : 0x1p126f);
            }
          }
          // Activations: 16-byte load of block b at column 64c + 32b + 8t; word m = B register m&1 of step 2b + m/2.
          const int64_t tok = n0 + std::min<int64_t>(g, count - 1);
          for (int b = 0; b < 2; ++b)
            for (int m = 0; m < 4; ++m)
              for (int h = 0; h < 2; ++h)
                Bv[2 * b + m / 2][l][m % 2][h] =
                    x[size_t(tok * C + 64 * c + 32 * b + 8 * t + 2 * m + h)] * (raw ? 0x1p100f : 1.0f);
          const uint8_t* sp = &ks[size_t((rt * NC + c) * 32 + g * 4)];
          sw[l] = uint32_t(sp[0]) | uint32_t(sp[1]) << 8 | uint32_t(sp[2]) << 16 | uint32_t(sp[3]) << 24;
        }
        if (fold) {
          for (int l = 0; l < 32; ++l)
            for (int st = 0; st < 4; ++st)
              for (int j = 0; j < 4; ++j) {
                const uint32_t e = (sw[l] >> (8 * (2 * (st >> 1) + (j & 1)))) & 0xFF;  // row g + 8(j&1), block st/2
                const float mult = bf16_bits_to_f32((e + 126) << 7);
                for (int h = 0; h < 2; ++h) A[st][l][j][h] = A[st][l][j][h] * 0x1p-126f * mult;  // exact
              }
          for (int st = 0; st < 4; ++st) {
            float q[32][4];
            emulate_mma(q, A[st], Bv[st], acc);
            std::memcpy(acc, q, sizeof(q));
          }
          continue;
        }
        for (int b = 0; b < 2; ++b) {
          float p[32][4] = {}, q[32][4];
          emulate_mma(q, A[2 * b], Bv[2 * b], p);
          emulate_mma(p, A[2 * b + 1], Bv[2 * b + 1], q);
          for (int l = 0; l < 32; ++l) {
            const uint32_t sg = special ? ml::e8m0_f32_bits<true>(sw[l], 2 * b) : ml::e8m0_f32_bits<false>(sw[l], 2 * b);
            const uint32_t sg8 =
                special ? ml::e8m0_f32_bits<true>(sw[l], 2 * b + 1) : ml::e8m0_f32_bits<false>(sw[l], 2 * b + 1);
            float fs[2];
            std::memcpy(&fs[0], &sg, 4);
            std::memcpy(&fs[1], &sg8, 4);
            for (int i = 0; i < 4; ++i) acc[l][i] = std::fma(p[l][i], fs[i / 2], acc[l][i]);
          }
        }
      }
      for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; ++i) {
          const int64_t n = 2 * t + i % 2;
          if (n < count) y[size_t((n0 + n) * R + rt * 16 + g + 8 * (i / 2))] = acc[l][i] * (raw ? 0x1p26f : 1.0f);
        }
      }
    }
  }
  return y;
}

// ---- MoeLayout (host only) --------------------------------------------------------------------------------
TEST(MoeLayout, DecodeGivesEveryCodeAtEveryPosition) {
  // Matrix v holds code (v + row + col) mod 16 everywhere: each element position sees all 16 codes.
  const int64_t R = 16, C = 64;
  int64_t checked = 0;
  for (int v = 0; v < 16; ++v) {
    Mx m{R, C, std::vector<uint8_t>(size_t(R * C / 2)), std::vector<uint8_t>(size_t(R * C / 32), 127)};
    auto code = [&](int64_t r, int64_t c) { return uint32_t((v + r + c) % 16); };
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; c += 2) m.packed[size_t(r * C / 2 + c / 2)] = uint8_t(code(r, c) | code(r, c + 1) << 4);
    const auto [kp, ks] = pack(m);
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int s = 0; s < 4; ++s) {
        uint32_t w = 0;
        for (int b = 0; b < 4; ++b) w |= uint32_t(kp[size_t(l * 16 + s * 4 + b)]) << (8 * b);
        for (int j = 0; j < 4; ++j) {
          const uint32_t bits = ml::e2m1_pair_bits(w, j);
          for (int h = 0; h < 2; ++h) {
            const float got = bf16_bits_to_f32(bits >> (16 * h)) * 0x1p126f;
            const float want = kE2M1Values[code(ml::frag_row(g, j), ml::frag_col(t, s, j, h))];
            ASSERT_TRUE(got == want && std::signbit(got) == std::signbit(want))
                << "lane " << l << " step " << s << " reg " << j << " half " << h << ": " << got << " != " << want;
            // The integer fallback decode gives the same BF16 bits.
            ASSERT_EQ(bf16_to_f32(uint16_t(ml::e2m1_pair_bf16_exact(bits) >> (16 * h))), want);
            ASSERT_EQ((ml::e2m1_pair_bf16_exact(bits) >> (16 * h + 15)) & 1, uint32_t(std::signbit(want)));
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 16 * R * C);
}

TEST(MoeLayout, ScaleWordsAndPermutation) {
  Rng rng(7);
  const int64_t R = 32, C = 128;
  Mx m = random_mx(R, C, rng, 0, 255);
  const auto [kp, ks] = pack(m);
  // Scale bytes: group g, byte i = (row g + 8(i&1), block 2c + i/2) of tile rt, chunk c.
  for (int64_t rt = 0; rt < R / 16; ++rt)
    for (int64_t c = 0; c < C / 64; ++c)
      for (int g = 0; g < 8; ++g)
        for (int i = 0; i < 4; ++i)
          ASSERT_EQ(ks[size_t((rt * (C / 64) + c) * 32 + g * 4 + i)],
                    m.scale[size_t((rt * 16 + g + 8 * (i & 1)) * (C / 32) + 2 * c + i / 2)]);
  // e8m0 → f32 for every code, normal and special path.
  for (uint32_t e = 0; e < 256; ++e) {
    for (int i = 0; i < 4; ++i) {
      const uint32_t word = (e << (8 * i)) | (0x5Au << (8 * ((i + 1) % 4)));  // junk in another byte
      const uint32_t fast = ml::e8m0_f32_bits<false>(word, i), exact = ml::e8m0_f32_bits<true>(word, i);
      float f;
      std::memcpy(&f, &exact, 4);
      const float want = e8m0_to_f32(uint8_t(e));
      EXPECT_TRUE(std::isnan(want) ? std::isnan(f) : f == want) << "e " << e << " byte " << i;
      if (e >= 1 && e <= 254) {
        EXPECT_EQ(fast, exact) << "e " << e;
      }
    }
  }
  // The packed nibbles are a permutation: histograms of (value, sign) match.
  std::vector<int64_t> h0(16), h1(16);
  for (uint8_t b : m.packed) ++h0[b & 15], ++h0[b >> 4];
  for (int64_t i = 0; i < int64_t(kp.size()) / 4; ++i) {
    uint32_t w = 0;
    for (int b = 0; b < 4; ++b) w |= uint32_t(kp[size_t(4 * i + b)]) << (8 * b);
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h)
        ++h1[((w >> (ml::kMagPos[j] + 16 * h)) & 7) | (((w >> (ml::kSignPos[j] + 16 * h)) & 1) << 3)];
  }
  EXPECT_EQ(h0, h1);
}

TEST(MoeLayout, EmulatedKernelMatchesCpuTwin) {
  Rng rng(8);
  struct Case {
    int64_t R, C, T;
    unsigned e_lo, e_hi;
  };
  for (Case c : {Case{16, 64, 1, 118, 122}, Case{64, 128, 5, 118, 122}, Case{32, 256, 8, 100, 140},
                 Case{48, 192, 13, 0, 254}, Case{32, 128, 7, 1, 128}}) {
    Mx m = random_mx(c.R, c.C, rng, c.e_lo, c.e_hi);
    if (c.e_hi >= 253)  // keep |w| finite on the CPU: codes with |v| ≤ 1.5 in those blocks
      for (int64_t r = 0; r < c.R; ++r)
        for (int64_t b = 0; b < c.C / 32; ++b)
          if (m.scale[size_t(r * (c.C / 32) + b)] >= 253)
            for (int64_t j = 0; j < 16; ++j) m.packed[size_t(r * c.C / 2 + b * 16 + j)] &= 0xBB;
    std::vector<float> x = to_f32(rand_bf16(size_t(c.T * c.C), rng, -1.0f, 1.0f));
    const bool special = cuda::mxfp4_special_scales(m.scale.data(), m.scale.size());
    const bool foldable = !cuda::mxfp4_fp32_scales(m.scale.data(), m.scale.size());
    const auto [kp, ks] = pack(m);
    const auto want = cpu_matmul(m, x, c.T);
    const auto bound = cpu_abs_matmul(m, x, c.T);
    for (bool fold : {false, true}) {
      if (fold && !foldable) continue;
      const auto got = emulate_kernel(kp, ks, special, x, c.T, c.R, c.C, fold);
      for (size_t i = 0; i < want.size(); ++i) {
        if (std::isnan(want[i]) || std::isinf(bound[i])) continue;
        ASSERT_LE(std::fabs(got[i] - want[i]), 1e-5 * bound[i] + 1e-38) << "R " << c.R << " C " << c.C << " T " << c.T
                                                                        << " fold " << fold << " at " << i << ": "
                                                                        << got[i] << " vs " << want[i];
      }
    }
  }
}

// The raw decode's claim on the host (moe_t8.cu kScaleRaw): with A as decoded and x·2^100, every MMA's FP32 sum is
// 2^-26 times the FP32-scale kernel's, so after the final 2^26 the outputs are the same bits — for foldable codes
// [1, 128] over x and sums far from subnormal (codes ≥ 100 here); GpuMoe.T8RawDecodeMatchesFp32Scales checks the
// tensor cores do the same.
TEST(MoeLayout, EmulatedRawDecodeMatchesFp32Scales) {
  Rng rng(9);
  for (int64_t T : {1, 5, 8, 13}) {
    Mx m = random_mx(48, 256, rng, 100, 128);
    const std::vector<float> x = to_f32(rand_bf16(size_t(T * 256), rng, -2.0f, 2.0f));
    const auto [kp, ks] = pack(m);
    const auto f32 = emulate_kernel(kp, ks, false, x, T, 48, 256);
    const auto raw = emulate_kernel(kp, ks, false, x, T, 48, 256, false, true);
    for (size_t i = 0; i < f32.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(raw[i]), std::bit_cast<uint32_t>(f32[i])) << "T " << T << " at " << i;
  }
}

// ---- GpuMoe ------------------------------------------------------------------------------------------------
const char* tile_name(cuda::MoeTokenTile t) {
  switch (t) {
    case cuda::MoeTokenTile::t8:
      return "t8";
    case cuda::MoeTokenTile::t32:
      return "t32";
    case cuda::MoeTokenTile::stream:
      return "stream";
    case cuda::MoeTokenTile::wide:
      return "wide";
    case cuda::MoeTokenTile::dense:
      return "dense";
    default:
      return "auto";
  }
}
constexpr cuda::MoeTokenTile kAllTiles[] = {cuda::MoeTokenTile::t8, cuda::MoeTokenTile::t32, cuda::MoeTokenTile::stream,
                                            cuda::MoeTokenTile::wide};

// y = bf16(x·Wᵀ) of mxfp4_matmul_packed vs bf16 of cpu::mxfp4_gemm: per element |Δ| ≤ 2^-7·|ref| (one BF16
// rounding of sums in another order) + 2^-16·Σ|w·x| (FP32 order), NaN exactly where the twin has NaN.
void check_matmul(const std::string& what, const Mx& m, const std::vector<float>& x_in, int64_t T,
                  cuda::MoeTokenTile tile) {
  const bool special = cuda::mxfp4_special_scales(m.scale.data(), m.scale.size());
  const bool fp32 = cuda::mxfp4_fp32_scales(m.scale.data(), m.scale.size());
  const auto [kp, ks] = pack(m);
  std::vector<uint16_t> xb(x_in.size());
  std::vector<float> x(x_in.size());  // the BF16 values both sides see
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_f32(xb[i] = f32_to_bf16(x_in[i]));
  auto dx = upload(xb);
  auto dp = upload(kp);
  auto ds = upload(ks);
  auto dy = poisoned<uint16_t>(size_t(T * m.R));
  auto dws = poisoned<uint8_t>(cuda::mxfp4_matmul_workspace_bytes(T));
  cuda::mxfp4_matmul_packed(dx.p(), dp.p(), ds.p(), special, fp32, T, m.R, m.C, dws.p(), dy.p(), nullptr, tile);
  sync();
  const auto got = dy.get();
  const auto ref = cpu_matmul(m, x, T), bound = cpu_abs_matmul(m, x, T);
  int64_t bad = 0, nan_ref = 0;
  double max_rel = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float g = bf16_to_f32(got[i]), r = round_bf16(ref[i]);
    if (std::isnan(r)) {
      ++nan_ref;
      if (!std::isnan(g) && bad++ < 5) ADD_FAILURE() << what << " at " << i << ": want NaN, got " << g;
      continue;
    }
    const double tol = kBf16Ulp * std::fabs(r) + 0x1p-16 * double(bound[i]);
    const double d = std::fabs(double(g) - double(r));
    if (!(d <= tol)) {
      if (bad++ < 5)
        ADD_FAILURE() << what << " at (" << i / size_t(m.R) << ", " << i % size_t(m.R) << "): got " << g << " want " << r
                      << " (Σ|w·x| " << bound[i] << ")";
    } else if (bound[i] > 0) {
      max_rel = std::max(max_rel, d / double(bound[i]));
    }
  }
  note(fmt::format("{:<28} {:<34} max|Δ|/Σ|wx| {:.2e}, {} NaN rows as the twin, {}", "mxfp4_matmul_packed", what,
                   max_rel, nan_ref, bad ? "FAIL" : "PASS"));
  EXPECT_EQ(bad, 0) << what;
}

TEST(GpuMoe, MatmulEveryCodeAndScale) {
  need_gpu();
  Rng rng(51);
  struct Range {
    unsigned e_lo, e_hi;
    int x_exp;  // |x| ≈ 2^x_exp keeps every output finite and normal
  };
  // [1, 40] and [41, 128] keep the scales foldable (stream and wide kernels, products down to 2^-128);
  // 0 and above 128 send stream/wide to the FP32-scale kernels.
  const Range ranges[] = {{118, 122, 0}, {1, 40, 60}, {41, 128, 0}, {0, 40, 60}, {41, 200, 0}, {201, 254, -80}};
  struct Shape {
    int64_t R, C;
  };
  for (Shape s : {Shape{64, 128}, Shape{128, 3072}}) {
    for (const Range& e : ranges) {
      Mx m = random_mx(s.R, s.C, rng, e.e_lo, e.e_hi);  // random bytes: all 16 codes in every position
      for (int64_t r = 0; r < s.R; ++r)
        for (int64_t b = 0; b < s.C / 32; ++b)
          if (m.scale[size_t(r * (s.C / 32) + b)] >= 253)  // |v|·2^(e−127) must stay finite for the twin
            for (int64_t j = 0; j < 16; ++j) m.packed[size_t(r * s.C / 2 + b * 16 + j)] &= 0xBB;
      for (int64_t T : {1, 7, 8, 9, 40, 130}) {
        std::vector<float> x(size_t(T * s.C));
        for (auto& v : x) v = std::ldexp(rng.uniform(1.0f, 2.0f), e.x_exp - int(rng.next() % 3)) * (rng.next() & 1 ? -1.0f : 1.0f);
        for (auto tile : kAllTiles)
          check_matmul(fmt::format("{}x{} T={} e {}..{} {}", s.R, s.C, T, e.e_lo, e.e_hi, tile_name(tile)), m, x, T,
                       tile);
      }
    }
  }
  // e8m0 255 (NaN) and 0 (2^-127) through the exact scale path: whole rows at 0 with large x, NaN blocks.
  Mx m = random_mx(64, 256, rng, 120, 124);
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t b = 0; b < 8; ++b) m.scale[size_t(r * 8 + b)] = 0;
  m.scale[size_t(20 * 8 + 3)] = 255;
  m.scale[size_t(63 * 8 + 7)] = 255;
  for (int64_t T : {1, 9}) {
    std::vector<float> x(size_t(T * 256));
    for (auto& v : x) v = rng.uniform(-2.0f, 2.0f);
    for (int64_t t = 0; t < T; ++t)  // token 0 large: rows at scale 2^-127 give normal outputs
      if (t == 0)
        for (int64_t k = 0; k < 256; ++k) x[size_t(k)] *= 0x1p100f;
    for (auto tile : kAllTiles)
      check_matmul(fmt::format("64x256 T={} scales 0/255 {}", T, tile_name(tile)), m, x, T, tile);
  }
}

// Experts in the checkpoint layout on the host (for the twin) and packed on the device.
struct Experts {
  int64_t X, Lt, I;
  std::vector<uint8_t> w1p, w1s, w3p, w3s, w2p, w2s;
  std::vector<cpu::ExpertPtrs> cpu;
  std::vector<cuda::DeviceBuffer> bufs;
  cuda::MoeExpertWeights dev{};
};
std::unique_ptr<Experts> make_experts(int64_t X, int64_t Lt, int64_t I, Rng& rng, int s_lo = 118, int s_hi = 122) {
  auto ex = std::make_unique<Experts>();
  Experts& E = *ex;
  E.X = X, E.Lt = Lt, E.I = I;
  const int64_t p13 = I * Lt / 2, s13 = I * Lt / 32, p2 = Lt * I / 2, s2 = Lt * I / 32;
  E.w1p = rand_u8(size_t(X * p13), rng, 0, 255), E.w3p = rand_u8(size_t(X * p13), rng, 0, 255);
  E.w2p = rand_u8(size_t(X * p2), rng, 0, 255);
  // e8m0 scales 2^-9 .. 2^-5: activations stay in SiTU's interesting range.
  E.w1s = rand_u8(size_t(X * s13), rng, s_lo, s_hi), E.w3s = rand_u8(size_t(X * s13), rng, s_lo, s_hi);
  E.w2s = rand_u8(size_t(X * s2), rng, s_lo, s_hi);
  std::vector<cuda::MoeExpertHost> host(static_cast<size_t>(X));
  for (int64_t e = 0; e < X; ++e) {
    const size_t a = size_t(e * p13), b = size_t(e * s13), c = size_t(e * p2), d = size_t(e * s2);
    E.cpu.push_back({{&E.w1p[a], &E.w1s[b]}, {&E.w3p[a], &E.w3s[b]}, {&E.w2p[c], &E.w2s[d]}});
    host[size_t(e)] = {&E.w1p[a], &E.w1s[b], &E.w3p[a], &E.w3s[b], &E.w2p[c], &E.w2s[d]};
  }
  E.dev = cuda::pack_experts_mxfp4(host.data(), X, Lt, I, [&E](size_t n) {
    E.bufs.emplace_back(n);
    return E.bufs.back().data();
  });
  EXPECT_EQ(E.dev.layout, cuda::kMoeExpertLayout);
  EXPECT_EQ(E.dev.special_scales, s_lo == 0 || s_hi == 255);
  EXPECT_EQ(E.dev.fp32_scales, s_lo == 0 || s_hi > 128);
  return ex;
}

enum class Routing { random, ties, skewed };

// K distinct experts per token. random/ties: uniform choice, weights random (ties: all 1/K). skewed: every
// token takes K of the first K+1 experts, except that token 0's last slot is expert X−1, which nobody else
// takes: experts with hundreds of tokens, exactly one, and none.
void make_routing(Routing kind, int64_t T, int64_t X, int64_t K, Rng& rng, std::vector<int32_t>& ids,
                  std::vector<float>& wts) {
  ids.assign(size_t(T * K), 0);
  wts.assign(size_t(T * K), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pool = kind == Routing::skewed ? K + 1 : X;
    std::vector<int32_t> all(static_cast<size_t>(pool));
    std::iota(all.begin(), all.end(), 0);
    for (size_t i = all.size(); i > 1; --i) std::swap(all[i - 1], all[rng.next() % i]);
    if (kind == Routing::skewed && t == 0) all[size_t(K - 1)] = int32_t(X - 1);
    float sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      ids[size_t(t * K + k)] = all[size_t(k)];
      sum += (wts[size_t(t * K + k)] = kind == Routing::ties ? 1.0f : rng.uniform(0.1f, 1.0f));
    }
    for (int64_t k = 0; k < K; ++k) wts[size_t(t * K + k)] /= sum;
  }
}

// One way of running the experts: the GEMM family and the knobs that change how the work is split.
struct MoeVariant {
  cuda::MoeTokenTile tile = cuda::MoeTokenTile::automatic;
  int grouped = -1;    // MoeExpertsOptions::grouped
  int ctas = 0;        // MoeExpertsOptions::stream_ctas
  int pdl = -1;        // MoeExpertsOptions::pdl
  bool lt = false;     // MoeExpertsOptions::lt given (automatic may take the dense path); always for dense
  int ksplit = 0;      // MoeExpertsOptions::t8_ksplit
  int scales = -1;     // MoeExpertsOptions::t8_scales
  int persist = -1;    // MoeExpertsOptions::t8_persist
  int p_ctas = 0;      // MoeExpertsOptions::t8p_ctas
  int p_kh = 0;        // MoeExpertsOptions::t8p_kh (2: no forced persistent split; ksplit is the fixed grid's)
  std::string name() const {
    std::string n = tile_name(tile);
    if (lt && tile != cuda::MoeTokenTile::dense) n += " +cuBLASLt";
    if (grouped == 0) n += " ungrouped";
    if (grouped == 1) n += " grouped";
    if (ctas > 0) n += fmt::format(" {} CTAs", ctas);
    if (pdl == 0) n += " no-PDL";
    if (ksplit > 0) n += fmt::format(" K/{}", ksplit);
    if (scales >= 0) n += scales == 0 ? " fp32-scales" : scales == 1 ? " folded" : " raw w2";
    if (persist == 0) n += " fixed-grid";
    if (persist > 0) n += fmt::format(" persistent{}", persist == 1 ? " w1|w3" : persist == 2 ? " w2" : "");
    if (p_ctas > 0) n += fmt::format(" ≤{} CTAs/SM", p_ctas);
    if (p_kh == 2) n += " K halves";
    return n;
  }
};
cuda::MoeExpertsOptions options(const MoeVariant& v) {
  cuda::MoeExpertsOptions o;
  o.tile = v.tile;
  o.grouped = v.grouped;
  o.stream_ctas = v.ctas;
  o.pdl = v.pdl;
  o.t8_ksplit = v.ksplit;
  o.t8_scales = v.scales;
  o.t8_persist = v.persist;
  o.t8p_ctas = v.p_ctas;
  o.t8p_split = v.persist > 0 ? (v.p_kh == 2 ? 1 : v.ksplit) : 0;
  o.t8p_kh = v.p_kh;
  return o;
}

std::vector<uint16_t> run_gpu_moe(const Experts& E, const std::vector<uint16_t>& z, const std::vector<int32_t>& ids,
                                  const std::vector<float>& wts, int64_t T, int64_t K, const MoeVariant& v) {
  auto dz = upload(z);
  auto dids = upload(ids);
  auto dw = upload(wts);
  auto dws = poisoned<uint8_t>(cuda::moe_experts_workspace_bytes(T, E.X, K, E.Lt, E.I, v.tile));
  auto dut = poisoned<uint16_t>(size_t(T * E.Lt));
  cuda::MoeExpertsOptions o = options(v);
  std::unique_ptr<cuda::GemmLt> lt;
  if (v.lt || v.tile == cuda::MoeTokenTile::dense) lt = std::make_unique<cuda::GemmLt>(), o.lt = lt.get();
  cuda::moe_experts_mxfp4(dz.p(), dids.p(), dw.p(), E.dev, T, E.X, K, E.Lt, E.I, 4.0f, 25.0f, dws.p(), dut.p(), nullptr,
                          o);
  sync();
  return dut.get();
}

void check_moe(const std::string& op, const std::string& shape, const std::vector<uint16_t>& got,
               const std::vector<uint16_t>& ref) {
  double scale = 0;
  for (uint16_t v : ref) scale = std::max(scale, double(std::fabs(bf16_to_f32(v))));
  // Same roundings (g, u, a, y, ũ) as the twin, FP32 sums in another order: a BF16 ulp here and there.
  check_bf16(op, shape, got, ref, {4e-3 * scale, 2 * kBf16Ulp, 5e-3});
}

TEST(GpuMoe, ExpertsMatchCpuTwin) {
  need_gpu();
  Rng rng(52);
  using cuda::MoeTokenTile;
  const MoeVariant autov{}, t8{MoeTokenTile::t8}, t32{MoeTokenTile::t32}, stream{MoeTokenTile::stream},
      wide{MoeTokenTile::wide};
  // Stream-K splits: 1 CTA (4 warps share everything), 3 and 7 CTAs (tiles cut by 2..many warps), ungrouped.
  const MoeVariant s1{MoeTokenTile::stream, -1, 1}, s3{MoeTokenTile::stream, -1, 3}, s7{MoeTokenTile::stream, -1, 7},
      sung{MoeTokenTile::stream, 0}, sgrp{MoeTokenTile::stream, 1}, snopdl{MoeTokenTile::stream, -1, 0, 0},
      wnopdl{MoeTokenTile::wide, -1, 0, 0};
  // Dequantise + cuBLASLt (prefill): forced, and chosen by `automatic` from 256 slots per hit expert.
  const MoeVariant dense{MoeTokenTile::dense}, autolt{MoeTokenTile::automatic, -1, 0, -1, true};
  // t8 with K split over 2, 3, 4 CTAs per tile (automatic picks 2 for w1|w3 and for w2 at real dims, T = 1, on the H200),
  // with and without PDL.
  const MoeVariant k2{MoeTokenTile::t8, -1, 0, -1, false, 2}, k3{MoeTokenTile::t8, -1, 0, -1, false, 3},
      k4{MoeTokenTile::t8, -1, 0, -1, false, 4}, k3nopdl{MoeTokenTile::t8, -1, 0, 0, false, 3};
  // t8 at T = 1 runs ungrouped (one job per slot, ids read before the PDL wait); grouped there, and ungrouped at
  // T > 1 (slots sharing an expert each read it), by hand.
  const MoeVariant t8g{MoeTokenTile::t8, 1}, t8u{MoeTokenTile::t8, 0}, t8gk3{MoeTokenTile::t8, 1, 0, -1, false, 3};
  struct Run {
    int64_t T;
    Routing routing;
    std::vector<MoeVariant> variants;  // all checked against one CPU reference
  };
  struct Case {
    int64_t X, K, Lt, I;
    const char* what;
    std::vector<Run> runs;
    int s_lo = 118, s_hi = 122;  // e8m0 scale codes
  };
  const std::vector<Case> cases = {
      {16, 4, 128, 64, "nano",
       {{1, Routing::random, {autov, sgrp, s1, t8g}},
        {2, Routing::random, {autov, s3, k2, t8u}},
        {7, Routing::random, {autov, sung, s7, snopdl, dense}},
        {64, Routing::random, {autov, stream, s1, s3}},
        {64, Routing::ties, {t32, stream, wide}},
        {300, Routing::skewed, {t8, t32, stream, s7, wide, wnopdl, dense}},
        {4096, Routing::random, {autov, t8, stream, autolt}},
        {4096, Routing::skewed, {autov, wide, s7, dense}}}},
      {8, 2, 3584, 3072, "mini (8 of 112 experts)",
       {{1, Routing::random, {autov, sgrp, s3, autolt}},
        {7, Routing::random, {autov, s7, wide, k3, t8u}},
        {64, Routing::random, {autov, stream, dense}},
        {300, Routing::random, {t8, stream}},
        {300, Routing::skewed, {t32, wide, s3, dense}},
        {1024, Routing::random, {autolt}}}},
      {32, 16, 3584, 3072, "real dims, 32 experts top-16",
       {{1, Routing::random, {autov, sgrp, t8, k2, k4, k3nopdl, t8g, t8gk3}},
        {2, Routing::random, {autov, k3}},
        {16, Routing::ties, {autov, wide, t8, dense, k4}},
        {16, Routing::random, {t32, stream, s7}}}},
      // Scales outside [1, 128] (2^-17 .. 2^3): FP32-scale kernels, and the dense path's dequantisation.
      {16, 4, 128, 64, "nano, wide scales", {{300, Routing::skewed, {autov, t32, dense}}}, 110, 130},
  };
  for (const Case& c : cases) {
    const auto E = make_experts(c.X, c.Lt, c.I, rng, c.s_lo, c.s_hi);
    for (const Run& run : c.runs) {
      const int64_t T = run.T;
      const auto z = rand_bf16(size_t(T * c.Lt), rng, -1.0f, 1.0f);
      std::vector<int32_t> ids;
      std::vector<float> wts;
      make_routing(run.routing, T, c.X, c.K, rng, ids, wts);
      std::vector<uint16_t> ref(size_t(T * c.Lt));
      cpu::moe_experts(z.data(), ids.data(), wts.data(), E->cpu.data(), T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, ref.data());
      const char* rname =
          run.routing == Routing::ties ? "ties" : run.routing == Routing::skewed ? "skewed" : "random";
      for (const MoeVariant& v : run.variants) {
        const auto got = run_gpu_moe(*E, z, ids, wts, T, c.K, v);
        check_moe("moe_experts_mxfp4 (u~)", fmt::format("{} T={} K={} {} {}", c.what, T, c.K, rname, v.name()), got,
                  ref);
      }
    }
  }
}

// The latent norm in the combine launch (MoeExpertsOptions::norm_w, model/cuda/moe.cpp): ũ bit-identical to the
// unfused launch, the normalised rows bit-identical to rmsnorm_bf16 on that ũ (the fused kernel keeps
// rmsnorm_kernel's thread ownership and order), and within the twin's tolerance of the CPU norm of the twin's ũ.
// Cases: one and many rows, Lt with fewer and more 8-vectors than threads, an out-of-range id, the dense path.
TEST(GpuMoe, CombineWithLatentNormMatchesSeparateNorm) {
  need_gpu();
  Rng rng(57);
  using cuda::MoeTokenTile;
  struct Case {
    int64_t X, K, Lt, I, T;
    MoeVariant v;
    bool bad_id;
  };
  const std::vector<Case> cases = {{16, 4, 128, 64, 1, {}, false},
                                   {16, 4, 128, 64, 7, {}, true},
                                   {16, 4, 128, 64, 300, {MoeTokenTile::dense}, false},
                                   {8, 2, 3584, 3072, 1, {}, false},
                                   {8, 2, 3584, 3072, 16, {}, true},
                                   {32, 16, 4608, 64, 3, {MoeTokenTile::t8}, false}};
  for (const Case& c : cases) {
    const auto E = make_experts(c.X, c.Lt, c.I, rng);
    const auto z = rand_bf16(size_t(c.T * c.Lt), rng, -1.0f, 1.0f);
    std::vector<int32_t> ids;
    std::vector<float> wts;
    make_routing(Routing::random, c.T, c.X, c.K, rng, ids, wts);
    std::vector<int32_t> gids = ids;
    if (c.bad_id) gids[1] = -1, wts[1] = 0.0f;  // adds nothing on the GPU; weight 0 for the twin
    const auto nw = rand_bf16(size_t(c.Lt), rng, 0.5f, 1.5f);
    const float eps = 1e-6f;
    auto dz = upload(z);
    auto dids = upload(gids);
    auto dw = upload(wts);
    auto dnw = upload(nw);
    auto dws = poisoned<uint8_t>(cuda::moe_experts_workspace_bytes(c.T, c.X, c.K, c.Lt, c.I, c.v.tile));
    auto dut = poisoned<uint16_t>(size_t(c.T * c.Lt));
    auto dut2 = poisoned<uint16_t>(size_t(c.T * c.Lt));
    auto dn = poisoned<uint16_t>(size_t(c.T * c.Lt));
    auto dn2 = poisoned<uint16_t>(size_t(c.T * c.Lt));
    std::unique_ptr<cuda::GemmLt> lt;
    cuda::MoeExpertsOptions o = options(c.v);
    o.combine_cluster = 0;  // the one-CTA kernel keeps rmsnorm_kernel's order (the cluster's: the test below)
    if (c.v.tile == MoeTokenTile::dense) lt = std::make_unique<cuda::GemmLt>(), o.lt = lt.get();
    cuda::moe_experts_mxfp4(dz.p(), dids.p(), dw.p(), E->dev, c.T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, dws.p(), dut.p(),
                            nullptr, o);
    cuda::rmsnorm_bf16(dut.p(), c.Lt, dnw.p(), dn.p(), c.Lt, c.T, c.Lt, eps, nullptr);
    o.norm_w = dnw.p(), o.norm_eps = eps, o.normed = dn2.p();
    cuda::moe_experts_mxfp4(dz.p(), dids.p(), dw.p(), E->dev, c.T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, dws.p(), dut2.p(),
                            nullptr, o);
    // The normed rows into the left part of wider rows (MoeExpertsOptions::normed_ld: the GPU model's stacked
    // out-projection input): the same values, the padding columns never written.
    const int64_t ldn = c.Lt + 64;
    auto dn3 = poisoned<uint16_t>(size_t(c.T * ldn));
    o.normed = dn3.p(), o.normed_ld = ldn;
    cuda::moe_experts_mxfp4(dz.p(), dids.p(), dw.p(), E->dev, c.T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, dws.p(), dut2.p(),
                            nullptr, o);
    sync();
    const std::string shape = fmt::format("X={} K={} Lt={} T={} {}{}", c.X, c.K, c.Lt, c.T, c.v.name(),
                                          c.bad_id ? " bad id" : "");
    const auto ut = dut.get(), ut2 = dut2.get(), n1 = dn.get(), n2 = dn2.get(), n3 = dn3.get();
    EXPECT_EQ(0, std::memcmp(ut.data(), ut2.data(), ut.size() * 2)) << "u~ differs with the fused norm: " << shape;
    EXPECT_EQ(0, std::memcmp(n1.data(), n2.data(), n1.size() * 2)) << "fused norm != rmsnorm_bf16: " << shape;
    const uint16_t poison = 0xFFFF;  // poisoned()'s bytes
    for (int64_t t = 0; t < c.T; ++t) {
      EXPECT_EQ(0, std::memcmp(n1.data() + t * c.Lt, n3.data() + t * ldn, size_t(c.Lt) * 2))
          << "row " << t << " with normed_ld " << ldn << ": " << shape;
      for (int64_t j = c.Lt; j < ldn; ++j)
        ASSERT_EQ(n3[size_t(t * ldn + j)], poison) << "padding written at row " << t << ": " << shape;
    }
    std::vector<uint16_t> ref(size_t(c.T * c.Lt)), nref(ref.size());
    cpu::moe_experts(z.data(), ids.data(), wts.data(), E->cpu.data(), c.T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, ref.data());
    cpu::rmsnorm_bf16(ref.data(), nw.data(), nref.data(), c.T, c.Lt, eps);
    check_moe("moe_experts_mxfp4 + latent norm", shape, n2, nref);
  }
}

// The combine + norm over a thread-block cluster (MoeExpertsOptions::combine_cluster = 1, moe_combine.cu) against the
// one-CTA kernel (0), with PDL between the launches as the engine runs them: ũ bit-identical, normed (into rows wider
// than Lt) within 2 BF16 steps of it — the order of its FP32 Σx², moe_combine.cu's bound — and bit-identical where
// the cluster is one CTA (nano's Lt = 128), both within that bound of cpu::rmsnorm_bf16 on ũ and within the twin's
// tolerance of the CPU norm of the twin's ũ. Cases: nano and the mini's Lt = 3584 (7 CTAs), top-1/2/4/8/16 (16:
// batches of 8), T = 1, 3, 64 (the bound), and 65 (past it: both options run the one-CTA kernel), an id outside the
// rank, the padding of the wider rows never written.
TEST(GpuMoe, CombineClusterMatchesOneCta) {
  need_gpu();
  Rng rng(58);
  struct Case {
    int64_t X, K, Lt, I, T;
    bool bad_id;
  };
  const std::vector<Case> cases = {{16, 4, 128, 64, 1, false},   {16, 4, 128, 64, 64, true},  {16, 16, 128, 64, 3, true},
                                   {8, 2, 3584, 3072, 1, false}, {8, 2, 3584, 3072, 3, true}, {8, 1, 3584, 64, 64, true},
                                   {16, 8, 3584, 64, 64, false}, {32, 16, 3584, 64, 3, true}, {8, 2, 3584, 64, 65, false}};
  auto steps = [](uint16_t a, uint16_t b) {  // BF16 steps apart on the ordered line (−0 = +0)
    auto ord = [](uint16_t v) { return v & 0x8000u ? -int(v & 0x7FFFu) : int(v); };
    return std::abs(ord(a) - ord(b));
  };
  for (const Case& c : cases) {
    const auto E = make_experts(c.X, c.Lt, c.I, rng);
    const auto z = rand_bf16(size_t(c.T * c.Lt), rng, -1.0f, 1.0f);
    std::vector<int32_t> ids;
    std::vector<float> wts;
    make_routing(Routing::random, c.T, c.X, c.K, rng, ids, wts);
    std::vector<int32_t> gids = ids;
    if (c.bad_id) gids[1] = -1, wts[1] = 0.0f;  // adds nothing on the GPU; weight 0 for the twin
    const auto nw = rand_bf16(size_t(c.Lt), rng, 0.5f, 1.5f);
    const float eps = 1e-6f;
    const int64_t ldn = c.Lt + 64;
    auto dz = upload(z);
    auto dids = upload(gids);
    auto dw = upload(wts);
    auto dnw = upload(nw);
    auto dws = poisoned<uint8_t>(cuda::moe_experts_workspace_bytes(c.T, c.X, c.K, c.Lt, c.I));
    cudaStream_t st;  // PDL needs a stream other than the legacy default one
    KCUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    std::vector<uint16_t> ut[2], normed[2];
    for (int cl = 0; cl < 2; ++cl) {
      auto dut = poisoned<uint16_t>(size_t(c.T * c.Lt));
      auto dn = poisoned<uint16_t>(size_t(c.T * ldn));
      cuda::MoeExpertsOptions o;
      o.pdl = 1, o.combine_cluster = cl;
      o.norm_w = dnw.p(), o.norm_eps = eps, o.normed = dn.p(), o.normed_ld = ldn;
      cuda::moe_experts_mxfp4(dz.p(), dids.p(), dw.p(), E->dev, c.T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, dws.p(), dut.p(),
                              st, o);
      KCUDA_CHECK(cudaStreamSynchronize(st));
      ut[cl] = dut.get(), normed[cl] = dn.get();
    }
    KCUDA_CHECK(cudaStreamDestroy(st));
    const std::string shape =
        fmt::format("X={} K={} Lt={} T={}{}", c.X, c.K, c.Lt, c.T, c.bad_id ? " bad id" : "");
    EXPECT_EQ(0, std::memcmp(ut[0].data(), ut[1].data(), ut[0].size() * 2)) << "u~ differs on the cluster: " << shape;
    std::vector<uint16_t> rows[2];  // the Lt left columns of each normed row
    const uint16_t poison = 0xFFFF;  // poisoned()'s bytes
    for (int cl = 0; cl < 2; ++cl)
      for (int64_t t = 0; t < c.T; ++t) {
        rows[cl].insert(rows[cl].end(), normed[cl].begin() + t * ldn, normed[cl].begin() + t * ldn + c.Lt);
        for (int64_t j = c.Lt; j < ldn; ++j)
          ASSERT_EQ(normed[cl][size_t(t * ldn + j)], poison) << "padding written at row " << t << ": " << shape;
      }
    std::vector<uint16_t> own(rows[0].size());
    cpu::rmsnorm_bf16(ut[1].data(), nw.data(), own.data(), c.T, c.Lt, eps);
    size_t differ = 0, far = 0, far_cpu = 0;
    for (size_t i = 0; i < rows[0].size(); ++i) {
      const bool finite = std::isfinite(bf16_to_f32(rows[1][i])) && std::isfinite(bf16_to_f32(rows[0][i]));
      differ += rows[0][i] != rows[1][i];
      far += !finite || steps(rows[0][i], rows[1][i]) > 2;
      far_cpu += !finite || steps(rows[1][i], own[i]) > 2 || steps(rows[0][i], own[i]) > 2;
    }
    EXPECT_EQ(far, 0u) << "normed: cluster more than 2 BF16 steps from the one-CTA kernel: " << shape;
    EXPECT_EQ(far_cpu, 0u) << "normed more than 2 BF16 steps from cpu::rmsnorm_bf16 of its u~: " << shape;
    if (c.Lt <= 512 || c.T > 64) {  // a cluster of one CTA (its Σx² in the same order), or the one-CTA kernel twice
      EXPECT_EQ(differ, 0u) << "normed: the same Σx² order should give the same bits: " << shape;
    }
    std::vector<uint16_t> ref(size_t(c.T * c.Lt)), nref(ref.size());
    cpu::moe_experts(z.data(), ids.data(), wts.data(), E->cpu.data(), c.T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, ref.data());
    cpu::rmsnorm_bf16(ref.data(), nw.data(), nref.data(), c.T, c.Lt, eps);
    check_moe("moe_experts_mxfp4 + latent norm on a cluster", shape, rows[1], nref);
  }
}

// Slots with an id outside [0, X) add nothing: the same as a valid id with weight 0 on the CPU.
TEST(GpuMoe, ExpertsOutOfRangeIdsAddNothing) {
  need_gpu();
  Rng rng(53);
  const int64_t X = 16, K = 4, Lt = 128, I = 64;
  const auto E = make_experts(X, Lt, I, rng);
  using cuda::MoeTokenTile;
  for (int64_t T : {9, 1}) {
    const auto z = rand_bf16(size_t(T * Lt), rng, -1.0f, 1.0f);
    std::vector<int32_t> ids;
    std::vector<float> wts;
    make_routing(Routing::random, T, X, K, rng, ids, wts);
    std::vector<int32_t> gids = ids;
    std::vector<size_t> bad = T == 1 ? std::vector<size_t>{1, 3} : std::vector<size_t>{1, 6, 35};
    const int32_t bad_ids[] = {-1, int32_t(X), 1 << 30};
    for (size_t b = 0; b < bad.size(); ++b) gids[bad[b]] = bad_ids[b];
    for (size_t i : bad) {
      wts[i] = 0.0f;
      // The twin needs a valid id that the token does not already use.
      for (int32_t e = 0; e < X; ++e) {
        const int64_t t = int64_t(i) / K;
        if (std::find(ids.begin() + t * K, ids.begin() + (t + 1) * K, e) == ids.begin() + (t + 1) * K) {
          ids[i] = e;
          break;
        }
      }
    }
    std::vector<uint16_t> ref(size_t(T * Lt));
    cpu::moe_experts(z.data(), ids.data(), wts.data(), E->cpu.data(), T, X, K, Lt, I, 4.0f, 25.0f, ref.data());
    for (const MoeVariant& v : {MoeVariant{}, MoeVariant{MoeTokenTile::stream, 0}, MoeVariant{MoeTokenTile::stream, 1, 3},
                             MoeVariant{MoeTokenTile::wide}, MoeVariant{MoeTokenTile::t8}}) {
      const auto got = run_gpu_moe(*E, z, gids, wts, T, K, v);
      check_moe("moe_experts_mxfp4 (bad ids)", fmt::format("nano T={} K=4 {}", T, v.name()), got, ref);
    }
  }
}

// Expert parallelism (model/cuda/moe.cpp): a rank packs only its experts [lo, lo + X/N), maps the global ids
// with moe_local_ids (others → −1) and runs the kernels over X/N experts; its ũ must be the twin's over all X
// experts with the other ranks' slots weighted 0. N = 8 leaves 2 experts per rank for K = 4 (K > X locally).
TEST(GpuMoe, ExpertParallelRankComputesItsExpertsOnly) {
  need_gpu();
  Rng rng(54);
  const int64_t X = 16, K = 4, Lt = 128, I = 64;
  const auto E = make_experts(X, Lt, I, rng);
  const int64_t p13 = I * Lt / 2, s13 = I * Lt / 32, p2 = Lt * I / 2, s2 = Lt * I / 32;
  using cuda::MoeTokenTile;
  for (int N : {2, 8}) {
    const int64_t Xe = X / N;
    for (int r : {0, N - 1}) {
      const int64_t lo = r * Xe;
      std::vector<cuda::MoeExpertHost> host;
      for (int64_t e = lo; e < lo + Xe; ++e)
        host.push_back({&E->w1p[size_t(e * p13)], &E->w1s[size_t(e * s13)], &E->w3p[size_t(e * p13)],
                        &E->w3s[size_t(e * s13)], &E->w2p[size_t(e * p2)], &E->w2s[size_t(e * s2)]});
      Experts mine;
      mine.X = Xe, mine.Lt = Lt, mine.I = I;
      mine.dev = cuda::pack_experts_mxfp4(host.data(), Xe, Lt, I, [&mine](size_t n) {
        mine.bufs.emplace_back(n);
        return mine.bufs.back().data();
      });
      for (int64_t T : {1, 9}) {
        const auto z = rand_bf16(size_t(T * Lt), rng, -1.0f, 1.0f);
        std::vector<int32_t> ids;
        std::vector<float> wts;
        make_routing(Routing::random, T, X, K, rng, ids, wts);
        // The local ids, on the device from the global ones.
        auto dids = upload(ids);
        auto dlocal = poisoned<int32_t>(ids.size());
        cuda::moe_local_ids(dids.p(), int64_t(ids.size()), lo, Xe, dlocal.p(), nullptr);
        sync();
        const std::vector<int32_t> local = dlocal.get();
        std::vector<float> ref_w = wts;
        for (size_t i = 0; i < ids.size(); ++i) {
          const bool own = ids[i] >= lo && ids[i] < lo + Xe;
          EXPECT_EQ(local[i], own ? ids[i] - lo : -1) << "N=" << N << " rank " << r << " slot " << i;
          if (!own) ref_w[i] = 0.0f;
        }
        std::vector<uint16_t> ref(size_t(T * Lt));
        cpu::moe_experts(z.data(), ids.data(), ref_w.data(), E->cpu.data(), T, X, K, Lt, I, 4.0f, 25.0f, ref.data());
        for (const MoeVariant& v : {MoeVariant{}, MoeVariant{MoeTokenTile::stream, 0}, MoeVariant{MoeTokenTile::stream, 1, 3},
                                 MoeVariant{MoeTokenTile::wide}, MoeVariant{MoeTokenTile::t8}}) {
          const auto got = run_gpu_moe(mine, z, local, wts, T, K, v);
          check_moe("moe_experts_mxfp4 (one EP rank)",
                    fmt::format("nano EP{} rank {} T={} K=4 {}", N, r, T, v.name()), got, ref);
        }
      }
    }
  }
}

// The four launches capture into a CUDA graph (no host reads, PDL edges included); replays follow new routing in
// the same buffers (the decode GEMMs' counters are zeroed again by every replay).
TEST(GpuMoe, ExpertsGraphReplay) {
  need_gpu();
  Rng rng(54);
  const int64_t X = 16, K = 4, Lt = 128, I = 64;
  const auto E = make_experts(X, Lt, I, rng);
  using cuda::MoeTokenTile;
  const std::pair<int64_t, MoeVariant> runs[] = {{33, MoeVariant{}},  // stream, grouped
                                              {33, MoeVariant{MoeTokenTile::wide}},
                                              {64, MoeVariant{}},  // wide (16 slots per expert)
                                              {33, MoeVariant{MoeTokenTile::stream, -1, 3}},
                                              {1, MoeVariant{}},  // t8, ungrouped (T = 1)
                                              {1, MoeVariant{MoeTokenTile::stream}},  // stream, ungrouped
                                              {2, MoeVariant{MoeTokenTile::stream, 1}},
                                              {5, MoeVariant{MoeTokenTile::t8, -1, 0, -1, false, 2}}};
  for (const auto& [T, v] : runs) {
    auto dz = poisoned<uint16_t>(size_t(T * Lt));
    auto dids = poisoned<int32_t>(size_t(T * K));
    auto dw = poisoned<float>(size_t(T * K));
    auto dws = poisoned<uint8_t>(cuda::moe_experts_workspace_bytes(T, X, K, Lt, I));
    auto dut = poisoned<uint16_t>(size_t(T * Lt));
    cudaStream_t stream;
    KCUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KCUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    cuda::moe_experts_mxfp4(dz.p(), dids.p(), dw.p(), E->dev, T, X, K, Lt, I, 4.0f, 25.0f, dws.p(), dut.p(), stream,
                            options(v));
    KCUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    KCUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      const auto z = rand_bf16(size_t(T * Lt), rng, -1.0f, 1.0f);
      std::vector<int32_t> ids;
      std::vector<float> wts;
      make_routing(rep == 1 ? Routing::skewed : Routing::random, T, X, K, rng, ids, wts);
      dz.buf.copy_from_host(z.data(), z.size() * 2);
      dids.buf.copy_from_host(ids.data(), ids.size() * 4);
      dw.buf.copy_from_host(wts.data(), wts.size() * 4);
      sync();  // the copies ran on the legacy stream; the graph runs on a non-blocking one
      KCUDA_CHECK(cudaGraphLaunch(exec, stream));
      KCUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<uint16_t> ref(size_t(T * Lt));
      cpu::moe_experts(z.data(), ids.data(), wts.data(), E->cpu.data(), T, X, K, Lt, I, 4.0f, 25.0f, ref.data());
      check_moe("moe_experts_mxfp4 (graph)", fmt::format("nano T={} {} replay {}", T, v.name(), rep), dut.get(), ref);
    }
    KCUDA_CHECK(cudaGraphExecDestroy(exec));
    KCUDA_CHECK(cudaGraphDestroy(graph));
    KCUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// The K-split t8 kernel sums its splits' partials in split order, whichever CTA finishes last: the same bits
// on every run (real dims, T = 1: the split the engine's batch-1 decode takes).
TEST(GpuMoe, T8KSplitIsDeterministic) {
  need_gpu();
  Rng rng(55);
  const int64_t X = 32, K = 16, Lt = 3584, I = 3072, T = 1;
  const auto E = make_experts(X, Lt, I, rng);
  const auto z = rand_bf16(size_t(T * Lt), rng, -1.0f, 1.0f);
  std::vector<int32_t> ids;
  std::vector<float> wts;
  make_routing(Routing::random, T, X, K, rng, ids, wts);
  for (int ks : {0, 3}) {
    const MoeVariant v{cuda::MoeTokenTile::t8, -1, 0, -1, false, ks};
    const auto first = run_gpu_moe(*E, z, ids, wts, T, K, v);
    for (int rep = 0; rep < 4; ++rep)
      EXPECT_EQ(run_gpu_moe(*E, z, ids, wts, T, K, v), first) << v.name() << " run " << rep + 1;
  }
}

// w1|w3 → w2 with h·2^100 and w2's raw decode (moe_t8.cu kScaleFoldH / kScaleRaw): every FP32 partial of w2 is
// exactly 2^-26 times the FP32-scale kernel's (powers of two commute with the rounding while nothing is
// subnormal), so the output must be bit-identical to t8_scales = 1 (w1|w3 folded, w2 FP32 scales), whatever the
// batch (ungrouped T = 1, grouped), the K split and PDL — and within the twin's tolerance. Scale codes up to the
// fold's 128; below ~2^-100 (codes under ~30) w2's raw sums would turn subnormal 2^26 sooner than the FP32-scale
// kernel's: outputs that small differ (both are ≈ 0), so those codes are not asked to match here.
TEST(GpuMoe, T8RawDecodeMatchesFp32Scales) {
  need_gpu();
  Rng rng(59);
  struct Case {
    int64_t X, K, Lt, I, T;
    int s_lo, s_hi;
  };
  for (const Case c : {Case{16, 4, 256, 128, 1, 100, 128}, Case{16, 4, 256, 128, 7, 100, 128},
                       Case{64, 8, 512, 256, 40, 100, 128}, Case{32, 16, 3584, 3072, 1, 116, 124},
                       Case{32, 16, 3584, 3072, 8, 116, 124}}) {
    const auto E = make_experts(c.X, c.Lt, c.I, rng, c.s_lo, c.s_hi);
    const auto z = rand_bf16(size_t(c.T * c.Lt), rng, -2.0f, 2.0f);
    std::vector<int32_t> ids;
    std::vector<float> wts;
    make_routing(Routing::random, c.T, c.X, c.K, rng, ids, wts);
    std::vector<uint16_t> ref(size_t(c.T * c.Lt));
    cpu::moe_experts(z.data(), ids.data(), wts.data(), E->cpu.data(), c.T, c.X, c.K, c.Lt, c.I, 4.0f, 25.0f, ref.data());
    const std::string shape = fmt::format("X={} K={} Lt={} I={} T={} codes {}..{}", c.X, c.K, c.Lt, c.I, c.T, c.s_lo, c.s_hi);
    for (int ks : {0, 1, 3}) {
      for (int pdl : {-1, 0}) {
        const MoeVariant fold{cuda::MoeTokenTile::t8, -1, 0, pdl, false, ks, 1};
        MoeVariant raw = fold;
        raw.scales = 2;
        const auto want = run_gpu_moe(*E, z, ids, wts, c.T, c.K, fold);
        const auto got = run_gpu_moe(*E, z, ids, wts, c.T, c.K, raw);
        EXPECT_EQ(got, want) << shape << " " << raw.name();
        check_moe("moe_experts_mxfp4 " + raw.name(), shape, got, ref);
      }
    }
  }
}

// The persistent t8 (moe_t8p.cu; one token, ungrouped): the same tiles and sums as the fixed-grid t8, so for
// the same K split its output must be bit-identical — whichever GEMMs run persistent, however many units each
// CTA takes (t8p_ctas: 1 CTA per SM gives every CTA many units, each loaded while the last one finishes), with
// ids outside [0, X) (expert parallelism: compacted away) — and within the twin's tolerance. Forced splits (the
// persistent kernel's default is none) that divide both GEMMs' chunks; split 0: each path's own choice.
// One token for the test below: random experts and routing, `bad` of the GPU's ids (slots 5b mod K) set
// outside [0, X) with weight 0, and the twin's ũ — the twin takes only valid, distinct ids, so where the GPU's
// id is outside, the twin's is an expert neither list uses (adding 0 · y); every slot outside: ũ = 0.
struct OneToken {
  std::unique_ptr<Experts> E;
  std::vector<uint16_t> z, ref;
  std::vector<int32_t> gids;  // the GPU's ids
  std::vector<float> wts;
  std::string shape;
};
OneToken one_token(int64_t X, int64_t K, int64_t Lt, int64_t I, int bad, Rng& rng) {
  OneToken o;
  o.E = make_experts(X, Lt, I, rng);
  o.z = rand_bf16(size_t(Lt), rng, -1.0f, 1.0f);
  std::vector<int32_t> ids;
  make_routing(Routing::random, 1, X, K, rng, ids, o.wts);
  o.gids = ids;
  for (int b = 0; b < bad; ++b) {
    const size_t i = size_t((b * 5) % K);
    o.gids[i] = int32_t(X + b);
    o.wts[i] = 0.0f;
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (o.gids[i] == ids[i]) continue;
    for (int32_t e = 0; e < X; ++e) {
      const bool unused = std::find(o.gids.begin(), o.gids.end(), e) == o.gids.end() &&
                          std::find(ids.begin(), ids.end(), e) == ids.end();
      if (unused) {
        ids[i] = e;
        break;
      }
    }
  }
  o.ref.assign(size_t(Lt), 0);
  if (bad < K)
    cpu::moe_experts(o.z.data(), ids.data(), o.wts.data(), o.E->cpu.data(), 1, X, K, Lt, I, 4.0f, 25.0f, o.ref.data());
  o.shape = fmt::format("X={} K={} Lt={} I={} T=1, {} ids outside", X, K, Lt, I, bad);
  return o;
}

TEST(GpuMoe, T8PersistentMatchesFixedGrid) {
  need_gpu();
  Rng rng(61);
  struct Case {
    int64_t X, K, Lt, I;
    int bad;                // ids set outside [0, X)
    std::vector<int> kss;   // K splits both paths can take (the fixed grid's FP32 partials must fit its scratch)
  };
  for (const Case& c : {Case{16, 4, 256, 256, 0, {0, 1, 2}}, Case{4, 2, 3584, 3072, 0, {0, 1, 2, 4, 8}},
                        Case{32, 16, 3584, 3072, 0, {0, 1, 2}}, Case{32, 16, 3584, 3072, 13, {0, 1, 2}},
                        Case{16, 16, 512, 768, 16, {0, 1}}}) {
    const int64_t T = 1;
    const OneToken o = one_token(c.X, c.K, c.Lt, c.I, c.bad, rng);
    for (int ks : c.kss) {
      MoeVariant fixed{cuda::MoeTokenTile::t8, -1, 0, -1, false, ks};
      fixed.persist = 0;
      const auto want = run_gpu_moe(*o.E, o.z, o.gids, o.wts, T, c.K, fixed);
      check_moe("moe_experts_mxfp4 " + fixed.name(), o.shape, want, o.ref);
      for (int persist : {1, 2, 3}) {
        for (int p_ctas : {0, 1}) {
          // K halves in a CTA (no persistent split) sum as the fixed grid's split 2 does: compared there.
          for (int kh : ks == 2 ? std::vector<int>{1, 2} : std::vector<int>{1}) {
            MoeVariant v = fixed;
            v.persist = persist, v.p_ctas = p_ctas, v.p_kh = kh;
            const auto got = run_gpu_moe(*o.E, o.z, o.gids, o.wts, T, c.K, v);
            if (ks > 0) {
              EXPECT_EQ(got, want) << o.shape << " " << v.name();
            }
            check_moe("moe_experts_mxfp4 " + v.name(), o.shape, got, o.ref);
          }
        }
      }
    }
  }
}

// Ungrouped t8 at T = 1 under PDL (GemmArgs::ready): w2's CTAs start during w1|w3's last wave and each waits for
// its own slot's tiles. On a non-blocking stream (PDL on; the tests above run on the legacy stream, where it is
// off), eager and in a CUDA graph, with the inputs changed every run and the workspace set to NaN before each
// PDL run (so a w2 or combine that read early would read NaN): every run bit-identical to the same inputs
// without PDL (w2 after w1|w3 has finished). Real dims; one id outside [0, X) (expert parallelism) in half the runs.
TEST(GpuMoe, T8ReadinessUnderPdlMatchesSerial) {
  need_gpu();
  Rng rng(58);
  const int64_t X = 32, K = 16, Lt = 3584, I = 3072, T = 1;
  const auto E = make_experts(X, Lt, I, rng);
  auto dz = poisoned<uint16_t>(size_t(T * Lt));
  auto dids = poisoned<int32_t>(size_t(T * K));
  auto dw = poisoned<float>(size_t(T * K));
  auto dws = poisoned<uint8_t>(cuda::moe_experts_workspace_bytes(T, X, K, Lt, I));
  auto dut = poisoned<uint16_t>(size_t(T * Lt));
  auto dnormed = poisoned<uint16_t>(size_t(T * Lt));
  auto dnw = upload(rand_bf16(size_t(Lt), rng, 0.5f, 1.5f));
  cudaStream_t stream;
  KCUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const int persist : {0, 1, 3}) {
    SCOPED_TRACE(persist == 0 ? "fixed-grid t8" : persist == 1 ? "persistent w1|w3 (the default)" : "both persistent");
    cuda::MoeExpertsOptions o;  // automatic: t8 ungrouped at T = 1; the combine with the latent norm (the engine's)
    o.norm_w = dnw.p(), o.norm_eps = 1e-6f, o.normed = dnormed.p();
    o.t8_persist = persist;
    auto run = [&] {
      cuda::moe_experts_mxfp4(dz.p(), dids.p(), dw.p(), E->dev, T, X, K, Lt, I, 4.0f, 25.0f, dws.p(), dut.p(), stream, o);
    };
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KCUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    run();
    KCUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    KCUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 12; ++rep) {
      const auto z = rand_bf16(size_t(T * Lt), rng, -1.0f, 1.0f);
      std::vector<int32_t> ids;
      std::vector<float> wts;
      make_routing(Routing::random, T, X, K, rng, ids, wts);
      if (rep % 2) ids[size_t(rep % K)] = int32_t(X + 3);
      dz.buf.copy_from_host(z.data(), z.size() * 2);
      dids.buf.copy_from_host(ids.data(), ids.size() * 4);
      dw.buf.copy_from_host(wts.data(), wts.size() * 4);
      sync();
      o.pdl = 0;
      run();
      KCUDA_CHECK(cudaStreamSynchronize(stream));
      const auto serial = dut.get(), serial_normed = dnormed.get();
      // NaN over the workspace (activations, y): a w2 reading before its slot is ready would not find the right
      // values left by the serial run. The counters are zeroed by the experts' own first kernel.
      KCUDA_CHECK(cudaMemsetAsync(dws.p(), 0xff, cuda::moe_experts_workspace_bytes(T, X, K, Lt, I), stream));
      o.pdl = -1;
      if (rep % 3 == 2)
        KCUDA_CHECK(cudaGraphLaunch(exec, stream));
      else
        run();
      KCUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_EQ(dut.get(), serial) << "run " << rep << (rep % 3 == 2 ? " (graph)" : " (eager)");
      EXPECT_EQ(dnormed.get(), serial_normed) << "normed, run " << rep;
      if (rep == 0) {  // and the serial run itself against the CPU twin
        std::vector<uint16_t> ref(size_t(T * Lt));
        cpu::moe_experts(z.data(), ids.data(), wts.data(), E->cpu.data(), T, X, K, Lt, I, 4.0f, 25.0f, ref.data());
        check_moe("moe_experts_mxfp4 (PDL, readiness)", "real dims T=1", serial, ref);
      }
    }
    KCUDA_CHECK(cudaGraphExecDestroy(exec));
    KCUDA_CHECK(cudaGraphDestroy(graph));
  }
  KCUDA_CHECK(cudaStreamDestroy(stream));
}

// Weights not packed for the kernels are refused with an error, not computed with.
TEST(GpuMoe, UnpackedWeightsRejected) {
  need_gpu();
  auto buf = poisoned<uint8_t>(1 << 16);
  cuda::MoeExpertWeights w{buf.p(), buf.p(), buf.p(), buf.p(), buf.p(), buf.p(), 64 * 128 / 2, 64 * 128 / 32,
                           64 * 128 / 2, 64 * 128 / 32};
  EXPECT_THROW(cuda::moe_experts_mxfp4(reinterpret_cast<uint16_t*>(buf.p()), reinterpret_cast<int32_t*>(buf.p()),
                                       reinterpret_cast<float*>(buf.p()), w, 1, 1, 1, 128, 64, 4.0f, 25.0f, buf.p(),
                                       reinterpret_cast<uint16_t*>(buf.p()), nullptr),
               std::exception);
}

}  // namespace
}  // namespace kestrel::gputest
