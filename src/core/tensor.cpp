#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "core/check.h"

namespace kestrel {

Shape::Shape(std::initializer_list<int64_t> dims) {
  KCHECK(dims.size() <= size_t(kMaxDims), "rank {} > {}", dims.size(), kMaxDims);
  for (int64_t v : dims) d[size_t(rank++)] = v;
}

Shape Shape::of(const std::vector<int64_t>& dims) {
  KCHECK(dims.size() <= size_t(kMaxDims), "rank {} > {}", dims.size(), kMaxDims);
  Shape s;
  for (int64_t v : dims) s.d[size_t(s.rank++)] = v;
  return s;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= d[size_t(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (d[size_t(i)] != o.d[size_t(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(d[size_t(i)]);
  }
  return s + "]";
}

TensorView::TensorView(void* data_, DType dtype_, Shape shape_, Device device_)
    : data(data_), dtype(dtype_), shape(shape_), device(device_) {
  int64_t s = 1;
  for (int i = shape.rank - 1; i >= 0; --i) {
    stride[size_t(i)] = s;
    s *= shape[i];
  }
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int i = shape.rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[size_t(i)] != s) return false;
    s *= shape[i];
  }
  return true;
}

void HostBuffer::Free::operator()(void* p) const { std::free(p); }

HostBuffer::HostBuffer(size_t nbytes) : size_(nbytes) {
  const size_t rounded = (nbytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded == 0 ? 64 : rounded);
  ptr_.reset(p);
}

HostTensor::HostTensor(DType dtype, Shape shape)
    : buf(size_t(shape.numel()) * dtype_size(dtype)), view(buf.data(), dtype, shape) {}

}  // namespace kestrel
