// Weight upload and expert packing (see weights.h).
#include "model/cuda/weights.h"

#include <cuda_runtime.h>

#include <initializer_list>
#include <utility>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"

namespace kestrel::model::gpu {
namespace {

class Uploader {
 public:
  explicit Uploader(cuda::DeviceArena& a) : arena_(a) {}

  const u16* bf16(const TensorView& v) {  // null for an empty (absent optional) tensor
    if (v.empty()) return nullptr;
    void* p = arena_.alloc(v.nbytes());
    KCUDA_CHECK(cudaMemcpy(p, v.data, v.nbytes(), cudaMemcpyHostToDevice));
    return static_cast<const u16*>(p);
  }
  const float* f32(const TensorView& v) {
    KCHECK(v.dtype == DType::f32, "expected an f32 tensor");
    return reinterpret_cast<const float*>(bf16(v));
  }
  // Rows of several tensors stacked into one (same row length): one GEMM for q|k|v, gate|up.
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
  MlpWeightsDev mlp(const MlpWeights& m) {
    return {static_cast<const u16*>(cat({&m.gate_proj, &m.up_proj})), bf16(m.down_proj), m.gate_proj.shape[0]};
  }

 private:
  cuda::DeviceArena& arena_;
};

KdaWeightsDev upload_kda(Uploader& up, const KdaWeights& k) {
  KdaWeightsDev d{};
  d.qkv = static_cast<const u16*>(up.cat({&k.q_proj, &k.k_proj, &k.v_proj}));
  d.conv = static_cast<const float*>(up.cat({&k.q_conv, &k.k_conv, &k.v_conv}));
  d.g_proj = up.bf16(k.g_proj);
  d.f_a = up.bf16(k.f_a_proj);
  d.f_b = up.bf16(k.f_b_proj);
  d.b_proj = up.bf16(k.b_proj);
  d.o_proj = up.bf16(k.o_proj);
  d.a_log = up.f32(k.a_log);
  d.dt_bias = up.f32(k.dt_bias);
  d.o_norm = up.f32(k.o_norm);
  return d;
}

MlaWeightsDev upload_mla(Uploader& up, const MlaWeights& m) {
  MlaWeightsDev d{};
  d.q_a = up.bf16(m.q_a_proj);
  d.q_a_norm = up.bf16(m.q_a_norm);
  d.q_b = up.bf16(m.q_b_proj);
  d.kv_a = up.bf16(m.kv_a_proj);
  d.kv_a_norm = up.bf16(m.kv_a_norm);
  d.kv_b = up.bf16(m.kv_b_proj);
  d.g_proj = up.bf16(m.g_proj);
  d.o_proj = up.bf16(m.o_proj);
  d.has_indexer = m.has_indexer;
  if (m.has_indexer) {
    d.wq_b = up.bf16(m.indexer.wq_b);
    d.wk = up.bf16(m.indexer.wk);
    d.k_norm = up.bf16(m.indexer.k_norm);
    d.k_norm_bias = up.bf16(m.indexer.k_norm_bias);
    d.weights_proj = up.bf16(m.indexer.weights_proj);
  }
  return d;
}

MoeWeightsDev upload_moe(Uploader& up, const TextConfig& tc, const MoeWeights& m) {
  MoeWeightsDev d{};
  d.router = up.bf16(m.router);
  d.router_bias = up.f32(m.router_bias);
  d.latent_down = up.bf16(m.latent_down);
  d.latent_norm = up.bf16(m.latent_norm);
  d.latent_up = up.bf16(m.latent_up);
  d.has_shared = m.has_shared;
  if (m.has_shared) d.shared = up.mlp(m.shared);
  // Experts repacked once into the tensor-core layout of kernels/cuda/moe_layout.h (the same bytes, permuted).
  const int64_t X = tc.num_experts, Lt = tc.routed_expert_hidden_size, I = tc.moe_intermediate_size;
  KCHECK(int64_t(m.experts.size()) == X, "MoE layer has {} experts, config {}", m.experts.size(), X);
  std::vector<cuda::MoeExpertHost> src(static_cast<size_t>(X));
  for (int64_t e = 0; e < X; ++e) {
    const ExpertWeights& ew = m.experts[size_t(e)];
    KCHECK(ew.w1.packed.nbytes() == size_t(I * Lt / 2) && ew.w3.packed.nbytes() == size_t(I * Lt / 2) &&
               ew.w2.packed.nbytes() == size_t(Lt * I / 2) && ew.w1.scale.nbytes() == size_t(I * Lt / 32) &&
               ew.w3.scale.nbytes() == size_t(I * Lt / 32) && ew.w2.scale.nbytes() == size_t(Lt * I / 32),
           "expert {} tensors do not match [I, Lt] = [{}, {}]", e, I, Lt);
    auto p = [](const TensorView& v) { return static_cast<const uint8_t*>(v.data); };
    src[size_t(e)] = {p(ew.w1.packed), p(ew.w1.scale), p(ew.w3.packed), p(ew.w3.scale), p(ew.w2.packed), p(ew.w2.scale)};
  }
  d.experts = cuda::pack_experts_mxfp4(src.data(), X, Lt, I, [&](size_t n) { return up.alloc(n); });
  return d;
}

}  // namespace

WeightsDev upload_weights(const ModelConfig& c, const ModelWeights& mw, cuda::DeviceArena& arena) {
  Uploader up(arena);
  WeightsDev w;
  w.embed = up.bf16(mw.embed);
  w.lm_head = mw.lm_head.empty() ? w.embed : up.bf16(mw.lm_head);
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
