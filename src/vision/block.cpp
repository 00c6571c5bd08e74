// One MoonViT-V2 encoder block (MODEL.md §6), pre-norm, on the stacked patches of all images:
//   h = RMSNorm0(x);  q, k, v = split(Lin(wqkv)(h)) as [3, Hv, dv];  q, k = RoPE2D(q), RoPE2D(k)
//   x = x + Lin(wo)(Attn(q, k, v))            full (non-causal) attention within each image, scale dv^−½
//   x = x + Lin(fc1)(gelu_tanh(Lin(fc0)(RMSNorm1(x))))
// The linear layers run once over all images' rows; attention per image and head (varlen).
//
// 2-D RoPE (§6): a head's dv values are dv/2 complex pairs of adjacent elements (x[2j], x[2j+1]); with
// f_i = 10000^(−4i/dv), i = 0..dv/4−1, pair 2i turns by col·f_i (width index) and pair 2i+1 by row·f_i.
// Angles in FP64, rotation in FP32, rounded to BF16 (the reference: k3ref/vision.py).
//
// Numerics: attention scores, softmax and the weighted sum of values in FP32, the output rounded once
// to BF16; GELU(tanh) in FP32, rounded once. The CPU attention is the plain O(N²) loop per query row
// (threaded over heads × rows): this is the reference-precision path, not a fast one.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "vision/layers.h"

namespace kestrel::vision {

void rope_2d(uint16_t* x, int64_t ld, int grid_h, int grid_w, int heads, int head_dim) {
  KCHECK(head_dim % 4 == 0, "vision head_dim {} must be a multiple of 4 for 2-D RoPE", head_dim);
  const int pairs = head_dim / 2;
  const int64_t N = int64_t(grid_h) * grid_w;
  cpu::parallel_for(N, N * heads * head_dim * 8, [&](int64_t b, int64_t e) {
    std::vector<float> cs(static_cast<size_t>(pairs)), sn(static_cast<size_t>(pairs));
    for (int64_t t = b; t < e; ++t) {
      const double row = double(t / grid_w), col = double(t % grid_w);
      for (int j = 0; j < pairs; ++j) {
        const int i = j / 2;
        const double f = std::pow(10000.0, -4.0 * i / head_dim);
        const double ang = (j % 2 == 0 ? col : row) * f;
        cs[size_t(j)] = float(std::cos(ang));
        sn[size_t(j)] = float(std::sin(ang));
      }
      for (int h = 0; h < heads; ++h) {
        uint16_t* v = x + t * ld + int64_t(h) * head_dim;
        for (int j = 0; j < pairs; ++j) {
          const float a = bf16_to_f32(v[2 * j]), c = bf16_to_f32(v[2 * j + 1]);
          v[2 * j] = f32_to_bf16(a * cs[size_t(j)] - c * sn[size_t(j)]);
          v[2 * j + 1] = f32_to_bf16(a * sn[size_t(j)] + c * cs[size_t(j)]);
        }
      }
    }
  });
}

void attention(const uint16_t* qkv, int64_t ld, int64_t N, int heads, int dv, uint16_t* o) {
  const int64_t W = int64_t(heads) * dv;
  // FP32 copies, head-major: kf, vf [Hv, N, dv]
  std::vector<float> kf(static_cast<size_t>(heads * N * dv)), vf(static_cast<size_t>(heads * N * dv));
  for (int64_t t = 0; t < N; ++t)
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < dv; ++d) {
        kf[size_t((h * N + t) * dv + d)] = bf16_to_f32(qkv[t * ld + W + h * dv + d]);
        vf[size_t((h * N + t) * dv + d)] = bf16_to_f32(qkv[t * ld + 2 * W + h * dv + d]);
      }
  const float scale = 1.0f / std::sqrt(float(dv));
  cpu::parallel_for(heads * N, heads * N * N * dv * 4, [&](int64_t b, int64_t e) {
    std::vector<float> s(static_cast<size_t>(N)), q(static_cast<size_t>(dv)), acc(static_cast<size_t>(dv));
    for (int64_t r = b; r < e; ++r) {
      const int h = int(r / N);
      const int64_t t = r % N;
      for (int d = 0; d < dv; ++d) q[size_t(d)] = bf16_to_f32(qkv[t * ld + h * dv + d]);
      const float* K = kf.data() + h * N * dv;
      const float* V = vf.data() + h * N * dv;
      float m = -INFINITY;
      for (int64_t j = 0; j < N; ++j) {
        float dot = 0.0f;
        for (int d = 0; d < dv; ++d) dot += q[size_t(d)] * K[j * dv + d];
        s[size_t(j)] = dot * scale;
        m = std::max(m, s[size_t(j)]);
      }
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < N; ++j) {
        const float p = std::exp(s[size_t(j)] - m);
        sum += p;
        for (int d = 0; d < dv; ++d) acc[size_t(d)] += p * V[j * dv + d];
      }
      for (int d = 0; d < dv; ++d) o[t * W + h * dv + d] = f32_to_bf16(acc[size_t(d)] / sum);
    }
  });
}

namespace {

inline float gelu_tanh(float x) {
  constexpr float k = 0.7978845608028654f;  // √(2/π)
  return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
}

}  // namespace

void encoder_block(const VisionBlockWeights& bw, const VisionConfig& c, std::span<const ImageRows> imgs, uint16_t* x,
                   int64_t T) {
  const int64_t Dvt = c.hidden_size, Fvt = c.intermediate_size, Wq = c.qkv_hidden_size;
  const int Hv = c.num_heads, dv = c.qkv_hidden_size / c.num_heads;
  const float eps = c.rms_norm_eps;
  std::vector<uint16_t> h(static_cast<size_t>(T * Dvt)), y(static_cast<size_t>(T * Dvt));  // bf16 [ΣN, Dvt]
  std::vector<uint16_t> qkv(static_cast<size_t>(T * 3 * Wq));                   // bf16 [ΣN, 3, Hv, dv]
  std::vector<uint16_t> o(static_cast<size_t>(T * Wq));                         // bf16 [ΣN, Hv·dv]
  // x += wo(Attn(RoPE2D(q, k), v)) on RMSNorm0(x)
  cpu::rmsnorm_bf16(x, model::bf16_ptr(bw.norm0), h.data(), T, Dvt, eps);
  cpu::gemm_bf16(h.data(), Dvt, model::bf16_ptr(bw.wqkv), qkv.data(), 3 * Wq, T, Dvt, 3 * Wq);
  for (const ImageRows& im : imgs) {
    uint16_t* r = qkv.data() + im.row0 * 3 * Wq;
    rope_2d(r, 3 * Wq, im.grid_h, im.grid_w, Hv, dv);       // q
    rope_2d(r + Wq, 3 * Wq, im.grid_h, im.grid_w, Hv, dv);  // k
    attention(r, 3 * Wq, im.n(), Hv, dv, o.data() + im.row0 * Wq);
  }
  cpu::gemm_bf16(o.data(), Wq, model::bf16_ptr(bw.wo), y.data(), Dvt, T, Wq, Dvt);
  cpu::add_bf16(x, y.data(), x, T * Dvt);
  // x += fc1(gelu_tanh(fc0(RMSNorm1(x))))
  cpu::rmsnorm_bf16(x, model::bf16_ptr(bw.norm1), h.data(), T, Dvt, eps);
  std::vector<uint16_t> f(static_cast<size_t>(T * Fvt));  // bf16 [ΣN, Fvt]
  cpu::gemm_bf16(h.data(), Dvt, model::bf16_ptr(bw.fc0), f.data(), Fvt, T, Dvt, Fvt);
  cpu::parallel_for(T, T * Fvt * 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b * Fvt; i < e * Fvt; ++i) f[size_t(i)] = f32_to_bf16(gelu_tanh(bf16_to_f32(f[size_t(i)])));
  });
  cpu::gemm_bf16(f.data(), Fvt, model::bf16_ptr(bw.fc1), y.data(), Dvt, T, Fvt, Dvt);
  cpu::add_bf16(x, y.data(), x, T * Dvt);
}

}  // namespace kestrel::vision
