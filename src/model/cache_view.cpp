// Paged cache reads and writes with quantise-on-write / dequantise-on-read (formats in core/cache_format.h).
#include "model/cache_view.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"

namespace kestrel::model {
namespace {

// MODEL.md §3.5 FP8 scale: s = 2^⌈log2(max(amax, 1e-4) / 448)⌉ (a UE8M0 value kept as f32).
float fp8_pow2_scale(const uint16_t* x /* bf16 [n] */, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(bf16_to_f32(x[i])));
  return e8m0_to_f32(e8m0_ceil_pow2(std::max(amax, 1e-4f) / kFp8E4M3Max));
}

void quantize_fp8(const uint16_t* x /* bf16 [n] */, int64_t n, float s, uint8_t* q /* e4m3 [n] */) {
  for (int64_t i = 0; i < n; ++i) q[i] = f32_to_f8e4m3(bf16_to_f32(x[i]) / s, Fp8Overflow::saturate);
}

// e4m3 · 2^k is exact in bf16 (3 mantissa bits, 8 exponent bits) for every scale the rule picks.
void dequantize_fp8(const uint8_t* q /* e4m3 [n] */, int64_t n, float s, uint16_t* y /* bf16 [n] */) {
  for (int64_t i = 0; i < n; ++i) y[i] = f32_to_bf16(f8e4m3_to_f32(q[i]) * s);
}

}  // namespace

int64_t kda_recurrent_elems(const TextConfig& c) { return int64_t(c.kda.num_heads) * c.kda.head_dim * c.kda.head_dim; }
int64_t kda_conv_elems(const TextConfig& c) {
  return 3 * int64_t(c.kda.conv_size - 1) * c.kda.num_heads * c.kda.head_dim;
}

MlaCacheView MlaCacheView::make(const TextConfig& c, LatentFormat lf, IndexKeyFormat kf, int block_size) {
  MlaCacheView v;
  v.latent_format = lf, v.key_format = kf, v.block_size = block_size;
  v.C = c.kv_lora_rank, v.R = c.qk_rope_head_dim, v.Di = c.has_indexer() ? c.index_head_dim : 0;
  check_index_key_format(kf, v.Di);
  return v;
}

void MlaCacheView::write_latent(int64_t pos, const uint16_t* row) const {
  KCHECK(pos >= 0 && pos < capacity(), "latent write at {} outside the block table ({} tokens)", pos, capacity());
  const int64_t tb = latent_token_bytes();
  uint8_t* dst = latent + (int64_t(block_table[size_t(pos / block_size)]) * block_size + pos % block_size) * tb;
  if (latent_format == LatentFormat::bf16) {
    std::memcpy(dst, row, size_t((C + R) * 2));
    return;
  }
  const int64_t groups = (C + 127) / 128;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = std::min<int64_t>(128, C - g * 128);
    const float s = fp8_pow2_scale(row + g * 128, n);
    quantize_fp8(row + g * 128, n, s, dst + g * 128);
    std::memcpy(dst + C + g * 4, &s, 4);
  }
  std::memcpy(dst + C + groups * 4, row + C, size_t(R) * 2);  // k_pe stays bf16
}

void MlaCacheView::read_latent(int64_t n, uint16_t* out) const {
  KCHECK(n <= capacity(), "latent read of {} tokens past the block table ({} tokens)", n, capacity());
  std::vector<int32_t> all(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) all[size_t(i)] = int32_t(i);
  read_latent_rows(all.data(), n, out);
}

void MlaCacheView::read_latent_rows(const int32_t* positions, int64_t n, uint16_t* out) const {
  const int64_t tb = latent_token_bytes(), CW = C + R, groups = (C + 127) / 128;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = positions[i];
    KCHECK(pos >= 0 && pos < capacity(), "latent read at {} outside the block table ({} tokens)", pos, capacity());
    const uint8_t* src = latent + (int64_t(block_table[size_t(pos / block_size)]) * block_size + pos % block_size) * tb;
    uint16_t* y = out + i * CW;
    if (latent_format == LatentFormat::bf16) {
      std::memcpy(y, src, size_t(CW * 2));
      continue;
    }
    for (int64_t g = 0; g < groups; ++g) {
      float s;
      std::memcpy(&s, src + C + g * 4, 4);
      dequantize_fp8(src + g * 128, std::min<int64_t>(128, C - g * 128), s, y + g * 128);
    }
    std::memcpy(y + C, src + C + groups * 4, size_t(R) * 2);
  }
}

namespace {
// Where one token's key lives in its kernel page (core/cache_format.h: values then scales).
struct KeySlot {
  uint8_t* values;  // this token's values
  uint8_t* scale;   // this token's scale bytes
};
KeySlot key_slot(const MlaCacheView& v, int64_t pos) {
  const int64_t P = v.block_size, K = index_key_kernel_page(P);
  const int64_t tb = v.key_token_bytes();
  const int64_t row = pos % P;
  uint8_t* page = v.keys + int64_t(v.block_table[size_t(pos / P)]) * P * tb;
  uint8_t* kpage = page + (row / K) * K * tb;
  const int64_t r = row % K;
  switch (v.key_format) {
    case IndexKeyFormat::bf16: return {kpage + r * tb, nullptr};
    case IndexKeyFormat::fp8: return {kpage + r * v.Di, kpage + K * v.Di + r * 4};
    case IndexKeyFormat::mxfp4: return {kpage + r * (v.Di / 2), kpage + K * (v.Di / 2) + r * (v.Di / 32)};
  }
  return {};
}
}  // namespace

void MlaCacheView::write_key(int64_t pos, const uint16_t* key) const {
  KCHECK(pos >= 0 && pos < capacity(), "index-key write at {} outside the block table ({} tokens)", pos, capacity());
  const KeySlot k = key_slot(*this, pos);
  switch (key_format) {
    case IndexKeyFormat::bf16: std::memcpy(k.values, key, size_t(Di * 2)); break;
    case IndexKeyFormat::fp8: {
      const float s = fp8_pow2_scale(key, Di);
      quantize_fp8(key, Di, s, k.values);
      std::memcpy(k.scale, &s, 4);
      break;
    }
    case IndexKeyFormat::mxfp4: {
      float blk[kMxBlock];
      for (int64_t b = 0; b < Di / 32; ++b) {
        for (int i = 0; i < kMxBlock; ++i) blk[i] = bf16_to_f32(key[b * 32 + i]);
        k.scale[b] = mxfp4_quantize_block(blk, k.values + b * 16);
      }
      break;
    }
  }
}

void MlaCacheView::read_keys(int64_t n, uint16_t* out) const {
  KCHECK(n <= capacity(), "index-key read of {} tokens past the block table ({} tokens)", n, capacity());
  std::vector<float> f(static_cast<size_t>(Di));
  for (int64_t pos = 0; pos < n; ++pos) {
    const KeySlot k = key_slot(*this, pos);
    uint16_t* y = out + pos * Di;
    switch (key_format) {
      case IndexKeyFormat::bf16: std::memcpy(y, k.values, size_t(Di * 2)); break;
      case IndexKeyFormat::fp8: {
        float s;
        std::memcpy(&s, k.scale, 4);
        dequantize_fp8(k.values, Di, s, y);
        break;
      }
      case IndexKeyFormat::mxfp4:
        mxfp4_dequantize_row(k.values, k.scale, f.data(), size_t(Di));
        for (int64_t i = 0; i < Di; ++i) y[i] = f32_to_bf16(f[size_t(i)]);  // e2m1 · 2^k: exact
        break;
    }
  }
}

MlaCacheView MlaCache::view(const TextConfig& c, int64_t n) {
  MlaCacheView v = MlaCacheView::make(c, latent_format, key_format, block_size);
  const int64_t pages = (n + block_size - 1) / block_size;
  while (int64_t(table.size()) < pages) table.push_back(int32_t(table.size()));
  latent.resize(size_t(pages * block_size * v.latent_token_bytes()));
  keys.resize(size_t(pages * block_size * v.key_token_bytes()));
  v.latent = latent.data();
  v.keys = keys.data();
  v.block_table = table;
  return v;
}

}  // namespace kestrel::model
