// KdaStatePool: bookkeeping of the fixed-size KDA state slots (recurrent + conv state of every KDA
// layer, layout.h gives the bytes). No bytes live here; the executor owns the buffer and indexes it
// by slot id.
//
// Every slot has exactly one role: free, running (the live state of one scheduled request) or
// checkpoint (a frozen snapshot at a block boundary, owned by a prefix-cache entry or by a snapshot
// in flight). A slot has at most one holder, so the role is its refcount. Copies are recorded, not
// performed: `before` copies (restore checkpoint → running) run before the step's forward pass,
// `after` copies (snapshot running → checkpoint) after it, because a snapshot must see the state at
// the end of the chunk just computed.
#pragma once

#include <cstdint>
#include <vector>

namespace kestrel::cache {

using SlotId = int32_t;

enum class SlotRole : uint8_t { free, running, checkpoint };
enum class CopyPhase : uint8_t { before_forward, after_forward };

struct SlotCopy {
  SlotId src = -1;
  SlotId dst = -1;
  CopyPhase phase = CopyPhase::before_forward;
};

class KdaStatePool {
 public:
  explicit KdaStatePool(int32_t num_slots);

  int32_t num_slots() const { return int32_t(role_.size()); }
  int32_t num_free() const { return int32_t(free_.size()); }
  int32_t count(SlotRole r) const;
  SlotRole role(SlotId s) const;

  // A free slot in role `r` (running or checkpoint); -1 when none is free.
  SlotId acquire(SlotRole r);
  void release(SlotId s);
  // Records that dst's bytes must become src's; both must be held.
  void copy(SlotId src, SlotId dst, CopyPhase phase);
  // The copies recorded since the last drain, in order.
  std::vector<SlotCopy> drain_copies();

  void check_integrity() const;

 private:
  void check_id(SlotId s) const;

  std::vector<SlotRole> role_;
  std::vector<SlotId> free_;
  std::vector<SlotCopy> copies_;
};

}  // namespace kestrel::cache
