// KdaStatePool bookkeeping (see state_pool.h).
#include "cache/state_pool.h"

#include "core/check.h"

namespace kestrel::cache {

KdaStatePool::KdaStatePool(int32_t num_slots) {
  if (num_slots <= 0) fail("state pool: need at least one slot, got {}", num_slots);
  role_.assign(size_t(num_slots), SlotRole::free);
  for (SlotId s = num_slots - 1; s >= 0; --s) free_.push_back(s);
}

void KdaStatePool::check_id(SlotId s) const {
  KCHECK(s >= 0 && s < num_slots(), "slot id {} outside [0, {})", s, num_slots());
}

SlotRole KdaStatePool::role(SlotId s) const {
  check_id(s);
  return role_[size_t(s)];
}

int32_t KdaStatePool::count(SlotRole r) const {
  int32_t n = 0;
  for (SlotRole x : role_) n += x == r;
  return n;
}

SlotId KdaStatePool::acquire(SlotRole r) {
  KCHECK(r != SlotRole::free, "acquire needs a held role");
  if (free_.empty()) return -1;
  const SlotId s = free_.back();
  free_.pop_back();
  role_[size_t(s)] = r;
  return s;
}

void KdaStatePool::release(SlotId s) {
  check_id(s);
  KCHECK(role_[size_t(s)] != SlotRole::free, "release of free slot {}", s);
  role_[size_t(s)] = SlotRole::free;
  free_.push_back(s);
}

void KdaStatePool::copy(SlotId src, SlotId dst, CopyPhase phase) {
  check_id(src), check_id(dst);
  KCHECK(src != dst, "copy of slot {} onto itself", src);
  KCHECK(role_[size_t(src)] != SlotRole::free && role_[size_t(dst)] != SlotRole::free,
         "copy {} -> {} touches a free slot", src, dst);
  copies_.push_back({src, dst, phase});
}

std::vector<SlotCopy> KdaStatePool::drain_copies() {
  std::vector<SlotCopy> out;
  out.swap(copies_);
  return out;
}

void KdaStatePool::check_integrity() const {
  std::vector<bool> seen(role_.size(), false);
  for (SlotId s : free_) {
    KCHECK(s >= 0 && s < num_slots(), "free list holds bad slot {}", s);
    KCHECK(!seen[size_t(s)], "slot {} twice on the free list", s);
    seen[size_t(s)] = true;
  }
  for (SlotId s = 0; s < num_slots(); ++s)
    KCHECK(seen[size_t(s)] == (role_[size_t(s)] == SlotRole::free), "slot {} role and free list disagree", s);
}

}  // namespace kestrel::cache
