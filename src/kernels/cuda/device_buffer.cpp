#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"

namespace kestrel::cuda {

DeviceBuffer::DeviceBuffer(size_t nbytes) : size_(nbytes) {
  if (nbytes) KCUDA_CHECK(cudaMalloc(&ptr_, nbytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), size_(o.size_) {
  o.ptr_ = nullptr;
  o.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    size_ = o.size_;
    o.ptr_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

TensorView DeviceBuffer::view(DType dtype, Shape shape) const {
  KCHECK(size_t(shape.numel()) * dtype_size(dtype) <= size_, "view {} {} exceeds buffer of {} bytes",
         dtype_name(dtype), shape.str(), size_);
  return TensorView(ptr_, dtype, shape, Device::cuda);
}

void DeviceBuffer::copy_from_host(const void* src, size_t nbytes) {
  KCHECK(nbytes <= size_, "copy of {} bytes into a {}-byte buffer", nbytes, size_);
  KCUDA_CHECK(cudaMemcpy(ptr_, src, nbytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::copy_to_host(void* dst, size_t nbytes) const {
  KCHECK(nbytes <= size_, "copy of {} bytes out of a {}-byte buffer", nbytes, size_);
  KCUDA_CHECK(cudaMemcpy(dst, ptr_, nbytes, cudaMemcpyDeviceToHost));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace kestrel::cuda
