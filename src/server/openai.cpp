// OpenAI protocol pieces: see openai.h.
#include "server/openai.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
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

namespace {

[[noreturn]] void bad(const std::string& field, const std::string& msg) { throw ApiError(400, "'" + field + "' " + msg, field); }

const ojson* field(const ojson& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const ojson& body, const char* name) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad(name, "must be a boolean");
  return v->get<bool>();
}

std::optional<float> get_number(const ojson& body, const char* name) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(name, "must be a number");
  return float(v->get<double>());
}

// An integer within [lo, hi]: the bounds of what the field can hold, or a protocol rule.
std::optional<int64_t> get_int(const ojson& body, const char* name, int64_t lo, int64_t hi) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) bad(name, "must be an integer");
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX)) bad(name, "is out of range");
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) bad(name, fmt::format("must be in [{}, {}], got {}", lo, hi, x));
  return x;
}

uint64_t random_seed() { return (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}(); }

}  // namespace

GenParams parse_gen_params(const ojson& body, Api api) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  GenParams g;
  if (const ojson* m = field(body, "model")) {
    if (!m->is_string()) bad("model", "must be a string");
    g.model = m->get<std::string>();
  }
  g.stream = get_bool(body, "stream").value_or(false);
  if (const ojson* so = field(body, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "must be an object");
    if (!g.stream) bad("stream_options", "is only allowed when 'stream' is true");
    g.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  // n copies cost n engine requests; 16 keeps one HTTP request from filling the engine.
  g.n = int(get_int(body, "n", 1, 16).value_or(1));
  auto mt = get_int(body, "max_tokens", INT32_MIN, INT32_MAX);
  if (api == Api::kChat) {
    if (auto mct = get_int(body, "max_completion_tokens", INT32_MIN, INT32_MAX)) mt = mct;
  }
  if (mt) g.max_tokens = int(*mt);
  Request& r = g.request;
  SamplingParams& s = r.sampling;
  s.temperature = get_number(body, "temperature").value_or(1.0f);  // OpenAI's default, not greedy
  s.top_p = get_number(body, "top_p").value_or(1.0f);
  const int64_t top_k = get_int(body, "top_k", INT32_MIN, INT32_MAX).value_or(0);
  s.top_k = top_k == -1 ? 0 : int32_t(top_k);  // vLLM: -1 (or 0) = off
  s.min_p = get_number(body, "min_p").value_or(0.0f);
  s.presence_penalty = get_number(body, "presence_penalty").value_or(0.0f);
  s.frequency_penalty = get_number(body, "frequency_penalty").value_or(0.0f);
  s.repetition_penalty = get_number(body, "repetition_penalty").value_or(1.0f);
  const auto seed = get_int(body, "seed", INT64_MIN, INT64_MAX);
  s.seed = seed ? uint64_t(*seed) : random_seed();
  r.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
  if (const ojson* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad("stop_token_ids", "must be an array of token ids");
    for (const auto& x : *ids) {
      if (!x.is_number_integer() || x.get<int64_t>() < INT32_MIN || x.get<int64_t>() > INT32_MAX)
        bad("stop_token_ids", "must be an array of token ids");
      r.stop_token_ids.push_back(int32_t(x.get<int64_t>()));
    }
  }
  if (const ojson* st = field(body, "stop")) {
    if (st->is_string()) {
      r.stop.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      for (const auto& x : *st) {
        if (!x.is_string()) bad("stop", "must be a string or an array of strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "must be a string or an array of strings");
    }
    r.stop.erase(std::remove(r.stop.begin(), r.stop.end(), std::string()), r.stop.end());
  }
  if (api == Api::kChat) {
    const bool logprobs = get_bool(body, "logprobs").value_or(false);
    const auto top = get_int(body, "top_logprobs", 0, INT32_MAX);
    if (top && *top > 0 && !logprobs) bad("top_logprobs", "requires 'logprobs' to be true");
    s.logprobs = logprobs ? int32_t(top.value_or(0)) : -1;
  } else if (auto lp = get_int(body, "logprobs", 0, INT32_MAX)) {
    s.logprobs = int32_t(*lp);
  }
  return g;
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

ChoiceStream::ChoiceStream(Api api, const tok::Tokenizer& tok, bool thinking, std::vector<std::string> tools,
                           std::vector<std::string> stop, bool logprobs)
    : tok_(&tok),
      text_(api == Api::kChat ? tok::TextStream::chat(tok, thinking, std::move(tools), std::move(stop))
                              : tok::TextStream::plain(tok, std::move(stop))),
      logprobs_(logprobs) {}

std::string ChoiceStream::token_text(int32_t id) const {
  if (id >= 0 && size_t(id) < tok_->vocab_size()) return tok::utf8_sanitize(tok_->token_bytes(tok::TokenId(id)));
  return fmt::format("<|token_{}|>", id);
}

json ChoiceStream::logprob_entry(const TokenEvent& ev) const {
  auto one = [&](int32_t id, float lp) {
    json bytes = json::array();
    if (id >= 0 && size_t(id) < tok_->vocab_size())
      for (unsigned char c : tok_->token_bytes(tok::TokenId(id))) bytes.push_back(int(c));
    return json{{"token", token_text(id)}, {"logprob", lp}, {"bytes", bytes}};
  };
  json e = one(ev.token, ev.logprob);
  json top = json::array();
  for (const auto& t : ev.top_logprobs) top.push_back(one(t.token, t.logprob));
  e["top_logprobs"] = top;
  return e;
}

// Text deltas into the OpenAI delta: tool calls get their ids on their first (named) delta, and
// consecutive argument fragments of one call are merged.
void ChoiceStream::absorb(tok::TextDelta&& td, Delta& d) {
  d.reasoning += td.reasoning;
  d.content += td.content;
  for (const auto& tc : td.tool_calls) {
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

ChoiceStream::Delta ChoiceStream::on_event(const TokenEvent& ev) {
  Delta d;
  if (done_) return d;
  if (ev.prompt_tokens > 0) {
    prompt_tokens_ = ev.prompt_tokens;
    cached_tokens_ = ev.cached_prompt_tokens;
  }
  if (ev.finish == FinishReason::error || ev.finish == FinishReason::cancelled) {
    done_ = true;
    const bool error = ev.finish == FinishReason::error;
    finish_reason_ = error ? "error" : "abort";
    d.error = error ? (ev.error.empty() ? "engine error" : ev.error) : "request aborted";
    d.finish_reason = finish_reason_;
    return d;
  }
  if (ev.token >= 0) {
    ++completion_tokens_;
    if (logprobs_) {
      json e = logprob_entry(ev);
      pending_logprobs_.push_back(e);
      logprobs_all_.push_back(std::move(e));
    }
    if (ev.finish != FinishReason::stop) {  // a stop token is never text
      tok::TextDelta td = text_.push(tok::TokenId(ev.token));
      if (!td.reasoning.empty()) reasoning_tokens_ = completion_tokens_;
      absorb(std::move(td), d);
    }
  }
  if (text_.done()) {  // a stop string matched
    d.cancel_engine = ev.finish == FinishReason::none;
  } else if (ev.finish == FinishReason::stop || ev.finish == FinishReason::length) {
    absorb(text_.finish(ev.finish == FinishReason::length ? tok::FinishCause::kLength : tok::FinishCause::kStop), d);
  }
  if (text_.done()) {
    done_ = true;
    finish_reason_ = text_.finish_reason();
    d.finish_reason = finish_reason_;
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
  for (size_t i = 0; i < calls.size(); ++i) {
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
    o["token_logprobs"].push_back(e["logprob"]);
    json top = json::object();
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

std::vector<std::string> delta_payloads(const ResponseHead& h, size_t i, const ChoiceStream::Delta& d,
                                        size_t& text_offset) {
  std::vector<std::string> out;
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
      out.push_back(dumps(chat_chunk(h, i, delta, nullptr, lp)));
      out.push_back(dumps(chat_chunk(h, i, json::object(), *d.finish_reason, nullptr)));
    } else if (has || d.finish_reason) {
      out.push_back(dumps(chat_chunk(h, i, delta, finish_json(d.finish_reason), lp)));
    }
  } else {
    json lp = d.logprobs.is_null() ? json(nullptr) : completion_logprobs(d.logprobs, text_offset);
    if (!d.content.empty() || d.finish_reason || !lp.is_null())
      out.push_back(dumps(completion_chunk(h, i, d.content, finish_json(d.finish_reason), lp)));
  }
  return out;
}

json usage_of(const std::vector<ChoiceStream>& choices) {
  int completion = 0, reasoning = 0;
  for (const auto& c : choices) {
    completion += c.completion_tokens();
    reasoning += c.reasoning_tokens();
  }
  // The prompt is one prompt, whatever n is (OpenAI counts it once).
  const int prompt = choices.empty() ? 0 : choices[0].prompt_tokens();
  const int cached = choices.empty() ? 0 : choices[0].cached_tokens();
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
