// GEMM driver: Lin(W) of MODEL.md §3 for any number of rows, FP32 accumulation in ORDER_K
// (gemm_kernels.h; ORDER_K2 on avx512bf16), over weights packed into 16-output panels.
//
// One path for every row count: decode (1 row), a batch of decodes and a prefill chunk run the same
// per-element arithmetic, so a token's output never depends on the other rows of the call — the CPU
// engine's batch invariance rests on this. Work is split over the thread pool in tasks of 4 panels
// (64 outputs) × up to 192 rows; inside a task each panel stays in L1 while the rows stream past; a
// call of few rows is weighed by its weight bytes (decode GEMVs are bandwidth-bound).
// Packing: under a PackedScope (the CPU executor holds one PackedWeights for its model) a weight is
// packed on first use and reused for the process's life of that object; otherwise every call packs
// its weights into scratch (the same values, so the same results, at the cost of a transpose).
// Several weights that share one input run as one call (gemm_*_multi): the activations are prepared
// once and all tasks share one parallel region.
// Why not OpenBLAS: Debian's build has no sbgemm (no bf16), sgemm would need every weight widened to
// f32 (twice the bytes for decode), and its result for a row may change with the row count (kernel
// choice by shape); `kestrel bench --cpu-ceilings` prints both rates.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/simd_avx2.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {

using gemm_detail::PackedView;
using gemm_detail::PanelFormat;

struct PackedWeights::Impl {
  using Key = std::tuple<const uint16_t*, int64_t, int64_t, int64_t, bool, int>;  // w, N, K, ldw, kmajor, format
  std::mutex mu;
  std::map<Key, std::vector<uint32_t>> packed;
  int64_t bytes = 0;
};

PackedWeights::PackedWeights() : impl_(std::make_unique<Impl>()) {}
PackedWeights::~PackedWeights() = default;
int64_t PackedWeights::bytes() const {
  std::lock_guard lk(impl_->mu);
  return impl_->bytes;
}

namespace {

thread_local PackedWeights* t_packed = nullptr;

struct OutDesc {
  const uint16_t* w;
  int64_t N, ldw;
  bool kmajor;
  float* y;
  uint16_t* yb;
  int64_t ldy;
};

}  // namespace

PackedScope::PackedScope(PackedWeights* p) : prev_(t_packed) { t_packed = p; }
PackedScope::~PackedScope() { t_packed = prev_; }

namespace {

// The packed form of one weight: from the scope's cache (packed on first use), else into `scratch`.
PackedView packed_view(const OutDesc& d, int64_t K, PanelFormat f, std::vector<uint32_t>& scratch) {
  PackedView v{nullptr, d.N, K, gemm_detail::panel_dwords(f, K), f};
  const size_t dwords = size_t((d.N + 15) / 16 * v.stride);
  if (PackedWeights* pw = t_packed) {
    auto& impl = *pw->impl();
    std::lock_guard lk(impl.mu);
    auto [it, fresh] = impl.packed.try_emplace({d.w, d.N, K, d.ldw, d.kmajor, int(f)});
    if (fresh) {
      it->second.resize(dwords);
      gemm_detail::pack(d.w, d.ldw, d.kmajor, d.N, K, f, it->second.data());
      impl.bytes += int64_t(dwords * 4);
    }
    v.data = it->second.data();
    return v;
  }
  scratch.resize(dwords);
  gemm_detail::pack(d.w, d.ldw, d.kmajor, d.N, K, f, scratch.data());
  v.data = scratch.data();
  return v;
}

void run(const uint16_t* xb, const float* xf, int64_t ldx, int64_t T, int64_t K, const std::vector<OutDesc>& outs) {
  if (T == 0 || outs.empty()) return;
  const Isa i = isa();
  const PanelFormat f = i == Isa::avx512bf16 && xb ? PanelFormat::kPairs : PanelFormat::kAvx2;
  // Activations as the kernels read them: f32 [T, K] (ORDER_K), or bf16 [T, Kp] padded to even K (pairs:
  // the caller's rows themselves when K is even, a padded copy otherwise).
  thread_local std::vector<float> xs;
  thread_local std::vector<uint16_t> xs16;
  const float* xk = nullptr;
  const uint16_t* xk16 = nullptr;
  int64_t ld = K;
  if (f == PanelFormat::kPairs && K % 2 == 0) {  // the rows as they are: no padding to add
    xk16 = xb;
    ld = ldx;
  } else if (f == PanelFormat::kPairs) {
    ld = K + 1;
    xs16.resize(size_t(T * ld));
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(xs16.data() + t * ld, xb + t * ldx, size_t(K) * 2);
      xs16[size_t(t * ld + K)] = 0;
    }
    xk16 = xs16.data();
  } else if (xf) {
    xk = xf;
    ld = ldx;
  } else {
    xs.resize(size_t(T * K));
    for (int64_t t = 0; t < T; ++t) bf16_to_f32_n(xb + t * ldx, xs.data() + t * K, K);
    xk = xs.data();
  }
  thread_local std::vector<std::vector<uint32_t>> scratch;
  if (scratch.size() < outs.size()) scratch.resize(outs.size());
  std::vector<PackedView> views(outs.size());
  for (size_t o = 0; o < outs.size(); ++o) views[o] = packed_view(outs[o], K, f, scratch[o]);

  constexpr int64_t kGroup = 4;  // panels per task
  // Row blocks of at most MBmax rows (the block's activations stay in L2 while the panels pass), as
  // equal as the micro-kernel's row count allows: a 256-row prefill chunk cut 192 + 64 left one thread
  // idle for up to a 192-row task at the region's end (issue #22); 132 + 124 (avx2) or 128 + 128 do
  // not. Which block or tile computes a row never changes its sums (ORDER_K / ORDER_K2 above).
  const int64_t MBmax = std::clamp<int64_t>((int64_t(192) << 10) / (K * 4) / 6 * 6, 6, 192);
  const int64_t mblocks = (T + MBmax - 1) / MBmax, mr = f == PanelFormat::kPairs ? 8 : 6;
  const int64_t MB = std::min(MBmax, ((T + mblocks - 1) / mblocks + mr - 1) / mr * mr);
  std::vector<int64_t> first(outs.size() + 1, 0);  // first task of each output
  int64_t work = 0;
  for (size_t o = 0; o < outs.size(); ++o) {
    const int64_t groups = ((outs[o].N + 15) / 16 + kGroup - 1) / kGroup;
    first[o + 1] = first[o] + groups * mblocks;
    // Few rows (decode) stream the weight from L3 or DRAM, which one core cannot saturate: count such a
    // call as if it had 8 rows, so a 256 × 256 decode GEMV already runs on two threads (issue #22:
    // c = 1 TPOT was mostly single-threaded GEMVs while the other core spun).
    work += std::max<int64_t>(T, 8) * K * outs[o].N;
  }
  parallel_for(first.back(), work, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      size_t o = 0;
      while (task >= first[o + 1]) ++o;
      const OutDesc& d = outs[o];
      const int64_t local = task - first[o], g = local / mblocks, mb = local % mblocks;
      const int64_t panels = (d.N + 15) / 16, m0 = mb * MB;
      gemm_detail::PanelBlock blk;
      blk.w = views[o];
      blk.p0 = g * kGroup;
      blk.np = std::min(kGroup, panels - blk.p0);
      blk.M = std::min(MB, T - m0);
      blk.ldx = ld;
      blk.ldy = d.ldy;
      if (d.yb)
        blk.yb = d.yb + m0 * d.ldy + 16 * blk.p0;
      else
        blk.y = d.y + m0 * d.ldy + 16 * blk.p0;
      if (f == PanelFormat::kPairs) {
        blk.xb = xk16 + m0 * ld;
        gemm_detail::panels_avx512bf16(blk);
      } else {
        blk.x = xk + m0 * ld;
        if (i >= Isa::avx2)
          gemm_detail::panels_avx2(blk);
        else
          gemm_detail::panels_portable(blk);
      }
    }
  });
}

void check_shape(int64_t ldx, int64_t T, int64_t in) {
  KCHECK(T >= 0 && in > 0, "bad gemm shape T={} in={}", T, in);
  KCHECK(ldx >= in, "bad gemm stride ldx={} (in {})", ldx, in);
}

std::vector<OutDesc> describe(int64_t in, std::span<const GemmOut> outs) {
  std::vector<OutDesc> d;
  for (const GemmOut& o : outs) {
    const int64_t ldw = o.ldw ? o.ldw : (o.w_kmajor ? o.out : in);
    KCHECK(o.w && o.out > 0 && o.ldy >= o.out && (o.y || o.yf), "bad gemm output out={} ldy={}", o.out, o.ldy);
    KCHECK(ldw >= (o.w_kmajor ? o.out : in), "bad gemm weight stride {}", ldw);
    d.push_back({o.w, o.out, ldw, o.w_kmajor, o.yf, o.y, o.ldy});
  }
  return d;
}

// bf16 → f32 is exact (a shift), so the vector loop gives the scalar loop's bits. Why: the AVX2 GEMM
// widens every call's activations on the calling thread before its region; as a scalar loop that was
// ~2 % of a 2K prefill on an AVX2-only CPU (issue #22).
KESTREL_AVX2 void bf16_to_f32_avx2(const uint16_t* x /* bf16 [n] */, float* y /* f32 [n] */, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_ps(y + i, simd::load_bf16(x + i));
    _mm256_storeu_ps(y + i + 8, simd::load_bf16(x + i + 8));
  }
  for (; i < n; ++i) y[i] = bf16_to_f32(x[i]);
}

}  // namespace

void bf16_to_f32_n(const uint16_t* x, float* y, int64_t n) {
  if (isa() >= Isa::avx2) return bf16_to_f32_avx2(x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(x[i]);
}

void f32_to_bf16_n(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = f32_to_bf16(x[i]);
}

void gemm_bf16_f32(const uint16_t* x, int64_t ldx, const uint16_t* w, float* y, int64_t ldy, int64_t T, int64_t in,
                   int64_t out) {
  const GemmOut o{w, out, nullptr, y, ldy};
  gemm_multi(x, nullptr, ldx, T, in, std::span<const GemmOut>(&o, 1));
}

void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t ldy, int64_t T, int64_t in,
               int64_t out) {
  const GemmOut o{w, out, y, nullptr, ldy};
  gemm_multi(x, nullptr, ldx, T, in, std::span<const GemmOut>(&o, 1));
}

void gemm_f32_bf16w(const float* x, int64_t ldx, const uint16_t* w, float* y, int64_t ldy, int64_t T, int64_t in,
                    int64_t out) {
  const GemmOut o{w, out, nullptr, y, ldy};
  gemm_multi(nullptr, x, ldx, T, in, std::span<const GemmOut>(&o, 1));
}

void gemm_bf16_multi(const uint16_t* x, int64_t ldx, int64_t T, int64_t in, std::span<const GemmOut> outs) {
  gemm_multi(x, nullptr, ldx, T, in, outs);
}

void gemm_multi(const uint16_t* xb, const float* xf, int64_t ldx, int64_t T, int64_t in, std::span<const GemmOut> outs) {
  KCHECK((xb != nullptr) != (xf != nullptr), "gemm needs exactly one of bf16 and f32 activations");
  check_shape(ldx, T, in);
  run(xb, xf, ldx, T, in, describe(in, outs));
}

}  // namespace kestrel::cpu
