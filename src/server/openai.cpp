// OpenAI protocol pieces: see openai.h.
#include "server/openai.h"

#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "tokenizer/utf8.h"

namespace kestrel::server {

std::string error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

std::string dumps(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body(int status, const std::string& message, const std::string& param) {
  json e = {{"message", message}, {"type", error_type(status)}, {"param", nullptr}, {"code", status}};
  if (!param.empty()) e["param"] = param;
  return dumps(json{{"error", e}});
}

ApiError api_error(const RequestError& e, Api api) {
  std::string param = e.field;
  if (api == Api::kChat && param == "prompt") param = "messages";
  if (api == Api::kChat && param == "logprobs") param = "top_logprobs";
  return ApiError(400, e.what(), param);
}

std::string random_id(const std::string& prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{}{:016x}{:08x}", prefix, rng(), uint32_t(rng()));
}

json usage_json(int prompt, int completion, int reasoning, int cached) {
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}},
          {"completion_tokens_details", {{"reasoning_tokens", reasoning}}}};
}

// ---- one choice ------------------------------------------------------------------------------

ChoiceStream::ChoiceStream(Api api, const tok::Tokenizer& tok, ChoiceOptions o)
    : tok_(&tok),
      text_(api == Api::kChat ? tok::TextStream::chat(tok, o.thinking, std::move(o.tools), std::move(o.stop), o.keep_special)
                              : tok::TextStream::plain(tok, std::move(o.stop), o.keep_special)),
      logprobs_(o.logprobs),
      single_tool_call_(o.single_tool_call),
      discard_(o.discard_output),
      echo_(std::move(o.echo)),
      echo_ids_(std::move(o.echo_ids)) {}

std::string ChoiceStream::token_text(int32_t id) const {
  if (id >= 0 && size_t(id) < tok_->vocab_size()) return tok::utf8_sanitize(tok_->token_bytes(tok::TokenId(id)));
  return fmt::format("<|token_{}|>", id);
}

json ChoiceStream::logprob_entry(int32_t token, float logprob, const std::vector<TokenLogprob>& top_lp) const {
  auto one = [&](int32_t id, float lp) {
    json bytes = json::array();
    if (id >= 0 && size_t(id) < tok_->vocab_size())
      for (unsigned char c : tok_->token_bytes(tok::TokenId(id))) bytes.push_back(int(c));
    return json{{"token", token_text(id)}, {"logprob", lp}, {"bytes", bytes}};
  };
  json e = one(token, logprob);
  json top = json::array();
  for (const auto& t : top_lp) top.push_back(one(t.token, t.logprob));
  e["top_logprobs"] = top;
  return e;
}

// Text deltas into the OpenAI delta: tool calls get their ids on their first (named) delta, and
// consecutive argument fragments of one call are merged.
void ChoiceStream::absorb(tok::TextDelta&& td, Delta& d) {
  d.reasoning += td.reasoning;
  d.content += td.content;
  for (const auto& tc : td.tool_calls) {
    if (single_tool_call_ && tc.index > 0) continue;  // on_event ends the answer there
    if (!d.tool_calls.empty() && d.tool_calls.back()["index"] == tc.index && !tc.name) {
      d.tool_calls.back()["function"]["arguments"] =
          d.tool_calls.back()["function"]["arguments"].get<std::string>() + tc.arguments;
      continue;
    }
    json e = {{"index", tc.index}, {"function", {{"arguments", tc.arguments}}}};
    if (tc.name) {
      while (call_ids_.size() <= tc.index) call_ids_.push_back(random_id("call_"));
      e["id"] = call_ids_[tc.index];
      e["type"] = "function";
      e["function"]["name"] = *tc.name;
    }
    d.tool_calls.push_back(std::move(e));
  }
}

void ChoiceStream::end(const std::string& reason, Delta& d) {
  done_ = true;
  finish_reason_ = reason;
  d.finish_reason = reason;
}

ChoiceStream::Delta ChoiceStream::on_event(const TokenEvent& ev) {
  Delta d;
  if (done_) return d;
  if (!started_) {
    started_ = true;
    prompt_tokens_ = ev.prompt_tokens;
    cached_tokens_ = ev.cached_prompt_tokens;
    // Echo: the prompt's text first, with its logprobs (the first token has none: no context).
    d.content = echo_;
    if (logprobs_ && !echo_ids_.empty()) {
      json first = {{"token", token_text(echo_ids_[0])}, {"logprob", nullptr}, {"bytes", json::array()},
                    {"top_logprobs", nullptr}};
      pending_logprobs_.push_back(first);
      logprobs_all_.push_back(std::move(first));
      for (const PromptLogprob& p : ev.prompt_logprobs) {
        json e = logprob_entry(p.token, p.logprob, p.top);
        pending_logprobs_.push_back(e);
        logprobs_all_.push_back(std::move(e));
      }
    }
  }
  if (ev.finish == FinishReason::error || ev.finish == FinishReason::cancelled) {
    const bool error = ev.finish == FinishReason::error;
    d.error = error ? (ev.error.empty() ? "engine error" : ev.error) : "request aborted";
    end(error ? "error" : "abort", d);
    return d;
  }
  if (discard_) {  // max_tokens 0: the one engine token is not output
    if (ev.finish != FinishReason::none) end("length", d);
    else d.cancel_engine = true;
  } else if (ev.token >= 0) {
    ++completion_tokens_;
    if (logprobs_) {
      json e = logprob_entry(ev.token, ev.logprob, ev.top_logprobs);
      pending_logprobs_.push_back(e);
      logprobs_all_.push_back(std::move(e));
    }
    if (ev.finish != FinishReason::stop) {  // a stop token is never text
      tok::TextDelta td = text_.push(tok::TokenId(ev.token));
      if (!td.reasoning.empty()) reasoning_tokens_ = completion_tokens_;
      const bool second_call = single_tool_call_ && std::any_of(td.tool_calls.begin(), td.tool_calls.end(),
                                                                 [](const tok::ToolCallDelta& c) { return c.index > 0; });
      absorb(std::move(td), d);
      if (second_call) {  // parallel_tool_calls = false: the answer is the first call
        d.cancel_engine = ev.finish == FinishReason::none;
        end("tool_calls", d);
      }
    }
  }
  if (!done_) {
    if (text_.done()) {  // a stop string matched
      d.cancel_engine = ev.finish == FinishReason::none;
    } else if (ev.finish == FinishReason::stop || ev.finish == FinishReason::length) {
      absorb(text_.finish(ev.finish == FinishReason::length ? tok::FinishCause::kLength : tok::FinishCause::kStop), d);
    }
    if (text_.done()) end(text_.finish_reason(), d);
  }
  if (!pending_logprobs_.empty() && (!d.empty() || done_)) {
    d.logprobs = pending_logprobs_;
    pending_logprobs_ = json::array();
  }
  return d;
}

json ChoiceStream::tool_calls_message() const {
  json out = json::array();
  const auto& calls = text_.tool_calls();
  for (size_t i = 0; i < calls.size() && !(single_tool_call_ && i > 0); ++i) {
    const std::string id = i < call_ids_.size() ? call_ids_[i] : random_id("call_");
    out.push_back({{"id", id},
                   {"type", "function"},
                   {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments.empty() ? "{}" : calls[i].arguments}}}});
  }
  return out;
}

// ---- chunks and bodies -----------------------------------------------------------------------

namespace {

// Completions-API logprobs from chat-style entries.
json completion_logprobs(const json& entries, size_t& offset) {
  json o = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
            {"text_offset", json::array()}};
  for (const auto& e : entries) {
    o["tokens"].push_back(e["token"]);
    o["token_logprobs"].push_back(e["logprob"]);  // null for an echoed prompt's first token
    json top = e["top_logprobs"].is_null() ? json(nullptr) : json::object();
    if (!top.is_null())
      for (const auto& t : e["top_logprobs"]) top[t["token"].get<std::string>()] = t["logprob"];
    o["top_logprobs"].push_back(top);
    o["text_offset"].push_back(offset);
    offset += e["token"].get<std::string>().size();
  }
  return o;
}

const char* object_of(const ResponseHead& h, bool chunk) {
  if (h.api == Api::kCompletion) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}

json head_json(const ResponseHead& h, bool chunk) {
  return {{"id", h.id}, {"object", object_of(h, chunk)}, {"created", h.created}, {"model", h.model},
          {"system_fingerprint", nullptr}};
}

json finish_json(const std::optional<std::string>& f) { return f ? json(*f) : json(nullptr); }

}  // namespace

json chat_chunk(const ResponseHead& h, size_t index, json delta, json finish, json logprobs) {
  json c = head_json(h, true);
  c["choices"] = json::array({json{{"index", index}, {"delta", std::move(delta)}, {"logprobs", std::move(logprobs)},
                                   {"finish_reason", std::move(finish)}}});
  if (h.include_usage) c["usage"] = nullptr;
  return c;
}

json completion_chunk(const ResponseHead& h, size_t index, const std::string& text, json finish, json logprobs) {
  json c = head_json(h, true);
  c["choices"] = json::array({json{{"index", index}, {"text", text}, {"logprobs", std::move(logprobs)},
                                   {"finish_reason", std::move(finish)}}});
  if (h.include_usage) c["usage"] = nullptr;
  return c;
}

std::vector<std::string> delta_payloads(const ResponseHead& h, size_t i, const ChoiceStream& c,
                                        const ChoiceStream::Delta& d, size_t& text_offset) {
  std::vector<std::string> out;
  // vLLM's continuous_usage_stats: every chunk says how many tokens its choice has produced so far.
  auto with_usage = [&](json chunk) {
    if (h.continuous_usage)
      chunk["usage"] = usage_json(c.prompt_tokens(), c.completion_tokens(), c.reasoning_tokens(), c.cached_tokens());
    return dumps(chunk);
  };
  if (!d.error.empty()) {
    out.push_back(error_body(500, d.error));
  } else if (h.api == Api::kChat) {
    json delta = json::object();
    if (!d.reasoning.empty()) delta["reasoning_content"] = delta["reasoning"] = d.reasoning;
    if (!d.content.empty()) delta["content"] = d.content;
    if (!d.tool_calls.empty()) delta["tool_calls"] = d.tool_calls;
    json lp = d.logprobs.is_null() ? json(nullptr) : json{{"content", d.logprobs}};
    const bool has = !delta.empty() || !lp.is_null();
    if (has && d.finish_reason) {  // content and finish in separate chunks, as OpenAI sends them
      out.push_back(with_usage(chat_chunk(h, i, delta, nullptr, lp)));
      out.push_back(with_usage(chat_chunk(h, i, json::object(), *d.finish_reason, nullptr)));
    } else if (has || d.finish_reason) {
      out.push_back(with_usage(chat_chunk(h, i, delta, finish_json(d.finish_reason), lp)));
    }
  } else {
    json lp = d.logprobs.is_null() ? json(nullptr) : completion_logprobs(d.logprobs, text_offset);
    if (!d.content.empty() || d.finish_reason || !lp.is_null())
      out.push_back(with_usage(completion_chunk(h, i, d.content, finish_json(d.finish_reason), lp)));
  }
  return out;
}

json usage_of(const std::vector<ChoiceStream>& choices, int n) {
  int prompt = 0, cached = 0, completion = 0, reasoning = 0;
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceStream& c = choices[i];
    completion += c.completion_tokens();
    reasoning += c.reasoning_tokens();
    if (i % size_t(std::max(n, 1)) == 0) prompt += c.prompt_tokens(), cached += c.cached_tokens();
  }
  return usage_json(prompt, completion, reasoning, cached);
}

json usage_chunk(const ResponseHead& h, const json& usage) {
  json u = head_json(h, true);
  u["choices"] = json::array();
  u["usage"] = usage;
  return u;
}

json response_body(const ResponseHead& h, const std::vector<ChoiceStream>& choices, const json& usage) {
  json out = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceStream& c = choices[i];
    if (h.api == Api::kChat) {
      const json calls = c.tool_calls_message();
      json msg = {{"role", "assistant"},
                  {"content", c.content().empty() && !calls.empty() ? json(nullptr) : json(c.content())},
                  {"reasoning_content", c.reasoning().empty() ? json(nullptr) : json(c.reasoning())}};
      msg["reasoning"] = msg["reasoning_content"];
      msg["tool_calls"] = calls;
      json lp = c.logprobs_all().empty() ? json(nullptr) : json{{"content", c.logprobs_all()}};
      out.push_back({{"index", i}, {"message", msg}, {"logprobs", lp}, {"finish_reason", c.finish_reason()}});
    } else {
      size_t off = 0;
      json lp = c.logprobs_all().empty() ? json(nullptr) : completion_logprobs(c.logprobs_all(), off);
      out.push_back({{"index", i}, {"text", c.content()}, {"logprobs", lp}, {"finish_reason", c.finish_reason()}});
    }
  }
  json r = head_json(h, false);
  r["choices"] = out;
  r["usage"] = usage;
  return r;
}

}  // namespace kestrel::server
