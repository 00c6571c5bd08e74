// The GPU executor's side of DSpark speculation (executor_cuda.h "Speculation", docs/speculative.md): the
// host drafting before a step's forward and the host verification after it. Internal to executor_cuda.cpp;
// the CPU executor's twin of the same steps is inline in executor.cpp (same SpecDrafter, same verify_step,
// same draws), so both executors emit the same tokens for the same logits.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/executor.h"
#include "runtime/spec_executor.h"
#include "sched/scheduler.h"

namespace kestrel::model {
class CudaModel;
class CudaDraft;
struct CudaCache;
}  // namespace kestrel::model

namespace kestrel::runtime {

class SpecProfile;  // spec_profile.h

// One step's speculative state, indexed like the executor's batch order.
struct SpecStep {
  std::vector<SpecDrafter::Block> blocks;   // the drafted tokens and q_i (f64 [γ, V])
  std::vector<std::vector<int32_t>> tokens;  // i32 [1 + γ]: the verify sequence's rows, anchor first
  std::vector<sched::SeqResult> results;     // what take_tokens returned for each verified sequence
  std::vector<uint8_t> greedy;               // the request samples greedily (temperature 0): verify on ids
  // i32 [step rows]: each verify row's target argmax, computed on the device (CudaModel::greedy_rows) when a
  // greedy block is in the step — then only these ids crossed to the host, not the rows' logits; empty: none.
  std::vector<int32_t> target_ids;
  SpecProfile* prof = nullptr;  // KESTREL_SPEC_PROFILE: the executor's phase timing (null: off)
};

// Drafts every speculative decode of `order` (num_draft > 0) over the draft's caches, which hold [0, start):
// on the host (gdraft null), or the block's base logits on the GPU draft and the Markov chain here, or — greedy
// picks on the GPU draft — the whole chain on the device, all such requests in one batched call
// (CudaDraft::greedy_tokens_batch; KESTREL_DRAFT_BATCHED=0: one call per request).
void draft_blocks(SpecDrafter& spec, model::CudaDraft* gdraft, std::span<const sched::ScheduledSeq* const> order,
                  const StepHooks& hooks, SpecStep& sp, ExecutorStats& st);

// After the forward: verifies each speculative decode from its rows' logits (host f32 [rows, V]; a sequence's
// rows start at first_row[i]) or, for a greedy request when sp.target_ids is filled, from its rows' device
// argmax there (the same ids: argmax_rows and the host's argmax both take the lower id on a tie), keeps the device KDA state after its last accepted position
// (CudaModel::keep_verified, k-th verify sequence = k-th speculative decode of `order`), emits its tokens
// (take_tokens, results in sp.results), and injects the taps of every sequence's committed rows (all rows of
// a plain sequence, anchor + accepted of a verified one) into the draft's caches (the GPU draft's straight
// from the device taps, all sequences in one CudaDraft::inject_batch after the loop unless
// KESTREL_DRAFT_BATCHED=0; the host's through one device → host copy of the step's taps).
void verify_blocks(SpecDrafter& spec, model::CudaDraft* gdraft, model::CudaModel& m, model::CudaCache& cc,
                   std::span<const sched::ScheduledSeq* const> order, const StepHooks& hooks,
                   std::span<const float> logits, std::span<const int64_t> first_row, int64_t V, SpecStep& sp,
                   ExecutorStats& st);

}  // namespace kestrel::runtime
