// Weight upload, stacking and expert packing (see weights.h). Stacks are assembled on the host (rows
// copied from the mmapped checkpoint into one staging buffer) and copied once; with ptpc-fp8 the BF16
// stack goes to scratch device memory and quantize_fp8_rows writes the e4m3 codes and scales into the arena.
#include "model/cuda/weights.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ptpc.h"

namespace kestrel::model::gpu {
namespace {

// One piece of a stacked matrix: a tensor's rows, or a gate/up pair interleaved by 8 rows.
struct Part {
  const TensorView* a = nullptr;
  const TensorView* b = nullptr;  // non-null: interleave a (gate) and b (up) in blocks of 8 rows
  int64_t rows() const { return a->shape[0] * (b ? 2 : 1); }
};

class Uploader {
 public:
  Uploader(cuda::DeviceArena& a, bool fp8) : arena_(a), fp8_(fp8) {}

  // null for an empty (absent optional) tensor; `extra` zero bytes appended (the TP embedding's zero row)
  const u16* bf16(const TensorView& v, size_t extra = 0) {
    if (v.empty()) return nullptr;
    KCHECK(v.is_contiguous(), "upload: a strided view (pack it first, model::pack_strided)");
    void* p = arena_.alloc(v.nbytes() + extra);
    KCUDA_CHECK(cudaMemcpy(p, v.data, v.nbytes(), cudaMemcpyHostToDevice));
    if (extra > 0) KCUDA_CHECK(cudaMemset(static_cast<char*>(p) + v.nbytes(), 0, extra));
    return static_cast<const u16*>(p);
  }
  const float* f32(const TensorView& v) {
    KCHECK(v.dtype == DType::f32, "expected an f32 tensor");
    return reinterpret_cast<const float*>(bf16(v));
  }
  // Rows of several tensors stacked into one (same row length), raw bytes: the conv kernels.
  const void* cat(std::initializer_list<const TensorView*> vs) {
    size_t n = 0;
    for (auto* v : vs) n += v->nbytes();
    char* p = static_cast<char*>(arena_.alloc(n));
    size_t off = 0;
    for (auto* v : vs) {
      KCUDA_CHECK(cudaMemcpy(p + off, v->data, v->nbytes(), cudaMemcpyHostToDevice));
      off += v->nbytes();
    }
    return p;
  }
  void* alloc(size_t n) { return arena_.alloc(n); }

  // A (stacked) BF16 matrix [Σ rows, K]; quantised to PTPC FP8 when `quantise` and the model runs ptpc-fp8.
  LinearDev linear(const std::vector<Part>& parts, bool quantise = true) {
    KCHECK(!parts.empty(), "empty weight stack");
    const int64_t K = parts[0].a->shape[1];
    int64_t N = 0;
    for (const Part& p : parts) {
      KCHECK(p.a->is_contiguous() && (!p.b || p.b->is_contiguous()),
             "upload: a strided view (pack it first, model::pack_strided)");
      KCHECK(p.a->dtype == DType::bf16 && p.a->shape.rank == 2 && p.a->shape[1] == K,
             "stacked weights must be bf16 [·, {}]", K);
      if (p.b) {
        KCHECK(p.b->dtype == DType::bf16 && p.b->shape[1] == K && p.b->shape[0] == p.a->shape[0] &&
                   p.a->shape[0] % 8 == 0,
               "gate/up pair must be bf16 [F, {}] with F a multiple of 8", K);
      }
      N += p.rows();
    }
    std::vector<uint16_t> host(size_t(N * K));
    int64_t r = 0;
    for (const Part& p : parts) {
      const auto* a = static_cast<const uint16_t*>(p.a->data);
      if (!p.b) {
        std::memcpy(host.data() + r * K, a, size_t(p.a->shape[0] * K) * 2);
      } else {
        const auto* b = static_cast<const uint16_t*>(p.b->data);
        for (int64_t f0 = 0; f0 < p.a->shape[0]; f0 += 8) {
          std::memcpy(host.data() + (r + 2 * f0) * K, a + f0 * K, size_t(8 * K) * 2);
          std::memcpy(host.data() + (r + 2 * f0 + 8) * K, b + f0 * K, size_t(8 * K) * 2);
        }
      }
      r += p.rows();
    }
    LinearDev d;
    d.N = N, d.K = K;
    const size_t bytes = host.size() * 2;
    if (fp8_ && quantise) {
      void* tmp = nullptr;
      KCUDA_CHECK(cudaMalloc(&tmp, bytes));
      KCUDA_CHECK(cudaMemcpy(tmp, host.data(), bytes, cudaMemcpyHostToDevice));
      auto* q = static_cast<uint8_t*>(arena_.alloc(size_t(N * K)));
      auto* s = static_cast<float*>(arena_.alloc(size_t(N) * 4));
      cuda::quantize_fp8_rows(static_cast<const uint16_t*>(tmp), K, N, K, q, s, nullptr);
      KCUDA_CHECK(cudaDeviceSynchronize());
      KCUDA_CHECK(cudaFree(tmp));
      d.w8 = q, d.ws = s;
    } else {
      void* p = arena_.alloc(bytes);
      KCUDA_CHECK(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice));
      d.w = static_cast<const u16*>(p);
    }
    return d;
  }
  LinearDev linear(const TensorView& v, bool quantise = true) { return linear({Part{&v}}, quantise); }
  // [a | b]: two BF16 matrices with the same rows side by side along K (row n = a's row n, then b's), one GEMM
  // for x_a·aᵀ + x_b·bᵀ over the input [x_a | x_b]. BF16 only (a quantised row's scale would span both).
  LinearDev linear_kcat(const TensorView& a, const TensorView& b) {
    KCHECK(!fp8_, "linear_kcat: BF16 weights only");
    KCHECK(a.is_contiguous() && b.is_contiguous(), "upload: a strided view (pack it first, model::pack_strided)");
    KCHECK(a.dtype == DType::bf16 && b.dtype == DType::bf16 && a.shape.rank == 2 && b.shape.rank == 2 &&
               a.shape[0] == b.shape[0],
           "side-by-side weights must be bf16 [N, ·] with the same N");
    const int64_t N = a.shape[0], Ka = a.shape[1], Kb = b.shape[1], K = Ka + Kb;
    std::vector<uint16_t> host(size_t(N * K));
    const auto* pa = static_cast<const uint16_t*>(a.data);
    const auto* pb = static_cast<const uint16_t*>(b.data);
    for (int64_t n = 0; n < N; ++n) {
      std::memcpy(host.data() + n * K, pa + n * Ka, size_t(Ka) * 2);
      std::memcpy(host.data() + n * K + Ka, pb + n * Kb, size_t(Kb) * 2);
    }
    LinearDev d;
    d.N = N, d.K = K;
    void* p = arena_.alloc(host.size() * 2);
    KCUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    d.w = static_cast<const u16*>(p);
    return d;
  }
  MlpWeightsDev mlp(const MlpWeights& m) {
    MlpWeightsDev d;
    d.gate_up = linear({Part{&m.gate_proj, &m.up_proj}});
    d.down = linear(m.down_proj);
    d.F = m.gate_proj.shape[0];
    return d;
  }
  bool fp8() const { return fp8_; }

 private:
  cuda::DeviceArena& arena_;
  bool fp8_;
};

KdaWeightsDev upload_kda(Uploader& up, const KdaWeights& k) {
  KdaWeightsDev d{};
  d.in_proj = up.linear({Part{&k.q_proj}, Part{&k.k_proj}, Part{&k.v_proj}, Part{&k.g_proj}, Part{&k.f_a_proj},
                         Part{&k.b_proj}});
  d.conv = static_cast<const float*>(up.cat({&k.q_conv, &k.k_conv, &k.v_conv}));
  d.f_b = up.linear(k.f_b_proj);
  d.f_b_bf16 = d.f_b.w ? d.f_b.w : up.bf16(k.f_b_proj);
  d.o_proj = up.linear(k.o_proj);
  d.a_log = up.f32(k.a_log);
  d.dt_bias = up.f32(k.dt_bias);
  d.o_norm = up.f32(k.o_norm);
  return d;
}

MlaWeightsDev upload_mla(Uploader& up, const MlaWeights& m) {
  MlaWeightsDev d{};
  d.has_indexer = m.has_indexer;
  d.has_gate = !m.g_proj.empty();
  std::vector<Part> in{Part{&m.q_a_proj}, Part{&m.kv_a_proj}};
  int64_t r = m.q_a_proj.shape[0];
  d.off_kv = r;
  r += m.kv_a_proj.shape[0];
  if (m.has_indexer) in.push_back(Part{&m.indexer.wk}), d.off_wk = r, r += m.indexer.wk.shape[0];
  if (d.has_gate) in.push_back(Part{&m.g_proj}), d.off_g = r, r += m.g_proj.shape[0];
  if (m.has_indexer && !up.fp8()) in.push_back(Part{&m.indexer.weights_proj}), d.off_hw = r;
  d.in_proj = up.linear(in);
  if (m.has_indexer && up.fp8()) d.head_w = up.linear(m.indexer.weights_proj, false);
  std::vector<Part> qp{Part{&m.q_b_proj}};
  if (m.has_indexer) qp.push_back(Part{&m.indexer.wq_b});
  d.q_proj = up.linear(qp);
  d.o_proj = up.linear(m.o_proj);
  d.q_a_norm = up.bf16(m.q_a_norm);
  d.kv_a_norm = up.bf16(m.kv_a_norm);
  d.kv_b = up.bf16(m.kv_b_proj);
  if (m.has_indexer) {
    d.k_norm = up.bf16(m.indexer.k_norm);
    d.k_norm_bias = up.bf16(m.indexer.k_norm_bias);
  }
  return d;
}

MoeWeightsDev upload_moe(Uploader& up, const TextConfig& tc, const MoeWeights& m) {
  MoeWeightsDev d{};
  d.has_shared = m.has_shared;
  std::vector<Part> in;
  int64_t r = 0;
  if (m.has_shared) {
    in.push_back(Part{&m.shared.gate_proj, &m.shared.up_proj});
    r = 2 * m.shared.gate_proj.shape[0];
    d.Is = m.shared.gate_proj.shape[0];
  }
  d.off_down = r;
  in.push_back(Part{&m.latent_down});
  r += m.latent_down.shape[0];
  if (!up.fp8()) in.push_back(Part{&m.router}), d.off_router = r;
  d.in_proj = up.linear(in);
  if (up.fp8()) d.router = up.linear(m.router, false);
  d.router_bias = up.f32(m.router_bias);
  d.latent_norm = up.bf16(m.latent_norm);
  // BF16 with shared experts: latent up | shared down side by side (MoeWeightsDev::out_proj), unless
  // KESTREL_MOE_STACK_OUT=0 (A/B: the two GEMMs and the add epilogue, as before).
  static const bool stack_out = [] {
    const char* e = std::getenv("KESTREL_MOE_STACK_OUT");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  if (m.has_shared && !up.fp8() && stack_out) {
    d.out_proj = up.linear_kcat(m.latent_up, m.shared.down_proj);
  } else {
    d.latent_up = up.linear(m.latent_up);
    if (m.has_shared) d.shared_down = up.linear(m.shared.down_proj);
  }
  d.Xl = m.router.shape[0];
  d.Ll = m.latent_down.shape[0];
  // Experts repacked once into the tensor-core layout of kernels/cuda/moe_layout.h (the same bytes, permuted).
  // I is this rank's width (the shard's w1 rows; the whole I on one rank and under expert parallelism). Under
  // expert parallelism (loader/shard.h) only the rank's contiguous range of whole experts is bound, the
  // others are empty views: only that range [x_lo, x_lo + Xe) is uploaded.
  const int64_t X = tc.num_experts, Lt = tc.routed_expert_hidden_size;
  KCHECK(int64_t(m.experts.size()) == X, "MoE layer has {} experts, config {}", m.experts.size(), X);
  int64_t lo = 0;
  while (lo < X && m.experts[size_t(lo)].w1.packed.empty()) ++lo;
  int64_t hi = lo;
  while (hi < X && !m.experts[size_t(hi)].w1.packed.empty()) ++hi;
  KCHECK(hi > lo, "MoE layer: no routed expert is bound on this rank");
  for (int64_t e = hi; e < X; ++e)
    KCHECK(m.experts[size_t(e)].w1.packed.empty(), "MoE layer: this rank's experts are not one range ({}..{} and {})",
           lo, hi - 1, e);
  d.x_lo = lo, d.Xe = hi - lo;
  const int64_t I = m.experts[size_t(lo)].w1.rows();
  d.I = I;
  std::vector<cuda::MoeExpertHost> src(static_cast<size_t>(d.Xe));
  for (int64_t e = lo; e < hi; ++e) {
    const ExpertWeights& ew = m.experts[size_t(e)];
    KCHECK(ew.w1.packed.is_contiguous() && ew.w2.packed.is_contiguous() && ew.w2.scale.is_contiguous(),
           "expert {}: a strided view (pack it first, model::pack_strided)", e);
    KCHECK(ew.w1.packed.nbytes() == size_t(I * Lt / 2) && ew.w3.packed.nbytes() == size_t(I * Lt / 2) &&
               ew.w2.packed.nbytes() == size_t(Lt * I / 2) && ew.w1.scale.nbytes() == size_t(I * Lt / 32) &&
               ew.w3.scale.nbytes() == size_t(I * Lt / 32) && ew.w2.scale.nbytes() == size_t(Lt * I / 32),
           "expert {} tensors do not match [I, Lt] = [{}, {}]", e, I, Lt);
    auto p = [](const TensorView& v) { return static_cast<const uint8_t*>(v.data); };
    src[size_t(e - lo)] = {p(ew.w1.packed), p(ew.w1.scale), p(ew.w3.packed), p(ew.w3.scale), p(ew.w2.packed),
                           p(ew.w2.scale)};
  }
  d.experts = cuda::pack_experts_mxfp4(src.data(), d.Xe, Lt, I, [&](size_t n) { return up.alloc(n); });
  return d;
}

}  // namespace

WeightsDev upload_weights(const ModelConfig& c, const ModelWeights& mw, cuda::DeviceArena& arena, bool fp8,
                          bool embed_zero_row) {
  Uploader up(arena, fp8);
  WeightsDev w;
  w.embed = up.bf16(mw.embed, embed_zero_row ? size_t(mw.embed.shape[1]) * 2 : 0);
  if (mw.lm_head.empty()) {
    w.lm_head.w = w.embed, w.lm_head.N = mw.embed.shape[0], w.lm_head.K = mw.embed.shape[1];
  } else {
    w.lm_head = up.linear(mw.lm_head, false);
  }
  w.final_norm = up.bf16(mw.final_norm);
  w.out_res_norm = up.bf16(mw.out_res_norm);
  w.out_res_proj = up.bf16(mw.out_res_proj);
  for (const LayerWeights& lw : mw.layers) {
    LayerWeightsDev L{};
    L.attn = lw.attn_kind;
    L.mlp = lw.mlp_kind;
    L.input_norm = up.bf16(lw.input_norm);
    L.post_attn_norm = up.bf16(lw.post_attn_norm);
    L.attn_res_norm = up.bf16(lw.attn_res_norm);
    L.attn_res_proj = up.bf16(lw.attn_res_proj);
    L.mlp_res_norm = up.bf16(lw.mlp_res_norm);
    L.mlp_res_proj = up.bf16(lw.mlp_res_proj);
    if (lw.attn_kind == AttnKind::kda)
      L.kda = upload_kda(up, lw.kda);
    else
      L.mla = upload_mla(up, lw.mla);
    if (lw.mlp_kind == MlpKind::dense)
      L.dense = up.mlp(lw.dense);
    else
      L.moe = upload_moe(up, c.text, lw.moe);
    w.layers.push_back(L);
  }
  KCUDA_CHECK(cudaDeviceSynchronize());
  return w;
}

}  // namespace kestrel::model::gpu
