// MoonViT-V2 on the GPU (MODEL.md §6): the CPU encoder's steps (src/vision, the twin it is tested
// against in tests/gpu/test_vision_gpu.cpp) with the linear layers on cuBLASLt (GemmLt), RMSNorm and adds
// from the common kernels and attention on tensor cores (kernels/cuda/vision.h). All images of a call are
// stacked, so every GEMM runs once per layer for the whole batch; attention alone is per image (varlen).
//
//   VisionCuda enc(config, VisionCuda::upload(host_weights, keep));   // or device pointers of your own
//   enc.encode(images, out_device /* bf16 [Σ tokens, D] */, stream);
//
// The position table is resized on the host (vision::resize_pos_table, the CPU twin itself) once per grid
// size and kept on the device. Scratch grows to the largest call seen and is reused.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "loader/config.h"
#include "loader/weights.h"
#include "request/request.h"

namespace kestrel::vision {

struct VisionDeviceWeights {  // device bf16 pointers, shapes as loader/weights.h VisionWeights
  struct Block {
    const uint16_t *norm0 = nullptr, *norm1 = nullptr;  // [Dvt]
    const uint16_t* wqkv = nullptr;                     // [3·qkv, Dvt]
    const uint16_t* wo = nullptr;                       // [Dvt, qkv]
    const uint16_t* fc0 = nullptr;                      // [Fvt, Dvt]
    const uint16_t* fc1 = nullptr;                      // [Dvt, Fvt]
  };
  const uint16_t* patch_embed = nullptr;  // [Dvt, 3·p·p]
  const uint16_t* pos_emb = nullptr;      // [h0, w0, Dvt] (used as is when the grid equals the table)
  std::vector<uint16_t> pos_host;         // host copy of pos_emb, for resizing
  std::vector<Block> blocks;
  const uint16_t* final_norm = nullptr;   // [Dvt]
  const uint16_t* proj0 = nullptr;        // [4·Dvt, 4·Dvt]
  const uint16_t* proj2 = nullptr;        // [D, 4·Dvt]
  const uint16_t* post_norm = nullptr;    // [D]
};

class VisionCuda {
 public:
  VisionCuda(const VisionConfig& c, VisionDeviceWeights w);

  // Copies host weights to the device; `keep` owns the buffers (must outlive the encoder).
  static VisionDeviceWeights upload(const VisionWeights& w, std::vector<cuda::DeviceBuffer>& keep);

  // The projector rows of every image, in order, into out (device bf16 [Σ tokens, D]) = prepare + run.
  void encode(std::span<const ImageInput* const> images, uint16_t* out, cudaStream_t stream);
  // prepare: checks the images (vision::check_image), waits for the stream's earlier work, uploads the
  // patches (as bf16) and index arrays (copies on `stream`, complete when it returns) and returns Σ tokens. run: the GPU work alone,
  // asynchronous on `stream` (the benchmark times it); it may be run again on the same prepared images.
  int64_t prepare(std::span<const ImageInput* const> images, cudaStream_t stream);
  void run(uint16_t* out, cudaStream_t stream);

 private:
  uint16_t* scratch(int i, size_t elems);  // bf16 scratch buffer i, at least elems
  const uint16_t* pos_for(int gh, int gw, cudaStream_t s);  // made (on s, waited for) by prepare

  VisionConfig c_;
  VisionDeviceWeights w_;
  cuda::GemmLt gemm_;
  std::vector<cuda::DeviceBuffer> scratch_;
  cuda::DeviceBuffer idx_;  // i32 index arrays of the call (row offsets, (row, col), merge sources)
  std::map<std::pair<int, int>, cuda::DeviceBuffer> pos_;
  // the prepared call
  std::vector<int32_t> row0_;               // host i32 [n_images + 1]
  std::vector<std::pair<int, int>> grids_;  // (grid_h, grid_w) per image
  int64_t T_ = 0, tokens_ = 0, max_rows_ = 0;
};

}  // namespace kestrel::vision
