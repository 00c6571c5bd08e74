// A small caching allocator over cudaMalloc. Freed blocks go to a free list keyed by their rounded
// size and are handed out again, so a forward step that allocates the same scratch shapes every call
// stops calling cudaMalloc/cudaFree after the first. Not thread-safe (one allocator per stream/worker).
//
// Why the memory stays flat under load (issue #24): serving steps come in endlessly varying shapes (tokens
// per step, context lengths), so exact size classes (the first version: 2 MiB granules) kept a free block
// for every size ever seen and grew by hundreds of MiB per 1,000 requests. Now (1) sizes round to a few
// classes per octave (512 B granules up to 64 KiB, then 8 classes per power of two: at most 12.5 % waste),
// so a bounded set of classes covers every request, and (2) a request takes the smallest cached block of
// at least its class and at most twice its size, so a large free block serves a slightly smaller request.
// What is cached is then bounded by the largest step's own needs, not by the history of shapes. Memory is
// given back to the driver by release_cached(), the destructor, or when cudaMalloc fails (cache dropped,
// then one retry).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

namespace kestrel::cuda {

class CachingAllocator {
 public:
  CachingAllocator() = default;
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* alloc(size_t nbytes);  // 256-byte aligned; nbytes 0 gives a 512-byte block
  void free(void* p);          // p from alloc(); null is ignored
  void release_cached();       // cudaFree every cached (free) block

  size_t bytes_in_use() const { return in_use_bytes_; }
  size_t bytes_reserved() const { return reserved_bytes_; }
  int64_t driver_allocs() const { return driver_allocs_; }

  static size_t round_size(size_t n);

 private:
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> live_;
  size_t in_use_bytes_ = 0, reserved_bytes_ = 0;
  int64_t driver_allocs_ = 0;
};

// A bump arena for long-lived data (weights): pieces carved from slabs the allocator hands out.
class DeviceArena {
 public:
  explicit DeviceArena(CachingAllocator& a, size_t slab_bytes = size_t(256) << 20) : a_(a), slab_(slab_bytes) {}
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  void* alloc(size_t nbytes);  // 256-byte aligned
  size_t bytes() const { return used_; }

 private:
  CachingAllocator& a_;
  size_t slab_;
  std::vector<void*> slabs_;
  char* cur_ = nullptr;
  size_t left_ = 0, used_ = 0;
};

}  // namespace kestrel::cuda
