// The DSpark draft on the GPU (see dspark.h), MODEL.md §5 in the order of its CPU twin model/dspark.cpp.
#include "model/cuda/dspark.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/dspark.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/paged.h"
#include "kernels/cuda/rows.h"
#include "model/common.h"
#include "model/dspark.h"
#include "model/cuda/layers.h"

namespace kestrel::model {

struct CudaDraft::Impl {
  using u16 = uint16_t;
  gpu::Context& x;
  const gpu::WeightsDev& target;  // embed, lm_head
  const Draft& d;
  int P = 0;  // tokens per page
  std::vector<cuda::DeviceBuffer> owned;  // the uploaded weights, the RoPE table, the pools
  struct Layer {
    const u16 *input_norm, *post_attn_norm, *q_a_norm, *kv_a_norm;  // bf16 [D], [D], [Q], [C]
    gpu::LinearDev q_a, q_b, kv_a, kv_b, o, gate, up, down;
    u16* pool = nullptr;  // bf16 [pages·P, C+R]: the layer's latent rows
  };
  std::vector<Layer> layers;
  gpu::LinearDev context_proj;
  const u16 *context_norm = nullptr, *final_norm = nullptr;
  const float* inv_freq = nullptr;  // f32 [R/2]
  const u16 *markov_w1 = nullptr, *markov_w2 = nullptr;  // bf16 [V, r] each: the Markov head (greedy_tokens)
  std::function<void(const char*)> marker;  // CudaDraft::set_marker
  bool absorbed = false;                     // CudaDraft::set_absorbed: the attention in the latent space
  void mark(const char* phase) const {
    if (marker) marker(phase);
  }

  const void* up(const void* host, size_t bytes) {
    owned.emplace_back(bytes);
    owned.back().copy_from_host(host, bytes);
    return owned.back().data();
  }
  const u16* up(const TensorView& t) { return static_cast<const u16*>(up(t.data, t.nbytes())); }
  gpu::LinearDev lin(const TensorView& t) {
    KCHECK(t.shape.rank == 2, "draft: a linear weight of rank {}", t.shape.rank);
    return gpu::LinearDev{up(t), nullptr, nullptr, t.shape[0], t.shape[1]};
  }

  Impl(gpu::Context& cx, const gpu::WeightsDev& tw, const Draft& dr, int32_t num_pages, int block_size)
      : x(cx), target(tw), d(dr), P(block_size) {
    const DraftConfig& c = *d.cfg;
    const DraftWeights& w = *d.w;
    KCHECK(c.hidden_size == x.c.hidden_size && c.vocab_size == x.c.vocab_size,
           "draft: D {} / V {} differ from the target's {} / {}", c.hidden_size, c.vocab_size, x.c.hidden_size,
           x.c.vocab_size);
    KCHECK(c.hidden_size % 8 == 0 && (c.kv_lora_rank + c.qk_rope_head_dim) % 8 == 0,
           "draft: D and C+R must be multiples of 8 (16-byte rows)");
    context_proj = lin(w.context_proj);
    context_norm = up(w.context_norm);
    final_norm = up(w.final_norm);
    markov_w1 = up(w.markov_w1);
    markov_w2 = up(w.markov_w2);
    inv_freq = static_cast<const float*>(up(d.rope.inv_freq.data(), d.rope.inv_freq.size() * 4));
    const int64_t rows = int64_t(num_pages) * P, CW = c.cache_width();
    for (const DraftLayerWeights& L : w.layers) {
      Layer l{up(L.input_norm), up(L.post_attn_norm), up(L.q_a_norm), up(L.kv_a_norm), lin(L.q_a_proj),
              lin(L.q_b_proj), lin(L.kv_a_proj), lin(L.kv_b_proj), lin(L.o_proj), lin(L.gate_proj), lin(L.up_proj),
              lin(L.down_proj), nullptr};
      owned.emplace_back(size_t(std::max<int64_t>(rows, 1) * CW) * 2);
      l.pool = static_cast<u16*>(owned.back().data());
      KCUDA_CHECK(cudaMemsetAsync(l.pool, 0, size_t(std::max<int64_t>(rows, 1) * CW) * 2, x.stream));
      layers.push_back(l);
    }
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
  }

  // The per-request calls are the batched ones with B = 1 (one code path for the draft's layers; the tests
  // compare B = 1 calls one at a time with B > 1). A per-request block must be the §5 block
  // [anchor, mask × (Nb−1)], which the batched draft builds itself from the anchor.
  CudaDraft::BlockSeq one_block(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens) const {
    const DraftConfig& c = *d.cfg;
    KCHECK(int64_t(tokens.size()) == c.block_size, "draft: a block of {} tokens (block size {})", tokens.size(),
           c.block_size);
    for (size_t j = 1; j < tokens.size(); ++j)
      KCHECK(tokens[j] == c.mask_token_id, "draft: block position {} holds {}, not the mask token {}", j, tokens[j],
             c.mask_token_id);
    return {table, ctx, tokens[0]};
  }
  void inject(std::span<const int32_t> table, int64_t pos0, const u16* taps, int64_t T) {
    if (T <= 0) return;
    const CudaDraft::InjectSeq one{table, pos0, 0, T};
    inject_batch(std::span<const CudaDraft::InjectSeq>(&one, 1), taps);
  }

  // ---- the batched draft: every request of a step in one launch sequence, no host sync in between ----------

  // Uploads host i32 [n] into step scratch. One pageable copy per batched call: both call sites find the stream
  // idle (the step's logits or ids were just synced), so a staging sync there costs nothing.
  int32_t* upload_i32(const std::vector<int32_t>& h) {
    int32_t* dv = x.tmp<int32_t>(int64_t(h.size()));
    if (!h.empty())
      KCUDA_CHECK(cudaMemcpyAsync(dv, h.data(), h.size() * 4, cudaMemcpyHostToDevice, x.stream));
    return dv;
  }
  int32_t pool_row(std::span<const int32_t> table, int64_t p) const {
    KCHECK(p / P < int64_t(table.size()), "draft: block table of {} pages for position {}", table.size(), p);
    return int32_t(int64_t(table[size_t(p / P)]) * P + p % P);
  }

  // inject() for every sequence at once: the taps rows [tap_row, tap_row + n) of `taps` (device bf16
  // [rows, n·Dt]) gathered, then the same per-row steps over all of them (RoPE at each row's own position),
  // each layer's rows scattered to their sequences' pool rows. No sync: the scratch goes back to the
  // stream-ordered allocator (one per stream), the next user of it runs after these launches.
  void inject_batch(std::span<const CudaDraft::InjectSeq> seqs, const u16* taps) {
    const DraftConfig& c = *d.cfg;
    const int64_t D = c.hidden_size, In = c.tap_width(), C = c.kv_lora_rank, R = c.qk_rope_head_dim, CW = C + R;
    int64_t M = 0;
    for (const auto& s : seqs) {
      KCHECK(s.n >= 0 && s.pos0 >= 0 && s.tap_row >= 0, "draft: inject of {} rows at {}", s.n, s.pos0);
      M += s.n;
    }
    if (M == 0) return;
    KCHECK(taps && (In * 2) % 16 == 0, "draft: taps rows of {} bf16 are not 16-byte rows", In);
    std::vector<int32_t>& h = host_idx;  // i32 [3, M]: taps row, pool row, position of each injected row
    h.resize(size_t(3 * M));
    int64_t k = 0;
    for (const auto& s : seqs)
      for (int64_t t = 0; t < s.n; ++t, ++k) {
        h[size_t(k)] = int32_t(s.tap_row + t);
        h[size_t(M + k)] = pool_row(s.table, s.pos0 + t);
        h[size_t(2 * M + k)] = int32_t(s.pos0 + t);
      }
    const int32_t* idx = upload_i32(h);
    const int32_t *src = idx, *dst = idx + M, *pos = idx + 2 * M;  // i32 [M] each
    u16* in = x.tmp<u16>(M * In);  // bf16 [M, n·Dt]: the committed rows' taps
    cuda::copy_rows(taps, src, in, nullptr, M, In * 2, x.stream);
    u16* proj = x.tmp<u16>(M * D);  // bf16 [M, D]
    u16* hctx = x.tmp<u16>(M * D);  // bf16 [M, D]
    gpu::linear(x, context_proj, in, In, M, proj, D);
    cuda::rmsnorm_bf16(proj, D, context_norm, hctx, D, M, D, c.rms_norm_eps, x.stream);
    u16* rows = x.tmp<u16>(M * CW);  // bf16 [M, C+R]
    for (const Layer& l : layers) {
      gpu::linear(x, l.kv_a, hctx, D, M, rows, CW);
      cuda::rmsnorm_bf16(rows, CW, l.kv_a_norm, rows, CW, M, C, c.rms_norm_eps, x.stream);
      cuda::dspark_rope_interleaved(rows + C, CW, M, 1, 0, 0, inv_freq, d.rope.cos_sin_mul, R, x.stream, pos);
      cuda::copy_rows(rows, nullptr, l.pool, dst, M, CW * 2, x.stream);
    }
    x.release_scratch();
  }

  // The batched block's index arrays, host i32, laid out as the device copy `meta` is read by
  // block_rows(): ids, pos, kbeg, klen, block latent row [T] each (T = B·Nb); anchors [B]; context pool row
  // and latent row [Sk − T] each. Rows b·Nb .. b·Nb+Nb−1 are request b's block [anchor, mask × (Nb−1)] at
  // ctx_b .. ctx_b+Nb−1; request b's latent rows (its context from the pools, then its block's) are
  // lo_b .. lo_b+ctx_b+Nb−1 of one [Sk, C+R] buffer. Sk ≥ Σ(ctx_b + Nb): a graph's padding copies pool row 0
  // into the unused latent rows, which no query reads.
  // Filled into host_meta (kept between calls: no host allocation once the shapes have been seen).
  std::vector<int32_t> host_meta, host_idx;  // i32: block_meta's arrays; inject_batch's [3, M]
  // The absorbed attention (set_absorbed) reads two more arrays after those: each block row's request [T]
  // and a block table per request [B, Smax] whose "pages" are single latent rows (block size 1: entry p of
  // request b is its latent row lo_b + p, −1 past its ctx_b + Nb keys), so mla_decode_paged reads the
  // gathered latent rows as a paged cache.
  const std::vector<int32_t>& block_meta(std::span<const CudaDraft::BlockSeq> reqs, int64_t Sk, int64_t Smax) {
    const DraftConfig& c = *d.cfg;
    const int64_t B = int64_t(reqs.size()), Nb = c.block_size, T = B * Nb, Cn = Sk - T;
    std::vector<int32_t>& h = host_meta;
    h.resize(size_t(5 * T + B + 2 * Cn + (absorbed ? T + B * Smax : 0)));
    int32_t *ids = h.data(), *pos = ids + T, *kb = pos + T, *kl = kb + T, *bd = kl + T, *an = bd + T, *cs = an + B,
            *cd = cs + Cn;
    int64_t lo = 0, cn = 0;
    for (int64_t b = 0; b < B; ++b) {
      const auto& r = reqs[size_t(b)];
      KCHECK(r.ctx >= 0 && r.anchor >= 0 && r.anchor < c.vocab_size, "draft: block of anchor {} at {}", r.anchor,
             r.ctx);
      an[b] = r.anchor;
      for (int64_t p = 0; p < r.ctx; ++p, ++cn) cs[cn] = pool_row(r.table, p), cd[cn] = int32_t(lo + p);
      for (int64_t j = 0; j < Nb; ++j) {
        const int64_t t = b * Nb + j;
        ids[t] = j == 0 ? r.anchor : c.mask_token_id;
        pos[t] = int32_t(r.ctx + j);
        kb[t] = int32_t(lo);
        kl[t] = int32_t(r.ctx + Nb);
        bd[t] = int32_t(lo + r.ctx + j);
      }
      lo += r.ctx + Nb;
    }
    KCHECK(lo <= Sk, "draft: {} latent rows for a bound of {}", lo, Sk);
    for (int64_t k = 0; cn < Cn; ++cn, ++k) cs[cn] = 0, cd[cn] = int32_t(lo + k);  // padding (graphs)
    if (absorbed) {
      int32_t *rq = cd + Cn, *bt = rq + T;
      lo = 0;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t S = reqs[size_t(b)].ctx + Nb;
        KCHECK(S <= Smax, "draft: {} keys for a bound of {}", S, Smax);
        for (int64_t j = 0; j < Nb; ++j) rq[b * Nb + j] = int32_t(b);
        for (int64_t p = 0; p < Smax; ++p) bt[b * Smax + p] = p < S ? int32_t(lo + p) : -1;
        lo += S;
      }
    }
    return h;
  }
  static void block_sizes(std::span<const CudaDraft::BlockSeq> reqs, int64_t Nb, int64_t& Sk, int64_t& Smax) {
    Sk = 0, Smax = 0;
    for (const auto& r : reqs) Sk += r.ctx + Nb, Smax = std::max(Smax, r.ctx + Nb);
  }

  // The blocks of B requests through the draft layers (§5: MLA over each request's context + block rows,
  // SwiGLU MLP), then the final norm and the target's lm_head, from `meta` (device, block_meta's layout): every
  // launch reads its indices from there and nothing crosses to the host, so the sequence is capturable
  // (graphs below). Every op is per row or per request (RoPE at each row's position, the attention varlen over
  // the request's own keys), so a request's rows get the same bits at any B wherever the GEMMs are row
  // invariant (the skinny GEMM, linear.h). Sk: latent rows, Smax ≥ the longest request's keys (the attention
  // scratch's stride). The attention: naive (kv_b expands every context row of every request each step, then
  // dspark_attend_varlen: the CPU twin's form) or, with set_absorbed, absorbed as the target's MLA decode
  // (mla_decode_paged over the gathered latent rows: q̃ = W_UKᵀ q_nope per row, scores against ĉ, o = W_UV ô;
  // no [Sk, Hm·(N+Dv)] expansion — equal in exact arithmetic, q̃ and p rounded to bf16 there).
  // Returns device f32 [B·Nb, V] in scratch (the caller releases it).
  const float* block_rows(const int32_t* meta, int64_t B, int64_t Sk, int64_t Smax) {
    const DraftConfig& c = *d.cfg;
    const int64_t Nb = c.block_size, T = B * Nb, D = c.hidden_size, V = c.vocab_size, F = c.intermediate_size,
                  Hm = c.num_attention_heads, Q = c.q_lora_rank, C = c.kv_lora_rank, N = c.qk_nope_head_dim,
                  R = c.qk_rope_head_dim, Dv = c.v_head_dim, QK = N + R, CW = C + R, Cn = Sk - T;
    const float eps = c.rms_norm_eps;
    KCHECK(B > 0 && Cn >= 0 && Smax >= Nb, "draft: a batched block of {} requests, {} latent rows", B, Sk);
    const int32_t *ids = meta, *pos = meta + T, *kbeg = meta + 2 * T, *klen = meta + 3 * T, *bdst = meta + 4 * T,
                  *csrc = meta + 5 * T + B, *cdst = csrc + Cn;  // i32, block_meta's layout
    u16* h = x.tmp<u16>(T * D);             // bf16 [T, D]: the residual stream
    cuda::embed_gather(target.embed, ids, T, D, h, x.stream);
    u16* xn = x.tmp<u16>(T * D);            // bf16 [T, D]
    u16* y = x.tmp<u16>(T * D);             // bf16 [T, D]
    u16* qa = x.tmp<u16>(T * Q);            // bf16 [T, Q]
    u16* cq = x.tmp<u16>(T * Q);            // bf16 [T, Q]
    u16* q = x.tmp<u16>(T * Hm * QK);       // bf16 [T, Hm·(N+R)]
    u16* blk = x.tmp<u16>(T * CW);          // bf16 [T, C+R]: the blocks' latent rows
    u16* latent = x.tmp<u16>(Sk * CW);      // bf16 [Sk, C+R]: per request its context rows, then its block's
    u16* o = x.tmp<u16>(T * Hm * Dv);       // bf16 [T, Hm·Dv]
    u16* g = x.tmp<u16>(T * F);             // bf16 [T, Fd]
    u16* u = x.tmp<u16>(T * F);             // bf16 [T, Fd]
    // Naive attention: every latent row expanded, and the scores. Absorbed: the decode kernel's workspace,
    // the latent rows seen as a paged cache of 1-row pages through block_meta's per-request tables.
    u16* kv = nullptr;          // bf16 [Sk, Hm·(N+Dv)]
    float* scratch = nullptr;   // f32 [T, Hm, Smax]
    void* ws = nullptr;         // mla_decode_paged_workspace_bytes(dims, T, Smax)
    const cuda::MlaDims dims{Hm, N, R, Dv, C};
    cuda::PagedMlaCache pv;
    cuda::MlaPagedBatch pb;
    // The draft's softmax scale (YaRN's mscale² included) over the kernel's (N+R)^−½, folded into q.
    const float q_mul = d.rope.softmax_scale * std::sqrt(float(QK));
    if (absorbed) {
      const int32_t* req = cdst + Cn;  // i32 [T], then the tables i32 [B, Smax]
      ws = x.tmp<char>(int64_t(cuda::mla_decode_paged_workspace_bytes(dims, T, Smax)));
      pv.latent_format = LatentFormat::bf16;
      pv.block_size = 1;
      pv.C = C, pv.R = R, pv.Di = 0;
      pv.latent = reinterpret_cast<uint8_t*>(latent);
      pv.block_tables = req + T;
      pv.bt_stride = Smax;
      pb = cuda::MlaPagedBatch{klen, req, nullptr, 0, T, Smax};
    } else {
      kv = x.tmp<u16>(Sk * Hm * (N + Dv));
      scratch = x.tmp<float>(T * Hm * Smax);
    }
    for (const Layer& l : layers) {
      cuda::rmsnorm_bf16(h, D, l.input_norm, xn, D, T, D, eps, x.stream);
      gpu::linear(x, l.q_a, xn, D, T, qa, Q);
      cuda::rmsnorm_bf16(qa, Q, l.q_a_norm, cq, Q, T, Q, eps, x.stream);
      gpu::linear(x, l.q_b, cq, Q, T, q, Hm * QK);
      cuda::dspark_rope_interleaved(q + N, Hm * QK, T, Hm, QK, 0, inv_freq, d.rope.cos_sin_mul, R, x.stream, pos);
      if (Cn > 0) cuda::copy_rows(l.pool, csrc, latent, cdst, Cn, CW * 2, x.stream);
      gpu::linear(x, l.kv_a, xn, D, T, blk, CW);
      cuda::rmsnorm_bf16(blk, CW, l.kv_a_norm, blk, CW, T, C, eps, x.stream);
      cuda::dspark_rope_interleaved(blk + C, CW, T, 1, 0, 0, inv_freq, d.rope.cos_sin_mul, R, x.stream, pos);
      cuda::copy_rows(blk, nullptr, latent, bdst, T, CW * 2, x.stream);
      if (absorbed) {
        KCHECK(l.kv_b.w, "draft: the absorbed attention needs kv_b in bf16");
        if (q_mul != 1.0f) cuda::dspark_scale_bf16(q, T * Hm * QK, q_mul, x.stream);
        cuda::mla_decode_paged(x.lt, dims, q, l.kv_b.w, pv, pb, ws, o, x.stream);
      } else {
        gpu::linear(x, l.kv_b, latent, CW, Sk, kv, Hm * (N + Dv));
        cuda::dspark_attend_varlen(q, kv, latent, T, kbeg, klen, Smax, Hm, N, R, Dv, C, d.rope.softmax_scale, scratch,
                                   o, x.stream);
      }
      gpu::linear(x, l.o, o, Hm * Dv, T, y, D);
      cuda::add_bf16(h, y, h, T * D, x.stream);
      cuda::rmsnorm_bf16(h, D, l.post_attn_norm, xn, D, T, D, eps, x.stream);
      gpu::linear(x, l.gate, xn, D, T, g, F);
      gpu::linear(x, l.up, xn, D, T, u, F);
      cuda::dspark_swiglu(g, u, g, T * F, x.stream);
      gpu::linear(x, l.down, g, F, T, y, D);
      cuda::add_bf16(h, y, h, T * D, x.stream);
    }
    cuda::rmsnorm_bf16(h, D, final_norm, xn, D, T, D, eps, x.stream);
    float* lg = x.tmp<float>(T * V);  // f32 [T, V]
    cuda::GemmSegs sg;
    sg.seg[0] = gpu::seg_f32(0, lg, V);
    sg.n = 1;
    gpu::linear(x, target.lm_head, xn, D, T, sg);
    return lg;
  }
  // The blocks' rows and then their greedy chains: ids device i32 [B, steps].
  void greedy_rows(const int32_t* meta, int64_t B, int64_t Sk, int64_t Smax, int64_t steps, int32_t* ids) {
    const float* lg = block_rows(meta, B, Sk, Smax);
    if (x.graph.mode == gpu::GraphRecorder::Mode::eager) mark("draft.layers");
    const int32_t* anchors = meta + 5 * B * d.cfg->block_size;  // block_meta's layout
    void* ws = x.tmp<char>(int64_t(cuda::dspark_markov_greedy_workspace_bytes(B, d.cfg->vocab_size)));
    cuda::dspark_markov_greedy(lg, d.cfg->block_size, markov_w1, markov_w2, anchors, B, d.cfg->vocab_size,
                               d.cfg->markov_rank, steps, ids, ws, x.stream);
  }

  void base_logits_batch(std::span<const CudaDraft::BlockSeq> reqs, float* host) {
    const int64_t B = int64_t(reqs.size()), Nb = d.cfg->block_size, V = d.cfg->vocab_size;
    KCHECK(B > 0, "draft: a batched block of no requests");
    int64_t Sk, Smax;
    block_sizes(reqs, Nb, Sk, Smax);
    const float* lg = block_rows(upload_i32(block_meta(reqs, Sk, Smax)), B, Sk, Smax);
    KCUDA_CHECK(cudaMemcpyAsync(host, lg, size_t(B * Nb * V) * 4, cudaMemcpyDeviceToHost, x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
    x.release_scratch();
  }

  // The batched greedy draft in CUDA graphs (CudaDraft::set_graphs): one graph per (B, steps, Sk bound, Smax
  // bound), the bounds powers of two (Sk ≥ 64: small steps share one, and up to 64 rows the skinny GEMM
  // keeps the padded kv_b rows from changing the real rows' bits). A graph reads its fixed `meta` and
  // writes its fixed `ids`; everything it allocated while capturing is kept (Context::tmp) until the graphs
  // are dropped: all of them once kMaxGraphs exist (a new working set of shapes), or with the draft.
  struct DraftGraph {
    cudaGraphExec_t exec = nullptr;
    gpu::GraphBucket kept;   // only .kept: the scratch baked into the graph
    int32_t* meta = nullptr;  // device i32: block_meta for the bounds
    int32_t* ids = nullptr;   // device i32 [B, steps]
  };
  static constexpr size_t kMaxGraphs = 24;
  bool graphs_on = false;
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, DraftGraph> graphs;  // by (B, steps, Sk, Smax)
  static int64_t pow2_at_least(int64_t n, int64_t lo) {
    int64_t b = lo;
    while (b < n) b *= 2;
    return b;
  }
  void drop_graphs() {
    for (auto& [k, g] : graphs) {
      if (g.exec) cudaGraphExecDestroy(g.exec);
      for (void* p : g.kept.kept) x.alloc.free(p);
      x.alloc.free(g.meta), x.alloc.free(g.ids);
    }
    graphs.clear();
  }
  ~Impl() {
    if (!graphs.empty()) {
      cudaStreamSynchronize(x.stream);  // no replay in flight (every call syncs; this is cheap insurance)
      drop_graphs();
    }
  }

  void greedy_tokens_batch(std::span<const CudaDraft::BlockSeq> reqs, int64_t steps, int32_t* host) {
    const int64_t Nb = d.cfg->block_size, B = int64_t(reqs.size());
    KCHECK(steps >= 1 && steps <= Nb, "draft: {} greedy picks from a block of {}", steps, Nb);
    if (B == 0) return;
    int64_t Sk, Smax;
    block_sizes(reqs, Nb, Sk, Smax);
    const int32_t* ids = nullptr;  // device i32 [B, steps]
    if (!graphs_on) {
      int32_t* out = x.tmp<int32_t>(B * steps);
      const int32_t* meta = upload_i32(block_meta(reqs, Sk, Smax));
      mark("draft.meta_upload");
      greedy_rows(meta, B, Sk, Smax, steps, out);
      mark("draft.markov_chain");
      ids = out;
    } else {
      KCHECK(x.graph.mode == gpu::GraphRecorder::Mode::eager, "draft: graphs while the model records one");
      const int64_t SkB = pow2_at_least(Sk, 64), SmaxB = pow2_at_least(Smax, 16);
      const auto key = std::tuple{B, steps, SkB, SmaxB};
      if (!graphs.count(key) && graphs.size() >= kMaxGraphs) drop_graphs();
      DraftGraph& g = graphs[key];
      const std::vector<int32_t>& meta = block_meta(reqs, SkB, SmaxB);
      if (!g.meta) {
        g.meta = static_cast<int32_t*>(x.alloc.alloc(meta.size() * 4));
        g.ids = static_cast<int32_t*>(x.alloc.alloc(size_t(B * steps) * 4));
      }
      // The stream is idle here (the previous step synced), so the pageable copy cannot overwrite `meta`
      // under a replay still reading it.
      KCUDA_CHECK(cudaMemcpyAsync(g.meta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, x.stream));
      mark("draft.meta_upload");
      if (!g.exec) {
        gpu::GraphRecorder& r = x.graph;
        r.mode = gpu::GraphRecorder::Mode::capture;
        r.bucket = &g.kept;
        try {
          KCUDA_CHECK(cudaStreamBeginCapture(x.stream, cudaStreamCaptureModeRelaxed));
          greedy_rows(g.meta, B, SkB, SmaxB, steps, g.ids);
          cudaGraph_t gr = nullptr;
          KCUDA_CHECK(cudaStreamEndCapture(x.stream, &gr));
          const cudaError_t err = cudaGraphInstantiate(&g.exec, gr, 0);
          cudaGraphDestroy(gr);
          KCUDA_CHECK(err);
        } catch (...) {
          cudaGraph_t junk = nullptr;
          if (cudaStreamEndCapture(x.stream, &junk) == cudaSuccess && junk) cudaGraphDestroy(junk);
          r.mode = gpu::GraphRecorder::Mode::eager;
          r.bucket = nullptr;
          g.exec = nullptr;
          throw;
        }
        r.mode = gpu::GraphRecorder::Mode::eager;
        r.bucket = nullptr;
        mark("draft.graph_capture");
      }
      KCUDA_CHECK(cudaGraphLaunch(g.exec, x.stream));  // capturing did not run it
      mark("draft.graph_replay");
      ids = g.ids;
    }
    KCUDA_CHECK(cudaMemcpyAsync(host, ids, size_t(B * steps) * 4, cudaMemcpyDeviceToHost, x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));  // the one sync of the batched draft
    mark("draft.ids_d2h_sync");
    x.release_scratch();
  }

  void base_logits(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens, float* host) {
    const CudaDraft::BlockSeq one = one_block(table, ctx, tokens);
    base_logits_batch(std::span<const CudaDraft::BlockSeq>(&one, 1), host);
  }
  void greedy_tokens(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens, int64_t steps,
                     int32_t* host) {
    const CudaDraft::BlockSeq one = one_block(table, ctx, tokens);
    greedy_tokens_batch(std::span<const CudaDraft::BlockSeq>(&one, 1), steps, host);
  }
};

CudaDraft::CudaDraft(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaDraft::~CudaDraft() = default;

void CudaDraft::inject(std::span<const int32_t> table, int64_t pos0, const uint16_t* taps_dev, int64_t T) {
  impl_->inject(table, pos0, taps_dev, T);
}
void CudaDraft::inject_host(std::span<const int32_t> table, int64_t pos0, const uint16_t* taps_host, int64_t T) {
  if (T <= 0) return;
  const size_t bytes = size_t(T * impl_->d.cfg->tap_width()) * 2;
  cuda::DeviceBuffer buf(bytes);  // bf16 [T, n·Dt]
  buf.copy_from_host(taps_host, bytes);
  impl_->inject(table, pos0, static_cast<const uint16_t*>(buf.data()), T);
  KCUDA_CHECK(cudaStreamSynchronize(impl_->x.stream));  // the launches read buf, freed on return
}
void CudaDraft::greedy_tokens(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens,
                              int64_t steps, int32_t* host) {
  impl_->greedy_tokens(table, ctx, tokens, steps, host);
}
void CudaDraft::base_logits(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens,
                            float* host) {
  impl_->base_logits(table, ctx, tokens, host);
}
void CudaDraft::inject_batch(std::span<const InjectSeq> seqs, const uint16_t* taps_dev) {
  impl_->inject_batch(seqs, taps_dev);
}
void CudaDraft::base_logits_batch(std::span<const BlockSeq> reqs, float* host) { impl_->base_logits_batch(reqs, host); }
void CudaDraft::greedy_tokens_batch(std::span<const BlockSeq> reqs, int64_t steps, int32_t* host) {
  impl_->greedy_tokens_batch(reqs, steps, host);
}
void CudaDraft::set_absorbed(bool on) {
  if (on == impl_->absorbed) return;
  if (!impl_->graphs.empty()) {  // their index layout and kernels are the other form's
    KCUDA_CHECK(cudaStreamSynchronize(impl_->x.stream));
    impl_->drop_graphs();
  }
  impl_->absorbed = on;
}
void CudaDraft::set_marker(std::function<void(const char*)> mark) { impl_->marker = std::move(mark); }
void CudaDraft::set_graphs(bool on) {
  if (!on && !impl_->graphs.empty()) {
    KCUDA_CHECK(cudaStreamSynchronize(impl_->x.stream));
    impl_->drop_graphs();
  }
  impl_->graphs_on = on;
}

namespace gpu {
std::unique_ptr<CudaDraft> new_cuda_draft(Context& x, const WeightsDev& w, const Draft& d, int32_t num_pages,
                                          int block_size) {
  return std::make_unique<CudaDraft>(std::make_unique<CudaDraft::Impl>(x, w, d, num_pages, block_size));
}
}  // namespace gpu

}  // namespace kestrel::model
