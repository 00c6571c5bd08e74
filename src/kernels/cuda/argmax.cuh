// The argmax order shared by the greedy argmax (argmax.cu) and the sampler's maximum (sampling.cu): larger
// value first, then the lower id; NaN never beats anything and anything non-NaN beats NaN; an id < 0 marks
// "nothing yet". A total order on the candidates, so any reduction tree gives the same winner.
#pragma once

namespace kestrel::cuda::argmax_detail {

// (a, ia) beats (b, ib).
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  if (a != a) return false;
  if (b != b) return true;
  return a > b || (a == b && ia < ib);
}

}  // namespace kestrel::cuda::argmax_detail
