// Lin(W)(x) dispatch (see linear.h).
#include "model/cuda/linear.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ptpc.h"
#include "model/cuda/context.h"

namespace kestrel::model::gpu {

DecodeOptions DecodeOptions::from_env() {
  DecodeOptions o;
  auto off = [](const char* name) {
    const char* e = std::getenv(name);
    return e && std::strcmp(e, "0") == 0;
  };
  o.skinny = !off("KESTREL_SKINNY");
  o.fuse = !off("KESTREL_FUSE");
  o.graph_attn = !off("KESTREL_GRAPH_ATTN");
  o.combine_norm = !off("KESTREL_COMBINE_NORM");
  o.embed_in_point = !off("KESTREL_EMBED_IN_POINT");
  o.mla_norms = !off("KESTREL_MLA_NORMS");
  o.mla_gate_in_merge = !off("KESTREL_MLA_GATE_IN_MERGE");
  if (const char* e = std::getenv("KESTREL_ROUTE_IN_GEMM")) o.route_in_gemm = std::strcmp(e, "1") == 0;
  o.spec_graphs = !off("KESTREL_SPEC_GRAPHS");
  if (const char* e = std::getenv("KESTREL_WIDE")) {
    const long v = std::strtol(e, nullptr, 10);
    if (v >= 0 && v <= cuda::kGemmMaxSegs) o.wide_min_segs = int(v);
  }
  if (const char* e = std::getenv("KESTREL_SPEC_GRAPH_PAD")) o.spec_graph_pad = std::strcmp(e, "1") == 0;
  if (const char* e = std::getenv("KESTREL_SPEC_TRACE")) o.spec_trace_kernels = std::strcmp(e, "launches") != 0;
  if (const char* e = std::getenv("KESTREL_SKINNY_MAX_T")) {
    const long v = std::strtol(e, nullptr, 10);
    if (v >= 0 && v <= cuda::kSkinnyMaxT) o.skinny_max_t = v;
  }
  if (const char* e = std::getenv("KESTREL_KDA_FUSED_MAX_T")) {
    const long v = std::strtol(e, nullptr, 10);
    if (v >= 0) o.kda_fused_max_t = v;
  }
  return o;
}

void linear(Context& c, const LinearDev& W, const u16* x, int64_t ldx, int64_t T, const cuda::GemmSegs& segs,
            const Fp8Act* pre) {
  KCHECK(W.N > 0 && W.K > 0 && (W.w || W.w8) && segs.n >= 1, "linear: empty weight or no output segments");
  if (T == 0) return;
  const int64_t K = W.K, N = W.N;
  // The router's top-k on the segments (gemm_skinny.h GemmRoute): in the skinny launch where it can run there,
  // else moe_route after whichever GEMM runs (the same ids and weights either way).
  if (segs.route.seg >= 0 &&
      !(!W.fp8() && c.opt.skinny && T <= c.opt.skinny_max_t && cuda::gemm_skinny_ok(x, ldx, W.w, T, K, N, segs, false) &&
        cuda::gemm_skinny_route_ok(T, segs, N, c.skinny))) {
    const cuda::GemmRoute& r = segs.route;
    KCHECK(r.seg < segs.n && segs.seg[r.seg].epi == cuda::GemmEpi::f32, "linear: the route's segment is not FP32");
    const cuda::GemmSeg& rs = segs.seg[r.seg];
    const int64_t X = (r.seg + 1 < segs.n ? segs.seg[r.seg + 1].n0 : N) - rs.n0;
    KCHECK(rs.ldy == X, "linear: the route's logits must be contiguous rows ([T, X])");
    cuda::GemmSegs plain = segs;
    plain.route = cuda::GemmRoute{};
    linear(c, W, x, ldx, T, plain, pre);
    cuda::moe_route(static_cast<const float*>(rs.y), r.bias, T, X, r.K, r.renormalize, r.scaling, r.ids, r.weights,
                    c.stream);
    return;
  }
  Fp8Act q;
  if (W.fp8()) {
    if (pre && pre->q) {
      q = *pre;
    } else {
      uint8_t* q8 = c.tmp<uint8_t>(T * K);
      float* s = c.tmp<float>(T);
      cuda::quantize_fp8_rows(x, ldx, T, K, q8, s, c.stream);
      q = {q8, s};
    }
  }
  const bool skinny = c.opt.skinny && T <= c.opt.skinny_max_t &&
                      (W.fp8() ? cuda::gemm_skinny_ok(q.q, K, W.w8, T, K, N, segs, true)
                               : cuda::gemm_skinny_ok(x, ldx, W.w, T, K, N, segs, false));
  if (skinny) {
    if (W.fp8())
      cuda::gemm_skinny_fp8(q.q, K, q.s, W.w8, W.ws, T, K, N, segs, c.skinny, c.stream);
    else
      cuda::gemm_skinny_bf16(x, ldx, W.w, T, K, N, segs, c.skinny, c.stream);
    return;
  }
  // Above the skinny kernel's rows and up to 64, for stacks of at least wide_min_segs outputs: the wide GEMM,
  // BF16, all segments in one launch (cuBLASLt below takes one launch per segment, plus the epilogues').
  if (!W.fp8() && c.opt.wide_min_segs > 0 && segs.n >= c.opt.wide_min_segs && T <= cuda::kSkinnyMaxT &&
      cuda::gemm_wide_ok(x, ldx, W.w, T, K, N, segs, c.skinny)) {
    cuda::gemm_wide_bf16(x, ldx, W.w, T, K, N, segs, c.skinny, c.stream);
    return;
  }
  // cuBLASLt, one call per segment over the segment's rows of W (contiguous), epilogues separately.
  for (int i = 0; i < segs.n; ++i) {
    const cuda::GemmSeg& sg = segs.seg[i];
    const int64_t n0 = sg.n0, n1 = i + 1 < segs.n ? segs.seg[i + 1].n0 : N, len = n1 - n0;
    KCHECK(n0 >= 0 && len > 0 && n1 <= N, "linear: bad segment [{}, {}) of {} rows", n0, n1, N);
    auto gemm_into = [&](u16* y, int64_t ldy) {
      if (!W.fp8()) {
        c.lt.bf16(x, ldx, W.w + n0 * K, y, ldy, T, K, len, c.stream);
      } else if (len % 16 == 0 && ldy % 8 == 0 && (reinterpret_cast<uintptr_t>(y) & 15u) == 0) {
        c.lt.fp8_ptpc(q.q, K, q.s, W.w8 + n0 * K, W.ws + n0, y, ldy, T, K, len, c.stream);
      } else {  // shapes cuBLASLt's FP8 kernels refuse (e.g. b_proj's 12 rows): the skinny kernel, 64 tokens at a time
        for (int64_t t0 = 0; t0 < T; t0 += cuda::kSkinnyMaxT) {
          const int64_t tn = std::min<int64_t>(cuda::kSkinnyMaxT, T - t0);
          cuda::GemmSegs one;
          one.seg[0] = seg_bf16(0, y + t0 * ldy, ldy);
          one.n = 1;
          cuda::gemm_skinny_fp8(q.q + t0 * K, K, q.s + t0, W.w8 + n0 * K, W.ws + n0, tn, K, len, one, c.skinny,
                                c.stream);
        }
      }
    };
    switch (sg.epi) {
      case cuda::GemmEpi::bf16:
        gemm_into(static_cast<u16*>(sg.y), sg.ldy);
        break;
      case cuda::GemmEpi::f32:
        KCHECK(!W.fp8(), "linear: an FP32 output of an FP8 weight");
        c.lt.bf16_f32(x, ldx, W.w + n0 * K, static_cast<float*>(sg.y), sg.ldy, T, K, len, c.stream);
        break;
      case cuda::GemmEpi::add_bf16: {
        KCHECK(sg.ldy == len && sg.ld_add == len, "linear: the add epilogue wants contiguous rows");
        u16* tmp = c.tmp<u16>(T * len);
        gemm_into(tmp, len);
        cuda::add_bf16(tmp, sg.add, static_cast<u16*>(sg.y), T * len, c.stream);
        break;
      }
      case cuda::GemmEpi::situ_glu8: {
        u16* tmp = c.tmp<u16>(T * len);
        gemm_into(tmp, len);
        cuda::situ_glu_i8_bf16(tmp, len, T, len / 2, segs.glu_beta, segs.glu_linear_beta, static_cast<u16*>(sg.y),
                               sg.ldy, c.stream);
        break;
      }
    }
  }
}

void linear(Context& c, const LinearDev& W, const u16* x, int64_t ldx, int64_t T, u16* y, int64_t ldy,
            const Fp8Act* pre) {
  cuda::GemmSegs s;
  s.seg[0] = seg_bf16(0, y, ldy);
  s.n = 1;
  linear(c, W, x, ldx, T, s, pre);
}

}  // namespace kestrel::model::gpu
