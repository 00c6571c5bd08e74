// CacheStore arenas (see cache_store.h).
#include "runtime/cache_store.h"

#include <cstring>

#include "core/check.h"

namespace kestrel::runtime {

CacheStore::CacheStore(const TextConfig& t, const CacheFormats& f, int32_t num_pages, int32_t num_slots)
    : t_(t), formats_(f), layout_(cache::CacheLayout::from_config(t, f)), num_pages_(num_pages), num_slots_(num_slots) {
  if (num_pages < 1 || num_slots < 1) fail("cache store: need >= 1 page and slot, got {} and {}", num_pages, num_slots);
  latent_.resize(size_t(t.num_hidden_layers));
  keys_.resize(size_t(t.num_hidden_layers));
  kda_offset_.assign(size_t(t.num_hidden_layers), -1);
  int64_t off = 0;
  for (int L = 0; L < t.num_hidden_layers; ++L) {
    if (t.attn_kind[size_t(L)] == AttnKind::kda) {
      kda_offset_[size_t(L)] = off;
      off += layout_.kda_recurrent_bytes + layout_.kda_conv_bytes;
    } else {
      latent_[size_t(L)].assign(size_t(layout_.latent_bytes_per_page_per_layer() * num_pages), 0);
      keys_[size_t(L)].assign(size_t(layout_.index_key_bytes_per_page_per_layer() * num_pages), 0);
    }
  }
  KCHECK(off == layout_.state_bytes_per_slot(), "slot layout {} B, CacheLayout says {} B", off,
         layout_.state_bytes_per_slot());
  slots_.assign(size_t(off * num_slots), 0);
}

int64_t CacheStore::bytes() const {
  return layout_.total_page_bytes(num_pages_) + layout_.total_state_bytes(num_slots_);
}

uint8_t* CacheStore::slot_ptr(cache::SlotId s) {
  KCHECK(s >= 0 && s < num_slots_, "state slot {} outside [0, {})", s, num_slots_);
  return slots_.data() + int64_t(s) * layout_.state_bytes_per_slot();
}

model::SeqCacheView CacheStore::view(cache::SlotId slot, std::span<const cache::PageId> table, int64_t pos) {
  for (cache::PageId p : table) KCHECK(p >= 0 && p < num_pages_, "page {} outside [0, {})", p, num_pages_);
  model::SeqCacheView v;
  v.pos = pos;
  v.kda.resize(size_t(t_.num_hidden_layers));
  v.mla.resize(size_t(t_.num_hidden_layers));
  uint8_t* base = slot_ptr(slot);
  for (int L = 0; L < t_.num_hidden_layers; ++L) {
    if (kda_offset_[size_t(L)] >= 0) {
      uint8_t* p = base + kda_offset_[size_t(L)];
      v.kda[size_t(L)] = {p, formats_.kda_state == KdaStateDtype::f16,
                          reinterpret_cast<uint16_t*>(p + layout_.kda_recurrent_bytes)};
    } else {
      model::MlaCacheView m = model::MlaCacheView::make(t_, formats_.latent, formats_.index_keys, formats_.block_size);
      m.latent = latent_[size_t(L)].data();
      m.keys = keys_[size_t(L)].data();
      m.block_table = std::span<const int32_t>(table.data(), table.size());
      v.mla[size_t(L)] = m;
    }
  }
  return v;
}

void CacheStore::zero_slot(cache::SlotId s) {
  std::memset(slot_ptr(s), 0, size_t(layout_.state_bytes_per_slot()));
}

void CacheStore::copy_slot(cache::SlotId src, cache::SlotId dst) {
  if (src == dst) return;
  std::memcpy(slot_ptr(dst), slot_ptr(src), size_t(layout_.state_bytes_per_slot()));
}

}  // namespace kestrel::runtime
