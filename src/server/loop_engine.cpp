// LoopEngine: see loop_engine.h.
#include "server/loop_engine.h"

#include <algorithm>
#include <unordered_map>

#include "core/check.h"
#include "runtime/sampler.h"
#include "server/paged_engine.h"

namespace kestrel::server {

struct LoopEngine::Seq {
  EngineRequest req;
  TokenSink sink;
  std::unique_ptr<Backend::SeqState> state;
  runtime::SamplingParams sampling;  // the request's knobs in the one sampler's terms
  std::vector<int32_t> output;
  int64_t positions = 0;  // tokens fed to the model
  int generated = 0;
  int32_t last = -1;
};

LoopEngine::LoopEngine(std::unique_ptr<Backend> backend, LoopEngineOptions opt)
    : backend_(std::move(backend)), opt_(opt) {
  KCHECK(opt_.max_num_seqs >= 1 && opt_.max_queue >= 0 && opt_.block_size >= 1, "bad engine options");
  thread_ = std::thread([this] { run(); });
}

LoopEngine::~LoopEngine() { shutdown(); }

bool LoopEngine::ready() const {
  std::lock_guard lk(mu_);
  return loaded_ && load_error_.empty() && !stopping_;
}
int64_t LoopEngine::max_model_len() const {
  std::lock_guard lk(mu_);
  return max_model_len_;
}
int64_t LoopEngine::vocab_size() const {
  std::lock_guard lk(mu_);
  return vocab_;
}
std::string LoopEngine::load_error() const {
  std::lock_guard lk(mu_);
  return load_error_;
}
bool LoopEngine::wait_loaded() const {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return loaded_ || stopping_; });
  return loaded_ && load_error_.empty();
}

SubmitResult LoopEngine::submit(EngineRequest req, TokenSink sink) {
  auto s = std::make_unique<Seq>();
  s->req = std::move(req);
  s->sink = std::move(sink);
  std::lock_guard lk(mu_);
  if (!loaded_ || !load_error_.empty() || stopping_) return SubmitResult::kNotReady;
  if (int(waiting_.size()) >= opt_.max_queue) return SubmitResult::kQueueFull;
  waiting_.push_back(std::move(s));
  stats_.waiting = int(waiting_.size());
  cv_.notify_all();
  return SubmitResult::kAccepted;
}

void LoopEngine::cancel(uint64_t id) {
  std::lock_guard lk(mu_);
  if (stopping_) return;
  cancelled_.insert(id);
  cv_.notify_all();
}

EngineStats LoopEngine::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

void LoopEngine::shutdown() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void LoopEngine::publish(const std::vector<std::unique_ptr<Seq>>& running) {
  int64_t pages = 0;
  for (auto& s : running) pages += pages_of(s->positions);
  stats_.running = int(running.size());
  stats_.waiting = int(waiting_.size());
  stats_.kv_pages_used = pages;
  stats_.kv_cache_usage = double(pages) / double(total_pages_);
}

int64_t LoopEngine::pages_of(int64_t positions) const { return (positions + opt_.block_size - 1) / opt_.block_size; }

void LoopEngine::run() {
  try {
    backend_->load();
    const int64_t ctx = backend_->context_len();
    if (opt_.max_model_len > ctx) fail("--max-model-len {} exceeds the model's context length {}", opt_.max_model_len, ctx);
    std::lock_guard lk(mu_);
    vocab_ = backend_->vocab_size();
    max_model_len_ = opt_.max_model_len > 0 ? opt_.max_model_len : ctx;
    total_pages_ = std::max<int64_t>(1, opt_.max_num_seqs * pages_of(max_model_len_));
    loaded_ = true;
  } catch (const std::exception& e) {
    std::lock_guard lk(mu_);
    load_error_ = e.what();
    loaded_ = true;
  }
  cv_.notify_all();
  if (!load_error().empty()) return;

  std::vector<std::unique_ptr<Seq>> running;
  std::vector<std::unique_ptr<Seq>> aborted;
  std::vector<float> logits(static_cast<size_t>(vocab_));
  for (;;) {
    bool stop = false;
    {
      std::unique_lock lk(mu_);
      if (running.empty()) cv_.wait(lk, [&] { return stopping_ || !waiting_.empty() || !cancelled_.empty(); });
      stop = stopping_;
      if (!cancelled_.empty() || stop) {
        auto hit = [&](const std::unique_ptr<Seq>& s) { return stop || cancelled_.count(s->req.id) > 0; };
        for (auto* q : {&waiting_}) {
          for (auto& s : *q)
            if (hit(s)) aborted.push_back(std::move(s));
          q->erase(std::remove(q->begin(), q->end(), nullptr), q->end());
        }
        for (auto& s : running)
          if (hit(s)) aborted.push_back(std::move(s));
        running.erase(std::remove(running.begin(), running.end(), nullptr), running.end());
        cancelled_.clear();  // ids not found had already finished
      }
      while (!stop && int(running.size()) < opt_.max_num_seqs && !waiting_.empty()) {
        running.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
      publish(running);
    }
    for (auto& s : aborted) {
      TokenEvent ev;
      ev.finish = Finish::kAbort;
      ev.prompt_tokens = int32_t(s->req.prompt.size());
      s->sink(std::move(ev));
    }
    aborted.clear();  // frees the model state of every aborted request here, at once
    if (stop) break;

    for (auto& s : running) {
      step(*s, logits);
      if (!s->sink) s.reset();  // finished: its terminal event has been sent
    }
    running.erase(std::remove(running.begin(), running.end(), nullptr), running.end());
    {
      std::lock_guard lk(mu_);  // finished requests' pages are free as of now, not as of the next round
      publish(running);
    }
    backend_->end_of_round();
  }
  std::lock_guard lk(mu_);
  stats_ = EngineStats{};
}

void LoopEngine::step(Seq& s, std::vector<float>& logits) {
  const SamplingParams& p = s.req.sampling;
  TokenEvent ev;
  try {
    if (!s.state) {
      const auto& prompt = s.req.prompt;
      if (prompt.empty()) fail("empty prompt");
      if (int64_t(prompt.size()) >= max_model_len_)
        fail("prompt of {} tokens does not fit the context of {}", prompt.size(), max_model_len_);
      for (int32_t t : prompt)
        if (t < 0 || t >= vocab_) fail("prompt token {} is outside the vocabulary", t);
      s.sampling = runtime_sampling(p);
      s.state = backend_->new_state();
      backend_->prefill(*s.state, prompt, logits.data());
      s.positions = int64_t(prompt.size());
      ev.prompt_tokens = int32_t(prompt.size());
      {
        std::lock_guard lk(mu_);
        stats_.prefix_cache_queries += prompt.size();
      }
    } else {
      backend_->decode(*s.state, s.last, logits.data());
      ++s.positions;
    }
    runtime::SampleResult r = runtime::sample_token(s.sampling, logits, s.req.prompt, s.output, s.output.size());
    const int32_t tok = r.token;
    ev.token = tok;
    ev.logprob = r.logprob;
    for (const runtime::TokenLogprob& t : r.top) ev.top_logprobs.push_back({t.token, t.logprob});
    s.last = tok;
    ++s.generated;
    s.output.push_back(tok);
    const bool stop_tok = !p.ignore_eos && std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), tok) != p.stop_token_ids.end();
    if (stop_tok)
      ev.finish = Finish::kStop;
    else if (s.generated >= p.max_tokens || s.positions + 1 >= max_model_len_)
      ev.finish = Finish::kLength;
  } catch (const std::exception& e) {
    ev = TokenEvent{};
    ev.finish = Finish::kError;
    ev.error = e.what();
  }
  const bool done = ev.finish != Finish::kNone;
  s.sink(std::move(ev));
  if (done) s.sink = nullptr;
}

}  // namespace kestrel::server
