// See kda_ops.h. The loops are those of the original model/kda.cpp, unchanged in order and precision.
#include "kernels/cpu/kda_ops.h"

#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"

namespace kestrel::cpu {

void kda_conv_silu(const uint16_t* x, int64_t ldx, const float* w, uint16_t* hist, float* y, int64_t ldy, int64_t T,
                   int64_t C, int64_t W) {
  KCHECK(W >= 1 && C > 0 && T >= 0 && ldx >= C && ldy >= C, "bad KDA conv shape T={} C={} W={}", T, C, W);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* cur = x + t * ldx;
    float* dst = y + t * ldy;
    for (int64_t ch = 0; ch < C; ++ch) {
      const float* wc = w + ch * W;
      float acc = 0.0f;
      for (int64_t j = 0; j < W - 1; ++j) acc += wc[j] * bf16_to_f32(hist[j * C + ch]);
      acc += wc[W - 1] * bf16_to_f32(cur[ch]);
      dst[ch] = round_bf16(silu(acc));
    }
    if (W > 1) {
      std::memmove(hist, hist + C, size_t((W - 2) * C) * 2);
      std::memcpy(hist + (W - 2) * C, cur, size_t(C) * 2);
    }
  }
}

void kda_qk_norm_gates(float* qf, float* kf, const uint16_t* z, const float* dt_bias, const float* a_log,
                       const uint16_t* bl, float lower, float* g, float* beta, int64_t T, int64_t H, int64_t Dk) {
  const int64_t HD = H * Dk;
  const float q_scale = 1.0f / std::sqrt(float(Dk));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float* q = qf + t * HD + h * Dk;
      float* k = kf + t * HD + h * Dk;
      float qq = 0.0f, kk = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        qq += q[i] * q[i];
        kk += k[i] * k[i];
      }
      const float qn = q_scale / std::sqrt(qq + 1e-6f), kn = 1.0f / std::sqrt(kk + 1e-6f);
      for (int64_t i = 0; i < Dk; ++i) {
        q[i] *= qn;
        k[i] *= kn;
      }
      const float a = std::exp(a_log[h]);
      for (int64_t i = 0; i < Dk; ++i) {
        const float zi = bf16_to_f32(z[t * HD + h * Dk + i]) + dt_bias[h * Dk + i];
        g[t * HD + h * Dk + i] = lower * sigmoid(a * zi);
      }
      beta[t * H + h] = sigmoid(bf16_to_f32(bl[t * H + h]));
    }
  }
}

void kda_out_norm_gate(const float* o, const uint16_t* gate, const float* o_norm, float eps, uint16_t* ohat,
                       int64_t T, int64_t H, int64_t Dk) {
  const int64_t HD = H * Dk;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const float* oh = o + t * HD + h * Dk;
      float ss = 0.0f;
      for (int64_t j = 0; j < Dk; ++j) ss += oh[j] * oh[j];
      const float r = 1.0f / std::sqrt(ss / float(Dk) + eps);
      for (int64_t j = 0; j < Dk; ++j) {
        const float gt = sigmoid(bf16_to_f32(gate[t * HD + h * Dk + j]));
        ohat[t * HD + h * Dk + j] = f32_to_bf16(oh[j] * r * o_norm[j] * gt);
      }
    }
  }
}

}  // namespace kestrel::cpu
