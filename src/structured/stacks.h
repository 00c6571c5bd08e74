// Internal: the stack machinery shared by the token-table precomputation and the matcher.
//
// A matcher configuration is a set of stacks. Stacks are persistent linked lists of frames
// (state, parent) hash-consed in a FramePool, so equal stacks are one id, a set of stacks is a small
// vector of ids, and pushing or popping allocates at most one frame. Frame 0 is the bottom: for a
// matcher it is "below the document" (popping into it means the document may end); for the
// precomputation it stands for the unknown caller of the state being tabulated (popping into it
// means the token leaves that rule, so its acceptance depends on the stack below).
//
// A Config is kept closed: every stack reachable without input (calls pushed, accepting tops popped)
// is in it, so stepping a byte only looks at byte edges of the tops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "structured/grammar.h"

namespace kestrel::structured::detail {

class FramePool {
 public:
  static constexpr uint32_t kBottom = 0;
  FramePool() { reset(); }

  void reset() {
    frames_.assign(1, Frame{kDead, kBottom, 0});
    slots_.assign(1024, kEmpty);
    marks_.assign(1, 0);
    epoch_ = 0;
  }
  uint32_t get(uint32_t state, uint32_t parent) {
    if ((frames_.size() + 1) * 2 > slots_.size()) grow();
    const size_t m = slots_.size() - 1;
    for (size_t i = hash(state, parent) & m;; i = (i + 1) & m) {
      const uint32_t id = slots_[i];
      if (id == kEmpty) {
        slots_[i] = uint32_t(frames_.size());
        frames_.push_back({state, parent, frames_[parent].depth + 1});
        marks_.push_back(0);
        return slots_[i];
      }
      if (frames_[id].state == state && frames_[id].parent == parent) return id;
    }
  }
  uint32_t state(uint32_t f) const { return frames_[f].state; }
  uint32_t parent(uint32_t f) const { return frames_[f].parent; }
  uint32_t depth(uint32_t f) const { return frames_[f].depth; }
  size_t size() const { return frames_.size(); }
  // Membership marks for building one config at a time.
  uint32_t new_epoch() {
    if (++epoch_ == 0) {  // wrapped: forget every old mark
      std::fill(marks_.begin(), marks_.end(), 0);
      epoch_ = 1;
    }
    return epoch_;
  }
  bool mark(uint32_t f, uint32_t epoch) {
    if (marks_[f] == epoch) return false;
    marks_[f] = epoch;
    return true;
  }

 private:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  struct Frame {
    uint32_t state, parent, depth;
  };
  static size_t hash(uint32_t s, uint32_t p) {
    uint64_t x = (uint64_t(s) << 32 | p) * 0x9E3779B97F4A7C15ull;
    return size_t(x ^ (x >> 31));
  }
  void grow() {
    std::vector<uint32_t> s(slots_.size() * 2, kEmpty);
    const size_t m = s.size() - 1;
    for (uint32_t id = 1; id < frames_.size(); ++id) {
      size_t i = hash(frames_[id].state, frames_[id].parent) & m;
      while (s[i] != kEmpty) i = (i + 1) & m;
      s[i] = id;
    }
    slots_.swap(s);
  }
  std::vector<Frame> frames_;
  std::vector<uint32_t> slots_;
  std::vector<uint32_t> marks_;
  uint32_t epoch_ = 0;
};

struct Config {
  std::vector<uint32_t> frames;
  bool ended = false;      // a stack popped into the bottom frame
  bool truncated = false;  // a push was refused by the depth limit
  void clear() {
    frames.clear();
    ended = truncated = false;
  }
  bool empty() const { return frames.empty(); }
};

// Builds closed configurations. `max_depth` bounds stack height (frames); deeper pushes are dropped.
class Closer {
 public:
  Closer(const Grammar& g, FramePool& pool, uint32_t max_depth) : g_(g), pool_(pool), max_depth_(max_depth) {}

  void begin(Config& c) {
    c.clear();
    epoch_ = pool_.new_epoch();
  }
  // Adds frame f and everything reachable from it without input.
  void add(Config& c, uint32_t f) {
    work_.clear();
    work_.push_back(f);
    while (!work_.empty()) {
      const uint32_t x = work_.back();
      work_.pop_back();
      if (x == FramePool::kBottom) {
        c.ended = true;
        continue;
      }
      if (!pool_.mark(x, epoch_)) continue;
      c.frames.push_back(x);
      const Grammar::State& s = g_.states[pool_.state(x)];
      if (s.calls_begin != s.calls_end) {
        if (pool_.depth(x) + 1 > max_depth_) {
          c.truncated = true;
        } else {
          const uint32_t parent = pool_.parent(x);
          for (uint32_t i = s.calls_begin; i < s.calls_end; ++i) {
            const Grammar::Call& call = g_.calls[i];
            const uint32_t ret = pool_.get(call.ret, parent);
            work_.push_back(pool_.get(g_.rules[call.rule].start, ret));
          }
        }
      }
      if (s.accepting) work_.push_back(pool_.parent(x));
    }
  }
  // out = closure of `in` after reading byte b.
  void step(const Config& in, uint8_t b, Config& out) {
    begin(out);
    for (uint32_t f : in.frames) {
      const uint32_t q = pool_.state(f);
      if (!g_.states[q].has_bytes) continue;
      const uint32_t t = g_.step(q, b);
      if (t != kDead) add(out, pool_.get(t, pool_.parent(f)));
    }
  }
  // out = closure of `in` after reading special token id (grammar edges only).
  void step_special(const Config& in, TokenId id, Config& out) {
    begin(out);
    for (uint32_t f : in.frames) {
      const Grammar::State& s = g_.states[pool_.state(f)];
      for (uint32_t i = s.specials_begin; i < s.specials_end; ++i)
        if (g_.specials[i].id == id) add(out, pool_.get(g_.specials[i].next, pool_.parent(f)));
    }
  }

 private:
  const Grammar& g_;
  FramePool& pool_;
  uint32_t max_depth_;
  uint32_t epoch_ = 0;
  std::vector<uint32_t> work_;
};

// What finishes one frame, by its state and its depth: min_accept[state] (tokens from that state to an
// accepting state of its rule, calls included; CompiledGrammar::min_accept) — unless the frame has fewer
// than near.size() frames of room above it before the matcher's depth limit (headroom h = max_depth −
// depth): then near[h], the same distance over paths whose calls fit in that room (CompiledGrammar::
// near_accept), stored sparsely as (state, distance) pairs sorted by state for the states where it differs.
// kInf: no path fits. Without `near` (the token tables' frame-relative walks), min_accept at every depth.
struct FrameDistances {
  static constexpr uint32_t kInf = 1u << 30;  // unreachable; sums saturate here
  const std::vector<uint32_t>* unlimited = nullptr;
  const std::vector<std::vector<std::pair<uint32_t, uint32_t>>>* near = nullptr;
  uint32_t max_depth = UINT32_MAX;
  uint32_t at(uint32_t state, uint32_t depth) const {
    if (near && depth <= max_depth && max_depth - depth < near->size()) {
      const auto& level = (*near)[max_depth - depth];
      const auto it = std::lower_bound(level.begin(), level.end(), std::pair<uint32_t, uint32_t>(state, 0));
      if (it != level.end() && it->first == state) return it->second;
    }
    return (*unlimited)[state];
  }
};

// Budget-aware completion (matcher.h, "Budget"): the tokens that finish a stack along its shortest
// path = the sum over its frames of what finishes each (FrameDistances), plus `bottom` (what the bottom
// frame still needs: a stop token, or nothing). Frames are persistent and hash-consed (a frame's depth is
// part of it), so the sum is memoised per frame id: a stack costs O(1) once its parent is known. Valid
// until the pool is reset (then reset this too), for one FrameDistances.
class StackDistance {
 public:
  static constexpr uint32_t kInf = FrameDistances::kInf;
  void reset(uint32_t bottom) { memo_.assign(1, bottom); }
  uint32_t frame(const FramePool& pool, const FrameDistances& fd, uint32_t f) {
    if (memo_.size() < pool.size()) memo_.resize(pool.size(), kUnknown);
    if (memo_[f] != kUnknown) return memo_[f];
    chain_.clear();
    uint32_t x = f;
    while (memo_[x] == kUnknown) chain_.push_back(x), x = pool.parent(x);
    uint32_t d = memo_[x];
    for (size_t i = chain_.size(); i-- > 0;) {
      d = std::min(kInf, d + fd.at(pool.state(chain_[i]), pool.depth(chain_[i])));
      memo_[chain_[i]] = d;
    }
    return d;
  }
  // The fewest that finish any stack of the configuration.
  uint32_t config(const FramePool& pool, const FrameDistances& fd, const Config& c) {
    uint32_t d = c.ended ? memo_[0] : kInf;
    for (uint32_t f : c.frames) d = std::min(d, frame(pool, fd, f));
    return d;
  }

 private:
  static constexpr uint32_t kUnknown = UINT32_MAX;
  std::vector<uint32_t> memo_{0};
  std::vector<uint32_t> chain_;
};

}  // namespace kestrel::structured::detail
