// GPU forward pass, MODEL.md §3; the step numbers in comments are model.cpp's, kda.cpp's, mla.cpp's,
// indexer.cpp's, moe.cpp's and mlp.cpp's (see model_cuda.h for the layout decisions).
#include "model/model_cuda.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <functional>
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
#include "kernels/cuda/paged.h"
#include "kernels/cuda/rows.h"
#include "kernels/cuda/sampling.h"

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

// Host-side description of one batched step, built by forward_batch and read by the layers.
struct BatchStep {
  int64_t T = 0, n = 0, nd = 0;       // tokens, sequences, leading T = 1 sequences (decodes)
  int64_t n_real = 0;                 // real sequences (< n when a graph bucket pads the batch)
  std::vector<int64_t> row0, len, pos0, goff;  // per sequence: first row, T_b, pos0_b, gathered-row offset
  int64_t G = 0, max_dec_S = 0;       // gathered rows Σ S_b; longest decode context
  std::vector<int32_t> slot;          // per sequence
  const int32_t* d_cu = nullptr;      // device i32 [n+1] cu_seqlens
  const int32_t* d_slots = nullptr;   // device i32 [n]
  const int32_t* d_pool_rows = nullptr;  // device i32 [T]: pool row of each new token
  const int32_t* d_gather = nullptr;     // device i32 [G]: pool rows of every sequence's context
  const int32_t* d_dec_lens = nullptr;   // device i32 [nd]
  const u16* const* d_dec_caches = nullptr;  // device [nd]: gathered latent base per decode
  u16* lat_g = nullptr;               // bf16 [G, C+R] scratch
  u16* keys_g = nullptr;              // bf16 [G, Di] scratch (indexer models)
  // Paged attention (kernels/cuda/paged.h): block tables of the real sequences, and per real row its
  // visible key count (position + 1) and sequence; G then counts only the prefill contexts (the naive
  // prefill still reads a contiguous latent).
  bool paged = false;
  const int32_t* d_tables = nullptr;  // device i32 [n_real, bt_stride]
  int64_t bt_stride = 0;
  const int32_t* d_row_lens = nullptr;  // device i32 [rows of the real sequences]
  const int32_t* d_row_req = nullptr;   // device i32 [same]
  int64_t max_S = 0;
};

// One captured decode bucket (see "CUDA graphs" in model_cuda.h): the graph segments between the
// attention islands, the islands themselves, and the fixed-address buffers the graphs read and write.
struct GraphBucket {
  int64_t B = 0;
  int32_t* meta = nullptr;   // device i32: ids [B] | cu [B+1] | slots [B] | pool rows [B] | logits rows [B]
  float* logits = nullptr;   // f32 [B, V]
  std::vector<cudaGraphExec_t> segments;
  std::vector<std::function<void(const BatchStep&)>> islands;  // islands[k] runs after segments[k]
  std::vector<void*> kept;   // every buffer allocated while capturing (addresses baked into the graphs)
};

struct CudaCache {
  cuda::CachingAllocator* alloc = nullptr;
  int32_t num_pages = 0, num_slots = 0;  // plus one hidden dummy page and slot for padded graph rows
  int P = 0;                   // tokens per page
  // per KDA layer: f32 [slots, H, Dk, Dk], or f16 with kda_state_f16 (widened per launch by kda_recurrent)
  std::vector<uint8_t*> kda_S;
  bool kda_state_f16 = false;
  int64_t state_bytes() const { return kda_state_f16 ? 2 : 4; }
  std::vector<u16*> kda_conv;  // per KDA layer: bf16 [slots, W-1, 3·H·Dk]
  // per MLA layer: u8 [pages·P, latent_token_bytes] (bf16: [pages·P, C+R] bf16; fp8: paged.h's row)
  std::vector<u16*> latent;
  LatentFormat latent_format = LatentFormat::bf16;
  // per MLA layer with an indexer: u8 [pages, P · key_token_bytes] in paged.h's layout for key_format
  // (bf16: [pages·P, Di] bf16; fp8 / mxfp4: 64-token kernel pages, values then scales)
  std::vector<u16*> index_k;
  IndexKeyFormat key_format = IndexKeyFormat::bf16;
  std::vector<void*> owned;
  std::map<int64_t, GraphBucket> buckets;  // by bucket batch size
};

struct CudaState {
  std::unique_ptr<CudaCache, void (*)(CudaCache*)> cache{nullptr, nullptr};
  int64_t cap = 0, pos = 0;
  std::vector<int32_t> table;  // identity block table over the state's own pages
};

namespace {
void free_cache(CudaCache* c) {
  if (!c) return;
  for (auto& [b, g] : c->buckets) {
    for (cudaGraphExec_t e : g.segments) cudaGraphExecDestroy(e);
    for (void* p : g.kept) c->alloc->free(p);
    c->alloc->free(g.meta), c->alloc->free(g.logits);
  }
  for (void* p : c->owned) c->alloc->free(p);
  delete c;
}
void free_state(CudaState* s) { delete s; }

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
    alloc.free(logits_dev);
    for (cudaEvent_t e : event_pool) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
  }

  // ---- scratch: freed at the end of each forward, reused through the caching allocator ----------------
  std::vector<void*> scratch;
  template <typename T>
  T* tmp(int64_t n) {
    void* p = alloc.alloc(size_t(std::max<int64_t>(n, 1)) * sizeof(T));
    // While capturing, every buffer may be baked into a graph: the bucket keeps it for good.
    if (gmode == GMode::capture) gbucket->kept.push_back(p);
    else scratch.push_back(p);
    return static_cast<T*>(p);
  }
  // ---- CUDA graphs: capture = run the step while recording the segments between islands -----------------
  enum class GMode { eager, capture, replay } gmode = GMode::eager;
  GraphBucket* gbucket = nullptr;
  bool graphs = false;
  bool paged_attention = true;  // kernels/cuda/paged.h for the indexer and the decode; false: gathered
  void begin_segment() { KCUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed)); }
  void end_segment() {
    cudaGraph_t g = nullptr;
    KCUDA_CHECK(cudaStreamEndCapture(stream, &g));
    cudaGraphExec_t e = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&e, g, 0);
    cudaGraphDestroy(g);
    KCUDA_CHECK(err);
    gbucket->segments.push_back(e);
    KCUDA_CHECK(cudaGraphLaunch(e, stream));  // capturing did not run it
  }
  // Work whose shapes depend on the contexts (gathers, indexer, attention): eager between segments.
  void island(const BatchStep& s, std::function<void(const BatchStep&)> f) {
    if (gmode != GMode::capture) return f(s);
    end_segment();
    f(s);
    gbucket->islands.push_back(std::move(f));
    begin_segment();
  }
  void release_scratch() {
    for (void* p : scratch) alloc.free(p);
    scratch.clear();
  }
  void mark(const char* name) {
    if (!timing || gmode != GMode::eager) return;
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

  void kda(const DKda& k, CudaCache& cc, const BatchStep& s, int layer, const u16* x, u16* out) {
    const TextConfig& c = cfg.text;
    const int64_t T = s.T, D = c.hidden_size, H = c.kda.num_heads, Dk = c.kda.head_dim, HD = H * Dk,
                  W = c.kda.conv_size;
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
    // BatchStep 2 over q|k|v at once: the decode rows in one launch over their slots, then each prefill.
    u16* conv = tmp<u16>(T * 3 * HD);
    u16* hist = cc.kda_conv[size_t(layer)];
    if (s.nd > 0) cuda::kda_conv_decode(qkv, 3 * HD, k.conv, hist, s.d_slots, conv, 3 * HD, s.nd, 3 * HD, W, stream);
    for (int64_t b = s.nd; b < s.n; ++b) {
      const int64_t r = s.row0[size_t(b)];
      cuda::kda_conv_prefill(qkv + r * 3 * HD, 3 * HD, k.conv, hist + int64_t(s.slot[size_t(b)]) * (W - 1) * 3 * HD,
                             conv + r * 3 * HD, 3 * HD, s.len[size_t(b)], 3 * HD, W, stream);
    }
    float* qf = tmp<float>(T * HD);
    float* kf = tmp<float>(T * HD);
    float* vf = tmp<float>(T * HD);
    float* g = tmp<float>(T * HD);
    float* beta = tmp<float>(T * H);
    cuda::kda_qk_norm_gates(conv, conv + HD, 3 * HD, z, k.dt_bias, k.a_log, bl, c.kda.gate_lower_bound, qf, kf, g,
                            beta, T, H, Dk, stream);  // steps 3–5
    cuda::bf16_to_f32_2d(conv + 2 * HD, 3 * HD, T, HD, vf, stream);
    float* o = tmp<float>(T * HD);
    // step 6, every sequence in one varlen launch
    if (cc.kda_state_f16)
      cuda::kda_recurrent(qf, kf, vf, g, HD, beta, H, s.d_cu, s.d_slots,
                          reinterpret_cast<uint16_t*>(cc.kda_S[size_t(layer)]), o, s.n, H, Dk, stream);
    else
      cuda::kda_recurrent(qf, kf, vf, g, HD, beta, H, s.d_cu, s.d_slots,
                          reinterpret_cast<float*>(cc.kda_S[size_t(layer)]), o, s.n, H, Dk, stream);
    u16* ohat = tmp<u16>(T * HD);
    cuda::kda_out_norm_gate(o, gate, k.o_norm, c.rms_norm_eps, ohat, T, H, Dk, stream);  // step 7
    mark("kda.core");
    gemm(ohat, HD, k.o_proj, out, D, T, HD, D);  // step 8
    mark("kda.o_proj");
  }

  void mla(const DMla& m, CudaCache& cc, const BatchStep& s, int layer, const u16* x, u16* out) {
    const TextConfig& c = cfg.text;
    const int64_t T = s.T, D = c.hidden_size, Q = c.q_lora_rank, C = c.kv_lora_rank, R = c.qk_rope_head_dim,
                  Dv = c.v_head_dim, Hm = c.num_attention_heads, QK = c.qk_nope_head_dim + R, CW = C + R;
    const float eps = c.rms_norm_eps;
    // BatchStep 1.
    u16* qa = tmp<u16>(T * Q);
    u16* cq = tmp<u16>(T * Q);
    u16* q = tmp<u16>(T * Hm * QK);
    gemm(x, D, m.q_a, qa, Q, T, D, Q);
    cuda::rmsnorm_bf16(qa, Q, m.q_a_norm, cq, Q, T, Q, eps, stream);
    gemm(cq, Q, m.q_b, q, Hm * QK, T, Q, Hm * QK);
    // BatchStep 2: ĉ normalised next to k_pe in new rows, which go into their pages.
    u16* kva = tmp<u16>(T * CW);
    u16* rows = tmp<u16>(T * CW);
    gemm(x, D, m.kv_a, kva, CW, T, D, CW);
    cuda::rmsnorm_bf16(kva, CW, m.kv_a_norm, rows, CW, T, C, eps, stream);
    KCUDA_CHECK(cudaMemcpy2DAsync(rows + C, size_t(CW) * 2, kva + C, size_t(CW) * 2, size_t(R) * 2, size_t(T),
                                  cudaMemcpyDeviceToDevice, stream));
    if (cc.latent_format == LatentFormat::bf16)
      cuda::copy_rows(rows, nullptr, cc.latent[size_t(layer)], s.d_pool_rows, T, CW * 2, stream);
    else  // quantise on write, byte-identical to MlaCacheView::write_latent
      cuda::paged_write_latent(paged_view(cc, s, layer), rows, CW, s.d_pool_rows, T, stream);
    // §3.5 steps 1–4 (the indexer's queries, keys into their pages, head weights).
    u16* qi = nullptr;
    float* hw = nullptr;
    if (m.has_indexer) {
      const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
      qi = tmp<u16>(T * Hi * Di);
      u16* kraw = tmp<u16>(T * Di);
      u16* knew = tmp<u16>(T * Di);
      hw = tmp<float>(T * Hi);
      gemm(cq, Q, m.wq_b, qi, Hi * Di, T, Q, Hi * Di);
      gemm(x, D, m.wk, kraw, Di, T, D, Di);
      cuda::indexer_key_norm(kraw, m.k_norm, m.k_norm_bias, T, Di, knew, stream);
      if (cc.key_format == IndexKeyFormat::bf16)
        cuda::copy_rows(knew, nullptr, cc.index_k[size_t(layer)], s.d_pool_rows, T, Di * 2, stream);
      else  // quantise on write, byte-identical to the CPU's MlaCacheView::write_key
        cuda::paged_write_keys(paged_view(cc, s, layer), knew, Di, s.d_pool_rows, T, stream);
      lt.bf16_f32(x, D, m.weights_proj, hw, Hi, T, D, Hi, stream);
    }
    mark("mla.proj");
    u16* o = tmp<u16>(T * Hm * Dv);
    // The island: everything whose shape depends on the contexts.
    island(s, [this, &m, &cc, layer, q, qi, hw, o](const BatchStep& st) { mla_attend(m, cc, st, layer, q, qi, hw, o); });
    // BatchStep 5.
    if (m.g_proj) {
      u16* g = tmp<u16>(T * Hm * Dv);
      gemm(x, D, m.g_proj, g, Hm * Dv, T, D, Hm * Dv);
      cuda::sigmoid_gate_bf16(o, g, T * Hm * Dv, stream);
    }
    gemm(o, Hm * Dv, m.o_proj, out, D, T, Hm * Dv, D);
    mark("mla.gate+o_proj");
  }

  // Gathers every sequence's context (rows [goff_b, goff_b + S_b) of lat_g / keys_g), selects with the
  // indexer per sequence, then attends: the absorbed decode for all T = 1 sequences in one launch, the
  // naive prefill per longer sequence. Writes o rows of the real sequences.
  cuda::PagedMlaCache paged_view(CudaCache& cc, const BatchStep& s, int layer) const {
    const TextConfig& c = cfg.text;
    cuda::PagedMlaCache v;
    v.latent_format = cc.latent_format;
    v.key_format = cc.key_format;
    v.block_size = cc.P;
    v.C = c.kv_lora_rank, v.R = c.qk_rope_head_dim, v.Di = c.has_indexer() ? c.index_head_dim : 0;
    v.latent = reinterpret_cast<uint8_t*>(cc.latent[size_t(layer)]);
    v.keys = reinterpret_cast<uint8_t*>(cc.index_k[size_t(layer)]);
    v.block_tables = s.d_tables;
    v.bt_stride = s.bt_stride;
    return v;
  }

  // Selects with the indexer and attends, writing the o rows of the real sequences: the absorbed decode
  // for all T = 1 sequences in one launch, the naive prefill per longer sequence. Paged (default): the
  // indexer and the decode read the pools through the block tables (kernels/cuda/paged.h), one launch
  // each for the whole batch; only prefill contexts are gathered (rows [goff_b, goff_b + S_b) of lat_g).
  // Gathered: every context is gathered and the indexer runs per sequence (the pre-paged path).
  void mla_attend(const DMla& m, CudaCache& cc, const BatchStep& s, int layer, const u16* q, const u16* qi, const float* hw,
                  u16* o) {
    const TextConfig& c = cfg.text;
    const int64_t C = c.kv_lora_rank, R = c.qk_rope_head_dim, N = c.qk_nope_head_dim, Dv = c.v_head_dim,
                  Hm = c.num_attention_heads, QK = N + R, CW = C + R, Ki = c.index_topk;
    const int64_t nd = std::min(s.nd, s.n_real), Treal = s.n_real == s.n ? s.T : s.n_real;
    if (s.G > 0) {
      if (cc.latent_format == LatentFormat::bf16)
        cuda::copy_rows(cc.latent[size_t(layer)], s.d_gather, s.lat_g, nullptr, s.G, CW * 2, stream);
      else  // the naive prefill reads a contiguous BF16 context: dequantise while gathering
        cuda::paged_gather_latent(paged_view(cc, s, layer), s.d_gather, s.G, s.lat_g, stream);
    }
    const cuda::PagedMlaCache pv = s.paged ? paged_view(cc, s, layer) : cuda::PagedMlaCache{};
    int32_t* sel = nullptr;
    if (m.has_indexer) {
      const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
      sel = tmp<int32_t>(Treal * Ki);
      if (s.paged) {
        // Scores scratch f32 [rows, max_S]; rows in chunks that keep it under 512 MiB.
        const int64_t rows_n = std::max<int64_t>(1, std::min<int64_t>(Treal, (int64_t(512) << 20) / (4 * s.max_S)));
        float* scores = tmp<float>(rows_n * s.max_S);
        for (int64_t r0 = 0; r0 < Treal; r0 += rows_n) {
          const int64_t nq = std::min(rows_n, Treal - r0);
          cuda::indexer_select_paged(qi + r0 * Hi * Di, hw + r0 * Hi, pv, s.d_row_lens + r0, s.d_row_req + r0, nq,
                                     s.max_S, Hi, Ki, scores, s.max_S, sel + r0 * Ki, stream);
        }
      } else {
        KCHECK(cc.key_format == IndexKeyFormat::bf16,
               "GPU engine: quantised index keys need the paged attention path (use_paged_attention)");
        cuda::copy_rows(cc.index_k[size_t(layer)], s.d_gather, s.keys_g, nullptr, s.G, Di * 2, stream);
        for (int64_t b = 0; b < s.n_real; ++b) {
          const int64_t r0 = s.row0[size_t(b)], Tb = s.len[size_t(b)], p0 = s.pos0[size_t(b)], S = p0 + Tb;
          const u16* keys = s.keys_g + s.goff[size_t(b)] * Di;
          // Scores scratch f32 [rows, S]; queries in chunks that keep it under 512 MiB.
          const int64_t rows_n = std::max<int64_t>(1, std::min<int64_t>(Tb, (int64_t(512) << 20) / (4 * S)));
          float* scores = tmp<float>(rows_n * S);
          for (int64_t t0 = 0; t0 < Tb; t0 += rows_n) {
            const int64_t nq = std::min(rows_n, Tb - t0);
            cuda::indexer_select(qi + (r0 + t0) * Hi * Di, keys, hw + (r0 + t0) * Hi, nq, p0 + t0, Hi, Di, Ki, scores,
                                 S, sel + (r0 + t0) * Ki, stream);
          }
        }
      }
      capture(layer, "index_topk", sel, Treal * Ki);
      mark("mla.indexer");
    }
    const cuda::MlaDims dims{Hm, N, R, Dv, C};
    if (nd > 0) {
      // Absorbed decode: every T = 1 sequence in one launch (they are rows 0..nd−1).
      const int64_t max_keys = sel ? std::min(s.max_dec_S, Ki) : s.max_dec_S;
      if (s.paged) {
        const cuda::MlaPagedBatch bt{s.d_dec_lens, nullptr, sel, Ki, nd, max_keys};
        void* ws = tmp<char>(int64_t(cuda::mla_decode_paged_workspace_bytes(dims, nd, max_keys)));
        cuda::mla_decode_paged(lt, dims, q, m.kv_b, pv, bt, ws, o, stream);
      } else {
        const cuda::MlaDecodeBatch bt{s.d_dec_caches, s.d_dec_lens, sel, Ki, nd, max_keys};
        void* ws = tmp<char>(int64_t(cuda::mla_decode_workspace_bytes(dims, nd, max_keys)));
        cuda::mla_decode_absorbed(lt, dims, q, m.kv_b, bt, ws, o, stream);
      }
    }
    for (int64_t b = nd; b < s.n_real; ++b) {
      // Naive prefill: [k_nope | v] for every cached token of the sequence, then per-head attention.
      const int64_t r0 = s.row0[size_t(b)], Tb = s.len[size_t(b)], p0 = s.pos0[size_t(b)], S = p0 + Tb;
      const u16* lat = s.lat_g + s.goff[size_t(b)] * CW;
      u16* kv = tmp<u16>(S * Hm * (N + Dv));
      gemm(lat, CW, m.kv_b, kv, Hm * (N + Dv), S, C, Hm * (N + Dv));
      cuda::mla_attn_naive(dims, q + r0 * Hm * QK, kv, lat, sel ? sel + r0 * Ki : nullptr, Ki, Tb, p0,
                           o + r0 * Hm * Dv, stream);
    }
    mark("mla.attn");
  }

  // ---- caches ---------------------------------------------------------------------------------------------
  int64_t kda_S_elems() const { return cfg.text.kda.num_heads * cfg.text.kda.head_dim * cfg.text.kda.head_dim; }
  int64_t kda_conv_elems() const {
    return (cfg.text.kda.conv_size - 1) * 3 * cfg.text.kda.num_heads * cfg.text.kda.head_dim;
  }

  std::unique_ptr<CudaCache, void (*)(CudaCache*)> new_cache(int32_t pages, int32_t slots, int P,
                                                             const CudaCacheFormats& f) {
    const TextConfig& tc = cfg.text;
    if (pages < 1 || slots < 1 || P < 1) fail("GPU cache: need >= 1 page, slot and token per page ({}, {}, {})", pages, slots, P);
    std::unique_ptr<CudaCache, void (*)(CudaCache*)> c(new CudaCache, free_cache);
    c->alloc = &alloc;
    c->num_pages = pages, c->num_slots = slots, c->P = P, c->latent_format = f.latent, c->key_format = f.keys,
    c->kda_state_f16 = f.kda_state_f16;
    auto get = [&](int64_t n) {
      void* p = alloc.alloc(size_t(n));
      c->owned.push_back(p);
      return p;
    };
    const size_t nl = size_t(tc.num_hidden_layers);
    c->kda_S.assign(nl, nullptr), c->kda_conv.assign(nl, nullptr), c->latent.assign(nl, nullptr),
        c->index_k.assign(nl, nullptr);
    // One hidden page and slot beyond the planned ones: where padded graph rows write (never read).
    const int64_t rows = (int64_t(pages) + 1) * P, nslots = int64_t(slots) + 1;
    for (size_t L = 0; L < nl; ++L) {
      if (tc.attn_kind[L] == AttnKind::kda) {
        c->kda_S[L] = static_cast<uint8_t*>(get(nslots * kda_S_elems() * c->state_bytes()));
        c->kda_conv[L] = static_cast<u16*>(get(nslots * kda_conv_elems() * 2));
        KCUDA_CHECK(cudaMemsetAsync(c->kda_S[L], 0, size_t(nslots * kda_S_elems() * c->state_bytes()), stream));
        KCUDA_CHECK(cudaMemsetAsync(c->kda_conv[L], 0, size_t(nslots * kda_conv_elems()) * 2, stream));
      } else {
        const int64_t lb = rows * latent_token_bytes(f.latent, tc.kv_lora_rank, tc.qk_rope_head_dim);
        c->latent[L] = static_cast<u16*>(get(lb));
        KCUDA_CHECK(cudaMemsetAsync(c->latent[L], 0, size_t(lb), stream));
        if (tc.has_indexer()) {
          const int64_t kb = rows * index_key_token_bytes(f.keys, tc.index_head_dim);
          c->index_k[L] = static_cast<u16*>(get(kb));
          KCUDA_CHECK(cudaMemsetAsync(c->index_k[L], 0, size_t(kb), stream));
        }
      }
    }
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    return c;
  }
  void zero_slot(CudaCache& c, int32_t slot) {
    KCHECK(slot >= 0 && slot < c.num_slots, "GPU cache: slot {} outside [0, {})", slot, c.num_slots);
    for (size_t L = 0; L < c.kda_S.size(); ++L) {
      if (!c.kda_S[L]) continue;
      const int64_t sb = kda_S_elems() * c.state_bytes();
      KCUDA_CHECK(cudaMemsetAsync(c.kda_S[L] + int64_t(slot) * sb, 0, size_t(sb), stream));
      KCUDA_CHECK(cudaMemsetAsync(c.kda_conv[L] + int64_t(slot) * kda_conv_elems(), 0, size_t(kda_conv_elems()) * 2,
                                  stream));
    }
  }
  void copy_slot(CudaCache& c, int32_t src, int32_t dst) {
    KCHECK(src >= 0 && src < c.num_slots && dst >= 0 && dst < c.num_slots, "GPU cache: slot copy {} -> {} outside [0, {})",
           src, dst, c.num_slots);
    if (src == dst) return;
    for (size_t L = 0; L < c.kda_S.size(); ++L) {
      if (!c.kda_S[L]) continue;
      const int64_t sb = kda_S_elems() * c.state_bytes();
      KCUDA_CHECK(cudaMemcpyAsync(c.kda_S[L] + int64_t(dst) * sb, c.kda_S[L] + int64_t(src) * sb, size_t(sb),
                                  cudaMemcpyDeviceToDevice, stream));
      KCUDA_CHECK(cudaMemcpyAsync(c.kda_conv[L] + int64_t(dst) * kda_conv_elems(),
                                  c.kda_conv[L] + int64_t(src) * kda_conv_elems(), size_t(kda_conv_elems()) * 2,
                                  cudaMemcpyDeviceToDevice, stream));
    }
  }

  // ---- the batched forward --------------------------------------------------------------------------------
  float* logits_dev = nullptr;  // f32 [logits_cap, V]: the eager steps' logits
  int64_t logits_cap = 0, logits_rows = 0;
  const float* logits_cur = nullptr;  // the last step's logits (logits_dev or a graph bucket's), read by
                                      // copy_logits / greedy / sample until the next forward
  int64_t graph_steps = 0;

  static int64_t bucket_for(int64_t n) {
    int64_t b = 1;
    while (b < n) b *= 2;
    return b;
  }
  static constexpr int64_t kMaxGraphBatch = 512;

  int64_t forward_batch(CudaCache& cc, std::span<const CudaSeq> seqs) {
    const TextConfig& tc = cfg.text;
    const int64_t V = tc.vocab_size, CW = tc.kv_lora_rank + tc.qk_rope_head_dim;
    KCHECK(!seqs.empty(), "forward_batch: no sequences");
    // Validate and describe the step on the host.
    BatchStep s;
    s.n = int64_t(seqs.size());
    s.paged = paged_attention;
    std::vector<int32_t> ids, cu{0}, slots, pool_rows, gather, dec_lens, lrows, row_lens, row_req;
    for (const CudaSeq& q : seqs) s.bt_stride = std::max<int64_t>(s.bt_stride, int64_t(q.block_table.size()));
    std::vector<int32_t> tables(size_t(s.n * s.bt_stride), 0);  // i32 [n, bt_stride], padded with page 0
    std::vector<bool> slot_used(size_t(cc.num_slots), false);
    bool decodes_done = false, all_last = true;
    for (int64_t b = 0; b < s.n; ++b) {
      const CudaSeq& q = seqs[size_t(b)];
      const int64_t Tb = int64_t(q.tokens.size()), S = q.pos0 + Tb;
      KCHECK(Tb > 0 && q.pos0 >= 0, "forward_batch: sequence {} has {} tokens at position {}", b, Tb, q.pos0);
      if (Tb == 1 && !decodes_done) ++s.nd;
      else decodes_done = true;
      KCHECK(Tb > 1 || b < s.nd, "forward_batch: single-token sequences must come first (sequence {})", b);
      KCHECK(q.slot >= 0 && q.slot < cc.num_slots && !slot_used[size_t(q.slot)],
             "forward_batch: sequence {} has state slot {} (of {}, distinct per sequence)", b, q.slot, cc.num_slots);
      slot_used[size_t(q.slot)] = true;
      if (int64_t(q.block_table.size()) * cc.P < S)
        fail("context {} exceeds the GPU cache capacity of the sequence's block table ({} pages of {})", S,
             q.block_table.size(), cc.P);
      for (int32_t p : q.block_table)
        KCHECK(p >= 0 && p < cc.num_pages, "forward_batch: page {} outside [0, {})", p, cc.num_pages);
      for (int64_t i = 0; i < Tb; ++i) {
        const int32_t t = q.tokens[size_t(i)];
        if (t < 0 || t >= V) fail("token id {} at position {} is outside [0, {})", t, q.pos0 + i, V);
        ids.push_back(t);
        const int64_t pos = q.pos0 + i;
        pool_rows.push_back(int32_t(int64_t(q.block_table[size_t(pos / cc.P)]) * cc.P + pos % cc.P));
      }
      s.row0.push_back(s.T), s.len.push_back(Tb), s.pos0.push_back(q.pos0), s.goff.push_back(s.G);
      s.slot.push_back(q.slot);
      slots.push_back(q.slot);
      std::copy(q.block_table.begin(), q.block_table.end(), tables.begin() + b * s.bt_stride);
      for (int64_t i = 0; i < Tb; ++i) row_lens.push_back(int32_t(q.pos0 + i + 1)), row_req.push_back(int32_t(b));
      s.max_S = std::max(s.max_S, S);
      // Contiguous copies of the contexts the attention reads gathered: all of them, or (paged) only
      // the prefills' (the naive form expands its whole context through kv_b).
      const bool gathered = !s.paged || Tb > 1 || b >= s.nd;
      if (gathered)
        for (int64_t pos = 0; pos < S; ++pos)
          gather.push_back(int32_t(int64_t(q.block_table[size_t(pos / cc.P)]) * cc.P + pos % cc.P));
      if (b < s.nd) dec_lens.push_back(int32_t(S)), s.max_dec_S = std::max(s.max_dec_S, S);
      all_last = all_last && q.logits == CudaSeq::Logits::last;
      if (q.logits == CudaSeq::Logits::all)
        for (int64_t i = 0; i < Tb; ++i) lrows.push_back(int32_t(s.T + i));
      else if (q.logits == CudaSeq::Logits::last)
        lrows.push_back(int32_t(s.T + Tb - 1));
      s.T += Tb;
      if (gathered) s.G += S;
      cu.push_back(int32_t(s.T));
    }
    s.n_real = s.n;
    marks.clear();
    events_used = 0;
    mark("start");
    // The context-dependent metadata (islands only): gather rows [G] | decode lengths [nd] | block
    // tables [n, bt_stride] | row lengths [T] | row sequences [T], and the gathered scratch with the
    // decodes' base pointers into it (gathered path).
    {
      std::vector<int32_t> meta(gather);
      for (const auto* v : {&dec_lens, &tables, &row_lens, &row_req}) meta.insert(meta.end(), v->begin(), v->end());
      int32_t* d = tmp<int32_t>(int64_t(meta.size()));
      KCUDA_CHECK(cudaMemcpyAsync(d, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, stream));
      s.d_gather = d;
      s.d_dec_lens = d + s.G;
      s.d_tables = s.d_dec_lens + s.nd;
      s.d_row_lens = s.d_tables + s.n * s.bt_stride;
      s.d_row_req = s.d_row_lens + s.T;
    }
    s.lat_g = tmp<u16>(s.G * CW);
    if (tc.has_indexer() && !s.paged) s.keys_g = tmp<u16>(s.G * tc.index_head_dim);
    if (s.nd > 0 && !s.paged) {
      std::vector<const u16*> ptrs;
      for (int64_t b = 0; b < s.nd; ++b) ptrs.push_back(s.lat_g + s.goff[size_t(b)] * CW);
      auto* d_ptrs = tmp<const u16*>(s.nd);
      KCUDA_CHECK(cudaMemcpyAsync(d_ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, stream));
      s.d_dec_caches = d_ptrs;
    }
    const bool use_graph = graphs && s.nd == s.n && all_last && !timing && !capturing && s.n <= kMaxGraphBatch;
    if (!use_graph) {
      // Eager: ids [T] | cu [n+1] | slots [n] | pool rows [T] | logit rows, in one copy.
      std::vector<int32_t> meta;
      for (const auto* v : {&ids, &cu, &slots, &pool_rows, &lrows}) meta.insert(meta.end(), v->begin(), v->end());
      int32_t* d = tmp<int32_t>(int64_t(meta.size()));
      KCUDA_CHECK(cudaMemcpyAsync(d, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, stream));
      s.d_cu = d + s.T;
      s.d_slots = s.d_cu + s.n + 1;
      s.d_pool_rows = s.d_slots + s.n;
      const int64_t nr = int64_t(lrows.size());
      if (nr > logits_cap) {
        alloc.free(logits_dev);
        logits_dev = static_cast<float*>(alloc.alloc(size_t(nr * V) * 4));
        logits_cap = nr;
      }
      body(cc, s, d, s.d_pool_rows + s.T, nr, logits_dev);
      logits_cur = logits_dev;
      logits_rows = nr;
    } else {
      // A decode bucket: the batch padded to B rows (token 0, the hidden dummy slot and page row, an
      // empty KDA range), static inputs rewritten, the bucket's graphs replayed around the islands.
      const int64_t B = bucket_for(s.n);
      GraphBucket& g = cc.buckets[B];
      if (!g.meta) {
        g.B = B;
        g.meta = static_cast<int32_t*>(alloc.alloc(size_t(5 * B + 1) * 4));
        g.logits = static_cast<float*>(alloc.alloc(size_t(B * V) * 4));
      }
      const int32_t dummy_slot = cc.num_slots, dummy_row = int32_t(int64_t(cc.num_pages) * cc.P);
      std::vector<int32_t> meta;
      for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? ids[size_t(b)] : 0);
      for (int64_t b = 0; b <= B; ++b) meta.push_back(int32_t(std::min(b, s.n)));
      for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? slots[size_t(b)] : dummy_slot);
      for (int64_t b = 0; b < B; ++b) meta.push_back(b < s.n ? pool_rows[size_t(b)] : dummy_row);
      for (int64_t b = 0; b < B; ++b) meta.push_back(int32_t(b));
      KCUDA_CHECK(cudaMemcpyAsync(g.meta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, stream));
      s.T = s.n = s.nd = B;
      s.d_cu = g.meta + B;
      s.d_slots = s.d_cu + B + 1;
      s.d_pool_rows = s.d_slots + B;
      if (g.segments.empty()) {
        gmode = GMode::capture;
        gbucket = &g;
        try {
          begin_segment();
          body(cc, s, g.meta, s.d_pool_rows + B, B, g.logits);
          end_segment();
        } catch (...) {
          cudaGraph_t junk = nullptr;
          if (cudaStreamEndCapture(stream, &junk) == cudaSuccess && junk) cudaGraphDestroy(junk);
          for (cudaGraphExec_t e : g.segments) cudaGraphExecDestroy(e);
          g.segments.clear(), g.islands.clear();
          gmode = GMode::eager;
          throw;
        }
        gmode = GMode::eager;
      } else {
        gmode = GMode::replay;
        for (size_t k = 0; k < g.segments.size(); ++k) {
          KCUDA_CHECK(cudaGraphLaunch(g.segments[k], stream));
          if (k < g.islands.size()) g.islands[k](s);
        }
        gmode = GMode::eager;
      }
      ++graph_steps;
      logits_cur = g.logits;
      logits_rows = s.n_real;
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
    return logits_rows;
  }

  // The layer loop over the step's stacked rows; logits of the `nr` rows `d_lrows` into `logits`.
  void body(CudaCache& cc, const BatchStep& s, const int32_t* d_ids, const int32_t* d_lrows, int64_t nr, float* logits) {
    const TextConfig& tc = cfg.text;
    const int64_t T = s.T, D = tc.hidden_size, V = tc.vocab_size;
    const float eps = tc.rms_norm_eps;
    const int Nb = tc.num_attn_res_blocks();
    // AttnRes stream: blocks [Nb, T, D] and the partial sum P [T, D] (§3.1–3.2).
    u16* blocks = tmp<u16>(int64_t(Nb) * T * D);
    u16* P = tmp<u16>(T * D);
    u16* normed = tmp<u16>(T * D);
    u16* y = tmp<u16>(T * D);
    cuda::embed_gather(w.embed, d_ids, T, D, P, stream);
    int nb = 0;
    for (int L = 0; L < tc.num_hidden_layers; ++L) {
      const DLayer& lw = w.layers[size_t(L)];
      // Steps 1 and 3's norm: x = RMSNorm_input(Mix(B, P)).
      cuda::attn_res_mix_rmsnorm(blocks, T * D, nb, P, D, lw.attn_res_norm, lw.attn_res_proj, lw.input_norm, eps,
                                 nullptr, normed, D, T, D, stream);
      // BatchStep 2.
      const bool write = tc.attn_res_writes(L);
      if (write) {
        KCUDA_CHECK(cudaMemcpyAsync(blocks + int64_t(nb) * T * D, P, size_t(T * D) * 2, cudaMemcpyDeviceToDevice,
                                    stream));
        ++nb;
      }
      mark("attn_res");
      // BatchStep 3.
      if (lw.attn == AttnKind::kda)
        kda(lw.kda, cc, s, L, normed, y);
      else
        mla(lw.mla, cc, s, L, normed, y);
      capture_bf16("L" + std::to_string(L) + ".attn_out", y, T * D);
      // BatchStep 4.
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
    // Final Mix, model.norm, lm_head in FP32 (§3.8) over the rows asked for.
    cuda::attn_res_mix_rmsnorm(blocks, T * D, nb, P, D, w.out_res_norm, w.out_res_proj, w.final_norm, eps, nullptr,
                               normed, D, T, D, stream);
    if (nr > 0) {
      u16* picked = tmp<u16>(nr * D);
      cuda::copy_rows(normed, d_lrows, picked, nullptr, nr, D * 2, stream);
      lt.bf16_f32(picked, D, w.lm_head, logits, V, nr, D, V, stream);
    }
  }

  void copy_logits_rows(int64_t first, int64_t n, float* host) const {
    KCHECK(first >= 0 && n >= 0 && first + n <= logits_rows, "logits rows [{}, {}) outside the {} of the last forward",
           first, first + n, logits_rows);
    const int64_t V = cfg.text.vocab_size;
    if (n == 0) return;
    KCUDA_CHECK(cudaMemcpyAsync(host, logits_cur + first * V, size_t(n * V) * 4, cudaMemcpyDeviceToHost, stream));
    KCUDA_CHECK(cudaStreamSynchronize(stream));
  }
  void greedy(int32_t* host) {
    if (logits_rows == 0) return;
    int32_t* d = static_cast<int32_t*>(alloc.alloc(size_t(logits_rows) * 4));
    cuda::argmax_rows(logits_cur, cfg.text.vocab_size, logits_rows, cfg.text.vocab_size, d, stream);
    KCUDA_CHECK(cudaMemcpyAsync(host, d, size_t(logits_rows) * 4, cudaMemcpyDeviceToHost, stream));
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    alloc.free(d);
  }

  void sample(std::span<const cuda::SampleParams> params, std::span<const cuda::PenaltyEntry> pen, int32_t* host) {
    const int64_t V = cfg.text.vocab_size, n = int64_t(params.size()), m = int64_t(pen.size());
    if (n == 0) return;
    for (const auto& p : params)
      KCHECK(p.row >= 0 && p.row < logits_rows, "sample: logits row {} outside the {} of the last forward", p.row,
             logits_rows);
    for (const auto& e : pen)
      KCHECK(e.row >= 0 && e.row < logits_rows && e.token >= 0 && e.token < V && e.count >= 0,
             "sample: bad penalty entry (row {}, token {}, count {})", e.row, e.token, e.count);
    auto* dp = static_cast<cuda::SampleParams*>(alloc.alloc(size_t(n) * sizeof(cuda::SampleParams)));
    auto* de = static_cast<cuda::PenaltyEntry*>(alloc.alloc(size_t(std::max<int64_t>(m, 1)) * sizeof(cuda::PenaltyEntry)));
    auto* di = static_cast<int32_t*>(alloc.alloc(size_t(n) * 4));
    KCUDA_CHECK(cudaMemcpyAsync(dp, params.data(), size_t(n) * sizeof(cuda::SampleParams), cudaMemcpyHostToDevice, stream));
    if (m > 0)
      KCUDA_CHECK(cudaMemcpyAsync(de, pen.data(), size_t(m) * sizeof(cuda::PenaltyEntry), cudaMemcpyHostToDevice, stream));
    cuda::apply_penalties(const_cast<float*>(logits_cur), V, V, de, m, stream);
    cuda::sample_rows(logits_cur, V, V, dp, n, di, stream);
    KCUDA_CHECK(cudaMemcpyAsync(host, di, size_t(n) * 4, cudaMemcpyDeviceToHost, stream));
    KCUDA_CHECK(cudaStreamSynchronize(stream));
    alloc.free(dp), alloc.free(de), alloc.free(di);
  }

  // The single-request API: a batch of one over the state's own cache.
  void forward(CudaState& st, std::span<const int32_t> tokens, float* logits_host, bool last_only) {
    KCHECK(!tokens.empty(), "empty token list");
    if (st.pos + int64_t(tokens.size()) > st.cap)
      fail("context {} exceeds the GPU state's capacity {}", st.pos + int64_t(tokens.size()), st.cap);
    CudaSeq q;
    q.tokens = tokens;
    q.pos0 = st.pos;
    q.slot = 0;
    q.block_table = st.table;
    q.logits = !logits_host ? CudaSeq::Logits::none : last_only ? CudaSeq::Logits::last : CudaSeq::Logits::all;
    const int64_t rows = forward_batch(*st.cache, std::span<const CudaSeq>(&q, 1));
    if (logits_host) copy_logits_rows(0, rows, logits_host);
    st.pos += int64_t(tokens.size());
  }
};

CudaModel::CudaModel(const ModelConfig& c, const ModelWeights& w) : impl_(std::make_unique<Impl>(c, w)) {}
CudaModel::~CudaModel() = default;

namespace {
constexpr int kStatePageTokens = 64;  // page size of a CudaState's private cache
}

std::unique_ptr<CudaState, void (*)(CudaState*)> CudaModel::new_state(int64_t max_context) {
  KCHECK(max_context > 0, "GPU state: max_context must be positive, got {}", max_context);
  std::unique_ptr<CudaState, void (*)(CudaState*)> s(new CudaState, free_state);
  const int64_t pages = (max_context + kStatePageTokens - 1) / kStatePageTokens;
  KCHECK(pages < (int64_t(1) << 31) / kStatePageTokens, "GPU state: max_context {} too large", max_context);
  s->cache = impl_->new_cache(int32_t(pages), 1, kStatePageTokens, CudaCacheFormats{});
  s->cap = max_context;
  for (int32_t p = 0; p < int32_t(pages); ++p) s->table.push_back(p);
  return s;
}

void CudaModel::reset(CudaState& s) {
  impl_->zero_slot(*s.cache, 0);
  KCUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  s.pos = 0;
}

void CudaModel::forward(CudaState& st, std::span<const int32_t> tokens, float* logits_host, bool last_only) {
  impl_->forward(st, tokens, logits_host, last_only);
}

int64_t CudaModel::cache_bytes(const TextConfig& t, int64_t pages, int64_t slots, int block_size,
                               const CudaCacheFormats& f) {
  ++pages, ++slots;  // the hidden dummy page and slot
  int64_t per_row = 0, per_slot = 0;
  for (int L = 0; L < t.num_hidden_layers; ++L) {
    if (t.attn_kind[size_t(L)] == AttnKind::kda)
      per_slot += t.kda.num_heads * t.kda.head_dim * t.kda.head_dim * (f.kda_state_f16 ? 2 : 4) +
                  (t.kda.conv_size - 1) * 3 * t.kda.num_heads * t.kda.head_dim * 2;
    else
      per_row += latent_token_bytes(f.latent, t.kv_lora_rank, t.qk_rope_head_dim) + (t.has_indexer() ? index_key_token_bytes(f.keys, t.index_head_dim) : 0);
  }
  return per_row * pages * block_size + per_slot * slots;
}
std::unique_ptr<CudaCache, void (*)(CudaCache*)> CudaModel::new_cache(int32_t num_pages, int32_t num_slots,
                                                                       int block_size,
                                                                       const CudaCacheFormats& f) {
  return impl_->new_cache(num_pages, num_slots, block_size, f);
}
void CudaModel::zero_slot(CudaCache& c, int32_t slot) { impl_->zero_slot(c, slot); }
void CudaModel::copy_slot(CudaCache& c, int32_t src, int32_t dst) { impl_->copy_slot(c, src, dst); }
int64_t CudaModel::forward_batch(CudaCache& c, std::span<const CudaSeq> seqs) { return impl_->forward_batch(c, seqs); }
void CudaModel::copy_logits(float* host) const { impl_->copy_logits_rows(0, impl_->logits_rows, host); }
void CudaModel::copy_logits_rows(int64_t first, int64_t n, float* host) const { impl_->copy_logits_rows(first, n, host); }
void CudaModel::greedy(int32_t* host) const { impl_->greedy(host); }
void CudaModel::enable_cuda_graphs(bool on) { impl_->graphs = on; }
void CudaModel::use_paged_attention(bool on) { impl_->paged_attention = on; }
int64_t CudaModel::graph_steps() const { return impl_->graph_steps; }
void CudaModel::sample(std::span<const cuda::SampleParams> params, std::span<const cuda::PenaltyEntry> penalties,
                       int32_t* ids_host) {
  impl_->sample(params, penalties, ids_host);
}
void* CudaModel::stream() const { return impl_->stream; }

void CudaModel::enable_op_timing(bool on) { impl_->timing = on; }
std::vector<std::pair<std::string, double>> CudaModel::op_times() const { return impl_->last_times; }
size_t CudaModel::weight_bytes() const { return impl_->arena.bytes(); }
void CudaModel::enable_captures(bool on) { impl_->capturing = on; }
const std::map<std::string, std::vector<int32_t>>& CudaModel::captures() const { return impl_->caps; }
const std::map<std::string, std::vector<float>>& CudaModel::activation_captures() const { return impl_->fcaps; }

}  // namespace kestrel::model
