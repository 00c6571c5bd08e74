// The reference reduction shared by the host backends (see comm.h for the order and rounding).
#include "parallel/comm.h"

#include <cstring>
#include <limits>

#include "core/check.h"

namespace kestrel::parallel {

void check_reduce_dtype(DType dt, const char* what) {
  if (dt != DType::f32 && dt != DType::bf16)
    fail("{}: reductions support f32 and bf16, not {}", what, dtype_name(dt));
}

size_t comm_bytes(size_t count, DType dt) {
  size_t b = 0;
  if (__builtin_mul_overflow(count, dtype_size(dt), &b)) fail("collective of {} elements overflows size_t", count);
  return b;
}

void sum_in_rank_order(const void* const* parts, int n, void* out, size_t count, DType dt) {
  check_reduce_dtype(dt, "sum_in_rank_order");
  KCHECK(n >= 1, "need at least one part, got {}", n);
  if (dt == DType::f32) {
    auto* o = static_cast<float*>(out);
    for (size_t i = 0; i < count; ++i) {
      float acc = static_cast<const float*>(parts[0])[i];
      for (int r = 1; r < n; ++r) acc += static_cast<const float*>(parts[r])[i];
      o[i] = acc;
    }
  } else {
    auto* o = static_cast<uint16_t*>(out);
    for (size_t i = 0; i < count; ++i) {
      float acc = bf16_to_f32(static_cast<const uint16_t*>(parts[0])[i]);
      for (int r = 1; r < n; ++r) acc += bf16_to_f32(static_cast<const uint16_t*>(parts[r])[i]);
      o[i] = f32_to_bf16(acc);
    }
  }
}

}  // namespace kestrel::parallel
