// A fake executor for scheduler tests: it plays a StepPlan against toy caches and returns a token
// that is a deterministic function of the request's whole history (vocab-sized hash of all tokens).
//
// It computes that token the way a real model would, from its caches, not from the history:
// the "KDA state" of a slot is a running hash of the tokens fed through it (reset, restored and
// snapshotted only as the plan's resets and copies say) and the "MLA cache" is the token id stored
// at each page position, read back through the block table. So a wrong page, a missing restore, a
// snapshot taken at the wrong time or a page overwritten while shared changes the output, and
// comparing with solo_output() catches it. Writing into a page that another holder shares throws.
// A run-ahead row (token_pending) takes the token that the previous run() sampled for its request, as a
// device executor's launch() would; steps run in call order, so running N+1 before complete(N) is run-ahead.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "sched/scheduler.h"

namespace kestrel::sched::testing {

inline uint64_t fake_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31, h *= 0xd6e8feb86659fd93ull;
  return h ^ (h >> 32);
}

struct FakeModel {
  uint64_t seed = 1;
  int32_t vocab = 1000;
  int32_t stop_every = 0;  // > 0: a token divisible by it ends the request (the "EOS")

  uint64_t initial_state() const { return fake_mix(seed, 0x5eed); }
  uint64_t initial_checksum() const { return fake_mix(seed, 0xc0ffee); }
  int32_t sample(uint64_t state, uint64_t checksum) const { return int32_t(fake_mix(state, checksum) % uint64_t(vocab)); }
  bool stops(int32_t t) const { return stop_every > 0 && t % stop_every == 0; }

  // What a request yields when it runs alone from an empty engine.
  std::vector<int32_t> solo_output(const std::vector<int32_t>& prompt, int32_t max_tokens) const {
    uint64_t st = initial_state(), ck = initial_checksum();
    for (int32_t t : prompt) st = fake_mix(st, uint64_t(t)), ck = fake_mix(ck, uint64_t(t));
    std::vector<int32_t> out;
    while (int32_t(out.size()) < max_tokens) {
      const int32_t t = sample(st, ck);
      out.push_back(t);
      if (stops(t)) break;
      st = fake_mix(st, uint64_t(t)), ck = fake_mix(ck, uint64_t(t));
    }
    return out;
  }
};

class FakeExecutor {
 public:
  FakeExecutor(FakeModel model, const cache::CacheConfig& c)
      : model_(model), P_(c.block_size), pages_(size_t(c.num_pages), std::vector<int32_t>(size_t(c.block_size), -1)),
        slots_(size_t(c.num_state_slots), 0) {}

  StepResult run(const StepPlan& plan, const cache::CacheManager& cm) {
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const ScheduledSeq& x : *list)
        if (x.reset_state) slots_.at(size_t(x.state_slot)) = model_.initial_state();
    for (const cache::SlotCopy& c : plan.copies_before) slots_.at(size_t(c.dst)) = slots_.at(size_t(c.src));
    StepResult r;
    std::map<RequestId, int32_t> sampled;
    for (const auto* list : {&plan.decodes, &plan.prefills})
      for (const ScheduledSeq& x : *list) {
        uint64_t& st = slots_.at(size_t(x.state_slot));
        for (int64_t pos = x.start; pos < x.end; ++pos) {
          int32_t t = x.tokens.at(size_t(pos - x.start));
          if (x.token_pending) {
            KCHECK(x.tokens.size() == 1 && last_.count(x.id), "step {}: request {} waits for a token never sampled",
                   plan.step, x.id);
            t = last_.at(x.id);
          }
          const cache::PageId page = x.block_table.at(size_t(pos / P_));
          KCHECK(cm.pages().refcount(page) == 1, "step {}: request {} writes shared page {}", plan.step, x.id, page);
          pages_[size_t(page)][size_t(pos % P_)] = t;
          st = fake_mix(st, uint64_t(t));
        }
        if (!x.sample) continue;
        uint64_t ck = model_.initial_checksum();
        for (int64_t pos = 0; pos < x.end; ++pos) {
          const int32_t t = pages_[size_t(x.block_table.at(size_t(pos / P_)))][size_t(pos % P_)];
          KCHECK(t >= 0, "step {}: request {} reads unwritten position {}", plan.step, x.id, pos);
          ck = fake_mix(ck, uint64_t(t));
        }
        const int32_t tok = model_.sample(st, ck);
        r.seqs.push_back({x.id, tok, model_.stops(tok), {}});
        sampled[x.id] = tok;
      }
    for (const cache::SlotCopy& c : plan.copies_after) slots_.at(size_t(c.dst)) = slots_.at(size_t(c.src));
    last_ = std::move(sampled);
    return r;
  }

 private:
  FakeModel model_;
  int P_;
  std::vector<std::vector<int32_t>> pages_;  // token id at each page position
  std::vector<uint64_t> slots_;              // "KDA state" per slot
  std::map<RequestId, int32_t> last_;        // the previous run's tokens (run-ahead's pending inputs)
};

// The scheduler tests' small cache, a request of n counting tokens (first, first + 1, ...) and a scheduler
// driven by the fake executor with integrity checked after every step.
inline cache::CacheConfig cache_config(int32_t pages, int32_t slots, int block = 16) {
  cache::CacheConfig c;
  c.num_pages = pages;
  c.num_state_slots = slots;
  c.block_size = block;
  return c;
}

inline Request request(int n, int32_t max_tokens, int32_t first = 1) {
  Request r;
  r.prompt.resize(size_t(n));
  std::iota(r.prompt.begin(), r.prompt.end(), first);
  r.max_tokens = max_tokens;
  return r;
}

struct Harness {
  cache::CacheConfig cc;
  Scheduler s;
  FakeModel model{7, 1000, 0};
  FakeExecutor exec;
  Harness(const SchedulerConfig& sc, const cache::CacheConfig& c) : cc(c), s(sc, c), exec(model, c) {}
  StepPlan step() {
    StepPlan p = s.schedule();
    s.complete(p, exec.run(p, s.cache()));
    s.check_integrity();
    return p;
  }
};

}  // namespace kestrel::sched::testing
