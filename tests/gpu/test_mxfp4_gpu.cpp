// MXFP4 dequantisation on the GPU against its CPU twin (core/dtype.h), bit for bit, over a shape
// table that includes the real per-rank expert shapes. Outputs are poisoned first so an element the
// kernel forgot to write cannot pass by accident.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/mxfp4.h"

namespace kestrel {
namespace {

TEST(GpuMxfp4, DequantMatchesCpuTwin) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device: run this binary on the GPU machine";
  struct Case {
    int64_t rows, cols;
  };
  std::mt19937 rng(1234);
  for (Case c : {Case{1, 32}, Case{7, 96}, Case{64, 128}, Case{3072, 3584}, Case{3584, 3072}}) {
    std::vector<uint8_t> packed(size_t(c.rows * c.cols / 2)), scale(size_t(c.rows * c.cols / 32));
    for (auto& b : packed) b = uint8_t(rng());
    for (auto& s : scale) s = uint8_t(100 + rng() % 50);  // 2^-27 .. 2^22
    scale[0] = 255;                                      // one NaN block
    cuda::DeviceBuffer dp(packed.size()), ds(scale.size()), dout(size_t(c.rows * c.cols * 2));
    dp.copy_from_host(packed.data(), packed.size());
    ds.copy_from_host(scale.data(), scale.size());
    std::vector<uint16_t> poison(size_t(c.rows * c.cols), 0x7fbf);
    dout.copy_from_host(poison.data(), poison.size() * 2);
    cuda::mxfp4_dequant_bf16(static_cast<uint8_t*>(dp.data()), c.cols / 2, static_cast<uint8_t*>(ds.data()),
                             c.cols / 32, static_cast<uint16_t*>(dout.data()), c.cols, c.rows, c.cols, nullptr);
    std::vector<uint16_t> got(size_t(c.rows * c.cols));
    dout.copy_to_host(got.data(), got.size() * 2);
    std::vector<float> row(size_t(c.cols));
    int64_t bad = 0;
    for (int64_t r = 0; r < c.rows; ++r) {
      mxfp4_dequantize_row(&packed[size_t(r * c.cols / 2)], &scale[size_t(r * c.cols / 32)], row.data(),
                           size_t(c.cols));
      for (int64_t j = 0; j < c.cols; ++j) {
        const uint16_t want = f32_to_bf16(row[size_t(j)]);
        const uint16_t have = got[size_t(r * c.cols + j)];
        const bool both_nan = std::isnan(bf16_to_f32(want)) && std::isnan(bf16_to_f32(have));
        if (have != want && !both_nan && bad++ < 5)
          ADD_FAILURE() << c.rows << "x" << c.cols << " at (" << r << "," << j << "): " << have << " != " << want;
      }
    }
    EXPECT_EQ(bad, 0) << c.rows << "x" << c.cols;
  }
}

}  // namespace
}  // namespace kestrel
