// The batch description (see batch.h).
#include "model/cuda/batch.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rows.h"
#include "model/cuda/cache.h"
#include "model/cuda/context.h"

namespace kestrel::model::gpu {

BatchStep describe_batch(std::span<const CudaSeq> seqs, const CudaCache& cc, int64_t V, BatchInputs& in,
                         std::span<const CudaEmbedRows> embed, int64_t n_prev) {
  KCHECK(!seqs.empty(), "forward_batch: no sequences");
  BatchStep s;
  s.n = int64_t(seqs.size());
  for (const CudaSeq& q : seqs) s.bt_stride = std::max<int64_t>(s.bt_stride, int64_t(q.block_table.size()));
  in.tables.assign(size_t(s.n * s.bt_stride), 0);  // i32 [n, bt_stride], padded with page 0
  std::vector<bool> slot_used(size_t(cc.num_slots), false);
  // Groups in order: plain single-token sequences (decodes), verify sequences, the rest (prefills).
  int group = 0;
  const int64_t P = cc.P;
  for (int64_t b = 0; b < s.n; ++b) {
    const CudaSeq& q = seqs[size_t(b)];
    const int64_t Tb = int64_t(q.tokens.size()), S = q.pos0 + Tb;
    KCHECK(Tb > 0 && q.pos0 >= 0, "forward_batch: sequence {} has {} tokens at position {}", b, Tb, q.pos0);
    const int g = q.verify ? 1 : Tb == 1 && group == 0 ? 0 : 2;
    KCHECK(g >= group, "forward_batch: sequence {}: single-token sequences first, then verify sequences, then the "
           "rest", b);
    group = g;
    if (g == 0) ++s.nd;
    if (g == 1) ++s.nv, s.nvr += Tb, s.max_ver_S = std::max(s.max_ver_S, S);
    KCHECK(!q.verify || q.logits == CudaSeq::Logits::all,
           "forward_batch: verify sequence {} must want every row's logits", b);
    KCHECK(Tb > 1 || g < 2, "forward_batch: single-token sequences must come first (sequence {})", b);
    KCHECK(q.slot >= 0 && q.slot < cc.num_slots && !slot_used[size_t(q.slot)],
           "forward_batch: sequence {} has state slot {} (of {}, distinct per sequence)", b, q.slot, cc.num_slots);
    slot_used[size_t(q.slot)] = true;
    if (int64_t(q.block_table.size()) * P < S)
      fail("context {} exceeds the GPU cache capacity of the sequence's block table ({} pages of {})", S,
           q.block_table.size(), P);
    for (int32_t p : q.block_table)
      KCHECK(p >= 0 && p < cc.num_pages, "forward_batch: page {} outside [0, {})", p, cc.num_pages);
    const auto pool_row = [&](int64_t pos) { return int32_t(int64_t(q.block_table[size_t(pos / P)]) * P + pos % P); };
    if (q.prev_id >= 0) {  // run-ahead: the token is on the device (resolve_pending_ids), validated when sampled
      KCHECK(g == 0 && q.prev_id < n_prev, "forward_batch: sequence {} takes id {} of the last sample_ahead ({} ids; "
             "a single-token sequence only)", b, q.prev_id, n_prev);
      in.pending = true;
    }
    for (int64_t i = 0; i < Tb; ++i) {
      const int32_t t = q.prev_id >= 0 ? cuda::pending_id(q.prev_id) : q.tokens[size_t(i)];
      if (q.prev_id < 0 && (t < 0 || t >= V)) fail("token id {} at position {} is outside [0, {})", t, q.pos0 + i, V);
      in.ids.push_back(t);
      in.pool_rows.push_back(pool_row(q.pos0 + i));
    }
    s.row0.push_back(s.T), s.len.push_back(Tb), s.pos0.push_back(q.pos0);
    s.slot.push_back(q.slot);
    in.slots.push_back(q.slot);
    std::copy(q.block_table.begin(), q.block_table.end(), in.tables.begin() + b * s.bt_stride);
    for (int64_t i = 0; i < Tb; ++i) in.row_lens.push_back(int32_t(q.pos0 + i + 1)), in.row_req.push_back(int32_t(b));
    s.max_S = std::max(s.max_S, S);
    const bool decode = b < s.nd;
    if (decode) in.dec_lens.push_back(int32_t(S)), s.max_dec_S = std::max(s.max_dec_S, S);
    in.all_last = in.all_last && q.logits == CudaSeq::Logits::last;
    if (q.logits == CudaSeq::Logits::all)
      for (int64_t i = 0; i < Tb; ++i) in.lrows.push_back(int32_t(s.T + i));
    else if (q.logits == CudaSeq::Logits::last)
      in.lrows.push_back(int32_t(s.T + Tb - 1));
    s.T += Tb;
    in.cu.push_back(int32_t(s.T));
  }
  // Image rows: positions inside their sequence, strictly ascending (so distinct), one entry per sequence.
  std::vector<bool> has_rows(size_t(s.n), false);
  for (const CudaEmbedRows& e : embed) {
    KCHECK(e.seq >= 0 && e.seq < s.n && !has_rows[size_t(e.seq)],
           "forward_batch: image rows for sequence {} (of {}; one entry per sequence)", e.seq, s.n);
    has_rows[size_t(e.seq)] = true;
    if (e.pos.empty()) continue;
    KCHECK(e.rows != nullptr && reinterpret_cast<uintptr_t>(e.rows) % 16 == 0,
           "forward_batch: sequence {} has {} image positions but its rows are null or not 16-byte aligned", e.seq,
           e.pos.size());
    const int64_t Tb = s.len[size_t(e.seq)];
    s.embed_rows.push_back({e.rows, int64_t(e.pos.size()), int64_t(in.embed_dst.size())});
    for (size_t k = 0; k < e.pos.size(); ++k) {
      const int32_t p = e.pos[k];
      KCHECK(p >= 0 && p < Tb && (k == 0 || p > e.pos[k - 1]),
             "forward_batch: sequence {}: image position {} (entry {}) outside [0, {}) or not ascending", e.seq, p, k,
             Tb);
      in.embed_dst.push_back(int32_t(s.row0[size_t(e.seq)] + p));
    }
  }
  s.n_real = s.n;
  return s;
}

void upload_context(Context& x, BatchStep& s, const BatchInputs& in) {
  std::vector<int32_t> meta;
  for (const auto* v : {&in.dec_lens, &in.tables, &in.row_lens, &in.row_req}) meta.insert(meta.end(), v->begin(), v->end());
  int32_t* d = x.tmp<int32_t>(int64_t(meta.size()));
  KCUDA_CHECK(cudaMemcpyAsync(d, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, x.stream));
  s.d_dec_lens = d;
  s.d_tables = s.d_dec_lens + s.nd;
  s.d_row_lens = s.d_tables + s.n * s.bt_stride;
  s.d_row_req = s.d_row_lens + s.T;
}

void upload_embed_rows(Context& x, BatchStep& s, const BatchInputs& in) {
  if (in.embed_dst.empty()) return;
  int32_t* d = x.tmp<int32_t>(int64_t(in.embed_dst.size()));
  KCUDA_CHECK(cudaMemcpyAsync(d, in.embed_dst.data(), in.embed_dst.size() * 4, cudaMemcpyHostToDevice, x.stream));
  s.d_embed_dst = d;
}

const int32_t* upload_inputs(Context& x, BatchStep& s, const BatchInputs& in) {
  std::vector<int32_t> meta;
  for (const auto* v : {&in.ids, &in.cu, &in.slots, &in.pool_rows, &in.lrows}) meta.insert(meta.end(), v->begin(), v->end());
  int32_t* d = x.tmp<int32_t>(int64_t(meta.size()));
  KCUDA_CHECK(cudaMemcpyAsync(d, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, x.stream));
  s.d_cu = d + s.T;
  s.d_slots = s.d_cu + s.n + 1;
  s.d_pool_rows = s.d_slots + s.n;
  return d;
}

}  // namespace kestrel::model::gpu

