// Owned device memory (plain cudaMalloc, never managed memory) and host<->device copies.
// A caching allocator comes with the CUDA backend issue; this is the RAII unit it will hand out.
#pragma once

#include <cstddef>

#include "core/tensor.h"

namespace kestrel::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t nbytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  TensorView view(DType dtype, Shape shape) const;

  void copy_from_host(const void* src, size_t nbytes);
  void copy_to_host(void* dst, size_t nbytes) const;

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

int device_count();  // 0 when no driver/GPU is present (never throws)

}  // namespace kestrel::cuda
