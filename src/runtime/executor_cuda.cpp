// CudaExecutor (see executor_cuda.h).
#include "runtime/executor_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/sampling.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/dspark.h"
#include "runtime/executor_cuda_spec.h"
#include "runtime/spec_profile.h"
#include "vision/cuda/vision_cuda.h"
#include "vision/vision.h"

namespace kestrel::runtime {

int64_t cuda_cache_budget(double utilization, int64_t reserve) {
  if (!(utilization > 0.0 && utilization <= 1.0)) fail("--gpu-memory-utilization must be in (0, 1], got {}", utilization);
  size_t free_b = 0, total_b = 0;
  KCUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const int64_t budget = int64_t(utilization * double(total_b)) - int64_t(total_b - free_b) - reserve;
  if (budget <= 0)
    fail("--gpu-memory-utilization {}: nothing left for caches ({:.2f} GiB in use of {:.2f} GiB, {:.2f} GiB reserved "
         "for activations)",
         utilization, double(total_b - free_b) / double(1 << 30), double(total_b) / double(1 << 30),
         double(reserve) / double(1 << 30));
  return budget;
}

void append_logit_adjustments(int32_t row, const StepHooks::SamplingInputs& in, int64_t V,
                              std::vector<cuda::PenaltyEntry>& out) {
  KCHECK(in.params != nullptr, "append_logit_adjustments: no sampling parameters");
  const SamplingParams& sp = *in.params;
  const bool rep = sp.repetition_penalty != 1.0f, freq = sp.frequency_penalty != 0.0f || sp.presence_penalty != 0.0f;
  const bool hold = in.output.size() < size_t(std::max(sp.min_tokens, 0));
  if (!rep && !freq && !hold && sp.logit_bias.empty()) return;
  // Distinct tokens, in id order.
  std::map<int32_t, cuda::PenaltyEntry> e;
  auto at = [&](int32_t t) -> cuda::PenaltyEntry& {
    auto [it, fresh] = e.try_emplace(t);
    if (fresh) it->second = {row, t, 0, 0, 0.0f, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty};
    return it->second;
  };
  auto ok = [&](int32_t t) { return t >= 0 && t < V; };
  for (auto [t, b] : sp.logit_bias)
    if (ok(t)) at(t).bias = b;
  if (hold)
    for (int32_t t : in.stop_ids)
      if (ok(t)) at(t).flags |= cuda::kPenaltyMasked;
  // Repetition covers prompt ∪ output; frequency/presence only output tokens (count > 0).
  if (rep)
    for (int32_t t : in.prompt)
      if (ok(t)) at(t).flags |= cuda::kPenaltyInContext;
  if (rep || freq)
    for (int32_t t : in.output)
      if (ok(t)) {
        cuda::PenaltyEntry& q = at(t);
        q.flags |= cuda::kPenaltyInContext;
        ++q.count;
      }
  for (auto& [t, q] : e) out.push_back(q);
}

namespace {
struct HostSample {  // a device-sampled row's parameters for the host fallback
  SamplingParams params;
  uint64_t index = 0;
};
}  // namespace

struct CudaExecutor::Impl {
  model::CudaModel& m;
  int64_t V, D;
  int32_t pad;  // <|media_pad|>
  model::CudaCachePtr cache;
  const void* pinned = nullptr;  // the engine's mask table, registered as pinned host memory
  // Image rows of running requests: a share of the device buffer of the step that encoded them.
  struct Media {
    std::shared_ptr<cuda::DeviceBuffer> buf;  // bf16 [rows of that step's calls, D]
    int64_t row0 = 0;                         // the request's first row in buf
    std::vector<int64_t> pos;                 // prompt position of each of its rows, ascending
  };
  std::unordered_map<cache::RequestId, Media> media;
  std::unique_ptr<SpecDrafter> spec;         // options.speculative: the draft's rules (and host caches)
  std::unique_ptr<model::CudaDraft> gdraft;  // options.draft_on_gpu: the draft on the device
  std::unique_ptr<SpecProfile> prof;         // KESTREL_SPEC_PROFILE: phase timing of speculative steps
  SpecStep sp;                               // the speculative step's state, reused step after step
  // A step's host vectors, kept so that their capacity is reused (a step allocates nothing once its batch
  // shapes have been seen); meaningful only inside run().
  struct StepScratch {
    std::vector<const sched::ScheduledSeq*> order;
    std::vector<model::CudaSeq> seqs;
    std::vector<int64_t> first_row;
    std::vector<uint8_t> all;
    std::vector<int32_t> dev_id;
    std::vector<HostSample> host_params;
    std::vector<cuda::SampleParams> params;
    std::vector<cuda::PenaltyEntry> penalties;
    std::vector<size_t> param_seq;
    std::vector<int32_t> mask_row, ids;
  } ss;
  std::vector<float> logits;                 // f32 [rows, V]: host rows of a step, reused (no zeroing per step)
  // Greedy verify blocks verified on their rows' device argmax (KESTREL_SPEC_DEVICE_GREEDY=0: on the host
  // from the rows' logits, as sampled blocks are).
  bool device_greedy = true;
  Impl(model::CudaModel& mm, const ModelConfig& c, const CacheFormats& f, const cache::CacheConfig& cc)
      : m(mm),
        V(c.text.vocab_size),
        D(c.text.hidden_size),
        pad(c.media_placeholder_token_id),
        cache(mm.new_cache(cc.num_pages, cc.num_state_slots, f)) {
    const char* e = std::getenv("KESTREL_SPEC_DEVICE_GREEDY");
    device_greedy = !(e && std::string_view(e) == "0");
  }
  // Where a step's time goes (ExecutorStats::launch_seconds, forward_done_seconds, mask_late_*): an event on
  // the idle stream as the step begins and one after the forward.
  cudaEvent_t ev_start = nullptr, ev_forward = nullptr;
  ~Impl() {
    if (pinned) cudaHostUnregister(const_cast<void*>(pinned));
    if (ev_start) cudaEventDestroy(ev_start);
    if (ev_forward) cudaEventDestroy(ev_forward);
  }

  // The step's image rows (executor_cuda.h, "Images"): encodes the images of every request in `order` whose
  // chunk overlaps a media span and that has no rows yet — all of them stacked, in calls of at most
  // kMaxVisionPatches patches, into one device buffer — then appends to `embed` the rows of each such
  // sequence's (order[i]'s) <|media_pad|> positions in its chunk; embed_pos[i] holds those positions.
  // `enc` null: a request with images in the step is an error (the engine refuses them at submit).
  void media_rows(vision::VisionCuda* enc, const std::vector<const sched::ScheduledSeq*>& order,
                  const StepHooks& hooks, std::vector<model::CudaEmbedRows>& embed,
                  std::vector<std::vector<int32_t>>& embed_pos, ExecutorStats& st) {
    std::vector<StepHooks::MediaInputs> mi(order.size());
    std::vector<size_t> fresh;  // indices into order: requests whose images are encoded in this step
    bool any = false;
    for (size_t i = 0; i < order.size(); ++i) {
      const sched::ScheduledSeq& x = *order[i];
      mi[i] = hooks.media_inputs(x);
      if (!overlaps_media(x, mi[i])) continue;
      KCHECK(enc != nullptr, "request {}: images, but this GPU executor has no vision encoder", x.id);
      any = true;
      if (!media.count(x.id)) fresh.push_back(i);
    }
    if (!any) return;
    if (!fresh.empty()) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<Media> got(fresh.size());
      std::vector<const ImageInput*> ims;  // every fresh request's images, request by request, in order
      int64_t rows = 0;
      for (size_t f = 0; f < fresh.size(); ++f) {
        const size_t i = fresh[f];
        got[f].pos = media_pad_positions(order[i]->id, mi[i], pad);  // as many pads as each image has rows
        got[f].row0 = rows;
        rows += int64_t(got[f].pos.size());
        for (const auto& im : mi[i].images) ims.push_back(im.get());
      }
      auto buf = std::make_shared<cuda::DeviceBuffer>(size_t(rows * D) * 2);  // bf16 [rows, D]
      auto* out = static_cast<uint16_t*>(buf->data());
      cudaStream_t s = static_cast<cudaStream_t>(m.stream());
      int64_t done = 0;  // rows written
      for (size_t a = 0; a < ims.size();) {
        // The next call: images [a, b), at most kMaxVisionPatches patches unless one image alone is larger.
        size_t b = a;
        int64_t patches = 0;
        while (b < ims.size()) {
          const int64_t p = int64_t(ims[b]->grid_h) * ims[b]->grid_w;
          if (b > a && patches + p > kMaxVisionPatches) break;
          patches += p, ++b;
        }
        const std::span<const ImageInput* const> call(ims.data() + a, b - a);
        KCHECK(done + vision::num_tokens(call) <= rows, "executor: image rows overflow ({} + {} > {})", done,
               vision::num_tokens(call), rows);
        // prepare() waits for the stream's earlier work (an earlier call's reads of its scratch) itself.
        const int64_t n = enc->prepare(call, s);
        enc->run(out + done * D, s);
        done += n;
        ++st.vision_calls;
        a = b;
      }
      KCHECK(done == rows, "executor: the encoder gave {} image rows, the prompts hold {} media_pad", done, rows);
      // Waited for here only so that vision_seconds is the encoder's time (a step with new images is rare).
      KCUDA_CHECK(cudaStreamSynchronize(s));
      st.vision_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      st.images_encoded += int64_t(ims.size());
      for (size_t f = 0; f < fresh.size(); ++f) {
        got[f].buf = buf;
        media.emplace(order[fresh[f]]->id, std::move(got[f]));
      }
    }
    for (size_t i = 0; i < order.size(); ++i) {
      const sched::ScheduledSeq& x = *order[i];
      if (!overlaps_media(x, mi[i])) continue;
      const Media& md = media.at(x.id);
      const auto lo = std::lower_bound(md.pos.begin(), md.pos.end(), x.start);
      const auto hi = std::lower_bound(lo, md.pos.end(), x.end);
      for (auto p = lo; p != hi; ++p) embed_pos[i].push_back(int32_t(*p - x.start));
      if (embed_pos[i].empty()) continue;
      embed.push_back({int64_t(i), embed_pos[i],
                       static_cast<const uint16_t*>(md.buf->data()) + (md.row0 + (lo - md.pos.begin())) * D});
    }
  }
  // Pins the engine's mask table once (it is fixed for the engine's lifetime, which holds this
  // executor); if pinning fails the copies still work, staged by the driver.
  void pin(const StepHooks::MaskTable& t) {
    if (!t.data || t.data == pinned) return;
    if (pinned) cudaHostUnregister(const_cast<void*>(pinned));
    pinned = nullptr;
    if (cudaHostRegister(const_cast<uint32_t*>(t.data), size_t(t.rows * t.words) * 4, cudaHostRegisterDefault) ==
        cudaSuccess)
      pinned = t.data;
    else
      (void)cudaGetLastError();
  }
};

CudaExecutor::CudaExecutor(model::CudaModel& model, const ModelConfig& c, const CacheFormats& formats,
                           const cache::CacheConfig& cc, const CudaExecutorOptions& options) {
  if (cc.block_size != formats.block_size)
    fail("executor: cache config block size {} != format block size {}", cc.block_size, formats.block_size);
  impl_ = std::make_unique<Impl>(model, c, formats, cc);
  model_ = &model, cache_ = impl_->cache.get();
  model.enable_cuda_graphs(options.cuda_graphs);
  follower_ = options.follower;
  if (options.speculative) {
    KCHECK(!options.follower, "executor: speculation runs on one rank only");
    // The same rule as the CPU executor: the KDA state is kept per block position in f32.
    if (formats.kda_state == KdaStateDtype::f16) fail("speculative decoding needs --kda-state-dtype f32");
    impl_->spec = std::make_unique<SpecDrafter>(*options.speculative, cc.num_pages, cc.block_size,
                                                !options.draft_on_gpu);
    model.set_taps(impl_->spec->draft().cfg->target_layer_ids);
    if (options.draft_on_gpu) {
      impl_->gdraft = model.new_draft(impl_->spec->draft(), cc.num_pages, cc.block_size);
      // The batched greedy draft as one CUDA graph per step shape (CudaDraft::set_graphs) whenever CUDA graphs
      // are on: measured faster on the H200 (k3-tiny c = 1 TPOT 0.319 → 0.308 ms, c = 32 2.16 → 1.79 ms) and
      // GpuSpec.* pass with it; KESTREL_DRAFT_GRAPHS=0 turns it off (eager launches, the A/B).
      const char* e = std::getenv("KESTREL_DRAFT_GRAPHS");
      if (options.cuda_graphs && !(e && std::string_view(e) == "0")) impl_->gdraft->set_graphs(true);
      // The draft's attention in the latent space (CudaDraft::set_absorbed): KESTREL_DRAFT_ATTN=absorbed; off by
      // default until measured on the device (it is what the real-shape draft needs: the naive form expands
      // every context row through kv_b each step).
      const char* a = std::getenv("KESTREL_DRAFT_ATTN");
      if (a && std::string_view(a) == "absorbed") impl_->gdraft->set_absorbed(true);
    }
    int64_t every = 0;
    if (SpecProfile::enabled_from_env(&every)) {
      SpecProfile* p = (impl_->prof = std::make_unique<SpecProfile>(static_cast<cudaStream_t>(model.stream()), every)).get();
      if (impl_->gdraft) impl_->gdraft->set_marker([p](const char* phase) { p->mark(phase); });
    }
  } else {
    model.set_taps({});  // the model may have served a speculating executor before
  }
  vision_ = options.vision;
  if (vision_) {
    KCHECK(c.vision.present && c.vision.text_hidden_size == c.text.hidden_size,
           "executor: a vision encoder for a config without a vision tower (or of another width)");
    KCHECK(c.text.hidden_size % 8 == 0, "executor: image rows need D % 8 == 0 (16-byte rows), D = {}",
           c.text.hidden_size);
  }
}

CudaExecutor::~CudaExecutor() {
  if (impl_ && impl_->gdraft) impl_->gdraft->set_marker({});  // the profile goes first (Impl's members)
}

bool CudaExecutor::runs_ahead() const { return !follower_ && !impl_->spec; }

void CudaExecutor::forget_media(const sched::StepPlan& plan) {
  for (const auto* list : {&plan.finished, &plan.cancelled})
    for (cache::RequestId id : *list) impl_->media.erase(id);
}

sched::StepResult CudaExecutor::run(const sched::StepPlan& plan, const StepHooks& hooks) {
  KCHECK(follower_ || bool(hooks.sample), "executor: no sampler hook");
  const auto t0 = std::chrono::steady_clock::now();
  model::CudaModel& m = impl_->m;
  model::CudaCache& cc = *impl_->cache;
  const int64_t V = impl_->V;
  ++stats_.steps;
  // The stream is idle here (the previous step ended with a sync): this event's time is the step's start.
  const bool timed = !follower_;
  if (timed) {
    if (!impl_->ev_start) {
      KCUDA_CHECK(cudaEventCreate(&impl_->ev_start));
      KCUDA_CHECK(cudaEventCreate(&impl_->ev_forward));
    }
    KCUDA_CHECK(cudaEventRecord(impl_->ev_start, static_cast<cudaStream_t>(m.stream())));
  }
  const auto t_start = std::chrono::steady_clock::now();
  SpecProfile* prof = follower_ ? nullptr : impl_->prof.get();
  if (prof) prof->begin_step();
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list)
      if (x.reset_state) m.zero_slot(cc, x.state_slot);
  for (const cache::SlotCopy& cp : plan.copies_before) m.copy_slot(cc, cp.src, cp.dst);
  forget_media(plan);
  // A synchronous step ends a run-ahead chain: the next pending token must come from a launched step.
  KCHECK(launched_.empty(), "executor: run() with {} run-ahead steps not collected", launched_.size());
  prev_rows_.clear();

  // The batch: single-token sequences first (one absorbed MLA launch), then speculative decodes (verify
  // sequences), in plan order otherwise.
  SpecDrafter* spec = impl_->spec.get();
  Impl::StepScratch& ss = impl_->ss;
  std::vector<const sched::ScheduledSeq*>& order = ss.order;
  order.clear();
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list) {
      KCHECK(x.end > x.start && x.num_draft >= 0 && int64_t(x.tokens.size()) + x.num_draft == x.end - x.start,
             "request {}: step range [{}, {}) with {} tokens and {} draft positions", x.id, x.start, x.end,
             x.tokens.size(), x.num_draft);
      KCHECK(x.num_draft == 0 || (spec && x.sample && x.tokens.size() == 1),
             "request {}: a speculative decode without a draft (or not a one-anchor decode)", x.id);
      order.push_back(&x);
    }
  // Ranks: 0 plain single-token decodes, 1 speculative decodes, 2 the rest (model::CudaSeq's order).
  std::stable_sort(order.begin(), order.end(), [](const sched::ScheduledSeq* a, const sched::ScheduledSeq* b) {
    auto rank = [](const sched::ScheduledSeq* x) { return x->num_draft > 0 ? 1 : x->end - x->start == 1 ? 0 : 2; };
    return rank(a) < rank(b);
  });
  // Speculative decodes: each block drafted now (the draft on the host or the GPU; its Markov chain, sequential
  // per request, on the host).
  SpecStep& sp = impl_->sp;
  sp.prof = prof;
  spec_mark(prof, "step.setup");
  if (spec) draft_blocks(*spec, impl_->gdraft.get(), order, hooks, sp, stats_);
  std::vector<model::CudaSeq>& seqs = ss.seqs;
  seqs.clear();
  std::vector<int64_t>& first_row = ss.first_row;  // first logits row of each sequence
  first_row.assign(order.size(), -1);
  std::vector<uint8_t>& all = ss.all;  // the sequence wants every row's logits
  all.assign(order.size(), 0);
  std::vector<int32_t>& dev_id = ss.dev_id;  // token sampled on the device; −1: host fallback; −2: host
  dev_id.assign(order.size(), -2);
  std::vector<HostSample>& host_params = ss.host_params;
  host_params.resize(order.size());
  std::vector<cuda::SampleParams>& params = ss.params;
  params.clear();
  std::vector<cuda::PenaltyEntry>& penalties = ss.penalties;
  penalties.clear();
  std::vector<size_t>& param_seq = ss.param_seq;  // sequence of each params entry
  param_seq.clear();
  int64_t rows = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const sched::ScheduledSeq& x = *order[i];
    model::CudaSeq q;
    q.tokens = x.tokens;
    q.pos0 = x.start;
    q.slot = x.state_slot;
    q.block_table = std::span<const int32_t>(x.block_table.data(), x.block_table.size());
    if (x.num_draft > 0) {  // a verify sequence: [anchor, drafts], every row's logits, verified on the host
      q.tokens = sp.tokens[i];
      q.verify = true;
      q.logits = model::CudaSeq::Logits::all;
      first_row[i] = rows;
      rows += x.end - x.start;
      seqs.push_back(q);
      ++stats_.forwards;
      stats_.tokens_forwarded += x.end - x.start;
      continue;
    }
    all[i] = hooks.wants_all_logits && hooks.all_logits && hooks.wants_all_logits(x.id);
    q.logits = all[i] ? model::CudaSeq::Logits::all
               : x.sample ? model::CudaSeq::Logits::last
                          : model::CudaSeq::Logits::none;
    if (q.logits != model::CudaSeq::Logits::none) {
      first_row[i] = rows;
      rows += all[i] ? x.end - x.start : 1;
    }
    // Device sampling for every sampled sequence but those wanting logprobs or every row's logits.
    if (!follower_ && x.sample && !all[i] && hooks.sampling_inputs && hooks.take_token) {
      const StepHooks::SamplingInputs in = hooks.sampling_inputs(x);
      KCHECK(in.params != nullptr, "executor: no sampling parameters for request {}", x.id);
      const SamplingParams& sp = *in.params;
      if (sp.logprobs < 0) {
        const int32_t row = int32_t(first_row[i]);
        params.push_back({row, sp.top_k, sp.temperature, sp.top_p, sp.min_p, sp.seed, uint64_t(in.output.size())});
        param_seq.push_back(i);
        dev_id[i] = -1;
        append_logit_adjustments(row, in, V, penalties);
        // The fallback samples the adjusted logits: bias, min_tokens and penalties off there.
        host_params[i].params = sp;
        host_params[i].params.repetition_penalty = 1.0f;
        host_params[i].params.frequency_penalty = 0.0f;
        host_params[i].params.presence_penalty = 0.0f;
        host_params[i].params.logit_bias.clear();
        host_params[i].params.min_tokens = 0;
        host_params[i].index = uint64_t(in.output.size());
      }
    }
    seqs.push_back(q);
    ++stats_.forwards;
    stats_.tokens_forwarded += x.end - x.start;
  }
  // Image rows of the chunks that cover <|media_pad|> positions (encoding the step's new images first).
  std::vector<std::vector<int32_t>> embed_pos(order.size());  // i32 per sequence: positions within its chunk
  std::vector<model::CudaEmbedRows> embed;
  if (hooks.media_inputs) impl_->media_rows(vision_, order, hooks, embed, embed_pos, stats_);
  spec_mark(prof, "step.build_seqs");
  const int64_t got = m.forward_batch(cc, seqs, embed);
  KCHECK(got == rows, "executor: {} logits rows, expected {}", got, rows);
  spec_mark(prof, "target.forward");
  if (timed) KCUDA_CHECK(cudaEventRecord(impl_->ev_forward, static_cast<cudaStream_t>(m.stream())));
  const auto t_launch = std::chrono::steady_clock::now();
  // The forward runs: the engine starts the step's mask jobs now (they need nothing the launch needed).
  if (hooks.forward_launched) hooks.forward_launched();
  if (follower_) {  // a TP rank other than 0: its logits are rank 0's; nothing to sample here
    for (const cache::SlotCopy& cp : plan.copies_after) m.copy_slot(cc, cp.src, cp.dst);
    KCUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(m.stream())));
    stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return {};
  }
  // Structured outputs: each device row's mask (filled by the engine's worker during the forward).
  // With few allowed ids top-k is cut to them, so the device keeps exactly the allowed set.
  std::vector<int32_t>& mask_row = ss.mask_row;
  mask_row.assign(params.size(), -1);
  int64_t mask_rows = 0;
  if (hooks.token_mask && hooks.mask_table.data) {
    impl_->pin(hooks.mask_table);
    for (size_t k = 0; k < params.size(); ++k) {
      const StepHooks::TokenMask tm = hooks.token_mask(*order[param_seq[k]]);
      if (tm.row < 0) continue;
      mask_row[k] = tm.row;
      mask_rows = std::max<int64_t>(mask_rows, tm.row + 1);
      if (tm.allowed <= cuda::kSampleCandidates && (params[k].top_k <= 0 || params[k].top_k > tm.allowed))
        params[k].top_k = int32_t(tm.allowed);
    }
  }
  const auto t_masks = std::chrono::steady_clock::now();
  const model::CudaModel::TokenMasks masks{hooks.mask_table.data, hooks.mask_table.rows, hooks.mask_table.words,
                                           mask_rows, mask_row};
  // The rows go to the device now, on a side stream beside the forward, not after it (CudaModel::stage_masks).
  if (mask_rows > 0 && !params.empty()) m.stage_masks(masks);
  spec_mark(prof, "step.masks");
  // Rows that go to the host raw (every-row dumps, logprobs, verify blocks) are copied before the device
  // sampler penalises its rows in place; fallback rows after, already penalised.
  // Greedy verify blocks (unless KESTREL_SPEC_DEVICE_GREEDY=0): every verify row's argmax on the device (the
  // verify sequences' rows are contiguous), only the ids back; their logits stay on the device.
  auto dev_greedy = [&](size_t i) { return impl_->device_greedy && order[i]->num_draft > 0 && sp.greedy[i]; };
  int64_t vlo = -1, vhi = -1;  // the verify rows [vlo, vhi)
  bool any_dev_greedy = false;
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i]->num_draft == 0) continue;
    if (vlo < 0) vlo = first_row[i];
    vhi = first_row[i] + order[i]->end - order[i]->start;
    any_dev_greedy = any_dev_greedy || dev_greedy(i);
  }
  if (any_dev_greedy) {
    sp.target_ids.assign(size_t(rows), -1);
    m.greedy_rows(vlo, vhi - vlo, sp.target_ids.data() + vlo);
    spec_mark(prof, "verify.argmax_d2h_sync");
  }
  // f32 [rows, V] on the host: only the rows copied below are meaningful. The buffer only grows (a resize
  // zeroes what it adds), so a step does not clear megabytes it then overwrites; n_host: rows·V once sized.
  std::vector<float>& logits = impl_->logits;
  size_t n_host = 0;
  auto host_rows = [&] {
    n_host = size_t(rows * V);
    if (logits.size() < n_host) logits.resize(n_host);
  };
  bool host_raw = false, verify_rows = false;
  for (size_t i = 0; i < order.size(); ++i) {
    host_raw = host_raw || all[i] || (order[i]->sample && order[i]->num_draft == 0 && dev_id[i] == -2);
    verify_rows = verify_rows || (order[i]->num_draft > 0 && !dev_greedy(i));
  }
  if (host_raw || verify_rows) host_rows();
  if (host_raw) {
    m.copy_logits(logits.data());
  } else if (verify_rows) {
    // The rows of the verify blocks the host verifies: the verify sequences' rows are contiguous, so one copy
    // (one sync) from the first such block's first row to the last one's end, not one per request.
    int64_t lo = -1, hi = -1;
    for (size_t i = 0; i < order.size(); ++i)
      if (order[i]->num_draft > 0 && !dev_greedy(i)) {
        if (lo < 0) lo = first_row[i];
        hi = first_row[i] + order[i]->end - order[i]->start;
      }
    m.copy_logits_rows(lo, hi - lo, logits.data() + lo * V);
  }
  if (!any_dev_greedy) sp.target_ids.clear();
  if (host_raw || verify_rows) spec_mark(prof, "verify.logits_d2h_sync");
  // Speculation: verify each block (the KDA state kept after its last accepted position), then every
  // sequence's committed rows' taps into the draft's caches.
  if (spec)
    verify_blocks(*spec, impl_->gdraft.get(), m, cc, order, hooks, std::span<const float>(logits.data(), n_host),
                  first_row, V, sp, stats_);
  if (!params.empty()) {
    std::vector<int32_t>& ids = ss.ids;
    ids.resize(params.size());
    m.sample(params, penalties, ids.data(), mask_rows > 0 ? &masks : nullptr);
    bool fallback = false;
    for (size_t k = 0; k < params.size(); ++k) {
      // A token the grammar refuses (free text drew a special it does not take; rounding drew a
      // masked id) is drawn again on the host from the (penalised, masked) row.
      if (ids[k] >= 0 && hooks.check_token && hooks.sample_penalised && !hooks.check_token(*order[param_seq[k]], ids[k]))
        ids[k] = -1;
      dev_id[param_seq[k]] = ids[k];
      if (ids[k] < 0) {
        fallback = true;
        ++stats_.host_fallback_samples;
      }
    }
    if (fallback) {
      if (n_host == 0) host_rows();
      for (size_t k = 0; k < params.size(); ++k)
        if (ids[k] < 0) m.copy_logits_rows(params[k].row, 1, logits.data() + int64_t(params[k].row) * V);
    }
    spec_mark(prof, "plain.sample_sync");
  }
  // Results in plan order, as the CPU executor gives them.
  sched::StepResult result;
  for (const auto* list : {&plan.decodes, &plan.prefills})
    for (const sched::ScheduledSeq& x : *list) {
      const size_t i = size_t(std::find(order.begin(), order.end(), &x) - order.begin());
      const int64_t T = x.end - x.start;
      if (x.num_draft > 0) {  // verified above
        result.seqs.push_back(sp.results[i]);
        continue;
      }
      if (all[i])
        hooks.all_logits(x, std::span<const float>(logits.data() + first_row[i] * V, size_t(T * V)));
      if (!x.sample) continue;
      const int64_t last = first_row[i] + (all[i] ? T - 1 : 0);
      const std::span<const float> lrow(logits.data() + last * V, size_t(V));
      sched::SeqResult r;
      if (dev_id[i] >= 0) {
        r = hooks.take_token(x, dev_id[i]);
        ++stats_.device_samples;
      } else if (dev_id[i] == -1 && hooks.sample_penalised) {
        r = hooks.sample_penalised(x, lrow);
      } else if (dev_id[i] == -1) {
        const SampleResult s = sample_token(host_params[i].params, lrow, {}, {}, host_params[i].index);
        r = hooks.take_token(x, s.token);
      } else {
        r = hooks.sample(x, lrow);
      }
      r.id = x.id;
      result.seqs.push_back(r);
      ++stats_.samples;
    }
  spec_mark(prof, "step.results");
  for (const cache::SlotCopy& cp : plan.copies_after) m.copy_slot(cc, cp.src, cp.dst);
  KCUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(m.stream())));
  spec_mark(prof, "step.final_sync");
  if (prof) {
    int64_t nv = 0, drafted = 0;
    for (const sched::ScheduledSeq* x : order) nv += x->num_draft > 0, drafted += x->num_draft;
    prof->end_step(nv, drafted);
  }
  stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (timed) {
    float ms = 0.0f;  // both events are done: the stream was synchronised
    KCUDA_CHECK(cudaEventElapsedTime(&ms, impl_->ev_start, impl_->ev_forward));
    const double done = 1e-3 * double(ms);  // the device's forward done, from the step's start
    stats_.launch_seconds += std::chrono::duration<double>(t_launch - t_start).count();
    stats_.forward_done_seconds += done;
    const double late = std::chrono::duration<double>(t_masks - t_start).count() - done;
    if (mask_rows > 0 && late > 0.0) stats_.mask_late_seconds += late, ++stats_.mask_late_steps;
  }
  return result;
}

}  // namespace kestrel::runtime
