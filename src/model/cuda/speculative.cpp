// DSpark verification on the GPU, MODEL.md §5 (docs/speculative.md "One speculative step"; CPU twins:
// ForwardOptions::tap_layers in model/model.cpp, KdaStateView::trace_* and kda_keep_position in
// model/kda.cpp):
//  - taps: the AttnRes partial sum P after each tap layer, every row of the step, into bf16 [T, n·D];
//  - a verify sequence's KDA steps 2 and 6 position by position with the decode kernels' per-token
//    arithmetic, so each row's state is what token-by-token decoding leaves, stored after each position in
//    the cache's trace: one traced launch over all verify sequences (kda_conv_decode_traced,
//    kda_decode_traced), or with KESTREL_SPEC_TRACE=launches (and for an FP16 state) one decode launch per
//    position and request followed by a copy of the slot;
//  - keep_verified: the traced state after the last accepted position back into the slot (no recompute):
//    keep_verified_batch does it for every verify sequence and KDA layer in one copy_rows_multi launch
//    (kernels/cuda/rows.h), the executor's default; keep_verified, two copies per layer and sequence, is the
//    A/B twin (KESTREL_SPEC_KEEP=perseq) and the tests' reference.
// A pure-verify step may run through a verify graph bucket (graphs.h): the traced launches, the taps' copies
// and every row's logits are captured; the trace's address is baked into those graphs, so reallocating it
// drops the cache's verify buckets first. The trace holds a full state per position: fine
// at nano / mini sizes; at full size it wants the kernel to keep only the block's states and select the
// accepted one in place (docs/speculative.md "What the GPU path needs").
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/rows.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

void upload_verify(Context& x, CudaCache& cc, BatchStep& s) {
  cc.verify.clear();
  if (s.nv == 0) return;
  // cu_seqlens of one row r is iota + r = {r, r + 1}: the decode kernels read row r of the step's stacked
  // activations through their usual base pointers.
  std::vector<int32_t> iota(size_t(s.T + 1));  // i32 [T+1]
  std::iota(iota.begin(), iota.end(), 0);
  int32_t* d = x.tmp<int32_t>(s.T + 1);
  KCUDA_CHECK(cudaMemcpyAsync(d, iota.data(), iota.size() * 4, cudaMemcpyHostToDevice, x.stream));
  s.d_iota = d;
  for (int64_t b = s.nd; b < s.nd + s.nv; ++b)
    cc.verify.push_back({s.slot[size_t(b)], s.row0[size_t(b)] - s.row0[size_t(s.nd)], s.len[size_t(b)]});
  // The trace: one slot's bytes per verify row and KDA layer, grown to the largest block count seen.
  if (s.nvr > cc.trace_cap) {
    const int64_t sb = cc.layout.kda_recurrent_bytes, cb = cc.layout.kda_conv_bytes;
    // The old trace may still be read by queued copies of an earlier step: wait for them before freeing.
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
    cc.graphs.release_verify(*cc.alloc);  // their graphs write the old trace
    for (auto* v : {&cc.trace_S, &cc.trace_conv})
      for (uint8_t* p : *v) cc.alloc->free(p);
    if (cc.keep_tab) cc.alloc->free(cc.keep_tab);  // it points into the old trace
    cc.keep_tab = nullptr, cc.keep_arrays = 0;
    cc.trace_S.assign(cc.kda_S.size(), nullptr);
    cc.trace_conv.assign(cc.kda_S.size(), nullptr);
    for (size_t L = 0; L < cc.kda_S.size(); ++L) {
      if (!cc.kda_S[L]) continue;
      cc.trace_S[L] = static_cast<uint8_t*>(cc.alloc->alloc(size_t(s.nvr * sb)));
      cc.trace_conv[L] = static_cast<uint8_t*>(cc.alloc->alloc(size_t(s.nvr * cb)));
    }
    cc.trace_cap = s.nvr;
  }
}

void kda_verify_conv(Context& x, const KdaWeightsDev& w, CudaCache& cc, const BatchStep& s, int layer,
                     const u16* qkv, u16* conv) {
  const TextConfig& c = x.c;
  const int64_t HD = c.kda.num_heads * c.kda.head_dim, W = c.kda.conv_size, cb = cc.layout.kda_conv_bytes;
  u16* hist = cc.kda_conv[size_t(layer)];  // bf16 [slots+1, W−1, 3·HD]
  if (x.opt.spec_trace_kernels && W >= 2) {
    // One launch over every verify sequence's positions, the history after each traced (kda.h).
    cuda::kda_conv_decode_traced(qkv, 3 * HD, w.conv, hist, s.d_cu + s.nd, s.d_slots + s.nd, conv, 3 * HD, s.nv,
                                 3 * HD, W, reinterpret_cast<u16*>(cc.trace_conv[size_t(layer)]), s.row0[size_t(s.nd)],
                                 x.stream);
    return;
  }
  for (int64_t b = s.nd; b < s.nd + s.nv; ++b) {
    const int32_t slot = s.slot[size_t(b)];
    for (int64_t t = 0; t < s.len[size_t(b)]; ++t) {
      const int64_t r = s.row0[size_t(b)] + t;  // step row
      // §3.3 step 2 for one position: the decode conv over the slot's history, which it shifts.
      cuda::kda_conv_decode(qkv + r * 3 * HD, 3 * HD, w.conv, hist, s.d_slots + b, conv + r * 3 * HD, 3 * HD, 1,
                            3 * HD, W, x.stream);
      KCUDA_CHECK(cudaMemcpyAsync(cc.trace_conv[size_t(layer)] + (r - s.row0[size_t(s.nd)]) * cb,
                                  reinterpret_cast<const uint8_t*>(hist) + int64_t(slot) * cb, size_t(cb),
                                  cudaMemcpyDeviceToDevice, x.stream));
    }
  }
}

namespace {
template <typename StateT>
void verify_scan(Context& x, CudaCache& cc, const BatchStep& s, int layer, const float* q, const float* k,
                 const float* v, const float* g, const float* beta, StateT* pool, float* o) {
  const int64_t H = x.c.kda.num_heads, Dk = x.c.kda.head_dim, sb = cc.layout.kda_recurrent_bytes;
  for (int64_t b = s.nd; b < s.nd + s.nv; ++b) {
    const int32_t slot = s.slot[size_t(b)];
    for (int64_t t = 0; t < s.len[size_t(b)]; ++t) {
      const int64_t r = s.row0[size_t(b)] + t;
      // §3.3 step 6 for one position: the decode scan over row r (cu = {r, r+1}) and the request's slot.
      cuda::kda_decode(q, k, v, g, H * Dk, beta, H, s.d_iota + r, s.d_slots + b, pool, o, 1, H, Dk, x.stream);
      KCUDA_CHECK(cudaMemcpyAsync(cc.trace_S[size_t(layer)] + (r - s.row0[size_t(s.nd)]) * sb,
                                  reinterpret_cast<const uint8_t*>(pool) + int64_t(slot) * sb, size_t(sb),
                                  cudaMemcpyDeviceToDevice, x.stream));
    }
  }
}
}  // namespace

void kda_verify_scan(Context& x, CudaCache& cc, const BatchStep& s, int layer, const float* q, const float* k,
                     const float* v, const float* g, const float* beta, float* o) {
  const int64_t H = x.c.kda.num_heads, Dk = x.c.kda.head_dim;
  if (x.opt.spec_trace_kernels && !cc.kda_state_f16()) {
    // One launch over every verify sequence's positions, the state after each traced (kda.h).
    cuda::kda_decode_traced(q, k, v, g, H * Dk, beta, H, s.d_cu + s.nd, s.d_slots + s.nd,
                            reinterpret_cast<float*>(cc.kda_S[size_t(layer)]), o, s.nv, H, Dk,
                            reinterpret_cast<float*>(cc.trace_S[size_t(layer)]), s.row0[size_t(s.nd)], x.stream);
    return;
  }
  if (cc.kda_state_f16())
    verify_scan(x, cc, s, layer, q, k, v, g, beta, reinterpret_cast<uint16_t*>(cc.kda_S[size_t(layer)]), o);
  else
    verify_scan(x, cc, s, layer, q, k, v, g, beta, reinterpret_cast<float*>(cc.kda_S[size_t(layer)]), o);
}

void keep_verified(CudaCache& cc, int64_t k, int64_t t, cudaStream_t stream) {
  KCHECK(k >= 0 && k < int64_t(cc.verify.size()), "keep_verified: verify sequence {} of the last forward's {}", k,
         cc.verify.size());
  const CudaCache::VerifySeq& vs = cc.verify[size_t(k)];
  KCHECK(t >= 0 && t < vs.len, "keep_verified: position {} outside the block's {}", t, vs.len);
  const int64_t sb = cc.layout.kda_recurrent_bytes, cb = cc.layout.kda_conv_bytes, row = vs.row0 + t;
  for (size_t L = 0; L < cc.kda_S.size(); ++L) {
    if (!cc.kda_S[L]) continue;
    KCUDA_CHECK(cudaMemcpyAsync(cc.kda_S[L] + int64_t(vs.slot) * sb, cc.trace_S[L] + row * sb, size_t(sb),
                                cudaMemcpyDeviceToDevice, stream));
    KCUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<uint8_t*>(cc.kda_conv[L]) + int64_t(vs.slot) * cb,
                                cc.trace_conv[L] + row * cb, size_t(cb), cudaMemcpyDeviceToDevice, stream));
  }
}

void keep_verified_batch(CudaCache& cc, std::span<const int64_t> t, cudaStream_t stream) {
  const int64_t nv = int64_t(cc.verify.size());
  KCHECK(int64_t(t.size()) == nv, "keep_verified_batch: {} positions for the last forward's {} verify sequences",
         t.size(), nv);
  if (nv == 0) return;
  const int64_t sb = cc.layout.kda_recurrent_bytes, cb = cc.layout.kda_conv_bytes;
  if (sb % 16 != 0 || cb % 16 != 0) {  // the launch moves 16-byte vectors; such a config keeps the copies
    for (int64_t k = 0; k < nv; ++k) keep_verified(cc, k, t[size_t(k)], stream);
    return;
  }
  if (!cc.keep_tab) {
    // The launch table of the current trace (rebuilt after upload_verify reallocates it). The pageable copy is
    // staged before cudaMemcpyAsync returns, so the host vector may go.
    std::vector<cuda::RowArrays> tab;  // [2 · KDA layers]
    for (size_t L = 0; L < cc.kda_S.size(); ++L) {
      if (!cc.kda_S[L]) continue;
      KCHECK(cc.trace_S[L] && cc.trace_conv[L], "keep_verified_batch: KDA layer {} has no trace", L);
      tab.push_back({cc.trace_S[L], cc.kda_S[L], sb});
      tab.push_back({cc.trace_conv[L], cc.kda_conv[L], cb});
    }
    if (tab.empty()) return;  // no KDA layer: nothing to keep
    cc.keep_tab = cc.alloc->alloc(tab.size() * sizeof(cuda::RowArrays));
    cc.keep_arrays = int64_t(tab.size());
    KCUDA_CHECK(cudaMemcpyAsync(cc.keep_tab, tab.data(), tab.size() * sizeof(cuda::RowArrays), cudaMemcpyHostToDevice,
                                stream));
  }
  if (nv > cc.keep_idx_cap) {
    // A launch still queued may read the old map: wait for it before giving the memory back (rare: growth).
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    if (cc.keep_idx) cc.alloc->free(cc.keep_idx);
    cc.keep_idx_cap = std::max<int64_t>(nv, 64);
    cc.keep_idx = static_cast<int32_t*>(cc.alloc->alloc(size_t(2 * cc.keep_idx_cap) * 4));
  }
  std::vector<int32_t> idx(size_t(2 * nv));  // i32 [2, nv]: trace rows, then slots
  for (int64_t k = 0; k < nv; ++k) {
    const CudaCache::VerifySeq& vs = cc.verify[size_t(k)];
    KCHECK(t[size_t(k)] >= 0 && t[size_t(k)] < vs.len, "keep_verified_batch: position {} outside the block's {}",
           t[size_t(k)], vs.len);
    idx[size_t(k)] = int32_t(vs.row0 + t[size_t(k)]);
    idx[size_t(nv + k)] = vs.slot;
  }
  // Stream-ordered after any earlier launch reading the map, so it cannot change under one.
  KCUDA_CHECK(cudaMemcpyAsync(cc.keep_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice, stream));
  cuda::copy_rows_multi(static_cast<const cuda::RowArrays*>(cc.keep_tab), cc.keep_arrays, std::max(sb, cb),
                        cc.keep_idx, cc.keep_idx + nv, nv, stream);
}

void copy_tap(Context& x, const AttnResDev& rs, int64_t k, int64_t n_taps, u16* taps) {
  // Column block k of bf16 [T, n·D]: a strided 2-D copy of P's T rows.
  const size_t row = size_t(rs.D) * 2;
  KCUDA_CHECK(cudaMemcpy2DAsync(taps + k * rs.D, row * size_t(n_taps), rs.partial, row, row, size_t(rs.T),
                                cudaMemcpyDeviceToDevice, x.stream));
}

}  // namespace kestrel::model::gpu
