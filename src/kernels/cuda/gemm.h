// Lin(W)(x) = x·Wᵀ on the GPU (MODEL.md §3 conventions): BF16 operands, FP32 accumulation, output
// rounded once to BF16 (or kept FP32 for the router / lm_head). CPU twins: cpu::gemm_bf16 and
// cpu::gemm_bf16_f32 (kernels/cpu/cpu_ops.h).
//
// GemmLt runs every shape through cuBLASLt (row-major x·Wᵀ is the column-major product W·xᵀ with W
// transposed), caching the heuristic's algorithm per (shape, strides, alignment, output dtype).
// The caches are LRU-bounded (kMaxPlans each): a server's steps come in every row count up to the
// token budget, so an unbounded cache kept a plan (~1 KB of descriptors) per shape ever seen and the
// host memory grew with the requests served (issue #24). A plan evicted and needed again costs one
// more heuristic query, which cuBLASLt answers from its own bounded heuristics cache.
// gemv_bf16 is a hand-written T = 1 kernel (one warp per output row, 16-byte loads of W) for the
// decode path, to be chosen over cuBLASLt where it measures faster.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <tuple>

namespace kestrel::cuda {

class GemmLt {
 public:
  explicit GemmLt(size_t workspace_bytes = size_t(32) << 20);
  ~GemmLt();
  GemmLt(const GemmLt&) = delete;
  GemmLt& operator=(const GemmLt&) = delete;

  // y = bf16(x·Wᵀ).
  void bf16(const uint16_t* x /* bf16 [T, K], row stride ldx */, int64_t ldx,
            const uint16_t* w /* bf16 [N, K], contiguous */, uint16_t* y /* bf16 [T, N], row stride ldy */,
            int64_t ldy, int64_t T, int64_t K, int64_t N, cudaStream_t stream);
  // y = x·Wᵀ in FP32.
  void bf16_f32(const uint16_t* x /* bf16 [T, K], row stride ldx */, int64_t ldx,
                const uint16_t* w /* bf16 [N, K], contiguous */, float* y /* f32 [T, N], row stride ldy */,
                int64_t ldy, int64_t T, int64_t K, int64_t N, cudaStream_t stream);
  // PTPC FP8 (--quantization ptpc-fp8): y = bf16((xq·Wqᵀ)[t, n]·ws[n]·xs[t]), e4m3 operands, FP32
  // accumulation, the scales applied by cuBLASLt as outer vectors (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F).
  // K and ldx multiples of 16; operands 16-byte aligned. The prefill path; decode takes gemm_skinny_fp8.
  void fp8_ptpc(const uint8_t* xq /* e4m3 [T, K], row stride ldx */, int64_t ldx, const float* xs /* f32 [T] */,
                const uint8_t* wq /* e4m3 [N, K], contiguous */, const float* ws /* f32 [N] */,
                uint16_t* y /* bf16 [T, N], row stride ldy */, int64_t ldy, int64_t T, int64_t K, int64_t N,
                cudaStream_t stream);
  // Batched, W not transposed: for b < batch, y_b[M, N] = x_b[M, K]·W_b[K, N] in FP32 (the MLA absorbed
  // q̃ = W_UKᵀ q_nope over heads). Matrix b starts at x + b·sx, w + b·sw, y + b·sy (elements).
  void batched_xw_f32(const uint16_t* x, int64_t ldx, int64_t sx, const uint16_t* w, int64_t ldw, int64_t sw,
                      float* y, int64_t ldy, int64_t sy, int64_t M, int64_t K, int64_t N, int64_t batch,
                      cudaStream_t stream);

  static constexpr size_t kMaxPlans = 4096;  // per cache (plain, FP8 and batched)
  size_t cached_plans() const { return plans_.size() + fp8_plans_.size() + bplans_.size(); }

 private:
  struct Plan;
  // An LRU map of plans: find() marks a hit most recent, insert() drops the least recent beyond kMaxPlans.
  template <class Key>
  class PlanCache {
   public:
    Plan* find(const Key& k);
    Plan* insert(const Key& k, std::unique_ptr<Plan> p);
    size_t size() const { return map_.size(); }
    void clear();

   private:
    struct Slot {
      std::unique_ptr<Plan> plan;
      typename std::list<Key>::iterator lru;
    };
    std::map<Key, Slot> map_;
    std::list<Key> lru_;  // front = least recently used
  };
  void run(const uint16_t* x, int64_t ldx, const uint16_t* w, void* y, int64_t ldy, int64_t T, int64_t K, int64_t N,
           bool f32_out, cudaStream_t stream);
  void* handle_ = nullptr;     // cublasLtHandle_t
  void* workspace_ = nullptr;  // device
  size_t workspace_bytes_ = 0;
  PlanCache<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, bool>> plans_;
  PlanCache<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int>> fp8_plans_;
  PlanCache<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>>
      bplans_;
};

// T = 1: y[n] = Σ_k x[k]·W[n, k], FP32 accumulation; bf16 output (y_bf16) or f32 output (y_f32):
// exactly one of the two is non-null. K must be a multiple of 8; x and W 16-byte aligned.
void gemv_bf16(const uint16_t* x /* bf16 [K] */, const uint16_t* w /* bf16 [N, K], contiguous */,
               uint16_t* y_bf16 /* bf16 [N] or null */, float* y_f32 /* f32 [N] or null */, int64_t K, int64_t N,
               cudaStream_t stream);

}  // namespace kestrel::cuda
