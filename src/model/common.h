// Shared plumbing of the CPU layer implementations: activation buffers and the activation observer.
//
// Activations are bf16 bit patterns in std::vector<uint16_t> (or f32 where MODEL.md §3 keeps FP32).
// An Observer lets tests and the golden-activation harness capture named tensors ("L3.attn_in",
// "L7.index_topk", "logits", ...) without the forward pass knowing who listens; with no observer the
// cost is one branch per capture point.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/check.h"
#include "core/tensor.h"

namespace kestrel::model {

using Observer = std::function<void(std::string_view name, const TensorView& t)>;

using Bf16Vec = std::vector<uint16_t>;

// An allocator whose value-less construct leaves the element uninitialised (default-initialised), so
// Scratch<T>(n) allocates without a zero-fill. For a step's buffers that a kernel writes in full
// before anything reads them: their zero-fill was a serial memset on the engine thread, ~4 % of a
// 2K prefill's engine-thread time while the pool's other thread waited (bench/RESULTS.md, issue #22).
template <class T>
struct NoZeroAllocator : std::allocator<T> {
  using value_type = T;
  NoZeroAllocator() = default;
  template <class U>
  NoZeroAllocator(const NoZeroAllocator<U>&) noexcept {}
  template <class U>
  struct rebind {
    using other = NoZeroAllocator<U>;
  };
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <class T>
using Scratch = std::vector<T, NoZeroAllocator<T>>;

// Names captures of one layer as "L{layer}.{what}" (or bare `what` when layer < 0).
struct Probe {
  const Observer* observer = nullptr;
  int layer = -1;

  bool active() const { return observer && *observer; }
  void operator()(std::string_view what, const void* data, DType dt, Shape shape) const {
    if (!active()) return;
    const std::string name = layer < 0 ? std::string(what) : fmt::format("L{}.{}", layer, what);
    (*observer)(name, TensorView(const_cast<void*>(data), dt, shape));
  }
};

inline const uint16_t* bf16_ptr(const TensorView& v) {
  KCHECK(v.dtype == DType::bf16 && v.is_contiguous(), "expected a contiguous bf16 tensor, got {} {}",
         dtype_name(v.dtype), v.shape.str());
  return v.as<const uint16_t>();
}
inline const float* f32_ptr(const TensorView& v) {
  KCHECK(v.dtype == DType::f32 && v.is_contiguous(), "expected a contiguous f32 tensor, got {} {}",
         dtype_name(v.dtype), v.shape.str());
  return v.as<const float>();
}

}  // namespace kestrel::model
