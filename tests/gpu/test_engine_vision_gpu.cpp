// GpuEngineVision.*: requests with images through the GPU engine (runtime/executor_cuda.h, "Images": the
// step's new images in one varlen call of the GPU encoder, rows scattered over the <|media_pad|> embeddings,
// model::CudaEmbedRows) against the CPU engine (runtime/executor.cpp media_rows, the twin), on every
// checkpoint of KESTREL_GPU_CKPTS that has a vision tower (bench/gpu/run.sh vision makes the nano one;
// none is a failure, not a skip).
//
// ImageRowsReplaceEmbeddingsAsOnTheCpu: the model alone. Two prefill sequences in one GPU forward with rows
// (real embedding rows of other tokens, so the change is large and at the model's scale) at chosen positions
// — runs, the first and last position, a lone one — against model::prefill with the same EmbedOverrides:
// the GpuModel bounds (MODEL.md §0.10: rel L2 ≤ 2e-2, max |Δ| ≤ 5% of max |logit|) at every position (so
// the rows land exactly where the CPU puts them); and the rows must matter: the same forward without them
// gives other logits (rel L2 > 1e-3) at every position that has a row.
//
// ImagesOnTheGpuEngineMatchTheCpuEngine: per checkpoint, the same script on a GPU engine and on a CPU engine
// (greedy, ignore_eos, every position's logits through on_logits):
//  0. the encoder alone: VisionCuda on the checkpoint's vision weights against vision::encode, the bound of
//     GpuVision.EncoderMatchesCpuEncoder (rel L2 ≤ 3e-2), and the measured value reported;
//  1. one step: the first step (a text request) is held at the executor while request A (two images) and
//     request B (one image) are submitted, so both prefill in the next step: on the GPU their three images
//     go through ONE encoder call (vision_calls 1, images_encoded 3);
//  2. prefix cache: A again (same images, same hashes) hits the prefix cache past both media spans, so
//     nothing is encoded (images_encoded stays 3) and prefix_hits grows; A with another first image (other
//     pixels, other hash, same tokens) hits nothing there and encodes its two images (images_encoded 5);
//  3. chunked prefill: A and B on an engine whose chunks are 5 tokens, so chunk boundaries cut every media
//     span, without the prefix cache.
// Every request's tokens must equal the CPU engine's, except from a near tie on (the CPU's top two logits
// within 4% of max |logit|, the bound of GpuEngine.*), reported; at every position both engines computed
// before the first differing token, the logits must agree as in GpuModel (MODEL.md §0.10): rel L2 ≤ 2e-2,
// max |Δ| ≤ 5% of max |logit|. The worst values are reported. A request with images that fails them is
// diagnosed in the same run ("DIAG" notes, see diagnose()): its encoder rows, their placement in the GPU
// model, and its logits errors split into the pad positions of each image, the 3 after each, and the rest.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "kernels/cuda/device_buffer.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cuda_model.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "runtime/executor_cuda.h"
#include "vision/cuda/vision_cuda.h"
#include "vision/vision.h"

namespace kestrel::gputest {
namespace {

std::vector<std::string> vision_ckpt_dirs() {
  std::vector<std::string> out;
  for (const std::string& d : gpu_ckpt_dirs())
    if (load_config(d).vision.present) out.push_back(d);
  return out;
}

std::shared_ptr<const ImageInput> image(int gh, int gw, int seed) {
  auto im = std::make_shared<ImageInput>();
  im->grid_h = gh, im->grid_w = gw;
  im->patches.resize(size_t(gh) * gw * 588);  // f32 [gh·gw, 3·14·14]
  for (size_t k = 0; k < im->patches.size(); ++k) im->patches[k] = float(std::sin(0.37 * double(k) + seed * 1.3));
  im->content_hash = uint64_t(seed) * 0x9e3779b97f4a7c15ull + 1;
  return im;
}

// 5 text tokens, per image [begin content pad×n end] + 3 text tokens, then 10 text tokens: the media spans
// end before the prompt's last full 16-token block, so a repeat's prefix hit covers them.
Request image_request(const ModelConfig& c, const std::vector<std::shared_ptr<const ImageInput>>& ims,
                      int max_tokens) {
  const int32_t pad = c.media_placeholder_token_id;
  Request r;
  r.prompt = {5, 77, 301, 12, 400};
  for (const auto& im : ims) {
    const int64_t s = int64_t(r.prompt.size());
    r.prompt.insert(r.prompt.end(), {pad - 3, pad - 2});
    r.prompt.insert(r.prompt.end(), size_t(im->num_tokens()), pad);
    r.prompt.push_back(pad - 1);
    r.prompt.insert(r.prompt.end(), {9, 33, 610});
    r.media.push_back({s + 2, s + 2 + im->num_tokens(), im->content_hash});  // the pad run (request.h MediaSpan)
    r.images.push_back(im);
  }
  for (int i = 0; i < 10; ++i) r.prompt.push_back(int32_t(100 + 37 * i));
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

// Holds the engine's steps at the executor while `held` (so requests submitted meanwhile share the next step).
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool held = false;
  int entered = 0;
  runtime::StepExecutor* exec = nullptr;  // the wrapped executor (its stats)
  void hold() {
    std::lock_guard<std::mutex> lk(mu);
    held = true;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lk(mu);
      held = false;
    }
    cv.notify_all();
  }
  bool wait_entered(int n) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, std::chrono::seconds(60), [&] { return entered >= n; });
  }
};

class Gated : public runtime::StepExecutor {
 public:
  Gated(std::unique_ptr<runtime::StepExecutor> inner, Gate& g) : inner_(std::move(inner)), g_(g) {
    g_.exec = inner_.get();
  }
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    {
      std::unique_lock<std::mutex> lk(g_.mu);
      ++g_.entered;
      g_.cv.notify_all();
      g_.cv.wait(lk, [&] { return !g_.held; });
    }
    return inner_->run(plan, hooks);
  }
  const runtime::ExecutorStats& stats() const override { return inner_->stats(); }
  bool supports_images() const override { return inner_->supports_images(); }

 private:
  std::unique_ptr<runtime::StepExecutor> inner_;
  Gate& g_;
};

struct Runner {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::map<int64_t, std::vector<float>>> logits;  // request → position → f32 [V]
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, Request> requests;
  int done = 0;
  std::string error;
  void submit(runtime::Engine& e, Request r, const std::string& key) {
    requests[key] = r;  // a copy: the prompt and images, for the comparison
    r.on_logits = [this, key](int64_t p, std::span<const float> row) {
      std::lock_guard<std::mutex> lk(mu);
      logits[key][p].assign(row.begin(), row.end());
    };
    e.submit(std::move(r), [this, key](const TokenEvent& ev) {
      std::lock_guard<std::mutex> lk(mu);
      if (ev.token >= 0) tokens[key].push_back(ev.token);
      if (ev.finish == FinishReason::error) error += key + ": " + ev.error + "; ";
      if (ev.finished()) ++done;
      cv.notify_all();
    });
  }
  bool wait(int n) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, std::chrono::seconds(300), [&] { return done >= n; });
  }
};

struct ScriptResult {
  Runner run;  // every request of every phase, keyed "phase/name"
  int64_t calls_after_1 = 0, encoded_after_1 = 0, encoded_after_repeat = 0, encoded_after_other = 0;
  int64_t hits_before_repeat = 0, hits_after_repeat = 0;
};

runtime::EngineConfig engine_config(int budget, bool prefix_cache) {
  runtime::EngineConfig ec;
  ec.memory_budget = int64_t(256) << 20;
  ec.max_running = 8;
  ec.formats.block_size = 16;
  ec.enable_prefix_cache = prefix_cache;
  ec.max_num_batched_tokens = budget;
  ec.long_prefill_token_threshold = budget;
  return ec;
}

// The script of the header on one engine kind: `gpu` null runs the CPU engine.
void run_script(const ModelConfig& cfg, const ModelWeights& w, model::CudaModel* gpu, vision::VisionCuda* enc,
                int max_tokens, ScriptResult& out) {
  Gate gate;
  auto factory = [&](runtime::EngineConfig ec) {
    ec.make_executor = [&cfg, &w, gpu, enc, &gate](const CacheFormats& f, const cache::CacheConfig& cc) {
      std::unique_ptr<runtime::StepExecutor> inner;
      if (gpu) {
        runtime::CudaExecutorOptions eo;
        eo.vision = enc;
        inner = std::make_unique<runtime::CudaExecutor>(*gpu, cfg, f, cc, eo);
      } else {
        inner = std::make_unique<runtime::Executor>(w, cfg, f, cc);
      }
      return std::unique_ptr<runtime::StepExecutor>(std::make_unique<Gated>(std::move(inner), gate));
    };
    return ec;
  };
  const auto A = [&](int seed1) { return image_request(cfg, {image(4, 6, seed1), image(6, 4, 2)}, max_tokens); };
  const Request B = image_request(cfg, {image(6, 6, 3)}, max_tokens);
  Runner& run = out.run;
  {
    runtime::Engine e(w, cfg, factory(engine_config(256, true)));
    // 1. A and B in one step.
    gate.hold();
    Request text;
    text.prompt = {5, 77, 301, 12, 400};
    text.max_tokens = 4;
    text.ignore_eos = true;
    run.submit(e, text, "1/text");
    ASSERT_TRUE(gate.wait_entered(1)) << "the engine never ran its first step";
    run.submit(e, A(1), "1/A");
    run.submit(e, B, "1/B");
    gate.release();
    ASSERT_TRUE(run.wait(3));
    e.wait_idle();
    out.calls_after_1 = gate.exec->stats().vision_calls;
    out.encoded_after_1 = gate.exec->stats().images_encoded;
    // 2. A again: a prefix hit past its media spans; then A with another first image: no hit there.
    out.hits_before_repeat = e.stats().prefix_hits;
    run.submit(e, A(1), "2/A again");
    ASSERT_TRUE(run.wait(4));
    e.wait_idle();
    out.hits_after_repeat = e.stats().prefix_hits;
    out.encoded_after_repeat = gate.exec->stats().images_encoded;
    run.submit(e, A(7), "2/A other image");
    ASSERT_TRUE(run.wait(5));
    e.wait_idle();
    out.encoded_after_other = gate.exec->stats().images_encoded;
  }
  {
    // 3. Chunks of 5 tokens cut every media span.
    runtime::Engine e(w, cfg, factory(engine_config(5, false)));
    run.submit(e, A(1), "3/A chunked");
    run.submit(e, B, "3/B chunked");
    ASSERT_TRUE(run.wait(7));
    e.wait_idle();
  }
  EXPECT_EQ(run.error, "");
}

double rel_gap(const std::vector<float>& x) { return gputest::rel_gap(x.data(), int64_t(x.size())); }

// rel L2 and max |Δ| / max |logit| of row `got` against `ref` (f32 [V] each).
std::pair<double, double> row_errors(const float* got, const float* ref, int64_t V) {
  double num = 0, den = 0, mx = 0, scale = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double e = double(got[v]) - ref[v];
    num += e * e, den += double(ref[v]) * ref[v];
    mx = std::max(mx, std::fabs(e)), scale = std::max(scale, double(std::fabs(ref[v])));
  }
  return {std::sqrt(num / den), mx / scale};
}

// rel L2 of each image's rows of `got` against `ref` (bf16 [Σ tokens, D] each), "a, b, c".
std::string per_image_rel(const std::vector<uint16_t>& got, const std::vector<uint16_t>& ref,
                          const std::vector<std::shared_ptr<const ImageInput>>& ims, int64_t D) {
  std::string out;
  int64_t r0 = 0;
  for (const auto& im : ims) {
    double num = 0, den = 0;
    for (int64_t e = r0 * D; e < (r0 + im->num_tokens()) * D; ++e) {
      const double g = bf16_to_f32(got[size_t(e)]), f = bf16_to_f32(ref[size_t(e)]);
      num += (g - f) * (g - f), den += f * f;
    }
    out += fmt::format("{}{}x{} {:.2e}", out.empty() ? "" : ", ", im->grid_h, im->grid_w, std::sqrt(num / den));
    r0 += im->num_tokens();
  }
  return out;
}

// Which kind of prompt position p is, for splitting a request's logits errors: the pad run of image k, one
// of the 3 positions after a pad run (the KDA short conv, width 4, reads a pad row there directly), or
// another position (which sees the image rows only through attention and the recurrent state).
std::string position_kind(const Request& r, int64_t p) {
  for (size_t k = 0; k < r.media.size(); ++k) {
    if (p >= r.media[k].start && p < r.media[k].end) return fmt::format("pads of image {}", k);
    if (p >= r.media[k].end && p < r.media[k].end + 3) return fmt::format("3 after image {}", k);
  }
  return "other positions";
}

// Errors of one request's logits rows, grouped by position_kind: how many rows, how many over the bound,
// the worst rel L2 and where.
struct ErrorSplit {
  struct Group {
    int rows = 0, bad = 0;
    double worst = 0;
    int64_t worst_pos = -1, lo = -1, hi = -1;
  };
  std::map<std::string, Group> groups;
  void add(const Request& r, int64_t p, double rel, bool bad) {
    Group& g = groups[position_kind(r, p)];
    ++g.rows, g.bad += bad ? 1 : 0;
    if (g.lo < 0) g.lo = p;
    g.hi = p;
    if (rel > g.worst) g.worst = rel, g.worst_pos = p;
  }
  std::string str() const {
    std::string out;
    for (const auto& [k, g] : groups)
      out += fmt::format("\n      {:<18} positions {}..{}: {}/{} rows over the bound, worst rel L2 {:.2e} at {}", k,
                         g.lo, g.hi, g.bad, g.rows, g.worst, g.worst_pos);
    return out;
  }
};

// For a request whose GPU-engine logits failed: what was wrong, in one run. The request's image rows from
// (a) vision::encode (the CPU engine's rows), (b) the GPU encoder on the legacy stream (the test's step 0
// way), (c) the GPU encoder the executor's way — prepare + run on the model's non-blocking stream, right
// after a call on other pixels of the same grids — each image against (a); then the GPU model alone on the
// request's prompt with (a)'s rows at its pad positions (no engine, no executor) against the CPU engine's
// logits and the GPU engine's, and with (c)'s rows against the GPU engine's. Every logits comparison is
// split by position_kind. Reading it: (c) off but (b) fine → the encoder's
// calls on the executor's stream (ordering, stale scratch); model-with-(a) off at the pads → the rows'
// placement in the GPU forward; model-with-(a) fine but the engine off against it → the engine fed other
// rows (the encoder's calls in the executor if (c) is off too; else the executor's bookkeeping: which rows
// it passes for which request and positions) or returned other logits rows.
void diagnose(const std::string& name, const std::string& key, const Request& req, const ModelConfig& cfg,
              const ModelWeights& w, model::CudaModel& gm, vision::VisionCuda& enc,
              const std::map<int64_t, std::vector<float>>& cpu_logits,
              const std::map<int64_t, std::vector<float>>& gpu_logits) {
  const int64_t D = cfg.text.hidden_size, V = cfg.text.vocab_size;
  std::vector<const ImageInput*> ims;
  for (const auto& im : req.images) ims.push_back(im.get());
  const std::vector<uint16_t> ref = vision::encode(w.vision, cfg.vision, ims);
  auto legacy = poisoned<uint16_t>(ref.size());
  enc.encode(ims, legacy.p(), nullptr);
  sync();
  // A decoy call first: the same grids, other pixels (so stale data from it is visible in (c)).
  std::vector<std::shared_ptr<const ImageInput>> decoy;
  std::vector<const ImageInput*> decoy_ptrs;
  for (size_t i = 0; i < ims.size(); ++i)
    decoy.push_back(image(ims[i]->grid_h, ims[i]->grid_w, 1000 + int(i))), decoy_ptrs.push_back(decoy.back().get());
  cudaStream_t s = static_cast<cudaStream_t>(gm.stream());
  auto decoy_out = poisoned<uint16_t>(ref.size());
  auto execway = poisoned<uint16_t>(ref.size());
  sync();
  enc.prepare(decoy_ptrs, s);
  enc.run(decoy_out.p(), s);
  const int64_t n = enc.prepare(ims, s);
  enc.run(execway.p(), s);
  sync();
  const std::vector<uint16_t> exec_rows = execway.get();
  note(fmt::format("  DIAG {} {}: image rows vs vision::encode, rel L2 per image: GPU encoder on the legacy stream "
                   "[{}]; the executor's way (model stream, after another call) [{}] ({} rows, expected {})",
                   name, key, per_image_rel(legacy.get(), ref, req.images, D),
                   per_image_rel(exec_rows, ref, req.images, D), n, int64_t(ref.size()) / D));

  // The GPU model alone on the whole prompt, the rows at the pad positions.
  std::vector<int32_t> pos;
  for (const MediaSpan& m : req.media)
    for (int64_t p = m.start; p < m.end; ++p) pos.push_back(int32_t(p));
  const int64_t T = int64_t(req.prompt.size());
  const int32_t pages = int32_t((T + 15) / 16);
  auto cache = gm.new_cache(pages, 1, engine_config(256, false).formats);
  std::vector<int32_t> table(static_cast<size_t>(pages));
  for (int32_t i = 0; i < pages; ++i) table[size_t(i)] = i;
  auto forward = [&](const uint16_t* rows) {
    gm.zero_slot(*cache, 0);
    const std::vector<model::CudaSeq> seqs = {{req.prompt, 0, 0, table, model::CudaSeq::Logits::all}};
    const std::vector<model::CudaEmbedRows> er = {{0, pos, rows}};
    const int64_t got = gm.forward_batch(*cache, seqs, er);
    std::vector<float> out(size_t(got * V));
    gm.copy_logits(out.data());
    return out;
  };
  const Dev<uint16_t> dref = upload(ref);
  sync();  // a legacy-stream copy: done before the model's (non-blocking) stream reads it
  const std::vector<float> with_ref = forward(dref.p()), with_exec = forward(execway.p());
  ErrorSplit vs_cpu, ref_vs_gpu_engine, vs_gpu_engine, engine_vs_cpu;
  for (int64_t p = 0; p < T; ++p) {
    auto c = cpu_logits.find(p), g = gpu_logits.find(p);
    if (c != cpu_logits.end()) {
      const double rel = row_errors(with_ref.data() + p * V, c->second.data(), V).first;
      vs_cpu.add(req, p, rel, rel > 2e-2);
    }
    if (g != gpu_logits.end()) {
      const double rel = row_errors(g->second.data(), with_ref.data() + p * V, V).first;
      ref_vs_gpu_engine.add(req, p, rel, rel > 2e-2);
      const double rel2 = row_errors(with_exec.data() + p * V, g->second.data(), V).first;
      vs_gpu_engine.add(req, p, rel2, rel2 > 2e-2);
    }
    if (c != cpu_logits.end() && g != gpu_logits.end()) {
      const double rel = row_errors(g->second.data(), c->second.data(), V).first;
      engine_vs_cpu.add(req, p, rel, rel > 2e-2);
    }
  }
  note(fmt::format("  DIAG {} {}: the GPU engine vs the CPU engine, prompt positions:{}", name, key,
                   engine_vs_cpu.str()));
  note(fmt::format("  DIAG {} {}: the GPU model alone with vision::encode's rows vs the CPU engine:{}", name, key,
                   vs_cpu.str()));
  note(fmt::format("  DIAG {} {}: the GPU engine vs the GPU model alone with vision::encode's rows:{}", name, key,
                   ref_vs_gpu_engine.str()));
  note(fmt::format("  DIAG {} {}: the GPU model alone with the executor-way encoder rows vs the GPU engine (equal "
                   "only if the engine got those rows):{}",
                   name, key, vs_gpu_engine.str()));
}

TEST(GpuEngineVision, ImageRowsReplaceEmbeddingsAsOnTheCpu) {
  const auto dirs = vision_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "no checkpoint with a vision tower in KESTREL_GPU_CKPTS: run through "
                                "bench/gpu/run.sh vision";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    const int64_t V = cfg.text.vocab_size, D = cfg.text.hidden_size;
    const std::string name = D == 256 ? "nano" : "mini(reduced)";
    const uint16_t* embed = w.embed.as<const uint16_t>();  // bf16 [V, D]
    struct SeqCase {
      int64_t len;
      std::vector<int32_t> pos;  // image positions, ascending
    };
    const std::vector<SeqCase> cases = {{40, {3, 4, 5, 6, 20, 21, 39}}, {23, {0, 7, 22}}};
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<uint16_t>> rows;  // bf16 [pos.size(), D] per sequence
    for (size_t b = 0; b < cases.size(); ++b) {
      std::vector<int32_t> t;
      for (int64_t i = 0; i < cases[b].len; ++i)
        t.push_back(int32_t((i * 7919 + 13 + int64_t(b) * 101) % std::min<int64_t>(V, 1000)));
      tokens.push_back(t);
      std::vector<uint16_t> r;
      for (size_t k = 0; k < cases[b].pos.size(); ++k) {
        const int64_t id = (int64_t(k) * 37 + 11 + int64_t(b) * 5) % std::min<int64_t>(V, 1000);
        r.insert(r.end(), embed + id * D, embed + (id + 1) * D);
      }
      rows.push_back(r);
    }
    // GPU: both sequences in one forward (block 16, pages 0..2 and 3..4, slots 0 and 1), every row's logits.
    model::CudaModel gm(cfg, w);
    auto cache = gm.new_cache(8, 2, CacheFormats{16, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
    const std::vector<std::vector<int32_t>> tables = {{0, 1, 2}, {3, 4}};
    std::vector<Dev<uint16_t>> drows;
    for (const auto& r : rows) drows.push_back(upload(r));
    sync();  // legacy-stream copies: landed before the model's non-blocking stream reads them
    auto gpu_forward = [&](bool with_rows) {
      for (int32_t slot : {0, 1}) gm.zero_slot(*cache, slot);
      std::vector<model::CudaSeq> seqs;
      std::vector<model::CudaEmbedRows> er;
      for (size_t b = 0; b < cases.size(); ++b) {
        seqs.push_back({tokens[b], 0, int32_t(b), tables[b], model::CudaSeq::Logits::all});
        if (with_rows) er.push_back({int64_t(b), cases[b].pos, drows[b].p()});
      }
      const int64_t n = gm.forward_batch(*cache, seqs, er);
      EXPECT_EQ(n, cases[0].len + cases[1].len);
      std::vector<float> out(size_t(n * V));
      gm.copy_logits(out.data());
      return out;
    };
    const std::vector<float> gpu = gpu_forward(true), plain = gpu_forward(false);
    double worst_rel = 0, worst_abs = 0;
    int64_t row0 = 0;
    for (size_t b = 0; b < cases.size(); ++b) {
      const int64_t T = cases[b].len;
      std::vector<model::EmbedOverride> ov;
      for (size_t k = 0; k < cases[b].pos.size(); ++k) ov.push_back({cases[b].pos[k], rows[b].data() + int64_t(k) * D});
      model::State st(cfg);
      model::ForwardOptions opt;
      opt.embed_override = ov;
      std::vector<float> cpu(size_t(T * V));
      model::prefill(w, cfg, st, tokens[b], cpu.data(), opt);
      for (int64_t p = 0; p < T; ++p) {
        const auto [rel, abs_rel] = row_errors(gpu.data() + (row0 + p) * V, cpu.data() + p * V, V);
        worst_rel = std::max(worst_rel, rel), worst_abs = std::max(worst_abs, abs_rel);
        EXPECT_LE(rel, 2e-2) << name << " sequence " << b << " position " << p << ": logits rel L2 vs the CPU";
        EXPECT_LE(abs_rel, 5e-2) << name << " sequence " << b << " position " << p << ": max |Δ| vs the CPU";
        if (std::count(cases[b].pos.begin(), cases[b].pos.end(), int32_t(p)) > 0) {
          const double moved = row_errors(plain.data() + (row0 + p) * V, gpu.data() + (row0 + p) * V, V).first;
          EXPECT_GT(moved, 1e-3) << name << " sequence " << b << " position " << p << ": its image row changed nothing";
        }
      }
      row0 += T;
    }
    note(fmt::format("{:<28} {:<34} worst rel L2 {:.2e}, worst max|Δ| {:.2e} of max|logit|", "image rows (GPU model)",
                     name + " 2 seqs", worst_rel, worst_abs));
  }
}

TEST(GpuEngineVision, ImagesOnTheGpuEngineMatchTheCpuEngine) {
  const auto dirs = vision_ckpt_dirs();
  ASSERT_FALSE(dirs.empty()) << "no checkpoint with a vision tower in KESTREL_GPU_CKPTS: run through "
                                "bench/gpu/run.sh vision";
  for (const std::string& dir : dirs) {
    const ModelConfig cfg = load_config(dir);
    const Checkpoint ckpt(dir);
    const ModelWeights w = bind_weights(cfg, ckpt);
    ASSERT_TRUE(w.has_vision) << dir;
    const bool nano = cfg.text.hidden_size == 256;
    const std::string name = nano ? "nano" : "mini(reduced)";
    const int max_tokens = nano ? 6 : 4;
    model::CudaModel gm(cfg, w);
    std::vector<cuda::DeviceBuffer> keep;
    vision::VisionCuda enc(cfg.vision, vision::VisionCuda::upload(w.vision, keep));

    // 0. The encoder alone on the checkpoint's weights.
    {
      const auto i1 = image(4, 6, 1), i2 = image(6, 4, 2), i3 = image(6, 6, 3);
      const std::vector<const ImageInput*> ims = {i1.get(), i2.get(), i3.get()};
      const std::vector<uint16_t> ref = vision::encode(w.vision, cfg.vision, ims);
      auto got = poisoned<uint16_t>(ref.size());
      enc.encode(ims, got.p(), nullptr);
      sync();
      check_bf16("vision encoder (checkpoint)", name, got.get(), ref, {6e-2, 6e-2, 3e-2});
    }

    ScriptResult g, c;
    run_script(cfg, w, &gm, &enc, max_tokens, g);
    if (HasFatalFailure()) return;
    run_script(cfg, w, nullptr, nullptr, max_tokens, c);
    if (HasFatalFailure()) return;

    // The encoder's work: one call for the step's three images; none for a repeat; two images for another.
    note(fmt::format("  engine-vision {}: GPU {} encoder call(s) for the images of step 1 ({} images); images "
                     "encoded after the repeat {}, after another image {}; prefix hits {} -> {}",
                     name, g.calls_after_1, g.encoded_after_1, g.encoded_after_repeat, g.encoded_after_other,
                     g.hits_before_repeat, g.hits_after_repeat));
    EXPECT_EQ(g.calls_after_1, 1) << "A's and B's images should go through one encoder call";
    EXPECT_EQ(g.encoded_after_1, 3);
    EXPECT_EQ(g.encoded_after_repeat, 3) << "a repeated image must not be encoded again (prefix hit)";
    EXPECT_GT(g.hits_after_repeat, g.hits_before_repeat) << "the repeated request should hit the prefix cache";
    EXPECT_EQ(g.encoded_after_other, 5) << "another image with the same tokens must be encoded";
    EXPECT_EQ(c.encoded_after_1, 3);
    EXPECT_EQ(c.encoded_after_repeat, 3);
    EXPECT_EQ(c.encoded_after_other, 5);

    const int64_t V = cfg.text.vocab_size;
    double worst_rel = 0, worst_abs = 0;
    int equal = 0, total = 0, rows = 0;
    for (const auto& [key, req] : c.run.requests) {
      const auto& ct = c.run.tokens[key];
      const auto& gt = g.run.tokens[key];
      ASSERT_EQ(ct.size(), size_t(req.max_tokens)) << name << " " << key;
      ASSERT_EQ(gt.size(), size_t(req.max_tokens)) << name << " " << key;
      ++total;
      size_t d = 0;
      while (d < ct.size() && ct[d] == gt[d]) ++d;
      const int64_t P = int64_t(req.prompt.size());
      auto& cl = c.run.logits[key];
      auto& gl = g.run.logits[key];
      if (d == ct.size()) {
        ++equal;
      } else {
        ASSERT_TRUE(cl.count(P - 1 + int64_t(d))) << key;
        const double gap = rel_gap(cl[P - 1 + int64_t(d)]);
        note(fmt::format("  engine-vision {} {}: GPU differs from CPU at output {} (CPU top-2 gap {:.2e} of "
                         "max|logit|)",
                         name, key, d, gap));
        EXPECT_LE(gap, 4e-2) << name << " " << key << ": GPU tokens differ from the CPU engine's at output " << d
                             << " where the CPU logits are no near tie";
      }
      // Positions whose inputs are the same on both: the prompt and the outputs up to the first difference.
      const int64_t last = P - 1 + int64_t(std::min(d, ct.size() - 1));
      EXPECT_EQ(cl.size(), gl.size()) << name << " " << key << ": the engines computed different positions";
      bool request_bad = false;  // any logits row of this request over the bounds: diagnose it below
      for (const auto& [p, crow] : cl) {
        if (p > last) break;
        auto it = gl.find(p);
        ASSERT_TRUE(it != gl.end()) << name << " " << key << ": the GPU engine gave no logits at position " << p;
        const std::vector<float>& grow = it->second;
        ASSERT_EQ(grow.size(), size_t(V));
        const auto [rel, abs_rel] = row_errors(grow.data(), crow.data(), V);
        worst_rel = std::max(worst_rel, rel), worst_abs = std::max(worst_abs, abs_rel);
        ++rows;
        EXPECT_LE(rel, 2e-2) << name << " " << key << " position " << p << " (" << position_kind(req, p)
                             << "): logits rel L2";
        EXPECT_LE(abs_rel, 5e-2) << name << " " << key << " position " << p << ": max |Δ| / max |logit|";
        request_bad = request_bad || !(rel <= 2e-2 && abs_rel <= 5e-2);
      }
      if (request_bad && !req.images.empty()) diagnose(name, key, req, cfg, w, gm, enc, cl, gl);
    }
    note(fmt::format("{:<28} {:<34} GPU == CPU tokens for {}/{} requests; {} logits rows, worst rel L2 {:.2e}, "
                     "worst max|Δ| {:.2e} of max|logit|",
                     "engine with images (GPU)", name, equal, total, rows, worst_rel, worst_abs));
  }
}

}  // namespace
}  // namespace kestrel::gputest
