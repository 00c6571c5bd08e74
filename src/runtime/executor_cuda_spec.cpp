// Host drafting and verification of the GPU executor's speculative steps (see executor_cuda_spec.h).
#include "runtime/executor_cuda_spec.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string_view>

#include "core/check.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/dspark.h"
#include "runtime/spec_decode.h"
#include "runtime/spec_profile.h"

namespace kestrel::runtime {

namespace {
// The GPU draft's greedy Markov chain on the device (KESTREL_DRAFT_CHAIN_ON_GPU=0: on the host from copied
// base logits, as sampled picks always are).
bool chain_on_device() {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_DRAFT_CHAIN_ON_GPU");
    return !(e && std::string_view(e) == "0");
  }();
  return on;
}
// The GPU draft batched over the step's requests (CudaDraft::inject_batch / greedy_tokens_batch: one launch
// sequence and at most one sync for all of them); KESTREL_DRAFT_BATCHED=0: one call per request, as before.
bool draft_batched() {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_DRAFT_BATCHED");
    return !(e && std::string_view(e) == "0");
  }();
  return on;
}
// Every verify sequence's KDA keep in one launch after the verification loop (CudaModel::keep_verified_batch);
// KESTREL_SPEC_KEEP=perseq: two copies per KDA layer and sequence inside the loop, as before (the A/B).
bool keep_batched() {
  static const bool on = [] {
    const char* e = std::getenv("KESTREL_SPEC_KEEP");
    return !(e && std::string_view(e) == "perseq");
  }();
  return on;
}
}  // namespace

void draft_blocks(SpecDrafter& spec, model::CudaDraft* gdraft, std::span<const sched::ScheduledSeq* const> order,
                  const StepHooks& hooks, SpecStep& sp, ExecutorStats& st) {
  const DraftConfig& dc = *spec.draft().cfg;
  SpecStep::Scratch& s = sp.scratch;
  std::vector<float>& base = s.base;  // f32 [Nb, V]: the GPU draft's base logits of one block
  const auto t0 = std::chrono::steady_clock::now();
  // Resized, not reassigned: the inner vectors keep their capacity from step to step.
  sp.blocks.resize(order.size());
  sp.tokens.resize(order.size());
  for (size_t i = 0; i < order.size(); ++i) sp.blocks[i].tokens.clear(), sp.blocks[i].q.clear(), sp.tokens[i].clear();
  sp.results.assign(order.size(), {});
  sp.greedy.assign(order.size(), 0);
  sp.target_ids.clear();
  // The batched device-greedy blocks: their requests' indices in `order` and their blocks, drafted in one call
  // after the loop; the longest num_draft of them is every chain's length (a shorter request keeps its first).
  std::vector<size_t>& batch = s.batch;
  std::vector<model::CudaDraft::BlockSeq>& bseqs = s.bseqs;
  batch.clear(), bseqs.clear();
  // The GPU draft's other blocks (sampled picks, top-k, oracle): their base logits in one batched call
  // (base_logits_batch: one copy and one sync for all), then each chain on the host in draft_block.
  std::vector<size_t>& sampled = s.sampled;
  std::vector<model::CudaDraft::BlockSeq>& sseqs = s.sseqs;
  sampled.clear(), sseqs.clear();
  int64_t bsteps = 0;
  std::vector<uint8_t>& dev_chain = s.dev_chain;  // the block's chain ran on the device (greedy picks)
  dev_chain.assign(order.size(), 0);
  for (size_t i = 0; i < order.size(); ++i) {
    const sched::ScheduledSeq& x = *order[i];
    if (x.num_draft == 0) continue;
    KCHECK(bool(hooks.sampling_inputs) && bool(hooks.take_tokens), "executor: speculation without its hooks");
    const StepHooks::SamplingInputs si = hooks.sampling_inputs(x);
    sp.greedy[i] = si.params->temperature == 0.0f;
    // The draft's caches are indexed by the target's page ids (spec_executor.h).
    // §5: the block [anchor, mask × (Nb−1)] at start.
    std::vector<int32_t>& blk = s.blk;  // i32 [Nb]
    blk.assign(size_t(dc.block_size), dc.mask_token_id);
    blk[0] = x.tokens[0];
    const SpecServing& sv = spec.serving();
    if (gdraft && chain_on_device() && (sp.greedy[i] || sv.draft_greedy) && sv.draft_topk == 0 && !sv.oracle) {
      // Greedy picks: the Markov chain on the device too (CudaDraft::greedy_tokens), only the γ tokens back;
      // q_i one-hot as draft_pick makes it, needed only by a sampled request's verification.
      SpecDrafter::Block& b = sp.blocks[i];
      b.tokens.resize(size_t(x.num_draft));
      dev_chain[i] = 1;
      if (draft_batched()) {
        batch.push_back(i);
        bseqs.push_back({x.block_table, x.start, x.tokens[0]});
        bsteps = std::max<int64_t>(bsteps, x.num_draft);
        continue;  // drafted below, with the others
      }
      gdraft->greedy_tokens(x.block_table, x.start, blk, x.num_draft, b.tokens.data());
    } else {
      // The base logits on the device (GPU draft) or the whole draft on the host; the chain in draft_block.
      if (gdraft && draft_batched()) {
        sampled.push_back(i);
        sseqs.push_back({x.block_table, x.start, x.tokens[0]});
        continue;  // drafted below, with the others
      }
      if (gdraft) {
        base.resize(size_t(dc.block_size) * size_t(dc.vocab_size));
        gdraft->base_logits(x.block_table, x.start, blk, base.data());
      }
      sp.blocks[i] = spec.draft_block(x.id, x.block_table, x.start, x.tokens[0], x.num_draft, *si.params,
                                      uint64_t(si.output.size()), gdraft ? base.data() : nullptr);
    }
  }
  spec_mark(sp.prof, "draft.host_prep");
  if (!sampled.empty()) {
    const size_t NbV = size_t(dc.block_size) * size_t(dc.vocab_size);
    base.resize(sampled.size() * NbV);  // f32 [B, Nb, V]
    gdraft->base_logits_batch(sseqs, base.data());
    spec_mark(sp.prof, "draft.base_logits_batch");
    for (size_t k = 0; k < sampled.size(); ++k) {
      const sched::ScheduledSeq& x = *order[sampled[k]];
      const StepHooks::SamplingInputs si = hooks.sampling_inputs(x);
      sp.blocks[sampled[k]] = spec.draft_block(x.id, x.block_table, x.start, x.tokens[0], x.num_draft, *si.params,
                                               uint64_t(si.output.size()), base.data() + k * NbV);
    }
    spec_mark(sp.prof, "draft.host_chains");
  }
  if (!batch.empty()) {
    std::vector<int32_t>& ids = s.ids;  // i32 [B, bsteps]
    ids.resize(batch.size() * size_t(bsteps));
    gdraft->greedy_tokens_batch(bseqs, bsteps, ids.data());
    for (size_t k = 0; k < batch.size(); ++k) {
      SpecDrafter::Block& b = sp.blocks[batch[k]];
      std::copy_n(ids.begin() + std::ptrdiff_t(k * size_t(bsteps)), b.tokens.size(), b.tokens.begin());
    }
  }
  for (size_t i = 0; i < order.size(); ++i) {
    const sched::ScheduledSeq& x = *order[i];
    if (x.num_draft == 0) continue;
    SpecDrafter::Block& b = sp.blocks[i];
    // A device-greedy block of a sampled request: q_i one-hot as draft_pick makes it (its verification reads it).
    if (dev_chain[i] && !sp.greedy[i]) {
      const int64_t V = dc.vocab_size;
      b.q.assign(size_t(x.num_draft * V), 0.0);
      for (int64_t t = 0; t < x.num_draft; ++t) b.q[size_t(t * V + b.tokens[size_t(t)])] = 1.0;
    }
    sp.tokens[i].push_back(x.tokens[0]);
    sp.tokens[i].insert(sp.tokens[i].end(), b.tokens.begin(), b.tokens.end());
  }
  spec_mark(sp.prof, "draft.host_post");
  st.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void verify_blocks(SpecDrafter& spec, model::CudaDraft* gdraft, model::CudaModel& m, model::CudaCache& cc,
                   std::span<const sched::ScheduledSeq* const> order, const StepHooks& hooks,
                   std::span<const float> logits, std::span<const int64_t> first_row, int64_t V, SpecStep& sp,
                   ExecutorStats& st) {
  // Every row's taps of the step (bf16 [step rows, n·Dt], rows in batch order), one copy.
  SpecStep::Scratch& s = sp.scratch;
  int64_t rows = 0;
  std::vector<int64_t>& row0 = s.row0;  // each sequence's first step row
  row0.resize(order.size());
  for (size_t i = 0; i < order.size(); ++i) row0[i] = rows, rows += order[i]->end - order[i]->start;
  const int64_t width = spec.tap_width();
  std::vector<uint16_t>& taps = s.taps;  // bf16 [rows, n·Dt]: the host draft's copy
  if (!gdraft) {
    taps.resize(size_t(rows * width));
    m.copy_taps(0, rows, taps.data());
  }
  // The taps of a sequence's first n rows into the draft's caches at its positions start.. : batched, all
  // after the loop in one CudaDraft::inject_batch (the sequences' pages are disjoint where they write, so the
  // order does not matter).
  const bool batched = gdraft && draft_batched();
  std::vector<model::CudaDraft::InjectSeq>& pending = s.pending;
  pending.clear();
  auto inject = [&](size_t i, int64_t n) {
    const sched::ScheduledSeq& x = *order[i];
    if (batched)
      pending.push_back({x.block_table, x.start, row0[i], n});
    else if (gdraft)
      gdraft->inject(x.block_table, x.start, m.taps_device() + row0[i] * width, n);
    else
      spec.inject(x.block_table, x.start, taps.data() + row0[i] * width, n);
  };
  int64_t k = 0;  // verify sequences so far (the model's order of them)
  const bool keep_batch = keep_batched();
  std::vector<int64_t>& keep = s.keep;  // each verify sequence's last kept position, in the model's order
  keep.clear();
  for (size_t i = 0; i < order.size(); ++i) {
    const sched::ScheduledSeq& x = *order[i];
    if (x.num_draft == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      inject(i, x.end - x.start);
      st.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      continue;
    }
    // Verify with the request's rule (greedy, token or block), as the CPU executor does; a greedy block from
    // the device's argmax of its rows when the executor computed it (verify_step's greedy rule on those ids).
    const int64_t T = x.end - x.start;
    const StepHooks::SamplingInputs si = hooks.sampling_inputs(x);
    VerifyOutcome o;
    if (sp.greedy[i] && !sp.target_ids.empty()) {
      KCHECK(first_row[i] >= 0 && size_t(first_row[i] + T) <= sp.target_ids.size(),
             "executor: request {}: its verify rows have no device argmax", x.id);
      o = verify_greedy(std::span<const int32_t>(sp.target_ids.data() + first_row[i], size_t(T)), sp.blocks[i].tokens);
    } else {
      KCHECK(first_row[i] >= 0 && size_t((first_row[i] + T) * V) <= logits.size(),
             "executor: request {}: its verify rows are not on the host", x.id);
      o = verify_step(*si.params, spec.serving().rejection, logits.data() + first_row[i] * V, sp.blocks[i].q.data(),
                      sp.blocks[i].tokens, V, uint64_t(si.output.size()));
    }
    ++st.spec_drafts;
    st.spec_draft_tokens += x.num_draft;
    st.spec_accepted_tokens += o.accepted;
    // Keep: the KDA state after position start + τ (the trace, no recompute); the MLA rows past it are
    // garbage the next forward overwrites, the pages wholly past it the scheduler releases (shrink).
    if (keep_batch) {
      keep.push_back(o.accepted);
    } else {
      spec_mark(sp.prof, "verify.host");
      m.keep_verified(cc, k++, o.accepted);
      spec_mark(sp.prof, "verify.keep_perseq");
    }
    const auto t0 = std::chrono::steady_clock::now();
    inject(i, o.accepted + 1);
    st.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!batched) spec_mark(sp.prof, "inject.per_seq");
    std::vector<int32_t>& emitted = s.emitted;
    emitted.assign(sp.blocks[i].tokens.begin(), sp.blocks[i].tokens.begin() + o.accepted);
    emitted.push_back(o.next);
    sched::SeqResult r = hooks.take_tokens(x, emitted);
    r.id = x.id;
    sp.results[i] = r;
    st.samples += int64_t(r.accepted.size()) + 1;
    spec_mark(sp.prof, "verify.host");
  }
  if (!keep.empty()) {
    m.keep_verified_batch(cc, keep);
    spec_mark(sp.prof, "verify.keep_batch");
  }
  if (!pending.empty()) {
    const auto t0 = std::chrono::steady_clock::now();
    gdraft->inject_batch(pending, m.taps_device());
    st.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    spec_mark(sp.prof, "inject.batch");
  }
}

}  // namespace kestrel::runtime
