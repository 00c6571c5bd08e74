// The GPU executor's side of DSpark speculation (executor_cuda.h "Speculation", docs/speculative.md): the
// host drafting before a step's forward and the host verification after it. Internal to executor_cuda.cpp;
// the CPU executor's twin of the same steps is inline in executor.cpp (same SpecDrafter, same verify_step,
// same draws), so both executors emit the same tokens for the same logits.
//
// Host syncs of one speculative step with the GPU draft (KESTREL_SPEC_PROFILE names each; nothing per
// request): (1) the draft's tokens (greedy_tokens_batch) or base logits (base_logits_batch) back, (2) the
// verify rows' device argmax (greedy blocks) or their logits (sampled blocks, one copy of the contiguous verify
// rows) back, (3) the step's closing stream sync in CudaExecutor::run — plus one for the device sampler when
// the step also holds plain decodes. Host → device uploads (pageable, staged without a sync): the draft's
// index arrays, the forward's batch metadata, keep_verified_batch's map, inject_batch's index arrays.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/cuda/dspark.h"
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

// One step's speculative state, indexed like the executor's batch order. The executor keeps one for its
// lifetime: each step overwrites it, so its vectors (and the scratch below) keep their capacity and a step
// allocates nothing on the host once the batch shapes have been seen.
struct SpecStep {
  std::vector<SpecDrafter::Block> blocks;   // the drafted tokens and q_i (f64 [γ, V])
  std::vector<std::vector<int32_t>> tokens;  // i32 [1 + γ]: the verify sequence's rows, anchor first
  std::vector<sched::SeqResult> results;     // what take_tokens returned for each verified sequence
  std::vector<uint8_t> greedy;               // the request samples greedily (temperature 0): verify on ids
  // i32 [step rows]: each verify row's target argmax, computed on the device (CudaModel::greedy_rows) when a
  // greedy block is in the step — then only these ids crossed to the host, not the rows' logits; empty: none.
  std::vector<int32_t> target_ids;
  SpecProfile* prof = nullptr;  // KESTREL_SPEC_PROFILE: the executor's phase timing (null: off)
  // Scratch of draft_blocks and verify_blocks (meaningless between calls).
  struct Scratch {
    std::vector<float> base;                            // f32 [Nb, V]: one block's base logits (GPU draft)
    std::vector<int32_t> blk;                           // i32 [Nb]: one block [anchor, mask × (Nb−1)]
    std::vector<size_t> batch;                          // indices into order of the batched device-greedy blocks
    std::vector<model::CudaDraft::BlockSeq> bseqs;      // their blocks
    std::vector<int32_t> ids;                           // i32 [B, steps]: their draft tokens
    std::vector<size_t> sampled;                        // indices into order of the batched base-logits blocks
    std::vector<model::CudaDraft::BlockSeq> sseqs;      // their blocks (base_logits_batch, chain on the host)
    std::vector<uint8_t> dev_chain;                     // per sequence: its chain ran on the device
    std::vector<int64_t> row0;                          // per sequence: its first step row
    std::vector<uint16_t> taps;                         // bf16 [rows, n·Dt]: the host draft's copy of the taps
    std::vector<model::CudaDraft::InjectSeq> pending;   // the batched injection
    std::vector<int64_t> keep;                          // per verify sequence: its last kept position
    std::vector<int32_t> emitted;                       // one sequence's emitted tokens
  } scratch;
};

// Drafts every speculative decode of `order` (num_draft > 0) over the draft's caches, which hold [0, start):
// on the host (gdraft null), or the blocks' base logits on the GPU draft (all such requests in one
// CudaDraft::base_logits_batch) and each Markov chain here, or — greedy picks on the GPU draft — the whole
// chain on the device, all such requests in one batched call (CudaDraft::greedy_tokens_batch);
// KESTREL_DRAFT_BATCHED=0: one call per request for both.
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
