// AttnRes on the GPU, MODEL.md §3.1–3.2: the stream of stored blocks and the partial sum, and the Mix
// fused with the RMSNorm that follows it (kernels/cuda/norm.h; CPU twin model/attn_res.cpp followed by
// cpu::rmsnorm_bf16).
#include <cuda_runtime.h>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rows.h"
#include "model/cuda/layers.h"

namespace kestrel::model::gpu {

AttnResDev attn_res_begin(Context& x, const u16* embed, const int32_t* d_ids, int64_t T, bool gather) {
  AttnResDev rs;
  rs.T = T, rs.D = x.c.hidden_size;
  rs.blocks = x.tmp<u16>(int64_t(x.c.num_attn_res_blocks()) * T * rs.D);
  rs.partial = x.tmp<u16>(T * rs.D);
  if (gather)
    cuda::embed_gather(embed, d_ids, T, rs.D, rs.partial, x.stream);
  else
    rs.embed = embed, rs.embed_ids = d_ids;
  return rs;
}

void attn_res_mix_norm(Context& x, const AttnResDev& rs, const u16* res_norm, const u16* res_proj, const u16* norm,
                       u16* out) {
  const int64_t T = rs.T, D = rs.D;
  cuda::attn_res_mix_rmsnorm(rs.blocks, T * D, rs.nb, rs.partial, D, res_norm, res_proj, norm, x.c.rms_norm_eps,
                             nullptr, out, D, T, D, x.stream);
}

void attn_res_write_block(Context& x, AttnResDev& rs) {
  const int64_t TD = rs.T * rs.D;
  // Copies as kernels (copy_rows), not memcpy nodes: the PDL launches that follow get a kernel to depend on.
  cuda::copy_rows(rs.partial, nullptr, rs.blocks + int64_t(rs.nb) * TD, nullptr, rs.T, rs.D * 2, x.stream);
  ++rs.nb;
}

void attn_res_add(Context& x, AttnResDev& rs, const u16* a, bool write) {
  const int64_t TD = rs.T * rs.D;
  if (write)
    cuda::copy_rows(a, nullptr, rs.partial, nullptr, rs.T, rs.D * 2, x.stream);
  else
    cuda::add_bf16(rs.partial, a, rs.partial, TD, x.stream);
}

void attn_res_point(Context& x, AttnResDev& rs, const u16* a, cuda::AttnResAdd mode, bool store, const u16* res_norm,
                    const u16* res_proj, const u16* norm, u16* out, Fp8Act* out8) {
  const int64_t T = rs.T, D = rs.D;
  u16* block = store ? rs.blocks + int64_t(rs.nb) * T * D : nullptr;
  uint8_t* q8 = nullptr;
  float* qs = nullptr;
  if (out8) {
    q8 = x.tmp<uint8_t>(T * D);
    qs = x.tmp<float>(T);
    *out8 = {q8, qs};
  }
  const int32_t* a_ids = nullptr;
  if (rs.embed_ids) {  // the first point: P := embed_tokens[ids] (replace, the rows gathered by the kernel)
    KCHECK(mode == cuda::AttnResAdd::none && !a && rs.nb == 0, "attn_res_point: P not gathered before a later point");
    mode = cuda::AttnResAdd::replace, a = rs.embed, a_ids = rs.embed_ids;
    rs.embed = nullptr, rs.embed_ids = nullptr;
  }
  cuda::attn_res_step(rs.blocks, T * D, rs.nb, rs.partial, a, mode, block, res_norm, res_proj, norm, x.c.rms_norm_eps,
                      out, q8, qs, T, D, x.stream, a_ids);
  if (store) ++rs.nb;
}

}  // namespace kestrel::model::gpu
