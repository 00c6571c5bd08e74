// Host repacking of MXFP4 expert weights from the checkpoint layout (MODEL.md §4) into the tensor-core
// layout of moe_layout.h, and the upload of a layer's experts. A pure permutation of nibbles and scale
// bytes: the packed buffers have the checkpoint's sizes. Runs once per layer at model load: up to 16
// experts are packed at a time by as many threads into a host staging buffer, then copied (cudaMemcpy).
#include <algorithm>
#include <thread>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_layout.h"

namespace kestrel::cuda {

namespace ml = moe_layout;

void pack_mxfp4_matrix(const uint8_t* packed, const uint8_t* scale, int64_t R, int64_t C, uint8_t* out_packed,
                       uint8_t* out_scale) {
  KCHECK(R > 0 && C > 0 && R % ml::kTileRows == 0 && C % ml::kChunkCols == 0,
         "pack_mxfp4_matrix: [{}, {}] must be multiples of [16, 64]", R, C);
  const int64_t RT = R / ml::kTileRows, NC = C / ml::kChunkCols, row_bytes = C / 2, row_scales = C / 32;
  for (int64_t rt = 0; rt < RT; ++rt) {
    for (int64_t c = 0; c < NC; ++c) {
      uint8_t* op = out_packed + (rt * NC + c) * ml::kTileChunkBytes;
      uint8_t* os = out_scale + (rt * NC + c) * ml::kTileChunkScaleBytes;
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        for (int s = 0; s < 4; ++s) {
          uint32_t word = 0;
          for (int j = 0; j < 4; ++j) {
            // Halves h = 0, 1 are columns 2m, 2m+1: the low and high nibble of one checkpoint byte.
            const int64_t row = rt * ml::kTileRows + ml::frag_row(g, j);
            const int64_t col = c * ml::kChunkCols + ml::frag_col(t, s, j, 0);
            const uint32_t byte = packed[row * row_bytes + col / 2];
            for (int h = 0; h < 2; ++h) {
              const uint32_t nib = (byte >> (4 * h)) & 0xFu;
              word |= (nib & 7u) << (ml::kMagPos[j] + 16 * h);
              word |= (nib >> 3) << (ml::kSignPos[j] + 16 * h);
            }
          }
          for (int b = 0; b < 4; ++b) op[lane * 16 + s * 4 + b] = uint8_t(word >> (8 * b));  // little-endian word
        }
      }
      for (int g = 0; g < 8; ++g)
        for (int i = 0; i < 4; ++i)
          os[g * 4 + i] = scale[(rt * ml::kTileRows + g + 8 * (i & 1)) * row_scales + 2 * c + (i >> 1)];
    }
  }
}

bool mxfp4_special_scales(const uint8_t* scale, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (scale[i] == 0 || scale[i] == 255) return true;
  return false;
}

bool mxfp4_fp32_scales(const uint8_t* scale, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (scale[i] == 0 || scale[i] > 128) return true;
  return false;
}

MoeExpertWeights pack_experts_mxfp4(const MoeExpertHost* experts, int64_t X, int64_t Lt, int64_t I,
                                    const std::function<void*(size_t)>& device_alloc) {
  KCHECK(X > 0 && Lt > 0 && I > 0 && Lt % 64 == 0 && I % 64 == 0,
         "pack_experts_mxfp4: X = {}, Lt = {}, I = {} (Lt and I must be multiples of 64)", X, Lt, I);
  const size_t p13 = size_t(I * Lt / 2), s13 = size_t(I * Lt / 32), p2 = size_t(Lt * I / 2), s2 = size_t(Lt * I / 32);
  struct Part {
    size_t bytes;
    uint8_t* dev;
  };
  // Order: w1 packed, w1 scales, w3 packed, w3 scales, w2 packed, w2 scales.
  Part parts[6] = {{p13, nullptr}, {s13, nullptr}, {p13, nullptr}, {s13, nullptr}, {p2, nullptr}, {s2, nullptr}};
  for (Part& p : parts) {
    p.dev = static_cast<uint8_t*>(device_alloc(p.bytes * size_t(X)));
    KCHECK(p.dev != nullptr, "pack_experts_mxfp4: device allocation of {} bytes failed", p.bytes * size_t(X));
  }
  const size_t per_expert = 2 * (p13 + s13) + p2 + s2;
  const int64_t workers = std::clamp<int64_t>(int64_t(std::thread::hardware_concurrency()), 1, 16);
  std::vector<uint8_t> staging(per_expert * size_t(std::min(workers, X)));
  bool special = false, fp32 = false;
  for (int64_t e0 = 0; e0 < X; e0 += workers) {
    const int64_t n = std::min(workers, X - e0);
    std::vector<std::thread> pool;
    std::vector<char> spec(size_t(n), 0), wide(size_t(n), 0);
    for (int64_t i = 0; i < n; ++i) {
      pool.emplace_back([&, i] {
        const MoeExpertHost& h = experts[e0 + i];
        uint8_t* s = staging.data() + size_t(i) * per_expert;
        pack_mxfp4_matrix(h.w1_packed, h.w1_scale, I, Lt, s, s + p13);
        pack_mxfp4_matrix(h.w3_packed, h.w3_scale, I, Lt, s + p13 + s13, s + 2 * p13 + s13);
        pack_mxfp4_matrix(h.w2_packed, h.w2_scale, Lt, I, s + 2 * (p13 + s13), s + 2 * (p13 + s13) + p2);
        spec[size_t(i)] = mxfp4_special_scales(h.w1_scale, s13) || mxfp4_special_scales(h.w3_scale, s13) ||
                          mxfp4_special_scales(h.w2_scale, s2);
        wide[size_t(i)] = mxfp4_fp32_scales(h.w1_scale, s13) || mxfp4_fp32_scales(h.w3_scale, s13) ||
                          mxfp4_fp32_scales(h.w2_scale, s2);
      });
    }
    for (auto& th : pool) th.join();
    for (int64_t i = 0; i < n; ++i) {
      special = special || spec[size_t(i)];
      fp32 = fp32 || wide[size_t(i)];
      const uint8_t* s = staging.data() + size_t(i) * per_expert;
      size_t off = 0;
      for (const Part& p : parts) {
        KCUDA_CHECK(cudaMemcpy(p.dev + size_t(e0 + i) * p.bytes, s + off, p.bytes, cudaMemcpyHostToDevice));
        off += p.bytes;
      }
    }
  }
  MoeExpertWeights w{parts[0].dev, parts[1].dev,   parts[2].dev,   parts[3].dev,   parts[4].dev,
                     parts[5].dev, int64_t(p13),   int64_t(s13),   int64_t(p2),    int64_t(s2)};
  w.layout = kMoeExpertLayout;
  w.special_scales = special;
  w.fp32_scales = fp32;
  return w;
}

}  // namespace kestrel::cuda
