// PagedEngine: see paged_engine.h.
#include "server/paged_engine.h"

#include <random>
#include <vector>

#include "core/check.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

namespace kestrel::server {

// Declared in this order so the runtime engine (which refers to cfg and w) goes first on destruction.
struct PagedEngine::Model {
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  ModelWeights w;
  std::shared_ptr<void> device;  // PagedEngineOptions::device_setup's result; outlives the engine
  std::unique_ptr<runtime::Engine> engine;
};

runtime::SamplingParams runtime_sampling(const SamplingParams& p) {
  runtime::SamplingParams r;
  r.temperature = p.temperature;
  r.top_k = p.top_k;
  r.top_p = p.top_p;
  r.min_p = p.min_p;
  r.repetition_penalty = p.repetition_penalty;
  r.presence_penalty = p.presence_penalty;
  r.frequency_penalty = p.frequency_penalty;
  // No seed asked for: a fresh one per request (the runtime's draws are a function of the seed).
  r.seed = p.seed ? *p.seed : (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  r.logprobs = p.logprobs ? p.top_logprobs : -1;
  return r;
}

namespace {

Finish to_finish(runtime::FinishReason r) {
  switch (r) {
    case runtime::FinishReason::none: return Finish::kNone;
    case runtime::FinishReason::length: return Finish::kLength;
    case runtime::FinishReason::stop: return Finish::kStop;
    case runtime::FinishReason::cancelled: return Finish::kAbort;
    case runtime::FinishReason::error: return Finish::kError;
  }
  return Finish::kError;
}

}  // namespace

PagedEngine::PagedEngine(PagedEngineOptions opt) : opt_(std::move(opt)) {
  KCHECK(opt_.max_queue >= 0, "bad engine options");
  loader_ = std::thread([this] { load(); });
}

PagedEngine::~PagedEngine() {
  shutdown();
  // model_ (and with it the runtime engine's thread) goes here, after every request has ended.
}

void PagedEngine::load() {
  std::string error;
  auto m = std::make_unique<Model>();
  try {
    m->cfg = load_config(opt_.model_dir);
    m->ckpt = std::make_unique<Checkpoint>(opt_.model_dir);
    m->w = bind_weights(m->cfg, *m->ckpt);
    runtime::EngineConfig ec = opt_.engine;
    if (opt_.device_setup) m->device = opt_.device_setup(m->cfg, m->w, ec);
    m->engine = std::make_unique<runtime::Engine>(m->w, m->cfg, ec);
    const int64_t ctx = m->cfg.text.max_position_embeddings;
    const int64_t longest = m->engine->memory_plan().longest_request;
    if (opt_.max_model_len > ctx)
      fail("--max-model-len {} exceeds the model's context length {}", opt_.max_model_len, ctx);
    if (opt_.max_model_len > longest)
      fail("--max-model-len {} needs more KV cache than the memory plan holds ({} tokens for one request); "
           "raise --memory-budget or lower --max-model-len", opt_.max_model_len, longest);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard lk(mu_);
  loaded_ = true;
  if (!error.empty()) {
    load_error_ = error;
  } else {
    vocab_ = m->cfg.text.vocab_size;
    const int64_t cap = std::min<int64_t>(m->cfg.text.max_position_embeddings, m->engine->memory_plan().longest_request);
    max_model_len_ = opt_.max_model_len > 0 ? opt_.max_model_len : cap;
    model_ = std::move(m);
  }
  cv_.notify_all();
}

bool PagedEngine::wait_loaded() const {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return loaded_; });
  return model_ != nullptr;
}

std::string PagedEngine::load_error() const {
  std::lock_guard lk(mu_);
  return load_error_;
}

const sched::MemoryPlan& PagedEngine::memory_plan() const {
  std::lock_guard lk(mu_);
  if (!model_) fail("the engine is not loaded");
  return model_->engine->memory_plan();
}

bool PagedEngine::ready() const {
  std::lock_guard lk(mu_);
  return model_ && !stopping_ && model_->engine->ready();
}

int64_t PagedEngine::max_model_len() const {
  std::lock_guard lk(mu_);
  return max_model_len_;
}

int64_t PagedEngine::vocab_size() const {
  std::lock_guard lk(mu_);
  return vocab_;
}

SubmitResult PagedEngine::submit(EngineRequest req, TokenSink sink) {
  // What the runtime callback needs; shared because the runtime copies its callback.
  struct Ctx {
    TokenSink sink;
    uint64_t id = 0;
    int32_t prompt_tokens = 0;
    bool first = true;
  };
  auto ctx = std::make_shared<Ctx>();
  ctx->sink = std::move(sink);
  ctx->id = req.id;
  ctx->prompt_tokens = int32_t(req.prompt.size());

  runtime::GenerateRequest g;
  g.prompt = std::move(req.prompt);
  g.max_tokens = req.sampling.max_tokens;
  g.sampling = runtime_sampling(req.sampling);
  // engine_api.h: ignore_eos ignores stop_token_ids too; the runtime applies its ids regardless.
  g.ignore_eos = req.sampling.ignore_eos;
  if (!g.ignore_eos) g.stop_token_ids = req.sampling.stop_token_ids;

  runtime::EventCallback cb = [this, ctx](const runtime::TokenEvent& ev) {
    TokenEvent out;
    out.token = ev.token;
    out.logprob = ev.logprob;
    out.top_logprobs.reserve(ev.top_logprobs.size());
    for (const runtime::TokenLogprob& t : ev.top_logprobs) out.top_logprobs.push_back({t.token, t.logprob});
    out.finish = ev.finished ? to_finish(ev.reason) : Finish::kNone;
    if (out.finish == Finish::kError) out.error = ev.error.empty() ? "engine error" : ev.error;
    if (ctx->first) {
      out.prompt_tokens = ctx->prompt_tokens;
      out.cached_prompt_tokens = ev.cached_prompt_tokens;
      ctx->first = false;
    }
    if (ev.finished) {
      // The runtime has freed the request's pages and slot; forget its id before the server hears
      // of the end, so a cancel() racing with it is a no-op.
      std::lock_guard lk(mu_);
      ids_.erase(ctx->id);
    }
    if (ctx->sink) ctx->sink(std::move(out));
    if (ev.finished) ctx->sink = nullptr;  // drop what the sink holds (the connection) right away
  };

  std::lock_guard lk(mu_);
  if (!model_ || stopping_ || !model_->engine->ready()) return SubmitResult::kNotReady;
  if (ids_.count(req.id)) fail("request id {} is already in use", req.id);
  if (model_->engine->num_waiting() >= opt_.max_queue) return SubmitResult::kQueueFull;
  if (int64_t(g.prompt.size()) + g.max_tokens > max_model_len_)
    fail("This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} "
         "for the completion).", max_model_len_, int64_t(g.prompt.size()) + g.max_tokens, g.prompt.size(), g.max_tokens);
  // Throws kestrel::Error for a request the runtime can never serve; nothing is then held. The
  // runtime's callbacks never run under its own lock, and ours is not taken by it, so holding mu_
  // here only makes the callback's erase wait until the id is recorded.
  const runtime::RequestId rid = model_->engine->submit(std::move(g), std::move(cb));
  ids_.emplace(req.id, rid);
  return SubmitResult::kAccepted;
}

void PagedEngine::cancel(uint64_t id) {
  runtime::RequestId rid = 0;
  runtime::Engine* e = nullptr;
  {
    std::lock_guard lk(mu_);
    auto it = ids_.find(id);
    if (it == ids_.end() || !model_) return;  // unknown or finished: a no-op
    rid = it->second;
    e = model_->engine.get();
  }
  e->cancel(rid);  // runtime ids are never reused, so a stale one is a no-op too
}

EngineStats PagedEngine::stats() const {
  runtime::Engine* e = nullptr;
  {
    std::lock_guard lk(mu_);
    if (!model_) return {};
    e = model_->engine.get();
  }
  const runtime::EngineStats s = e->stats();
  EngineStats out;
  out.running = int(s.running);
  out.waiting = int(s.waiting);
  // vLLM's meaning: cached prefix pages nobody holds are reclaimable, so they count as free.
  out.kv_pages_used = s.pages_held;
  out.kv_cache_usage = s.pages_total ? double(s.pages_held) / double(s.pages_total) : 0.0;
  out.prefix_cache_queries = uint64_t(s.prefix_query_tokens);
  out.prefix_cache_hits = uint64_t(s.prefix_hit_tokens);
  return out;
}

void PagedEngine::shutdown() {
  if (loader_.joinable()) loader_.join();
  std::vector<runtime::RequestId> live;
  runtime::Engine* e = nullptr;
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    if (!model_) return;
    e = model_->engine.get();
    for (const auto& [sid, rid] : ids_) live.push_back(rid);
  }
  for (runtime::RequestId rid : live) e->cancel(rid);
  e->wait_idle();  // every request has had its final (kAbort) event
}

}  // namespace kestrel::server
