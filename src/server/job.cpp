// Job: see job.h.
#include "server/job.h"

namespace kestrel::server {
namespace {
double secs(Job::Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

Job::Job(Engine& engine, Metrics& metrics, std::atomic<int>& jobs, ResponseHead head, bool stream)
    : engine_(engine), metrics_(metrics), jobs_(jobs), head_(std::move(head)), stream_(stream), start_(Clock::now()) {}

void Job::start(const std::shared_ptr<Connection>& conn, const Request& request, int n, const tok::Tokenizer& tok,
                bool thinking, const std::vector<std::string>& tools) {
  for (int i = 0; i < n; ++i)
    choices_.emplace_back(head_.api, tok, thinking, tools, request.stop, request.sampling.logprobs >= 0);
  last_token_.assign(size_t(n), start_);
  got_token_.assign(size_t(n), false);
  text_offset_.assign(size_t(n), 0);
  remaining_ = n;
  auto cancel_submitted = [&] {
    ended_ = true;  // their cancelled events, still to come, are for nobody
    for (RequestId id : engine_ids_) engine_.cancel(id);
  };
  for (int i = 0; i < n; ++i) {
    Request r = request;
    r.sampling.seed += uint64_t(i);
    auto self = shared_from_this();
    TokenSink sink = [conn, self, i](TokenEvent&& ev) {
      conn->post([self, i, ev = std::move(ev)]() mutable { self->on_event(size_t(i), std::move(ev)); });
    };
    Submission s;
    try {
      s = engine_.submit(std::move(r), std::move(sink));
    } catch (const RequestError& e) {
      cancel_submitted();
      throw api_error(e, head_.api);
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
  if (stream_) {
    conn->stream_begin();
    if (head_.api == Api::kChat)  // OpenAI opens every choice with the role
      for (int i = 0; i < n; ++i)
        conn->stream_event(dumps(chat_chunk(head_, size_t(i), json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr)));
  }
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
  if (stream_)
    for (const std::string& payload : delta_payloads(head_, i, d, text_offset_[i])) conn_->stream_event(payload);
  if (c.done()) {
    const std::string& reason = c.finish_reason();
    metrics_.on_finished(reason == "tool_calls" ? "stop" : reason, secs(now - start_));
    if (--remaining_ == 0) finish();
  }
}

void Job::finish() {
  ended_ = true;
  jobs_.fetch_sub(1);
  if (stream_) {
    if (head_.include_usage) conn_->stream_event(dumps(usage_chunk(head_, usage_of(choices_))));
    conn_->stream_event("[DONE]");
    conn_->stream_end();
  } else if (!error_.empty()) {
    conn_->reply(500, error_body(500, error_));
  } else {
    conn_->reply(200, dumps(response_body(head_, choices_, usage_of(choices_))));
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
}

}  // namespace kestrel::server
