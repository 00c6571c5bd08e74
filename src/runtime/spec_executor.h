// The CPU executor's side of DSpark speculation in the serving engine (docs/speculative.md, MODEL.md §5):
// the draft's paged caches and the per-request drafting and acceptance of a step. The scheduler plans a
// speculating request's decode as plain data (ScheduledSeq::num_draft positions after the anchor); the
// executor (executor.cpp) drafts them here, runs every sequence's rows in its ONE batched target forward
// (speculative rows with all logits and a KDA state trace), and hands each speculative sequence back here
// to verify (spec_decode.h's draft_pick / verify_step, the single-request loop's own rules).
//
// Draft caches: one latent arena per draft layer, indexed by the target's page ids — a request's draft
// rows live in the same pages as its target rows, so the scheduler's page bookkeeping (growth, release
// of rejected positions, preemption, prefix-cache sharing) covers both. Every target forward, speculating
// or not, injects the taps of the positions it commits, so a prefix-cache page carries draft rows too
// (taps depend only on the tokens before them: whoever computed the page wrote the same rows).
// The arenas are not part of the engine's memory budget: (Ld · (C+R) · 2) bytes per page slot.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "cache/page_pool.h"
#include "model/dspark.h"
#include "request/request.h"
#include "runtime/spec_verify.h"

namespace kestrel::runtime {

// What the engine speculates with (engine_host.cpp builds it from --speculative-config).
struct SpecServing {
  const model::Draft* draft = nullptr;
  int num_speculative_tokens = 7;  // γ ≤ the draft's block size
  RejectionMethod rejection = RejectionMethod::block;
  bool draft_greedy = false;       // draft_sample_method "greedy"
  int draft_topk = 0;              // dspark_draft_topk
  int disable_by_batch_size = 0;   // no drafts in a step with more decodes than this (0 = never)
  // Test hook (an always-agreeing draft): the token proposed for output index j of request id, or −1 to
  // keep the draft model's. The draft model still runs.
  std::function<int32_t(RequestId id, int64_t j)> oracle;
};

class SpecDrafter {
 public:
  // host_caches = false: the draft runs elsewhere (the GPU draft, model/cuda/dspark.h), no host arenas; then
  // only draft_block with base logits may be called.
  SpecDrafter(const SpecServing& s, int32_t num_pages, int block_size, bool host_caches = true);

  const SpecServing& serving() const { return s_; }
  const model::Draft& draft() const { return *s_.draft; }
  int64_t tap_width() const { return s_.draft->cfg->tap_width(); }
  // The draft layers' cache views over a block table.
  std::vector<model::MlaCacheView> views(std::span<const cache::PageId> table);
  // Taps of positions [pos0, pos0 + T) into the draft caches of the request with `table`.
  void inject(std::span<const cache::PageId> table, int64_t pos0, const uint16_t* taps /* bf16 [T, n·Dt] */,
              int64_t T);

  // One request's draft: γ tokens after `anchor` at position ctx (the caches hold [0, ctx)), q_i kept
  // (f64 [γ, V]). out_index = the request's output tokens so far (the anchor is the last).
  struct Block {
    std::vector<int32_t> tokens;  // [γ]
    std::vector<double> q;        // f64 [γ, V]
  };
  // base: the block's base logits computed elsewhere (f32 [Nb, V], the GPU draft), else the draft model runs
  // here over the host caches.
  Block draft_block(RequestId id, std::span<const cache::PageId> table, int64_t ctx, int32_t anchor, int gamma,
                    const SamplingParams& params, uint64_t out_index, const float* base = nullptr);

 private:
  SpecServing s_;
  int block_size_;
  bool host_ = true;                          // host caches (latent_) allocated
  std::vector<std::vector<uint8_t>> latent_;  // per draft layer: u8 [pages, P · (C+R)·2]
};

}  // namespace kestrel::runtime
