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

std::string error_body(int status, const std::string& message, const std::string& param) {
  json e = {{"message", message}, {"type", error_type(status)}, {"param", nullptr}, {"code", status}};
  if (!param.empty()) e["param"] = param;
  return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
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

std::optional<double> get_number(const ojson& body, const char* name, double lo, double hi, bool lo_open = false) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(name, "must be a number");
  const double x = v->get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
    bad(name, fmt::format("must be in {}{}, {}], got {}", lo_open ? "(" : "[", lo, hi, x));
  return x;
}

std::optional<int64_t> get_int(const ojson& body, const char* name, int64_t lo, int64_t hi) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) bad(name, "must be an integer");
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX)) bad(name, "is out of range");
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) bad(name, fmt::format("must be in [{}, {}], got {}", lo, hi, x));
  return x;
}

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
  auto mt = get_int(body, "max_tokens", 1, INT32_MAX);
  if (api == Api::kChat) {
    if (auto mct = get_int(body, "max_completion_tokens", 1, INT32_MAX)) mt = mct;
  }
  if (mt) g.max_tokens = int(*mt);
  SamplingParams& s = g.sampling;
  s.temperature = float(get_number(body, "temperature", 0.0, 2.0).value_or(1.0));
  s.top_p = float(get_number(body, "top_p", 0.0, 1.0, /*lo_open=*/true).value_or(1.0));
  const int64_t top_k = get_int(body, "top_k", -1, INT32_MAX).value_or(0);
  s.top_k = top_k < 0 ? 0 : int(top_k);  // vLLM: -1 (or 0) = off
  s.min_p = float(get_number(body, "min_p", 0.0, 1.0).value_or(0.0));
  s.presence_penalty = float(get_number(body, "presence_penalty", -2.0, 2.0).value_or(0.0));
  s.frequency_penalty = float(get_number(body, "frequency_penalty", -2.0, 2.0).value_or(0.0));
  s.repetition_penalty = float(get_number(body, "repetition_penalty", 0.0, 10.0, true).value_or(1.0));
  if (auto seed = get_int(body, "seed", INT64_MIN, INT64_MAX)) s.seed = uint64_t(*seed);
  s.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
  if (const ojson* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad("stop_token_ids", "must be an array of token ids");
    for (const auto& x : *ids) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX)
        bad("stop_token_ids", "must be an array of token ids");
      s.stop_token_ids.push_back(int32_t(x.get<int64_t>()));
    }
  }
  if (const ojson* st = field(body, "stop")) {
    if (st->is_string()) {
      g.stop.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      for (const auto& x : *st) {
        if (!x.is_string()) bad("stop", "must be a string or an array of strings");
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "must be a string or an array of strings");
    }
    if (g.stop.size() > 16) bad("stop", "may hold at most 16 strings");
    g.stop.erase(std::remove(g.stop.begin(), g.stop.end(), std::string()), g.stop.end());
  }
  if (api == Api::kChat) {
    g.logprobs = get_bool(body, "logprobs").value_or(false);
    g.top_logprobs = int(get_int(body, "top_logprobs", 0, 20).value_or(0));
    if (g.top_logprobs > 0 && !g.logprobs) bad("top_logprobs", "requires 'logprobs' to be true");
  } else {
    if (auto lp = get_int(body, "logprobs", 0, 20)) {
      g.logprobs = true;
      g.top_logprobs = int(*lp);
    }
  }
  s.logprobs = g.logprobs;
  s.top_logprobs = g.top_logprobs;
  return g;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

std::string StopMatcher::push(const std::string& text) {
  if (matched_) return {};
  if (stops_.empty()) return text;
  held_ += text;
  size_t best = std::string::npos;
  for (const auto& s : stops_) best = std::min(best, held_.find(s));
  if (best != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  // Keep the longest suffix of held_ that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const auto& s : stops_)
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k)
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  if (!matched_) out.swap(held_);
  return out;
}

std::vector<int32_t> stop_token_ids(const tok::Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (const char* t : {"<|end_of_msg|>", "[EOS]", "[EOT]"})
    if (auto id = tok.special_id(t)) ids.push_back(int32_t(*id));
  return ids;
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

ChoiceStream::ChoiceStream(Api api, const tok::Tokenizer& tok, bool thinking, std::vector<std::string> tools,
                           std::vector<std::string> stop, bool logprobs)
    : api_(api), tok_(&tok), stop_(std::move(stop)), logprobs_(logprobs) {
  if (api == Api::kChat)
    parser_.emplace(tok, thinking, std::move(tools));
  else
    decoder_.emplace(tok);
}

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

void ChoiceStream::absorb(const tok::ParseDelta& pd, Delta& d) {
  d.reasoning += pd.reasoning;
  reasoning_ += pd.reasoning;
  if (!pd.content.empty()) {
    std::string c = stop_.push(pd.content);
    d.content += c;
    content_ += c;
  }
  if (stop_.matched()) return;  // nothing after a stop string counts
  for (const auto& tc : pd.tool_calls) {
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
  if (ev.finish == Finish::kError || ev.finish == Finish::kAbort) {
    done_ = true;
    finish_reason_ = ev.finish == Finish::kError ? "error" : "abort";
    d.error = ev.finish == Finish::kError ? (ev.error.empty() ? "engine error" : ev.error) : "request aborted";
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
    if (api_ == Api::kChat) {
      tok::ParseDelta pd = parser_->push(tok::TokenId(ev.token));
      if (!pd.reasoning.empty()) reasoning_tokens_ = completion_tokens_;
      absorb(pd, d);
    } else if (ev.finish != Finish::kStop && size_t(ev.token) < tok_->vocab_size()) {
      std::string c = stop_.push(decoder_->push(tok::TokenId(ev.token)));
      d.content += c;
      content_ += c;
    }
  }
  if (stop_.matched()) {
    done_ = true;
    d.cancel_engine = ev.finish == Finish::kNone;
    finish_reason_ = "stop";
  } else if (ev.finish == Finish::kStop || ev.finish == Finish::kLength) {
    done_ = true;
    const bool length = ev.finish == Finish::kLength;
    if (api_ == Api::kChat) {
      absorb(parser_->finish(length ? tok::FinishCause::kLength : tok::FinishCause::kStop), d);
      finish_reason_ = length ? "length" : parser_->result().finish_reason;
    } else {
      std::string c = stop_.push(decoder_->finish());
      d.content += c;
      content_ += c;
      finish_reason_ = length ? "length" : "stop";
    }
    if (stop_.matched()) {
      finish_reason_ = "stop";
    } else {
      std::string tail = stop_.flush();
      d.content += tail;
      content_ += tail;
    }
  }
  if (done_) d.finish_reason = finish_reason_;
  if (!pending_logprobs_.empty() && (!d.empty() || done_)) {
    d.logprobs = pending_logprobs_;
    pending_logprobs_ = json::array();
  }
  return d;
}

json ChoiceStream::tool_calls_message() const {
  json out = json::array();
  if (!parser_) return out;
  const auto& calls = parser_->result().tool_calls;
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string id = i < call_ids_.size() ? call_ids_[i] : random_id("call_");
    out.push_back({{"id", id},
                   {"type", "function"},
                   {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments.empty() ? "{}" : calls[i].arguments}}}});
  }
  return out;
}

}  // namespace kestrel::server
