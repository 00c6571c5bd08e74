// cuBLASLt BF16 GEMM (host code, built by g++). Row-major y[T, N] = x[T, K]·W[N, K]ᵀ is, in cuBLASLt's
// column-major terms, D[N, T] = op(A)·B with A = W viewed as a K×N column-major matrix (lda = K) and
// op = transpose, B = x viewed as K×T (ldb = ldx), D = y viewed as N×T (ldd = ldy).
#include <cublasLt.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"

#define KCUBLAS_CHECK(call)                                                                              \
  do {                                                                                                   \
    const cublasStatus_t kcublas_st_ = (call);                                                           \
    KCUDA_REQUIRE(kcublas_st_ == CUBLAS_STATUS_SUCCESS,                                                  \
                  std::string(#call) + " -> cuBLAS status " + std::to_string(int(kcublas_st_)));          \
  } while (0)

namespace kestrel::cuda {

struct GemmLt::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

template <class Key>
GemmLt::Plan* GemmLt::PlanCache<Key>::find(const Key& k) {
  auto it = map_.find(k);
  if (it == map_.end()) return nullptr;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  return it->second.plan.get();
}

template <class Key>
GemmLt::Plan* GemmLt::PlanCache<Key>::insert(const Key& k, std::unique_ptr<Plan> p) {
  // The descriptors of an evicted plan are host data that cuBLASLt read when the matmul was enqueued
  // (or captured): nothing on the device refers to them, so they may go at once.
  while (map_.size() >= kMaxPlans) {
    map_.erase(lru_.front());
    lru_.pop_front();
  }
  Plan* raw = p.get();
  auto lru = lru_.insert(lru_.end(), k);
  map_.emplace(k, Slot{std::move(p), lru});
  return raw;
}

template <class Key>
void GemmLt::PlanCache<Key>::clear() {
  map_.clear();
  lru_.clear();
}

GemmLt::GemmLt(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  cublasLtHandle_t h = nullptr;
  KCUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (workspace_bytes_) KCUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

GemmLt::~GemmLt() {
  plans_.clear();
  fp8_plans_.clear();
  bplans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

namespace {
int alignment_of(const void* p, int64_t ld_elems, size_t elem) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p) | uintptr_t(ld_elems * int64_t(elem));
  int a = 256;
  while (a > 1 && (v % uintptr_t(a)) != 0) a /= 2;
  return a;
}
}  // namespace

// cuBLASLt's first heuristic choice for a plan's descriptors, within our workspace; `align` > 0 also
// promises that alignment of every operand (0: no promise). One lookup per plan, cached by the callers.
static cublasLtMatmulAlgo_t choose_algo(cublasLtHandle_t handle, uint64_t workspace_bytes, cublasLtMatmulDesc_t op,
                                        cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d,
                                        int align, const std::string& what) {
  cublasLtMatmulPreference_t pref = nullptr;
  KCUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                       sizeof workspace_bytes);
  if (align > 0) {
    const uint32_t al = uint32_t(align);
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof al);
  }
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  KCUDA_REQUIRE(st == CUBLAS_STATUS_SUCCESS && found > 0,
                "cuBLASLt found no algorithm for " + what + " (status " + std::to_string(int(st)) + ")");
  return res.algo;
}

void GemmLt::run(const uint16_t* x, int64_t ldx, const uint16_t* w, void* y, int64_t ldy, int64_t T, int64_t K,
                 int64_t N, bool f32_out, cudaStream_t stream) {
  KCUDA_REQUIRE(x && w && y, std::string("gemm: null pointer"));
  KCUDA_REQUIRE(T >= 0 && K > 0 && N > 0 && ldx >= K && ldy >= N,
                "gemm: bad shape T=" + std::to_string(T) + " K=" + std::to_string(K) + " N=" + std::to_string(N) +
                    " ldx=" + std::to_string(ldx) + " ldy=" + std::to_string(ldy));
  KCUDA_REQUIRE(T < (int64_t(1) << 31) && K < (int64_t(1) << 31) && N < (int64_t(1) << 31),
                std::string("gemm: dimension too large"));
  if (T == 0) return;
  const size_t out_elem = f32_out ? 4 : 2;
  const int align = std::min({alignment_of(x, ldx, 2), alignment_of(w, K, 2), alignment_of(y, ldy, out_elem)});
  auto key = std::make_tuple(T, K, N, ldx, ldy, align, f32_out);
  const Plan* plan = plans_.find(key);
  if (!plan) {
    auto p = std::make_unique<Plan>();
    KCUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const cudaDataType_t dt = f32_out ? CUDA_R_32F : CUDA_R_16BF;
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, uint64_t(K), uint64_t(N), K));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, uint64_t(K), uint64_t(T), ldx));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, dt, uint64_t(N), uint64_t(T), ldy));
    p->algo = choose_algo(static_cast<cublasLtHandle_t>(handle_), workspace_bytes_, p->op, p->a, p->b, p->d, align,
                          "T=" + std::to_string(T) + " K=" + std::to_string(K) + " N=" + std::to_string(N));
    plan = plans_.insert(key, std::move(p));
  }
  const Plan& p = *plan;
  const float alpha = 1.0f, beta = 0.0f;
  KCUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.op, &alpha, w, p.a, x, p.b, &beta, y, p.d, y,
                               p.d, &p.algo, workspace_, workspace_bytes_, stream));
}

void GemmLt::bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t ldy, int64_t T, int64_t K,
                  int64_t N, cudaStream_t stream) {
  run(x, ldx, w, y, ldy, T, K, N, false, stream);
}

void GemmLt::bf16_f32(const uint16_t* x, int64_t ldx, const uint16_t* w, float* y, int64_t ldy, int64_t T, int64_t K,
                      int64_t N, cudaStream_t stream) {
  run(x, ldx, w, y, ldy, T, K, N, true, stream);
}

void GemmLt::fp8_ptpc(const uint8_t* xq, int64_t ldx, const float* xs, const uint8_t* wq, const float* ws, uint16_t* y,
                      int64_t ldy, int64_t T, int64_t K, int64_t N, cudaStream_t stream) {
  KCUDA_REQUIRE(xq && xs && wq && ws && y, std::string("fp8 gemm: null pointer"));
  KCUDA_REQUIRE(T >= 0 && K > 0 && N > 0 && K % 16 == 0 && ldx >= K && ldx % 16 == 0 && ldy >= N &&
                    T < (int64_t(1) << 31) && K < (int64_t(1) << 31) && N < (int64_t(1) << 31),
                "fp8 gemm: bad shape T=" + std::to_string(T) + " K=" + std::to_string(K) + " N=" + std::to_string(N));
  if (T == 0) return;
  const int align = std::min({alignment_of(xq, ldx, 1), alignment_of(wq, K, 1), alignment_of(y, ldy, 2)});
  auto key = std::make_tuple(T, K, N, ldx, ldy, align);
  Plan* plan = fp8_plans_.find(key);
  if (!plan) {
    auto p = std::make_unique<Plan>();
    KCUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof outer));
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof outer));
    // Placeholder scale pointers for the heuristic; each call sets its own.
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof ws));
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof xs));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, uint64_t(K), uint64_t(N), K));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, uint64_t(K), uint64_t(T), ldx));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, CUDA_R_16BF, uint64_t(N), uint64_t(T), ldy));
    p->algo = choose_algo(static_cast<cublasLtHandle_t>(handle_), workspace_bytes_, p->op, p->a, p->b, p->d, align,
                          "fp8 T=" + std::to_string(T) + " K=" + std::to_string(K) + " N=" + std::to_string(N));
    plan = fp8_plans_.insert(key, std::move(p));
  }
  const Plan& p = *plan;
  KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof ws));
  KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof xs));
  const float alpha = 1.0f, beta = 0.0f;
  KCUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.op, &alpha, wq, p.a, xq, p.b, &beta, y, p.d,
                               y, p.d, &p.algo, workspace_, workspace_bytes_, stream));
}

// Row-major y[M, N] = x[M, K]·W[K, N] is, column-major, D[N, M] = A[N, K]·B[K, M] with A = W (ld ldw) and
// B = x (ld ldx), neither transposed.
void GemmLt::batched_xw_f32(const uint16_t* x, int64_t ldx, int64_t sx, const uint16_t* w, int64_t ldw, int64_t sw,
                            float* y, int64_t ldy, int64_t sy, int64_t M, int64_t K, int64_t N, int64_t batch,
                            cudaStream_t stream) {
  KCUDA_REQUIRE(x && w && y && M >= 0 && K > 0 && N > 0 && batch > 0 && ldx >= K && ldw >= N && ldy >= N,
                std::string("batched gemm: bad arguments"));
  if (M == 0) return;
  auto key = std::make_tuple(M, K, N, ldx, ldw, ldy, sx, sw, sy, batch);
  const Plan* plan = bplans_.find(key);
  if (!plan) {
    auto p = std::make_unique<Plan>();
    KCUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t tn = CUBLAS_OP_N;
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &tn, sizeof tn));
    KCUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tn, sizeof tn));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, uint64_t(N), uint64_t(K), ldw));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, uint64_t(K), uint64_t(M), ldx));
    KCUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, uint64_t(N), uint64_t(M), ldy));
    const int32_t bc = int32_t(batch);
    cublasLtMatrixLayout_t lay[3] = {p->a, p->b, p->d};
    const int64_t strides[3] = {sw, sx, sy};
    for (int i = 0; i < 3; ++i) {
      KCUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(lay[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
      KCUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(lay[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                                                     sizeof strides[i]));
    }
    p->algo = choose_algo(static_cast<cublasLtHandle_t>(handle_), workspace_bytes_, p->op, p->a, p->b, p->d, 0,
                          "batched M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N));
    plan = bplans_.insert(key, std::move(p));
  }
  const Plan& p = *plan;
  const float alpha = 1.0f, beta = 0.0f;
  KCUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.op, &alpha, w, p.a, x, p.b, &beta, y, p.d, y,
                               p.d, &p.algo, workspace_, workspace_bytes_, stream));
}

}  // namespace kestrel::cuda
