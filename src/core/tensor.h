// Tensor views and owned host buffers.
//
// A TensorView is a non-owning (dtype, shape, strides, device, pointer) record: weights point into a
// memory-mapped checkpoint, activations into a HostBuffer or (CUDA issue) a device allocation.
// Strides are in elements, like PyTorch. Shapes have at most kMaxDims dimensions so a view is a
// small value type that kernels can take by value.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace kestrel {

enum class Device : uint8_t { cpu, cuda };

inline constexpr int kMaxDims = 6;

struct Shape {
  std::array<int64_t, kMaxDims> d{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  static Shape of(const std::vector<int64_t>& dims);

  int64_t operator[](int i) const { return d[size_t(i)]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[3072, 1792]"
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  std::array<int64_t, kMaxDims> stride{};  // in elements
  Device device = Device::cpu;

  TensorView() = default;
  // Contiguous row-major view.
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu);

  bool empty() const { return data == nullptr; }
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;

  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

// 64-byte aligned host memory owned by one object; move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t nbytes);
  HostBuffer(HostBuffer&&) noexcept = default;
  HostBuffer& operator=(HostBuffer&&) noexcept = default;

  void* data() const { return ptr_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> ptr_;
  size_t size_ = 0;
};

// A host tensor that owns its storage (activations, test data, golden tensors).
struct HostTensor {
  HostBuffer buf;
  TensorView view;

  HostTensor() = default;
  HostTensor(DType dtype, Shape shape);
  template <typename T>
  T* as() const { return view.as<T>(); }
};

}  // namespace kestrel
