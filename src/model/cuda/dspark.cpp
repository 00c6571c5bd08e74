// The DSpark draft on the GPU (see dspark.h), MODEL.md §5 in the order of its CPU twin model/dspark.cpp.
#include "model/cuda/dspark.h"

#include <cuda_runtime.h>

#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/dspark.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/norm.h"
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

  // Pool rows of positions [pos0, pos0 + T) through `table`, uploaded: device i32 [T].
  const int32_t* pool_rows(std::span<const int32_t> table, int64_t pos0, int64_t T) {
    KCHECK(int64_t(table.size()) * P >= pos0 + T, "draft: block table of {} pages for positions up to {}",
           table.size(), pos0 + T);
    std::vector<int32_t> r(static_cast<size_t>(T));  // i32 [T]
    for (int64_t t = 0; t < T; ++t) r[size_t(t)] = int32_t(int64_t(table[size_t((pos0 + t) / P)]) * P + (pos0 + t) % P);
    int32_t* dv = x.tmp<int32_t>(T);
    KCUDA_CHECK(cudaMemcpyAsync(dv, r.data(), size_t(T) * 4, cudaMemcpyHostToDevice, x.stream));
    return dv;
  }

  void inject(std::span<const int32_t> table, int64_t pos0, const u16* taps, int64_t T) {
    const DraftConfig& c = *d.cfg;
    const int64_t D = c.hidden_size, In = c.tap_width(), C = c.kv_lora_rank, R = c.qk_rope_head_dim, CW = C + R;
    if (T <= 0) return;
    // H_ctx = RMSNorm_{context_norm}(Lin(context_proj)(concat taps)).
    u16* proj = x.tmp<u16>(T * D);  // bf16 [T, D]
    u16* hctx = x.tmp<u16>(T * D);  // bf16 [T, D]
    gpu::linear(x, context_proj, taps, In, T, proj, D);
    cuda::rmsnorm_bf16(proj, D, context_norm, hctx, D, T, D, c.rms_norm_eps, x.stream);
    // Per layer: [c | k_pe] = Lin(kv_a_proj)(H_ctx); ĉ = RMSNorm(c) in place; RoPE(k_pe, pos); into the pool.
    const int32_t* dst = pool_rows(table, pos0, T);
    u16* rows = x.tmp<u16>(T * CW);  // bf16 [T, C+R]
    for (const Layer& l : layers) {
      gpu::linear(x, l.kv_a, hctx, D, T, rows, CW);
      cuda::rmsnorm_bf16(rows, CW, l.kv_a_norm, rows, CW, T, C, c.rms_norm_eps, x.stream);
      cuda::dspark_rope_interleaved(rows + C, CW, T, 1, 0, pos0, inv_freq, d.rope.cos_sin_mul, R, x.stream);
      cuda::copy_rows(rows, nullptr, l.pool, dst, T, CW * 2, x.stream);
    }
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));  // the host index list and scratch go away below
    x.release_scratch();
  }

  // The block's base logits, device f32 [T, V] in step scratch (the caller releases it).
  const float* block_logits(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens) {
    const DraftConfig& c = *d.cfg;
    const int64_t T = int64_t(tokens.size()), D = c.hidden_size, V = c.vocab_size, F = c.intermediate_size,
                  Hm = c.num_attention_heads, Q = c.q_lora_rank, C = c.kv_lora_rank, N = c.qk_nope_head_dim,
                  R = c.qk_rope_head_dim, Dv = c.v_head_dim, QK = N + R, CW = C + R, S = ctx + T;
    const float eps = c.rms_norm_eps;
    KCHECK(T > 0 && ctx >= 0, "draft block of {} tokens at {}", T, ctx);
    for (int32_t id : tokens) KCHECK(id >= 0 && id < V, "draft block token {} outside [0, {})", id, V);
    // Inputs are the target's embeddings of the block tokens.
    int32_t* ids = x.tmp<int32_t>(T);  // i32 [T]
    KCUDA_CHECK(cudaMemcpyAsync(ids, tokens.data(), size_t(T) * 4, cudaMemcpyHostToDevice, x.stream));
    u16* h = x.tmp<u16>(T * D);  // bf16 [T, D]: the residual stream
    cuda::embed_gather(target.embed, ids, T, D, h, x.stream);
    const int32_t* src = ctx > 0 ? pool_rows(table, 0, ctx) : nullptr;  // the context rows' pool rows
    u16* xn = x.tmp<u16>(T * D);            // bf16 [T, D]
    u16* y = x.tmp<u16>(T * D);             // bf16 [T, D]
    u16* qa = x.tmp<u16>(T * Q);            // bf16 [T, Q]
    u16* cq = x.tmp<u16>(T * Q);            // bf16 [T, Q]
    u16* q = x.tmp<u16>(T * Hm * QK);       // bf16 [T, Hm·(N+R)]
    u16* latent = x.tmp<u16>(S * CW);       // bf16 [S, C+R]: context rows, then the block's
    u16* kv = x.tmp<u16>(S * Hm * (N + Dv));  // bf16 [S, Hm·(N+Dv)]
    u16* o = x.tmp<u16>(T * Hm * Dv);       // bf16 [T, Hm·Dv]
    u16* g = x.tmp<u16>(T * F);             // bf16 [T, Fd]
    u16* u = x.tmp<u16>(T * F);             // bf16 [T, Fd]
    float* scratch = x.tmp<float>(T * Hm * S);  // f32 [T, Hm, S]
    for (const Layer& l : layers) {
      // h += MLA(RMSNorm(h)): §3.4 with interleaved RoPE on the rope dims, no output gate.
      cuda::rmsnorm_bf16(h, D, l.input_norm, xn, D, T, D, eps, x.stream);
      gpu::linear(x, l.q_a, xn, D, T, qa, Q);
      cuda::rmsnorm_bf16(qa, Q, l.q_a_norm, cq, Q, T, Q, eps, x.stream);
      gpu::linear(x, l.q_b, cq, Q, T, q, Hm * QK);
      cuda::dspark_rope_interleaved(q + N, Hm * QK, T, Hm, QK, ctx, inv_freq, d.rope.cos_sin_mul, R, x.stream);
      // Context rows from the pool, then the block's own rows (computed here, never written to the pool).
      if (ctx > 0) cuda::copy_rows(l.pool, src, latent, nullptr, ctx, CW * 2, x.stream);
      u16* blk = latent + ctx * CW;
      gpu::linear(x, l.kv_a, xn, D, T, blk, CW);
      cuda::rmsnorm_bf16(blk, CW, l.kv_a_norm, blk, CW, T, C, eps, x.stream);
      cuda::dspark_rope_interleaved(blk + C, CW, T, 1, 0, ctx, inv_freq, d.rope.cos_sin_mul, R, x.stream);
      gpu::linear(x, l.kv_b, latent, CW, S, kv, Hm * (N + Dv));
      cuda::dspark_attend(q, kv, latent, T, S, Hm, N, R, Dv, C, d.rope.softmax_scale, scratch, o, x.stream);
      gpu::linear(x, l.o, o, Hm * Dv, T, y, D);
      cuda::add_bf16(h, y, h, T * D, x.stream);
      // h += MLP(RMSNorm(h)): SwiGLU, silu(g)·u in FP32, one rounding.
      cuda::rmsnorm_bf16(h, D, l.post_attn_norm, xn, D, T, D, eps, x.stream);
      gpu::linear(x, l.gate, xn, D, T, g, F);
      gpu::linear(x, l.up, xn, D, T, u, F);
      cuda::dspark_swiglu(g, u, g, T * F, x.stream);
      gpu::linear(x, l.down, g, F, T, y, D);
      cuda::add_bf16(h, y, h, T * D, x.stream);
    }
    // Final norm, then the target's lm_head in FP32.
    cuda::rmsnorm_bf16(h, D, final_norm, xn, D, T, D, eps, x.stream);
    float* lg = x.tmp<float>(T * V);  // f32 [T, V]
    cuda::GemmSegs sg;
    sg.seg[0] = gpu::seg_f32(0, lg, V);
    sg.n = 1;
    gpu::linear(x, target.lm_head, xn, D, T, sg);
    return lg;
  }

  void base_logits(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens, float* host) {
    const float* lg = block_logits(table, ctx, tokens);
    const int64_t V = d.cfg->vocab_size, T = int64_t(tokens.size());
    KCUDA_CHECK(cudaMemcpyAsync(host, lg, size_t(T * V) * 4, cudaMemcpyDeviceToHost, x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
    x.release_scratch();
  }

  void greedy_tokens(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens, int64_t steps,
                     int32_t* host) {
    const int64_t V = d.cfg->vocab_size, T = int64_t(tokens.size());
    KCHECK(steps >= 1 && steps <= T, "draft: {} greedy picks from a block of {}", steps, T);
    const float* lg = block_logits(table, ctx, tokens);
    int32_t* anchor = x.tmp<int32_t>(1);  // i32 [1]
    int32_t* ids = x.tmp<int32_t>(steps);  // i32 [steps]
    KCUDA_CHECK(cudaMemcpyAsync(anchor, tokens.data(), 4, cudaMemcpyHostToDevice, x.stream));
    cuda::dspark_markov_greedy(lg, T, markov_w1, markov_w2, anchor, 1, V, d.cfg->markov_rank, steps, ids, x.stream);
    KCUDA_CHECK(cudaMemcpyAsync(host, ids, size_t(steps) * 4, cudaMemcpyDeviceToHost, x.stream));
    KCUDA_CHECK(cudaStreamSynchronize(x.stream));
    x.release_scratch();
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
  impl_->inject(table, pos0, static_cast<const uint16_t*>(buf.data()), T);  // synchronises before returning
}
void CudaDraft::greedy_tokens(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens,
                              int64_t steps, int32_t* host) {
  impl_->greedy_tokens(table, ctx, tokens, steps, host);
}
void CudaDraft::base_logits(std::span<const int32_t> table, int64_t ctx, std::span<const int32_t> tokens,
                            float* host) {
  impl_->base_logits(table, ctx, tokens, host);
}

namespace gpu {
std::unique_ptr<CudaDraft> new_cuda_draft(Context& x, const WeightsDev& w, const Draft& d, int32_t num_pages,
                                          int block_size) {
  return std::make_unique<CudaDraft>(std::make_unique<CudaDraft::Impl>(x, w, d, num_pages, block_size));
}
}  // namespace gpu

}  // namespace kestrel::model
