// GPU forward pass, MODEL.md §3; the step numbers in comments are model.cpp's, kda.cpp's, mla.cpp's,
// indexer.cpp's, moe.cpp's and mlp.cpp's (see model_cuda.h for the layout decisions).
#include "model/model_cuda.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_alloc.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/mla.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/norm.h"

namespace kestrel::model {

using u16 = uint16_t;

namespace {

struct DKda {
  const u16 *qkv, *g_proj, *f_a, *f_b, *b_proj, *o_proj;
  const float *conv, *a_log, *dt_bias, *o_norm;
};
struct DMla {
  const u16 *q_a, *q_a_norm, *q_b, *kv_a, *kv_a_norm, *kv_b, *g_proj, *o_proj;
  bool has_indexer;
  const u16 *wq_b, *wk, *k_norm, *k_norm_bias, *weights_proj;
};
struct DMlp {
  const u16 *gate_up, *down;
  int64_t F;
};
struct DMoe {
  const u16 *router, *latent_down, *latent_norm, *latent_up;
  const float* router_bias;
  cuda::MoeExpertWeights experts;
  bool has_shared;
  DMlp shared;
};
struct DLayer {
  const u16 *input_norm, *post_attn_norm, *attn_res_norm, *attn_res_proj, *mlp_res_norm, *mlp_res_proj;
  AttnKind attn;
  MlpKind mlp;
  DKda kda;
  DMla mla;
  DMlp dense;
  DMoe moe;
};

}  // namespace

struct CudaWeights {
  const u16 *embed, *lm_head, *final_norm, *out_res_norm, *out_res_proj;
  std::vector<DLayer> layers;
};

struct CudaState {
  cuda::CachingAllocator* alloc = nullptr;
  int64_t cap = 0, pos = 0;
  std::vector<float*> kda_S;   // per layer: f32 [H, Dk, Dk]
  std::vector<u16*> kda_conv;  // per layer: bf16 [W-1, 3·H·Dk]
  std::vector<u16*> latent;    // per layer: bf16 [cap, C+R]
  std::vector<u16*> index_k;   // per layer: bf16 [cap, Di]
  int32_t* meta = nullptr;     // device: [0] = 0, [1] = T (cu_seqlens), [2] = 0 (slot), [3] = S (len)
  const u16** cache_ptr = nullptr;  // device [1]
  std::vector<void*> owned;
};

namespace {
void free_state(CudaState* s) {
  if (!s) return;
  for (void* p : s->owned) s->alloc->free(p);
  delete s;
}
}  // namespace

struct CudaModel::Impl {
  ModelConfig cfg;
  cuda::CachingAllocator alloc;
  cuda::DeviceArena arena{alloc};
  cuda::GemmLt lt;
  cudaStream_t stream = nullptr;
  CudaWeights w;
  bool timing = false, capturing = false;
  std::map<std::string, std::vector<int32_t>> caps;
  std::map<std::string, std::vector<float>> fcaps;
  void capture_bf16(const std::string& name, const u16* d, int64_t n) {
    if (!capturing) return;
    std::vector<u16> h(static_cast<size_t>(n));
    KCUDA_CHECK(cudaMemcpyAsync(h.data(), d, size_t(n) * 2, cudaMemcpyDeviceToHost, stream));
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    auto& v = fcaps[name];
    for (u16 x : h) {
      const uint32_t u = uint32_t(x) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      v.push_back(f);
    }
  }
  void capture(int layer, const char* what, const int32_t* d, int64_t n) {
    if (!capturing) return;
    std::vector<int32_t> h(static_cast<size_t>(n));
    KCUDA_CHECK(cudaMemcpyAsync(h.data(), d, size_t(n) * 4, cudaMemcpyDeviceToHost, stream));
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    auto& v = caps["L" + std::to_string(layer) + "." + what];
    v.insert(v.end(), h.begin(), h.end());
  }
  std::vector<std::pair<std::string, cudaEvent_t>> marks;
  std::vector<cudaEvent_t> event_pool;
  size_t events_used = 0;
  std::vector<std::pair<std::string, double>> last_times;

  // ---- upload ------------------------------------------------------------------------------------------
  const u16* up(const TensorView& v) {
    if (v.empty()) return nullptr;
    void* p = arena.alloc(v.nbytes());
    KCUDA_CHECK(cudaMemcpy(p, v.data, v.nbytes(), cudaMemcpyHostToDevice));
    return static_cast<const u16*>(p);
  }
  const float* upf(const TensorView& v) {
    KCHECK(v.dtype == DType::f32, "expected an f32 tensor");
    return reinterpret_cast<const float*>(up(v));
  }
  // Rows of several tensors stacked into one (same row length): one GEMM for q|k|v, gate|up.
  const void* up_cat(std::initializer_list<const TensorView*> vs) {
    size_t n = 0;
    for (auto* v : vs) n += v->nbytes();
    char* p = static_cast<char*>(arena.alloc(n));
    size_t off = 0;
    for (auto* v : vs) {
      KCUDA_CHECK(cudaMemcpy(p + off, v->data, v->nbytes(), cudaMemcpyHostToDevice));
      off += v->nbytes();
    }
    return p;
  }
  DMlp up_mlp(const MlpWeights& m) {
    return {static_cast<const u16*>(up_cat({&m.gate_proj, &m.up_proj})), up(m.down_proj), m.gate_proj.shape[0]};
  }

  Impl(const ModelConfig& c, const ModelWeights& mw) : cfg(c) {
    KCUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const TextConfig& tc = c.text;
    w.embed = up(mw.embed);
    w.lm_head = mw.lm_head.empty() ? w.embed : up(mw.lm_head);
    w.final_norm = up(mw.final_norm);
    w.out_res_norm = up(mw.out_res_norm);
    w.out_res_proj = up(mw.out_res_proj);
    for (const LayerWeights& lw : mw.layers) {
      DLayer L{};
      L.attn = lw.attn_kind;
      L.mlp = lw.mlp_kind;
      L.input_norm = up(lw.input_norm);
      L.post_attn_norm = up(lw.post_attn_norm);
      L.attn_res_norm = up(lw.attn_res_norm);
      L.attn_res_proj = up(lw.attn_res_proj);
      L.mlp_res_norm = up(lw.mlp_res_norm);
      L.mlp_res_proj = up(lw.mlp_res_proj);
      if (lw.attn_kind == AttnKind::kda) {
        const KdaWeights& k = lw.kda;
        L.kda.qkv = static_cast<const u16*>(up_cat({&k.q_proj, &k.k_proj, &k.v_proj}));
        L.kda.conv = static_cast<const float*>(up_cat({&k.q_conv, &k.k_conv, &k.v_conv}));
        L.kda.g_proj = up(k.g_proj);
        L.kda.f_a = up(k.f_a_proj);
        L.kda.f_b = up(k.f_b_proj);
        L.kda.b_proj = up(k.b_proj);
        L.kda.o_proj = up(k.o_proj);
        L.kda.a_log = upf(k.a_log);
        L.kda.dt_bias = upf(k.dt_bias);
        L.kda.o_norm = upf(k.o_norm);
      } else {
        const MlaWeights& m = lw.mla;
        L.mla = {up(m.q_a_proj), up(m.q_a_norm), up(m.q_b_proj), up(m.kv_a_proj), up(m.kv_a_norm), up(m.kv_b_proj),
                 up(m.g_proj),   up(m.o_proj),   m.has_indexer,   nullptr,          nullptr,          nullptr,
                 nullptr,        nullptr};
        if (m.has_indexer) {
          L.mla.wq_b = up(m.indexer.wq_b);
          L.mla.wk = up(m.indexer.wk);
          L.mla.k_norm = up(m.indexer.k_norm);
          L.mla.k_norm_bias = up(m.indexer.k_norm_bias);
          L.mla.weights_proj = up(m.indexer.weights_proj);
        }
      }
      if (lw.mlp_kind == MlpKind::dense) {
        L.dense = up_mlp(lw.dense);
      } else {
        const MoeWeights& m = lw.moe;
        L.moe.router = up(m.router);
        L.moe.router_bias = upf(m.router_bias);
        L.moe.latent_down = up(m.latent_down);
        L.moe.latent_norm = up(m.latent_norm);
        L.moe.latent_up = up(m.latent_up);
        L.moe.has_shared = m.has_shared;
        if (m.has_shared) L.moe.shared = up_mlp(m.shared);
        // Experts back to back: w1 packed [X, I, Lt/2], scales [X, I, Lt/32]; likewise w3; w2 [X, Lt, I/2], [X, Lt, I/32].
        const int64_t X = tc.num_experts;
        KCHECK(int64_t(m.experts.size()) == X, "MoE layer has {} experts, config {}", m.experts.size(), X);
        auto pack = [&](auto get) {
          const size_t n = get(m.experts[0]).nbytes();
          char* p = static_cast<char*>(arena.alloc(n * size_t(X)));
          for (int64_t e = 0; e < X; ++e) {
            const TensorView& v = get(m.experts[size_t(e)]);
            KCHECK(v.nbytes() == n, "expert tensors differ in size");
            KCUDA_CHECK(cudaMemcpy(p + size_t(e) * n, v.data, n, cudaMemcpyHostToDevice));
          }
          return std::pair<const uint8_t*, int64_t>{reinterpret_cast<const uint8_t*>(p), int64_t(n)};
        };
        auto w1p = pack([](const ExpertWeights& e) -> const TensorView& { return e.w1.packed; });
        auto w1s = pack([](const ExpertWeights& e) -> const TensorView& { return e.w1.scale; });
        auto w3p = pack([](const ExpertWeights& e) -> const TensorView& { return e.w3.packed; });
        auto w3s = pack([](const ExpertWeights& e) -> const TensorView& { return e.w3.scale; });
        auto w2p = pack([](const ExpertWeights& e) -> const TensorView& { return e.w2.packed; });
        auto w2s = pack([](const ExpertWeights& e) -> const TensorView& { return e.w2.scale; });
        L.moe.experts = {w1p.first, w1s.first, w3p.first, w3s.first, w2p.first,  w2s.first,
                         w1p.second, w1s.second, w2p.second, w2s.second};
      }
      w.layers.push_back(L);
    }
    KCUDA_CHECK(cudaDeviceSynchronize());
  }
  ~Impl() {
    for (cudaEvent_t e : event_pool) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
  }

  // ---- scratch: freed at the end of each forward, reused through the caching allocator ----------------
  std::vector<void*> scratch;
  template <typename T>
  T* tmp(int64_t n) {
    void* p = alloc.alloc(size_t(std::max<int64_t>(n, 1)) * sizeof(T));
    scratch.push_back(p);
    return static_cast<T*>(p);
  }
  void release_scratch() {
    for (void* p : scratch) alloc.free(p);
    scratch.clear();
  }
  void mark(const char* name) {
    if (!timing) return;
    if (events_used == event_pool.size()) {
      cudaEvent_t e;
      KCUDA_CHECK(cudaEventCreate(&e));
      event_pool.push_back(e);
    }
    cudaEvent_t e = event_pool[events_used++];
    KCUDA_CHECK(cudaEventRecord(e, stream));
    marks.emplace_back(name, e);
  }

  void gemm(const u16* x, int64_t ldx, const u16* wt, u16* y, int64_t ldy, int64_t T, int64_t K, int64_t N) {
    lt.bf16(x, ldx, wt, y, ldy, T, K, N, stream);
  }

  // ---- layers -------------------------------------------------------------------------------------------
  void mlp(const DMlp& m, const u16* x, int64_t T, u16* out) {
    const TextConfig& c = cfg.text;
    const int64_t D = c.hidden_size, F = m.F;
    u16* gu = tmp<u16>(T * 2 * F);
    u16* a = tmp<u16>(T * F);
    gemm(x, D, m.gate_up, gu, 2 * F, T, D, 2 * F);
    cuda::situ_glu_bf16(gu, 2 * F, T, F, c.situ_beta, c.situ_linear_beta, a, stream);
    gemm(a, F, m.down, out, D, T, F, D);
  }

  void moe(const DMoe& m, int layer, const u16* x, int64_t T, u16* out) {
    const TextConfig& c = cfg.text;
    const int64_t D = c.hidden_size, X = c.num_experts, K = c.num_experts_per_token, Lt = c.routed_expert_hidden_size,
                  I = c.moe_intermediate_size;
    float* r = tmp<float>(T * X);
    int32_t* ids = tmp<int32_t>(T * K);
    float* wts = tmp<float>(T * K);
    lt.bf16_f32(x, D, m.router, r, X, T, D, X, stream);
    cuda::moe_route(r, m.router_bias, T, X, K, c.moe_renormalize, c.routed_scaling_factor, ids, wts, stream);
    capture(layer, "router_ids", ids, T * K);
    u16* z = tmp<u16>(T * Lt);
    gemm(x, D, m.latent_down, z, Lt, T, D, Lt);
    mark("moe.router+down");
    u16* ut = tmp<u16>(T * Lt);
    void* ws = tmp<char>(int64_t(cuda::moe_experts_workspace_bytes(T, X, K, Lt, I)));
    cuda::moe_experts_mxfp4(z, ids, wts, m.experts, T, X, K, Lt, I, c.situ_beta, c.situ_linear_beta, ws, ut, stream);
    mark("moe.experts");
    const u16* lin = ut;
    if (c.latent_moe_use_norm) {
      u16* un = tmp<u16>(T * Lt);
      cuda::rmsnorm_bf16(ut, Lt, m.latent_norm, un, Lt, T, Lt, c.rms_norm_eps, stream);
      lin = un;
    }
    u16* routed = m.has_shared ? tmp<u16>(T * D) : out;
    gemm(lin, Lt, m.latent_up, routed, D, T, Lt, D);
    if (m.has_shared) {
      mlp(m.shared, x, T, out);
      cuda::add_bf16(routed, out, out, T * D, stream);
    }
    mark("moe.up+shared");
  }

  void kda(const DKda& k, CudaState& st, int layer, const u16* x, int64_t T, u16* out) {
    const TextConfig& c = cfg.text;
    const int64_t D = c.hidden_size, H = c.kda.num_heads, Dk = c.kda.head_dim, HD = H * Dk, W = c.kda.conv_size;
    u16* qkv = tmp<u16>(T * 3 * HD);
    gemm(x, D, k.qkv, qkv, 3 * HD, T, D, 3 * HD);  // step 1
    u16* fa = tmp<u16>(T * Dk);
    u16* z = tmp<u16>(T * HD);
    u16* bl = tmp<u16>(T * H);
    u16* gate = tmp<u16>(T * HD);
    gemm(x, D, k.f_a, fa, Dk, T, D, Dk);
    gemm(fa, Dk, k.f_b, z, HD, T, Dk, HD);
    gemm(x, D, k.b_proj, bl, H, T, D, H);
    gemm(x, D, k.g_proj, gate, HD, T, D, HD);
    mark("kda.proj");
    u16* conv = tmp<u16>(T * 3 * HD);  // step 2 over q|k|v at once
    cuda::kda_conv_prefill(qkv, 3 * HD, k.conv, st.kda_conv[size_t(layer)], conv, 3 * HD, T, 3 * HD, W, stream);
    float* qf = tmp<float>(T * HD);
    float* kf = tmp<float>(T * HD);
    float* vf = tmp<float>(T * HD);
    float* g = tmp<float>(T * HD);
    float* beta = tmp<float>(T * H);
    cuda::kda_qk_norm_gates(conv, conv + HD, 3 * HD, z, k.dt_bias, k.a_log, bl, c.kda.gate_lower_bound, qf, kf, g,
                            beta, T, H, Dk, stream);  // steps 3–5
    cuda::bf16_to_f32_2d(conv + 2 * HD, 3 * HD, T, HD, vf, stream);
    float* o = tmp<float>(T * HD);
    cuda::kda_recurrent(qf, kf, vf, g, HD, beta, H, st.meta, st.meta + 2, st.kda_S[size_t(layer)], o, 1, H, Dk,
                        stream);  // step 6
    u16* ohat = tmp<u16>(T * HD);
    cuda::kda_out_norm_gate(o, gate, k.o_norm, c.rms_norm_eps, ohat, T, H, Dk, stream);  // step 7
    mark("kda.core");
    gemm(ohat, HD, k.o_proj, out, D, T, HD, D);  // step 8
    mark("kda.o_proj");
  }

  void mla(const DMla& m, CudaState& st, int layer, const u16* x, int64_t T, u16* out) {
    const TextConfig& c = cfg.text;
    const int64_t D = c.hidden_size, Q = c.q_lora_rank, C = c.kv_lora_rank, R = c.qk_rope_head_dim,
                  N = c.qk_nope_head_dim, Dv = c.v_head_dim, Hm = c.num_attention_heads, QK = N + R, CW = C + R;
    const int64_t pos0 = st.pos, S = pos0 + T;
    KCHECK(S <= st.cap, "context {} exceeds the GPU state's capacity {}", S, st.cap);
    const float eps = c.rms_norm_eps;
    u16* latent = st.latent[size_t(layer)];
    // Step 1.
    u16* qa = tmp<u16>(T * Q);
    u16* cq = tmp<u16>(T * Q);
    u16* q = tmp<u16>(T * Hm * QK);
    gemm(x, D, m.q_a, qa, Q, T, D, Q);
    cuda::rmsnorm_bf16(qa, Q, m.q_a_norm, cq, Q, T, Q, eps, stream);
    gemm(cq, Q, m.q_b, q, Hm * QK, T, Q, Hm * QK);
    // Step 2: ĉ normalised straight into the cache rows, k_pe copied beside it.
    u16* kva = tmp<u16>(T * CW);
    gemm(x, D, m.kv_a, kva, CW, T, D, CW);
    cuda::rmsnorm_bf16(kva, CW, m.kv_a_norm, latent + pos0 * CW, CW, T, C, eps, stream);
    KCUDA_CHECK(cudaMemcpy2DAsync(latent + pos0 * CW + C, size_t(CW) * 2, kva + C, size_t(CW) * 2, size_t(R) * 2,
                                  size_t(T), cudaMemcpyDeviceToDevice, stream));
    mark("mla.proj");
    // §3.5: the indexer's selection.
    int32_t* sel = nullptr;
    const int64_t Ki = c.index_topk;
    if (m.has_indexer) {
      const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
      u16* qi = tmp<u16>(T * Hi * Di);
      u16* kraw = tmp<u16>(T * Di);
      float* hw = tmp<float>(T * Hi);
      gemm(cq, Q, m.wq_b, qi, Hi * Di, T, Q, Hi * Di);
      gemm(x, D, m.wk, kraw, Di, T, D, Di);
      u16* keys = st.index_k[size_t(layer)];
      cuda::indexer_key_norm(kraw, m.k_norm, m.k_norm_bias, T, Di, keys + pos0 * Di, stream);
      lt.bf16_f32(x, D, m.weights_proj, hw, Hi, T, D, Hi, stream);
      sel = tmp<int32_t>(T * Ki);
      // Scores scratch f32 [rows, S]; queries in chunks that keep it under 512 MiB.
      const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(T, (int64_t(512) << 20) / (4 * S)));
      float* scores = tmp<float>(rows * S);
      for (int64_t t0 = 0; t0 < T; t0 += rows) {
        const int64_t n = std::min(rows, T - t0);
        cuda::indexer_select(qi + t0 * Hi * Di, keys, hw + t0 * Hi, n, pos0 + t0, Hi, Di, Ki, scores, S,
                             sel + t0 * Ki, stream);
      }
      capture(layer, "index_topk", sel, T * Ki);
      mark("mla.indexer");
    }
    const cuda::MlaDims dims{Hm, N, R, Dv, C};
    u16* o = tmp<u16>(T * Hm * Dv);
    if (T == 1) {
      // Absorbed decode over the contiguous cache: one request, B = 1.
      const int32_t meta[4] = {0, 1, 0, int32_t(S)};
      KCUDA_CHECK(cudaMemcpyAsync(st.meta, meta, sizeof meta, cudaMemcpyHostToDevice, stream));
      const u16* base = latent;
      KCUDA_CHECK(cudaMemcpyAsync(st.cache_ptr, &base, sizeof base, cudaMemcpyHostToDevice, stream));
      const int64_t max_keys = sel ? std::min(S, Ki) : S;
      const cuda::MlaDecodeBatch bt{st.cache_ptr, st.meta + 3, sel, Ki, 1, max_keys};
      void* ws = tmp<char>(int64_t(cuda::mla_decode_workspace_bytes(dims, 1, max_keys)));
      cuda::mla_decode_absorbed(lt, dims, q, m.kv_b, bt, ws, o, stream);
      // The host copies above read stack memory: make sure they are done before it goes away.
      KCUDA_CHECK(cudaStreamSynchronize(stream));
    } else {
      // Naive prefill: [k_nope | v] for every cached token, then per-head attention.
      u16* kv = tmp<u16>(S * Hm * (N + Dv));
      gemm(latent, CW, m.kv_b, kv, Hm * (N + Dv), S, C, Hm * (N + Dv));
      cuda::mla_attn_naive(dims, q, kv, latent, sel, Ki, T, pos0, o, stream);
    }
    mark("mla.attn");
    // Step 5.
    if (m.g_proj) {
      u16* g = tmp<u16>(T * Hm * Dv);
      gemm(x, D, m.g_proj, g, Hm * Dv, T, D, Hm * Dv);
      cuda::sigmoid_gate_bf16(o, g, T * Hm * Dv, stream);
    }
    gemm(o, Hm * Dv, m.o_proj, out, D, T, Hm * Dv, D);
    mark("mla.gate+o_proj");
  }

  void forward(CudaState& st, std::span<const int32_t> tokens, float* logits_host, bool last_only) {
    const TextConfig& tc = cfg.text;
    const int64_t T = int64_t(tokens.size()), D = tc.hidden_size, V = tc.vocab_size;
    KCHECK(T > 0, "empty token list");
    for (int64_t i = 0; i < T; ++i)
      if (tokens[size_t(i)] < 0 || tokens[size_t(i)] >= V)
        fail("token id {} at position {} is outside [0, {})", tokens[size_t(i)], i, V);
    marks.clear();
    events_used = 0;
    mark("start");
    const float eps = tc.rms_norm_eps;
    const int Nb = tc.num_attn_res_blocks();
    int32_t* ids = tmp<int32_t>(T);
    KCUDA_CHECK(cudaMemcpyAsync(ids, tokens.data(), size_t(T) * 4, cudaMemcpyHostToDevice, stream));
    // KDA recurrence metadata for one request: cu_seqlens {0, T}, slot 0.
    const int32_t meta[4] = {0, int32_t(T), 0, 0};
    KCUDA_CHECK(cudaMemcpyAsync(st.meta, meta, sizeof meta, cudaMemcpyHostToDevice, stream));
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    // AttnRes stream: blocks [Nb, T, D] and the partial sum P [T, D] (§3.1–3.2).
    u16* blocks = tmp<u16>(int64_t(Nb) * T * D);
    u16* P = tmp<u16>(T * D);
    u16* normed = tmp<u16>(T * D);
    u16* y = tmp<u16>(T * D);
    cuda::embed_gather(w.embed, ids, T, D, P, stream);
    int nb = 0;
    for (int L = 0; L < tc.num_hidden_layers; ++L) {
      const DLayer& lw = w.layers[size_t(L)];
      // Steps 1 and 3's norm: x = RMSNorm_input(Mix(B, P)).
      cuda::attn_res_mix_rmsnorm(blocks, T * D, nb, P, D, lw.attn_res_norm, lw.attn_res_proj, lw.input_norm, eps,
                                 nullptr, normed, D, T, D, stream);
      // Step 2.
      const bool write = tc.attn_res_writes(L);
      if (write) {
        KCUDA_CHECK(cudaMemcpyAsync(blocks + int64_t(nb) * T * D, P, size_t(T * D) * 2, cudaMemcpyDeviceToDevice,
                                    stream));
        ++nb;
      }
      mark("attn_res");
      // Step 3.
      if (lw.attn == AttnKind::kda)
        kda(lw.kda, st, L, normed, T, y);
      else
        mla(lw.mla, st, L, normed, T, y);
      capture_bf16("L" + std::to_string(L) + ".attn_out", y, T * D);
      // Step 4.
      if (write)
        KCUDA_CHECK(cudaMemcpyAsync(P, y, size_t(T * D) * 2, cudaMemcpyDeviceToDevice, stream));
      else
        cuda::add_bf16(P, y, P, T * D, stream);
      // Steps 5–6.
      cuda::attn_res_mix_rmsnorm(blocks, T * D, nb, P, D, lw.mlp_res_norm, lw.mlp_res_proj, lw.post_attn_norm, eps,
                                 nullptr, normed, D, T, D, stream);
      mark("attn_res");
      if (lw.mlp == MlpKind::dense) {
        mlp(lw.dense, normed, T, y);
        mark("dense_mlp");
      } else {
        moe(lw.moe, L, normed, T, y);
      }
      capture_bf16("L" + std::to_string(L) + ".mlp_out", y, T * D);
      cuda::add_bf16(P, y, P, T * D, stream);
    }
    st.pos += T;
    // Final Mix, model.norm, lm_head in FP32 (§3.8).
    cuda::attn_res_mix_rmsnorm(blocks, T * D, nb, P, D, w.out_res_norm, w.out_res_proj, w.final_norm, eps, nullptr,
                               normed, D, T, D, stream);
    if (logits_host) {
      const int64_t first = last_only ? T - 1 : 0, rows = T - first;
      float* logits = tmp<float>(rows * V);
      lt.bf16_f32(normed + first * D, D, w.lm_head, logits, V, rows, D, V, stream);
      KCUDA_CHECK(cudaMemcpyAsync(logits_host, logits, size_t(rows * V) * 4, cudaMemcpyDeviceToHost, stream));
    }
    mark("final+lm_head");
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    release_scratch();
    if (timing) {
      std::map<std::string, double> acc;
      std::vector<std::string> order;
      for (size_t i = 1; i < marks.size(); ++i) {
        float ms = 0;
        KCUDA_CHECK(cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second));
        if (!acc.count(marks[i].first)) order.push_back(marks[i].first);
        acc[marks[i].first] += double(ms) * 1000.0;
      }
      last_times.clear();
      for (const auto& n : order) last_times.emplace_back(n, acc[n]);
    }
  }
};

CudaModel::CudaModel(const ModelConfig& c, const ModelWeights& w) : impl_(std::make_unique<Impl>(c, w)) {}
CudaModel::~CudaModel() = default;

std::unique_ptr<CudaState, void (*)(CudaState*)> CudaModel::new_state(int64_t max_context) {
  const TextConfig& tc = impl_->cfg.text;
  std::unique_ptr<CudaState, void (*)(CudaState*)> s(new CudaState, free_state);
  s->alloc = &impl_->alloc;
  s->cap = max_context;
  auto get = [&](size_t n) {
    void* p = impl_->alloc.alloc(n);
    s->owned.push_back(p);
    return p;
  };
  const int64_t n_layers = tc.num_hidden_layers;
  s->kda_S.assign(size_t(n_layers), nullptr);
  s->kda_conv.assign(size_t(n_layers), nullptr);
  s->latent.assign(size_t(n_layers), nullptr);
  s->index_k.assign(size_t(n_layers), nullptr);
  const int64_t H = tc.kda.num_heads, Dk = tc.kda.head_dim, W = tc.kda.conv_size;
  for (int64_t L = 0; L < n_layers; ++L) {
    if (tc.attn_kind[size_t(L)] == AttnKind::kda) {
      s->kda_S[size_t(L)] = static_cast<float*>(get(size_t(H * Dk * Dk) * 4));
      s->kda_conv[size_t(L)] = static_cast<u16*>(get(size_t((W - 1) * 3 * H * Dk) * 2));
    } else {
      s->latent[size_t(L)] = static_cast<u16*>(get(size_t(max_context * (tc.kv_lora_rank + tc.qk_rope_head_dim)) * 2));
      if (tc.has_indexer()) s->index_k[size_t(L)] = static_cast<u16*>(get(size_t(max_context * tc.index_head_dim) * 2));
    }
  }
  s->meta = static_cast<int32_t*>(get(64));
  s->cache_ptr = static_cast<const u16**>(get(64));
  reset(*s);
  return s;
}

void CudaModel::reset(CudaState& s) {
  const TextConfig& tc = impl_->cfg.text;
  const int64_t H = tc.kda.num_heads, Dk = tc.kda.head_dim, W = tc.kda.conv_size;
  for (size_t L = 0; L < s.kda_S.size(); ++L) {
    if (!s.kda_S[L]) continue;
    KCUDA_CHECK(cudaMemset(s.kda_S[L], 0, size_t(H * Dk * Dk) * 4));
    KCUDA_CHECK(cudaMemset(s.kda_conv[L], 0, size_t((W - 1) * 3 * H * Dk) * 2));
  }
  s.pos = 0;
}

void CudaModel::forward(CudaState& st, std::span<const int32_t> tokens, float* logits_host, bool last_only) {
  impl_->forward(st, tokens, logits_host, last_only);
}

void CudaModel::enable_op_timing(bool on) { impl_->timing = on; }
std::vector<std::pair<std::string, double>> CudaModel::op_times() const { return impl_->last_times; }
size_t CudaModel::weight_bytes() const { return impl_->arena.bytes(); }
void CudaModel::enable_captures(bool on) { impl_->capturing = on; }
const std::map<std::string, std::vector<int32_t>>& CudaModel::captures() const { return impl_->caps; }
const std::map<std::string, std::vector<float>>& CudaModel::activation_captures() const { return impl_->fcaps; }

}  // namespace kestrel::model
