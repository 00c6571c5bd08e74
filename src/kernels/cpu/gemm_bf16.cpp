// GEMM driver: Lin(W) of MODEL.md §3 for any number of rows, with FP32 accumulation in ORDER16
// (gemm_kernels.h) on avx2/portable and the vdpbf16ps order on avx512bf16.
//
// One path for every row count: decode (1 row), a batch of decodes and a prefill chunk all run the
// same per-element arithmetic, so a token's output never depends on the other rows of the call —
// the CPU engine's batch invariance rests on this. Work is split over the thread pool in blocks of
// 64 output columns × up to 256 rows (the row block shrinks for long K so the activation block stays
// in L2); the weights are read straight from the checkpoint's bf16 storage, never converted.
// Several weights that share one input (q/k/v/g of KDA, gate/up of an MLP) run as one call
// (gemm_bf16_multi): the activations are prepared once and all blocks share one parallel region.
// Why not OpenBLAS: Debian's build has no sbgemm (no bf16), sgemm would need every weight widened to
// f32 first, and its result for a row changes with the row count; kestrel bench --cpu-ceilings
// prints both rates.
#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"

namespace kestrel::cpu {
namespace {

using gemm_detail::Block;

struct OutDesc {
  const uint16_t* w;
  int64_t N;
  float* y;
  uint16_t* yb;
  int64_t ldy;
};

void check_shape(int64_t ldx, int64_t T, int64_t in) {
  KCHECK(T >= 0 && in > 0, "bad gemm shape T={} in={}", T, in);
  KCHECK(ldx >= in, "bad gemm stride ldx={} (in {})", ldx, in);
}

void run(const uint16_t* xb, const float* xf, int64_t ldx, int64_t T, int64_t K, const std::vector<OutDesc>& outs) {
  if (T == 0 || outs.empty()) return;
  const Isa i = isa();
  const bool bf16_path = i == Isa::avx512bf16 && xb;
  thread_local std::vector<float> xp;  // f32 [T, K] permuted activations (ORDER16 paths)
  if (!bf16_path) {
    xp.resize(size_t(T * K));
    for (int64_t t = 0; t < T; ++t) {
      if (xf)
        gemm_detail::permute_row_f32(xf + t * ldx, K, xp.data() + t * K);
      else if (i >= Isa::avx2)
        gemm_detail::permute_row_bf16_avx2(xb + t * ldx, K, xp.data() + t * K);
      else
        gemm_detail::permute_row_bf16(xb + t * ldx, K, xp.data() + t * K);
    }
  }
  constexpr int64_t NB = 64;
  const int64_t MB = std::clamp<int64_t>((int64_t(256) << 10) / (K * 4) / 4 * 4, 4, 256);
  const int64_t mblocks = (T + MB - 1) / MB;
  std::vector<int64_t> first(outs.size() + 1, 0);  // first task of each output
  int64_t work = 0;
  for (size_t o = 0; o < outs.size(); ++o) {
    first[o + 1] = first[o] + (outs[o].N + NB - 1) / NB * mblocks;
    work += T * K * outs[o].N;
  }
  const float* xpd = xp.data();
  parallel_for(first.back(), work, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      size_t o = 0;
      while (task >= first[o + 1]) ++o;
      const OutDesc& d = outs[o];
      const int64_t local = task - first[o], nb = local / mblocks, mb = local % mblocks;
      const int64_t n0 = nb * NB, m0 = mb * MB;
      Block blk;
      blk.K = K;
      blk.M = std::min(MB, T - m0);
      blk.N = std::min(NB, d.N - n0);
      blk.w = d.w + n0 * K;
      blk.ldw = K;
      blk.ldy = d.ldy;
      if (d.yb)
        blk.yb = d.yb + m0 * d.ldy + n0;
      else
        blk.y = d.y + m0 * d.ldy + n0;
      if (bf16_path) {
        blk.xb = xb + m0 * ldx;
        blk.ldx = ldx;
        gemm_detail::block_avx512bf16(blk);
      } else {
        blk.xp = xpd + m0 * K;
        blk.ldx = K;
        if (i >= Isa::avx2)
          gemm_detail::block_avx2(blk);
        else
          gemm_detail::block_portable(blk);
      }
    }
  });
}

}  // namespace

void bf16_to_f32_n(const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(x[i]);
}

void f32_to_bf16_n(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = f32_to_bf16(x[i]);
}

void gemm_bf16_f32(const uint16_t* x, int64_t ldx, const uint16_t* w, float* y, int64_t ldy, int64_t T, int64_t in,
                   int64_t out) {
  check_shape(ldx, T, in);
  KCHECK(out > 0 && ldy >= out, "bad gemm output out={} ldy={}", out, ldy);
  run(x, nullptr, ldx, T, in, {OutDesc{w, out, y, nullptr, ldy}});
}

void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t ldy, int64_t T, int64_t in,
               int64_t out) {
  check_shape(ldx, T, in);
  KCHECK(out > 0 && ldy >= out, "bad gemm output out={} ldy={}", out, ldy);
  run(x, nullptr, ldx, T, in, {OutDesc{w, out, nullptr, y, ldy}});
}

void gemm_f32_bf16w(const float* x, int64_t ldx, const uint16_t* w, float* y, int64_t ldy, int64_t T, int64_t in,
                    int64_t out) {
  check_shape(ldx, T, in);
  KCHECK(out > 0 && ldy >= out, "bad gemm output out={} ldy={}", out, ldy);
  run(nullptr, x, ldx, T, in, {OutDesc{w, out, y, nullptr, ldy}});
}

void gemm_bf16_multi(const uint16_t* x, int64_t ldx, int64_t T, int64_t in, std::span<const GemmOut> outs) {
  check_shape(ldx, T, in);
  std::vector<OutDesc> d;
  for (const GemmOut& o : outs) {
    KCHECK(o.w && o.out > 0 && o.ldy >= o.out && (o.y || o.yf), "bad gemm output out={} ldy={}", o.out, o.ldy);
    d.push_back({o.w, o.out, o.yf, o.y, o.ldy});
  }
  run(x, nullptr, ldx, T, in, d);
}

}  // namespace kestrel::cpu
