// Executor: StepPlan → forward passes (see executor.h).
#include "runtime/executor.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/model.h"
#include "vision/vision.h"
#include "runtime/spec_decode.h"

namespace kestrel::runtime {

namespace {

// A step's activations are vectors of 100 KB to a few MB, allocated and freed every step. glibc's
// defaults hand such blocks back to the kernel (mmap above 128 KB until its threshold adapts, heap
// trimming above 128 KB free at the top, both per arena) and fault them in again, zero-filled, on the
// next step: a fifth of the server's CPU time in a k3-tiny c = 16 profile (bench/RESULTS.md, issue
// #22). Keep them: blocks up to 32 MiB (glibc's largest mmap threshold) from the heap, and a heap
// that shrinks only past 256 MiB of free top. RSS then holds the step's high-water mark, which is
// flat across requests (the memory soak checks that).
void keep_step_memory() {
  static const bool once = [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    return true;
  }();
  (void)once;
}

}  // namespace

Executor::Executor(const ModelWeights& w, const ModelConfig& c, const CacheFormats& formats,
                   const cache::CacheConfig& cc, const ExecutorOptions& options)
    : w_(w), c_(c), options_(options), store_(c.text, formats, cc.num_pages, cc.num_state_slots) {
  if (cc.block_size != formats.block_size)
    fail("executor: cache config block size {} != format block size {}", cc.block_size, formats.block_size);
  keep_step_memory();
  if (options.speculative) {
    // The KDA trace keeps f32 states per block position (model/kda.h); an f16 state rounds per call.
    if (formats.kda_state == KdaStateDtype::f16) fail("speculative decoding needs --kda-state-dtype f32");
    spec_ = std::make_unique<SpecDrafter>(*options.speculative, cc.num_pages, cc.block_size);
  }
}

bool overlaps_media(const sched::ScheduledSeq& x, const StepHooks::MediaInputs& mi) {
  if (mi.images.empty()) return false;
  for (const MediaSpan& m : mi.media)
    if (m.start < x.end && x.start < m.end) return true;
  return false;
}

std::vector<int64_t> media_pad_positions(cache::RequestId id, const StepHooks::MediaInputs& mi, int32_t pad) {
  KCHECK(mi.images.size() == mi.media.size(), "request {}: {} images for {} media spans", id, mi.images.size(),
         mi.media.size());
  std::vector<int64_t> pos;
  for (size_t i = 0; i < mi.images.size(); ++i) {
    const MediaSpan& m = mi.media[i];
    int64_t pads = 0;
    for (int64_t p = std::max<int64_t>(m.start, 0); p < m.end && p < int64_t(mi.prompt.size()); ++p)
      if (mi.prompt[size_t(p)] == pad) pos.push_back(p), ++pads;
    KCHECK(mi.images[i] && pads == mi.images[i]->num_tokens(),
           "request {}: media span {} holds {} media_pad tokens, its image {}", id, i, pads,
           mi.images[i] ? mi.images[i]->num_tokens() : -1);
  }
  return pos;
}

std::vector<model::EmbedOverride> Executor::media_rows(const sched::ScheduledSeq& x, const StepHooks& hooks) {
  std::vector<model::EmbedOverride> out;
  if (!hooks.media_inputs) return out;
  const StepHooks::MediaInputs mi = hooks.media_inputs(x);
  if (!overlaps_media(x, mi)) return out;
  auto it = media_.find(x.id);
  if (it == media_.end()) {  // first chunk that needs the images: encode all of them (MODEL.md §6)
    KCHECK(supports_images(), "request {}: images, but the checkpoint has no vision tower", x.id);
    EncodedMedia em;
    em.pos = media_pad_positions(x.id, mi, c_.media_placeholder_token_id);
    std::vector<const ImageInput*> ims;
    for (const auto& im : mi.images) ims.push_back(im.get());
    const auto t0 = std::chrono::steady_clock::now();
    em.rows = vision::encode(w_.vision, c_.vision, ims);
    stats_.vision_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.images_encoded += int64_t(ims.size());
    ++stats_.vision_calls;
    it = media_.emplace(x.id, std::move(em)).first;
  }
  const EncodedMedia& em = it->second;
  const int64_t D = c_.text.hidden_size;
  for (size_t k = 0; k < em.pos.size(); ++k)
    if (em.pos[k] >= x.start && em.pos[k] < x.end) out.push_back({em.pos[k] - x.start, em.rows.data() + int64_t(k) * D});
  return out;
}

void StepExecutor::launch(const sched::StepPlan& plan, const StepHooks&) {
  fail("executor: launch() of step {}, but this executor does not run ahead (runs_ahead() is false)", plan.step);
}

sched::StepResult StepExecutor::collect(const sched::StepPlan& plan, const StepHooks&) {
  fail("executor: collect() of step {}, but this executor does not run ahead (runs_ahead() is false)", plan.step);
}

sched::StepResult Executor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  if (!launched_.empty()) fail("executor: run() of step {} while step {} is launched and not collected", plan.step,
                               launched_.front().step);
  return run_rank(plan, hooks, nullptr);
}

void Executor::launch(const sched::StepPlan& plan, const StepHooks& hooks) {
  if (launched_.size() >= 2)
    fail("executor: launch() of step {} with steps {} and {} not collected (at most two)", plan.step,
         launched_[0].step, launched_[1].step);
  KCHECK(bool(hooks.sampling_inputs), "executor: launch() without the sampling_inputs hook");
  if (!plan.prefills.empty() || !plan.copies_before.empty() || !plan.copies_after.empty())
    fail("executor: launch() of step {}: only decodes run ahead ({} prefills, {} + {} copies)", plan.step,
         plan.prefills.size(), plan.copies_before.size(), plan.copies_after.size());
  // The pending inputs: what the previous launch sampled (on a device they would never leave its memory).
  sched::StepPlan resolved = plan;
  for (sched::ScheduledSeq& x : resolved.decodes) {
    if (!x.sample || x.num_draft != 0 || x.end - x.start != 1 || x.tokens.size() != 1)
      fail("executor: launch() of step {}: request {} is not a single-token sampled decode", plan.step, x.id);
    if (!x.token_pending) continue;
    auto t = last_launch_tokens_.find(x.id);
    if (t == last_launch_tokens_.end())
      fail("executor: launch() of step {}: request {} waits for a token the previous launch did not sample",
           plan.step, x.id);
    x.tokens[0] = t->second;
    x.token_pending = false;
  }
  // Sampling here by the engine's rule (sampler.h), so the draw is the one run() + the engine would make.
  Launched l;
  l.step = plan.step;
  StepHooks own;
  own.sample = [&](const sched::ScheduledSeq& r_x, std::span<const float> logits) {
    // run_rank samples the rows in plan order: this is row l.tokens.size() of the engine's plan.
    const sched::ScheduledSeq& x = plan.decodes.at(l.tokens.size());
    KCHECK(x.id == r_x.id, "executor: step {} sampled request {} in place of {}", plan.step, r_x.id, x.id);
    const StepHooks::SamplingInputs si = hooks.sampling_inputs(x);
    const uint64_t index = uint64_t(si.output.size()) + (x.token_pending ? 1 : 0);
    sched::SeqResult r;
    r.token = sample_token(*si.params, logits, si.prompt, si.output, index, si.stop_ids).token;
    l.tokens.push_back(r.token);
    return r;
  };
  run_rank(resolved, own, nullptr);
  KCHECK(l.tokens.size() == plan.decodes.size(), "executor: step {} sampled {} of {} rows", plan.step,
         l.tokens.size(), plan.decodes.size());
  last_launch_tokens_.clear();
  for (size_t i = 0; i < plan.decodes.size(); ++i) last_launch_tokens_[plan.decodes[i].id] = l.tokens[i];
  launched_.push_back(std::move(l));
}

sched::StepResult Executor::collect(const sched::StepPlan& plan, const StepHooks& hooks) {
  if (launched_.empty() || launched_.front().step != plan.step)
    fail("executor: collect() of step {}, but the oldest launched step is {}", plan.step,
         launched_.empty() ? std::string("none") : std::to_string(launched_.front().step));
  KCHECK(bool(hooks.take_token), "executor: collect() without the take_token hook");
  const Launched l = std::move(launched_.front());
  launched_.pop_front();
  KCHECK(l.tokens.size() == plan.decodes.size(), "executor: collect() of step {} with {} rows, launched with {}",
         plan.step, plan.decodes.size(), l.tokens.size());
  sched::StepResult result;
  for (size_t i = 0; i < plan.decodes.size(); ++i) {
    sched::SeqResult r = hooks.take_token(plan.decodes[i], l.tokens[i]);
    r.id = plan.decodes[i].id;
    result.seqs.push_back(r);
  }
  return result;
}

sched::StepResult Executor::run_rank(const sched::StepPlan& plan, const StepHooks& hooks, parallel::Comm* comm) {
  KCHECK(bool(hooks.sample), "executor: no sampler hook");
  KCHECK(!spec_ || !comm, "executor: speculation runs on one rank only");
  const cpu::PackedScope packed(&packed_);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t V = c_.text.vocab_size;
  ++stats_.steps;
  // 1. Fresh starts, 2. restores (checkpoint → running slot).
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list)
      if (x.reset_state) store_.zero_slot(x.state_slot);
  for (const cache::SlotCopy& cp : plan.copies_before) store_.copy_slot(cp.src, cp.dst);

  // 3. The forward pass: every scheduled sequence (decodes first, as listed) in one call. Under
  // tensor parallelism every rank runs the same plan with the same logits requests (executor_tp.h).
  model::ForwardOptions opt;
  opt.comm = comm;
  opt.dcp = comm ? options_.dcp : 1;
  std::vector<const sched::ScheduledSeq*> seqs;
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list) {
      const int64_t T = x.end - x.start;
      KCHECK(T > 0 && int64_t(x.tokens.size()) + x.num_draft == T && x.num_draft >= 0,
             "request {}: step range [{}, {}) with {} tokens and {} draft positions", x.id, x.start, x.end,
             x.tokens.size(), x.num_draft);
      KCHECK(x.num_draft == 0 || (spec_ && x.sample && x.tokens.size() == 1),
             "request {}: a speculative decode without a draft (or not a one-anchor decode)", x.id);
      KCHECK(!x.token_pending, "request {}: a pending token outside launch()", x.id);
      seqs.push_back(&x);
    }
  for (const auto* list : {&plan.finished, &plan.cancelled})
    for (cache::RequestId id : *list) media_.erase(id);
  std::vector<std::vector<model::EmbedOverride>> overrides(seqs.size());  // image rows per sequence
  // Speculative decodes: draft each block now (per request: its Markov chain is sequential), then the
  // anchor and the drafts run as the sequence's rows, every row's logits wanted, KDA states traced.
  const auto td = std::chrono::steady_clock::now();
  std::vector<SpecDrafter::Block> blocks(seqs.size());
  std::vector<std::vector<int32_t>> spec_tokens(seqs.size());  // [anchor, drafts]
  std::vector<std::vector<float>> trace_S(seqs.size());        // f32 [KDA layers, T, H, Dk, Dk]
  std::vector<model::Bf16Vec> trace_conv(seqs.size());         // bf16 [KDA layers, T, 3, W−1, H·Dk]
  for (size_t i = 0; i < seqs.size(); ++i) {
    const sched::ScheduledSeq& x = *seqs[i];
    if (x.num_draft == 0) continue;
    KCHECK(bool(hooks.sampling_inputs) && bool(hooks.take_tokens), "executor: speculation without its hooks");
    const StepHooks::SamplingInputs si = hooks.sampling_inputs(x);
    blocks[i] = spec_->draft_block(x.id, x.block_table, x.start, x.tokens[0], x.num_draft, *si.params,
                                   uint64_t(si.output.size()));
    spec_tokens[i] = {x.tokens[0]};
    spec_tokens[i].insert(spec_tokens[i].end(), blocks[i].tokens.begin(), blocks[i].tokens.end());
  }
  if (spec_) stats_.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - td).count();
  const TextConfig& tc = c_.text;
  const int64_t Se = model::kda_recurrent_elems(tc), Ce = model::kda_conv_elems(tc);
  std::vector<model::SeqInput> in(seqs.size());
  std::vector<int64_t> first_row(seqs.size() + 1, 0);  // each sequence's first logits row
  std::vector<int64_t> tap_row(seqs.size() + 1, 0);    // each sequence's first row of the step (taps)
  for (size_t i = 0; i < seqs.size(); ++i) {
    const sched::ScheduledSeq& x = *seqs[i];
    const int64_t T = x.end - x.start;
    const bool all = x.num_draft > 0 || (hooks.wants_all_logits && hooks.all_logits && hooks.wants_all_logits(x.id));
    in[i].view = store_.view(x.state_slot, x.block_table, x.start);
    in[i].tokens = x.num_draft > 0 ? std::span<const int32_t>(spec_tokens[i]) : std::span<const int32_t>(x.tokens);
    overrides[i] = media_rows(x, hooks);
    in[i].embed_override = overrides[i];
    in[i].logits = all ? model::Logits::all : x.sample ? model::Logits::last : model::Logits::none;
    const int64_t n = in[i].logits == model::Logits::all ? T : in[i].logits == model::Logits::last ? 1 : 0;
    first_row[i + 1] = first_row[i] + n;
    tap_row[i + 1] = tap_row[i] + T;
    if (x.num_draft > 0) {
      trace_S[i].resize(size_t(tc.num_hidden_layers * T * Se));
      trace_conv[i].resize(size_t(tc.num_hidden_layers * T * Ce));
      for (int L = 0; L < tc.num_hidden_layers; ++L)
        if (tc.attn_kind[size_t(L)] == AttnKind::kda) {
          in[i].view.kda[size_t(L)].trace_recurrent = trace_S[i].data() + L * T * Se;
          in[i].view.kda[size_t(L)].trace_conv = trace_conv[i].data() + L * T * Ce;
        }
    }
  }
  model::Bf16Vec taps;  // bf16 [step rows, n·Dt]: the draft's context for every committed position
  if (spec_) {
    opt.tap_layers = spec_->draft().cfg->target_layer_ids;
    taps.resize(size_t(tap_row.back() * spec_->tap_width()));
    opt.taps_out = taps.data();
  }
  std::vector<float> logits(size_t(first_row.back() * V));  // f32 [rows wanted, V]
  if (options_.batched) {
    if (!in.empty()) {
      model::forward_batch(w_, c_, in, logits.data(), opt);
      ++stats_.forwards;
    }
  } else {
    for (size_t i = 0; i < in.size(); ++i) {
      if (spec_) opt.taps_out = taps.data() + tap_row[i] * spec_->tap_width();
      model::forward_batch(w_, c_, std::span<const model::SeqInput>(&in[i], 1), logits.data() + first_row[i] * V, opt);
      ++stats_.forwards;
    }
  }
  sched::StepResult result;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const sched::ScheduledSeq& x = *seqs[i];
    const int64_t T = x.end - x.start;
    stats_.tokens_forwarded += T;
    const float* rows = logits.data() + first_row[i] * V;
    const uint16_t* seq_taps = spec_ ? taps.data() + tap_row[i] * spec_->tap_width() : nullptr;
    if (x.num_draft > 0) {
      // Verify (the request's rule), keep the KDA states after the last kept position, give the kept
      // positions' taps to the draft, emit the tokens.
      const StepHooks::SamplingInputs si = hooks.sampling_inputs(x);
      const SpecServing& ss = spec_->serving();
      const VerifyOutcome o = verify_step(*si.params, ss.rejection, rows, blocks[i].q.data(), blocks[i].tokens, V,
                                          uint64_t(si.output.size()));
      ++stats_.spec_drafts;
      stats_.spec_draft_tokens += x.num_draft;
      stats_.spec_accepted_tokens += o.accepted;
      for (int L = 0; L < tc.num_hidden_layers; ++L)
        if (tc.attn_kind[size_t(L)] == AttnKind::kda) model::kda_keep_position(tc, in[i].view.kda[size_t(L)], o.accepted);
      const auto ti = std::chrono::steady_clock::now();
      spec_->inject(x.block_table, x.start, seq_taps, o.accepted + 1);
      stats_.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - ti).count();
      std::vector<int32_t> emitted(blocks[i].tokens.begin(), blocks[i].tokens.begin() + o.accepted);
      emitted.push_back(o.next);
      sched::SeqResult r = hooks.take_tokens(x, emitted);
      r.id = x.id;
      result.seqs.push_back(r);
      stats_.samples += int64_t(r.accepted.size()) + 1;
      continue;
    }
    if (spec_) {
      const auto ti = std::chrono::steady_clock::now();
      spec_->inject(x.block_table, x.start, seq_taps, T);
      stats_.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - ti).count();
    }
    if (in[i].logits == model::Logits::all)
      hooks.all_logits(x, std::span<const float>(rows, size_t(T * V)));
    if (x.sample) {
      const float* last = rows + (in[i].logits == model::Logits::all ? (T - 1) * V : 0);
      sched::SeqResult r = hooks.sample(x, std::span<const float>(last, size_t(V)));
      r.id = x.id;
      result.seqs.push_back(r);
      ++stats_.samples;
    }
  }
  // 4. Snapshots (running → checkpoint slot) of the state at the end of this step's chunks.
  for (const cache::SlotCopy& cp : plan.copies_after) store_.copy_slot(cp.src, cp.dst);
  stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace kestrel::runtime
