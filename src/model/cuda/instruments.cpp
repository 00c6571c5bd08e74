// Op timing and debug captures (see instruments.h).
#include "model/cuda/instruments.h"

#include <cstring>

#include "kernels/cuda/cuda_check.h"

namespace kestrel::model::gpu {

OpTimer::~OpTimer() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

void OpTimer::begin_step() {
  marks_.clear();
  used_ = 0;
}

void OpTimer::mark(const char* name, cudaStream_t stream) {
  if (used_ == pool_.size()) {
    cudaEvent_t e;
    KCUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  cudaEvent_t e = pool_[used_++];
  KCUDA_CHECK(cudaEventRecord(e, stream));
  marks_.emplace_back(name, e);
}

void OpTimer::end_step() {
  std::map<std::string, double> acc;
  std::vector<std::string> order;
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0;
    KCUDA_CHECK(cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second));
    if (!acc.count(marks_[i].first)) order.push_back(marks_[i].first);
    acc[marks_[i].first] += double(ms) * 1000.0;
  }
  last_times_.clear();
  for (const auto& n : order) last_times_.emplace_back(n, acc[n]);
}

void Captures::ids_i32(int layer, const char* what, const int32_t* d, int64_t n, cudaStream_t stream) {
  if (!on) return;
  std::vector<int32_t> h(static_cast<size_t>(n));
  KCUDA_CHECK(cudaMemcpyAsync(h.data(), d, size_t(n) * 4, cudaMemcpyDeviceToHost, stream));
  KCUDA_CHECK(cudaStreamSynchronize(stream));
  auto& v = ids["L" + std::to_string(layer) + "." + what];
  v.insert(v.end(), h.begin(), h.end());
}

void Captures::bf16(const std::string& name, const uint16_t* d, int64_t n, cudaStream_t stream) {
  if (!on) return;
  std::vector<uint16_t> h(static_cast<size_t>(n));
  KCUDA_CHECK(cudaMemcpyAsync(h.data(), d, size_t(n) * 2, cudaMemcpyDeviceToHost, stream));
  KCUDA_CHECK(cudaStreamSynchronize(stream));
  auto& v = acts[name];
  for (uint16_t x : h) {
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
  }
}

}  // namespace kestrel::model::gpu
