// CUDA error checking usable from both .cpp (g++) and .cu (nvcc) files. It deliberately avoids
// fmt: nvcc cannot compile fmt 9's compile-time format checks, so the message is assembled in
// cuda_check.cpp, which g++ builds. Every runtime call goes through KCUDA_CHECK; a failure throws
// kestrel::Error with file, line, call text and CUDA's own message; nothing aborts.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace kestrel::cuda {
[[noreturn]] void raise_cuda_error(const char* file, int line, int err, const char* call);
[[noreturn]] void raise_check_failed(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace kestrel::cuda

#define KCUDA_CHECK(call)                                                                  \
  do {                                                                                     \
    const cudaError_t kcuda_err_ = (call);                                                 \
    if (kcuda_err_ != cudaSuccess) ::kestrel::cuda::raise_cuda_error(__FILE__, __LINE__, int(kcuda_err_), #call); \
  } while (0)

// After a kernel launch: catches bad launch configurations immediately.
#define KCUDA_CHECK_LAUNCH() KCUDA_CHECK(cudaGetLastError())

// Argument check for launchers in .cu files; msg is a std::string expression.
#define KCUDA_REQUIRE(cond, msg)                                                           \
  do {                                                                                     \
    if (!(cond)) ::kestrel::cuda::raise_check_failed(__FILE__, __LINE__, #cond, (msg));    \
  } while (0)
