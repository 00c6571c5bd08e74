// Device caches (see cache.h).
#include "model/cuda/cache.h"

#include <memory>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"

namespace kestrel::model {

cuda::PagedMlaCache CudaCache::mla_view(int layer, const int32_t* block_tables, int64_t bt_stride) const {
  cuda::PagedMlaCache v;
  v.latent_format = formats.latent;
  v.key_format = formats.index_keys;
  v.block_size = P;
  v.C = C, v.R = R, v.Di = Di;
  v.latent = latent[size_t(layer)];
  v.keys = index_k[size_t(layer)];
  v.block_tables = block_tables;
  v.bt_stride = bt_stride;
  return v;
}

namespace gpu {

int64_t cache_bytes(const TextConfig& t, int64_t pages, int64_t slots, const CacheFormats& f) {
  const cache::CacheLayout l = cache::CacheLayout::from_config(t, f);
  return l.total_page_bytes(pages + 1) + l.total_state_bytes(slots + 1);  // + the hidden page and slot
}

CudaCache* new_cache(cuda::CachingAllocator& alloc, cudaStream_t stream, const TextConfig& t, int32_t pages,
                     int32_t slots, const CacheFormats& f) {
  if (pages < 1 || slots < 1 || f.block_size < 1)
    fail("GPU cache: need >= 1 page, slot and token per page ({}, {}, {})", pages, slots, f.block_size);
  std::unique_ptr<CudaCache, void (*)(CudaCache*)> c(new CudaCache, free_cache);
  c->alloc = &alloc;
  c->num_pages = pages, c->num_slots = slots, c->P = f.block_size, c->formats = f;
  c->layout = cache::CacheLayout::from_config(t, f);
  c->C = t.kv_lora_rank, c->R = t.qk_rope_head_dim, c->Di = t.has_indexer() ? t.index_head_dim : 0;
  auto get = [&](int64_t n) {
    void* p = alloc.alloc(size_t(n));
    c->owned.push_back(p);
    return p;
  };
  const cache::CacheLayout& l = c->layout;
  const size_t nl = size_t(t.num_hidden_layers);
  c->kda_S.assign(nl, nullptr), c->kda_conv.assign(nl, nullptr), c->latent.assign(nl, nullptr),
      c->index_k.assign(nl, nullptr);
  // One hidden page and slot beyond the planned ones: where padded graph rows write (never read).
  const int64_t rows = (int64_t(pages) + 1) * c->P, nslots = int64_t(slots) + 1;
  for (size_t L = 0; L < nl; ++L) {
    if (t.attn_kind[L] == AttnKind::kda) {
      c->kda_S[L] = static_cast<uint8_t*>(get(nslots * l.kda_recurrent_bytes));
      c->kda_conv[L] = static_cast<uint16_t*>(get(nslots * l.kda_conv_bytes));
      KCUDA_CHECK(cudaMemsetAsync(c->kda_S[L], 0, size_t(nslots * l.kda_recurrent_bytes), stream));
      KCUDA_CHECK(cudaMemsetAsync(c->kda_conv[L], 0, size_t(nslots * l.kda_conv_bytes), stream));
    } else {
      const int64_t lb = rows * l.latent_bytes_per_token;
      c->latent[L] = static_cast<uint8_t*>(get(lb));
      KCUDA_CHECK(cudaMemsetAsync(c->latent[L], 0, size_t(lb), stream));
      if (t.has_indexer()) {
        const int64_t kb = rows * l.index_key_bytes_per_token;
        c->index_k[L] = static_cast<uint8_t*>(get(kb));
        KCUDA_CHECK(cudaMemsetAsync(c->index_k[L], 0, size_t(kb), stream));
      }
    }
  }
  KCUDA_CHECK(cudaStreamSynchronize(stream));
  return c.release();
}

void free_cache(CudaCache* c) {
  if (!c) return;
  c->graphs.release(*c->alloc);
  for (void* p : c->owned) c->alloc->free(p);
  for (auto* v : {&c->trace_S, &c->trace_conv})
    for (uint8_t* p : *v) c->alloc->free(p);
  if (c->keep_tab) c->alloc->free(c->keep_tab);
  if (c->keep_idx) c->alloc->free(c->keep_idx);
  delete c;
}

void zero_slot(CudaCache& c, int32_t slot, cudaStream_t stream) {
  KCHECK(slot >= 0 && slot < c.num_slots, "GPU cache: slot {} outside [0, {})", slot, c.num_slots);
  const int64_t sb = c.layout.kda_recurrent_bytes, cb = c.layout.kda_conv_bytes;
  for (size_t L = 0; L < c.kda_S.size(); ++L) {
    if (!c.kda_S[L]) continue;
    KCUDA_CHECK(cudaMemsetAsync(c.kda_S[L] + int64_t(slot) * sb, 0, size_t(sb), stream));
    KCUDA_CHECK(cudaMemsetAsync(reinterpret_cast<uint8_t*>(c.kda_conv[L]) + int64_t(slot) * cb, 0, size_t(cb), stream));
  }
}

void copy_slot(CudaCache& c, int32_t src, int32_t dst, cudaStream_t stream) {
  KCHECK(src >= 0 && src < c.num_slots && dst >= 0 && dst < c.num_slots, "GPU cache: slot copy {} -> {} outside [0, {})",
         src, dst, c.num_slots);
  if (src == dst) return;
  const int64_t sb = c.layout.kda_recurrent_bytes, cb = c.layout.kda_conv_bytes;
  for (size_t L = 0; L < c.kda_S.size(); ++L) {
    if (!c.kda_S[L]) continue;
    KCUDA_CHECK(cudaMemcpyAsync(c.kda_S[L] + int64_t(dst) * sb, c.kda_S[L] + int64_t(src) * sb, size_t(sb),
                                cudaMemcpyDeviceToDevice, stream));
    uint8_t* conv = reinterpret_cast<uint8_t*>(c.kda_conv[L]);
    KCUDA_CHECK(cudaMemcpyAsync(conv + int64_t(dst) * cb, conv + int64_t(src) * cb, size_t(cb), cudaMemcpyDeviceToDevice,
                                stream));
  }
}

}  // namespace gpu
}  // namespace kestrel::model
