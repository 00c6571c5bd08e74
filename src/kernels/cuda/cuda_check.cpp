#include "kernels/cuda/cuda_check.h"

#include <fmt/format.h>

#include "core/check.h"

namespace kestrel::cuda {

void raise_cuda_error(const char* file, int line, int err, const char* call) {
  throw Error(fmt::format("{}:{}: CUDA error {} ({}) in {}", file, line, err,
                          cudaGetErrorString(cudaError_t(err)), call));
}

void raise_check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  throw Error(fmt::format("{}:{}: check failed: {}: {}", file, line, cond, msg));
}

}  // namespace kestrel::cuda
