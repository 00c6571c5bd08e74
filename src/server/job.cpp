// Job: see job.h.
#include "server/job.h"

#include <algorithm>

namespace kestrel::server {
namespace {

double secs(Job::Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class OpenAIShaper : public Shaper {
 public:
  explicit OpenAIShaper(ResponseHead h) : h_(std::move(h)) {}
  void begin(Connection& conn, const std::vector<ChoiceStream>& choices) override {
    offsets_.assign(choices.size(), 0);
    conn.stream_begin();
    if (h_.api == Api::kChat)  // OpenAI opens every choice with the role
      for (size_t i = 0; i < choices.size(); ++i) {
        json c = chat_chunk(h_, i, json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr);
        if (h_.continuous_usage) c["usage"] = usage_json(choices[i].prompt_tokens(), 0, 0, 0);
        conn.stream_event(dumps(c));
      }
  }
  void delta(Connection& conn, size_t i, const std::vector<ChoiceStream>& choices, const ChoiceStream::Delta& d) override {
    for (const std::string& payload : delta_payloads(h_, i, choices[i], d, offsets_[i])) conn.stream_event(payload);
  }
  void end(Connection& conn, const std::vector<ChoiceStream>& choices) override {
    if (h_.include_usage) conn.stream_event(dumps(usage_chunk(h_, usage_of(choices, h_.n))));
    conn.stream_event("[DONE]");
    conn.stream_end();
  }
  void body(Connection& conn, const std::vector<ChoiceStream>& choices) override {
    conn.reply(200, dumps(response_body(h_, choices, usage_of(choices, h_.n))));
  }

 private:
  ResponseHead h_;
  std::vector<size_t> offsets_;  // completions logprobs text offsets, per choice
};

}  // namespace

std::unique_ptr<Shaper> openai_shaper(ResponseHead head) { return std::make_unique<OpenAIShaper>(std::move(head)); }

Job::Job(Engine& engine, Metrics& metrics, std::atomic<int>& jobs, Api api, std::string id,
         std::unique_ptr<Shaper> shaper, bool stream, int n)
    : engine_(engine),
      metrics_(metrics),
      jobs_(jobs),
      api_(api),
      id_(std::move(id)),
      shaper_(std::move(shaper)),
      stream_(stream),
      n_(std::max(n, 1)),
      start_(Clock::now()) {}

void Job::start(const std::shared_ptr<Connection>& conn, std::vector<Request> requests,
                std::vector<ChoiceOptions> options, const tok::Tokenizer& tok) {
  KCHECK(!requests.empty() && requests.size() == options.size(), "job: {} requests, {} option sets", requests.size(),
         options.size());
  const size_t n = requests.size();
  for (size_t i = 0; i < n; ++i) {
    choices_.emplace_back(api_, tok, std::move(options[i]));
    choices_.back().set_prompt_tokens(int(requests[i].prompt.size()));
  }
  last_token_.assign(n, start_);
  got_token_.assign(n, false);
  remaining_ = int(n);
  conn->record().id = id_;
  auto cancel_submitted = [&] {
    ended_ = true;  // their cancelled events, still to come, are for nobody
    for (RequestId id : engine_ids_) engine_.cancel(id);
  };
  for (size_t i = 0; i < n; ++i) {
    auto self = shared_from_this();
    TokenSink sink = [conn, self, i](TokenEvent&& ev) {
      conn->post([self, i, ev = std::move(ev)]() mutable { self->on_event(i, std::move(ev)); });
    };
    Submission s;
    try {
      s = engine_.submit(std::move(requests[i]), std::move(sink));
    } catch (const RequestError& e) {
      cancel_submitted();
      throw api_error(e, api_);
    } catch (const Error& e) {  // a request this engine can never serve
      cancel_submitted();
      throw ApiError(400, e.what());
    }
    if (!s.accepted()) {
      cancel_submitted();
      if (s.status == SubmitStatus::queue_full) throw ApiError(429, "the server is overloaded (request queue full); retry later");
      throw ApiError(503, "the engine is not ready");
    }
    engine_ids_.push_back(s.id);
  }
  conn_ = conn.get();
  jobs_.fetch_add(1);
  conn->hold(shared_from_this());
  if (stream_) shaper_->begin(*conn, choices_);
}

void Job::on_event(size_t i, TokenEvent&& ev) {
  if (ended_) return;  // a finished or abandoned job
  ChoiceStream& c = choices_[i];
  if (c.done()) return;
  const auto now = Clock::now();
  if (ev.prompt_tokens > 0) metrics_.on_prompt_tokens(ev.prompt_tokens);
  if (ev.token >= 0) {
    metrics_.on_generation_tokens(1);
    if (!got_token_[i])
      metrics_.on_ttft(secs(now - start_));
    else
      metrics_.on_itl(secs(now - last_token_[i]));
    got_token_[i] = true;
    last_token_[i] = now;
  }
  ChoiceStream::Delta d = c.on_event(ev);
  if (d.cancel_engine) engine_.cancel(engine_ids_[i]);
  if (!d.error.empty() && error_.empty()) error_ = d.error;
  if (stream_) shaper_->delta(*conn_, i, choices_, d);
  if (c.done()) {
    const std::string& reason = c.finish_reason();
    metrics_.on_finished(reason == "tool_calls" ? "stop" : reason, secs(now - start_));
    if (--remaining_ == 0) finish();
  }
}

void Job::record_usage() {
  AccessRecord& r = conn_->record();
  r.prompt_tokens = r.completion_tokens = 0;
  for (size_t i = 0; i < choices_.size(); ++i) {
    if (i % size_t(n_) == 0) r.prompt_tokens += choices_[i].prompt_tokens();
    r.completion_tokens += choices_[i].completion_tokens();
  }
}

void Job::finish() {
  ended_ = true;
  jobs_.fetch_sub(1);
  record_usage();
  if (stream_) {
    shaper_->end(*conn_, choices_);
  } else if (!error_.empty()) {
    conn_->record().error = error_;
    conn_->reply(500, error_body(500, error_));
  } else {
    shaper_->body(*conn_, choices_);
  }
}

void Job::abandon() {
  if (ended_) return;
  ended_ = true;
  for (size_t i = 0; i < choices_.size(); ++i)
    if (!choices_[i].done()) {
      engine_.cancel(engine_ids_[i]);
      metrics_.on_finished("abort", secs(Clock::now() - start_));
    }
  jobs_.fetch_sub(1);
  if (conn_) record_usage();
}

}  // namespace kestrel::server
