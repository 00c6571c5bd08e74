// Requests with images through the CPU engine (runtime/engine.cpp check_images, runtime/executor.cpp
// media_rows): the rows of the vision tower replace the <|media_pad|> embeddings in every prefill chunk
// (including chunks that cut a media span), a request gets the logits model::prefill gives with the same
// rows, and images a model cannot take are refused at submit with a RequestError, never in the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "model/model.h"
#include "nano_checkpoint.h"
#include "runtime/engine.h"
#include "vision/vision.h"

namespace kestrel {
namespace {

using runtime::Engine;
using runtime::EngineConfig;

const testing::NanoCheckpoint& vision_nano() { return testing::nano_checkpoint(); }

std::shared_ptr<const ImageInput> image(int gh, int gw, int seed) {
  auto im = std::make_shared<ImageInput>();
  im->grid_h = gh, im->grid_w = gw;
  im->patches.resize(size_t(gh) * gw * 588);
  for (size_t k = 0; k < im->patches.size(); ++k) im->patches[k] = float(std::sin(0.37 * double(k) + seed * 1.3));
  im->content_hash = uint64_t(seed) * 0x9e3779b97f4a7c15ull + 1;
  return im;
}

// text, [begin content pad×n end] per image, text; the media spans cover the four-token frames.
Request image_request(const std::vector<std::shared_ptr<const ImageInput>>& ims) {
  const int32_t pad = vision_nano().cfg.media_placeholder_token_id;
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
  r.max_tokens = 3;
  r.ignore_eos = true;
  return r;
}

// model::prefill of the prompt with the images' rows at its pads: the reference for the engine.
std::vector<float> model_logits(const Request& r) {
  const auto& n = vision_nano();
  std::vector<const ImageInput*> ims;
  for (const auto& im : r.images) ims.push_back(im.get());
  const std::vector<uint16_t> rows = vision::encode(n.w.vision, n.cfg.vision, ims);
  std::vector<model::EmbedOverride> ov;
  for (size_t j = 0; j < r.prompt.size(); ++j)
    if (r.prompt[j] == n.cfg.media_placeholder_token_id)
      ov.push_back({int64_t(j), rows.data() + int64_t(ov.size()) * n.cfg.text.hidden_size});
  model::State st(n.cfg);
  model::ForwardOptions opt;
  opt.embed_override = ov;
  std::vector<float> logits(r.prompt.size() * size_t(n.cfg.text.vocab_size));
  model::prefill(n.w, n.cfg, st, r.prompt, logits.data(), opt);
  return logits;
}

struct Runner {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, std::map<int64_t, std::vector<float>>> logits;  // request → position → row
  std::map<int, std::vector<int32_t>> tokens;
  int done = 0;
  void submit(Engine& e, Request r, int key) {
    r.on_logits = [this, key](int64_t p, std::span<const float> row) {
      std::lock_guard<std::mutex> lk(mu);
      logits[key][p].assign(row.begin(), row.end());
    };
    ASSERT_TRUE(e.submit(std::move(r), [this, key](TokenEvent&& ev) {
                   std::lock_guard<std::mutex> lk(mu);
                   if (ev.token >= 0) tokens[key].push_back(ev.token);
                   if (ev.finished()) ++done;
                   cv.notify_all();
                 }).accepted());
  }
  void wait(int n) {
    std::unique_lock<std::mutex> lk(mu);
    ASSERT_TRUE(cv.wait_for(lk, std::chrono::seconds(60), [&] { return done >= n; }));
  }
};

double rel_l2(std::span<const float> a, std::span<const float> b) {
  double n = 0, d = 0;
  for (size_t i = 0; i < a.size(); ++i) n += double(a[i] - b[i]) * (a[i] - b[i]), d += double(b[i]) * b[i];
  return std::sqrt(n / d);
}

TEST(EngineVision, ChunkedPrefillAcrossMediaSpansGivesTheModelLogits) {
  const Request r = image_request({image(4, 6, 1), image(6, 4, 2)});  // 6 + 6 image tokens, 38-token prompt
  const std::vector<float> want = model_logits(r);
  const int64_t V = vision_nano().cfg.text.vocab_size, P = int64_t(r.prompt.size());
  for (int chunk : {5, 7, 1 << 10}) {  // 5 and 7 cut both media spans; the last runs the prompt at once
    EngineConfig cfg;
    cfg.memory_budget = 32 << 20;
    cfg.max_num_batched_tokens = chunk;
    cfg.long_prefill_token_threshold = chunk;
    Engine e(vision_nano().w, vision_nano().cfg, cfg);
    Runner run;
    run.submit(e, r, 0);
    run.wait(1);
    for (int64_t p = 0; p < P; ++p) {
      ASSERT_TRUE(run.logits[0].count(p)) << p;
      const std::span<const float> w(want.data() + p * V, size_t(V));
      EXPECT_LE(rel_l2(run.logits[0][p], w), 1e-5) << "chunk " << chunk << " position " << p;
    }
  }
}

TEST(EngineVision, TheImageDecidesTheOutputAndTheSameImageGivesTheSameOutput) {
  EngineConfig cfg;
  cfg.memory_budget = 32 << 20;
  cfg.enable_prefix_cache = false;
  Engine e(vision_nano().w, vision_nano().cfg, cfg);
  Runner run;
  run.submit(e, image_request({image(4, 6, 1)}), 0);
  run.submit(e, image_request({image(4, 6, 1)}), 1);  // same pixels, another object, same step
  run.submit(e, image_request({image(4, 6, 5)}), 2);
  run.wait(3);
  const int64_t P = int64_t(image_request({image(4, 6, 1)}).prompt.size());
  for (int64_t p = 0; p < P; ++p) EXPECT_EQ(run.logits[0][p], run.logits[1][p]) << p;
  EXPECT_EQ(run.tokens[0], run.tokens[1]);
  for (int64_t p = 0; p < P; ++p) {
    if (p < 7) {  // text and the frame tokens before the pads: causal, untouched
      EXPECT_EQ(run.logits[0][p], run.logits[2][p]) << p;
    } else {      // the pads and everything after them see the image
      EXPECT_GT(rel_l2(run.logits[0][p], run.logits[2][p]), 1e-3) << p;
    }
  }
}

// The CPU executor with a gate before each step (so requests submitted while it is held share the next
// step) and its stats readable from the test.
class Gated : public runtime::StepExecutor {
 public:
  explicit Gated(std::unique_ptr<runtime::StepExecutor> inner) : inner_(std::move(inner)) {}
  sched::StepResult run(const sched::StepPlan& plan, const runtime::StepHooks& hooks) override {
    {
      std::unique_lock<std::mutex> lk(mu);
      ++entered;
      cv.notify_all();
      cv.wait(lk, [&] { return !held; });
      max_prefills = std::max(max_prefills, plan.prefills.size());
    }
    return inner_->run(plan, hooks);
  }
  const runtime::ExecutorStats& stats() const override { return inner_->stats(); }
  bool supports_images() const override { return inner_->supports_images(); }
  std::mutex mu;
  std::condition_variable cv;
  bool held = false;
  int entered = 0;
  size_t max_prefills = 0;  // most prefill chunks in one step

 private:
  std::unique_ptr<runtime::StepExecutor> inner_;
};

// Request with the images, then 10 text tokens: its media spans end before its last full 16-token block.
Request image_request_with_tail(const std::vector<std::shared_ptr<const ImageInput>>& ims) {
  Request r = image_request(ims);
  for (int i = 0; i < 10; ++i) r.prompt.push_back(100 + 37 * i);
  return r;
}

// What GpuEngineVision.ImagesOnTheGpuEngineMatchTheCpuEngine (tests/gpu) expects of the CPU engine, which it
// runs beside the GPU one: two image requests that share a step are both encoded before it (per request on
// the CPU: two encoder calls); the same request again hits the prefix cache past its media spans and encodes
// nothing; the same tokens with another first image (another hash) hit nothing there and encode both images.
TEST(EngineVision, ARepeatedImageHitsThePrefixCacheAndIsNotEncodedAgain) {
  EngineConfig cfg;
  cfg.memory_budget = 64 << 20;
  cfg.formats.block_size = 16;
  cfg.max_num_batched_tokens = 256;
  Gated* gate = nullptr;
  cfg.make_executor = [&gate](const CacheFormats& f, const cache::CacheConfig& cc) {
    auto g = std::make_unique<Gated>(std::make_unique<runtime::Executor>(vision_nano().w, vision_nano().cfg, f, cc));
    gate = g.get();
    return std::unique_ptr<runtime::StepExecutor>(std::move(g));
  };
  Engine e(vision_nano().w, vision_nano().cfg, cfg);
  ASSERT_NE(gate, nullptr);
  Runner run;
  {
    std::lock_guard<std::mutex> lk(gate->mu);
    gate->held = true;
  }
  Request text;
  text.prompt = {5, 77, 301, 12, 400};
  text.max_tokens = 4;
  text.ignore_eos = true;
  run.submit(e, text, 0);
  {
    std::unique_lock<std::mutex> lk(gate->mu);
    ASSERT_TRUE(gate->cv.wait_for(lk, std::chrono::seconds(60), [&] { return gate->entered >= 1; }));
  }
  const Request A = image_request_with_tail({image(4, 6, 1), image(6, 4, 2)});  // 39 tokens, spans end at 25
  run.submit(e, A, 1);
  run.submit(e, image_request_with_tail({image(6, 6, 3)}), 2);                    // 30 tokens, span [7, 16)
  {
    std::lock_guard<std::mutex> lk(gate->mu);
    gate->held = false;
  }
  gate->cv.notify_all();
  run.wait(3);
  e.wait_idle();
  EXPECT_EQ(gate->stats().images_encoded, 3);
  EXPECT_EQ(gate->stats().vision_calls, 2);  // per request on the CPU
  EXPECT_EQ(gate->max_prefills, 2u) << "the two image requests should prefill in one step";
  const int64_t hits = e.stats().prefix_hits;
  run.submit(e, A, 3);
  run.wait(4);
  e.wait_idle();
  EXPECT_EQ(e.stats().prefix_hits, hits + 1);
  EXPECT_EQ(gate->stats().images_encoded, 3) << "a repeated image must not be encoded again";
  EXPECT_EQ(run.tokens[3], run.tokens[1]);
  run.submit(e, image_request_with_tail({image(4, 6, 7), image(6, 4, 2)}), 4);
  run.wait(5);
  e.wait_idle();
  EXPECT_EQ(e.stats().prefix_hits, hits + 1) << "another image with the same tokens must not hit";
  EXPECT_EQ(gate->stats().images_encoded, 5);
}

TEST(EngineVision, ImagesTheModelCannotTakeAreRefusedAtSubmit) {
  EngineConfig cfg;
  cfg.memory_budget = 16 << 20;
  auto refused = [&](const ModelConfig& c, Request r, const char* what) {
    Engine e(vision_nano().w, c, cfg);
    try {
      e.submit(std::move(r), [](TokenEvent&&) {});
      ADD_FAILURE() << "accepted: " << what;
    } catch (const RequestError& err) {
      EXPECT_EQ(err.field, "images");
      EXPECT_NE(std::string(err.what()).find(what), std::string::npos) << err.what();
    }
    EXPECT_TRUE(e.ready());
  };
  ModelConfig blind = vision_nano().cfg;  // as a --no-vision checkpoint
  blind.vision = VisionConfig{};
  refused(blind, image_request({image(2, 2, 0)}), "no vision tower");
  Request fewer = image_request({image(4, 6, 1)});
  fewer.prompt[8] = 5;  // one pad less than the image's 6 tokens
  refused(vision_nano().cfg, fewer, "media_pad");
  Request extra = image_request({image(2, 2, 1)});
  extra.media.push_back({0, 2, 9});
  refused(vision_nano().cfg, extra, "1 images for 2 media spans");
  Request odd = image_request({image(2, 2, 1)});
  auto bad = std::make_shared<ImageInput>(*odd.images[0]);
  bad->patches.resize(10);
  odd.images[0] = bad;
  refused(vision_nano().cfg, odd, "preprocessed even grid");  // request validation, before the tower's own check
}

}  // namespace
}  // namespace kestrel
