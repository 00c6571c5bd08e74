#include "kernels/cuda/device_alloc.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"

namespace kestrel::cuda {

size_t CachingAllocator::round_size(size_t n) {
  if (n == 0) n = 1;
  if (n <= (size_t(64) << 10)) return (n + 511) / 512 * 512;
  // 8 classes per octave: step = 2^(floor(log2 n) − 3).
  int e = 63 - __builtin_clzll(uint64_t(n));
  const size_t g = size_t(1) << (e - 3);
  return (n + g - 1) / g * g;
}

CachingAllocator::~CachingAllocator() {
  release_cached();
  for (auto& [p, n] : live_) cudaFree(p);  // leaked by the owner: give it back anyway
}

void* CachingAllocator::alloc(size_t nbytes) {
  size_t n = round_size(nbytes);
  auto it = free_.lower_bound(n);  // the smallest cached block that fits, if it is at most twice the class
  void* p = nullptr;
  if (it != free_.end() && it->first <= 2 * n) {
    n = it->first;
    p = it->second;
    free_.erase(it);
  } else {
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess) {  // out of memory: drop the cache once and retry
      cudaGetLastError();
      release_cached();
      KCUDA_CHECK(cudaMalloc(&p, n));
    }
    reserved_bytes_ += n;
    ++driver_allocs_;
  }
  live_[p] = n;
  in_use_bytes_ += n;
  return p;
}

void CachingAllocator::free(void* p) {
  if (!p) return;
  auto it = live_.find(p);
  KCUDA_REQUIRE(it != live_.end(), std::string("CachingAllocator::free of a pointer it did not hand out"));
  in_use_bytes_ -= it->second;
  free_.emplace(it->second, p);
  live_.erase(it);
}

void CachingAllocator::release_cached() {
  for (auto& [n, p] : free_) {
    cudaFree(p);
    reserved_bytes_ -= n;
  }
  free_.clear();
}

DeviceArena::~DeviceArena() {
  for (void* s : slabs_) a_.free(s);
}

void* DeviceArena::alloc(size_t nbytes) {
  const size_t n = (std::max<size_t>(nbytes, 1) + 255) / 256 * 256;
  if (n > left_) {
    const size_t sz = std::max(slab_, n);
    cur_ = static_cast<char*>(a_.alloc(sz));
    slabs_.push_back(cur_);
    left_ = sz;
  }
  void* p = cur_;
  cur_ += n;
  left_ -= n;
  used_ += n;
  return p;
}

}  // namespace kestrel::cuda
