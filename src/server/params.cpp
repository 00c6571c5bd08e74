// Request parameters: see params.h.
#include "server/params.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <random>
#include <set>

namespace kestrel::server {
namespace {

// The fields each endpoint honours. Anything else is refused (params.h).
const std::set<std::string, std::less<>> kCommon = {
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "logit_bias", "min_tokens", "skip_special_tokens", "user", "logprobs",
    "response_format", "complete_within_max_tokens"};  // completions too: one JSON document (server/structured.h)
const std::set<std::string, std::less<>> kChatOnly = {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning_effort", "thinking", "chat_template_kwargs"};
const std::set<std::string, std::less<>> kCompletionOnly = {"prompt", "echo", "best_of", "suffix"};

void check_fields(const ojson& body, Api api) {
  const auto& only = api == Api::kChat ? kChatOnly : kCompletionOnly;
  for (const auto& [k, v] : body.items()) {
    // null means absent (docs/api.md), as in the Responses API: a client that sends every field it knows,
    // unset ones as null, asks for nothing kestrel would ignore.
    if (kCommon.count(k) || only.count(k) || v.is_null()) continue;
    const bool other = (api == Api::kChat ? kCompletionOnly : kChatOnly).count(k) > 0;
    throw ApiError(400, fmt::format("unsupported parameter '{}'{}", k,
                                    other ? (api == Api::kChat ? " in chat completions" : " in completions")
                                          : ": kestrel does not implement it (docs/api.md lists what it does)"),
                   k);
  }
}

const ojson* field(const ojson& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const ojson& body, const char* name) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad_field(name, "must be a boolean");
  return v->get<bool>();
}

std::optional<float> get_number(const ojson& body, const char* name) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad_field(name, "must be a number");
  return float(v->get<double>());
}

// An integer within [lo, hi]: the bounds of what the field can hold, or a protocol rule. `shown`: the
// field's name in errors when the client spelled it otherwise (a Responses field renamed for chat).
std::optional<int64_t> get_int(const ojson& body, const char* name, int64_t lo, int64_t hi, const std::string& shown = {}) {
  const ojson* v = field(body, name);
  if (!v) return std::nullopt;
  const std::string& who = shown.empty() ? std::string(name) : shown;
  if (!v->is_number_integer()) bad_field(who, "must be an integer");
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX)) bad_field(who, "is out of range");
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) bad_field(who, fmt::format("must be in [{}, {}], got {}", lo, hi, x));
  return x;
}

uint64_t random_seed() { return (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}(); }

// OpenAI's logit_bias: {"token id": bias}. Ids and ranges are validate()'s; here only the shape.
std::vector<std::pair<int32_t, float>> parse_logit_bias(const ojson& v) {
  if (!v.is_object()) bad_field("logit_bias", "must be an object mapping token ids to numbers, e.g. {\"1234\": -100}");
  std::vector<std::pair<int32_t, float>> out;
  for (const auto& [k, b] : v.items()) {
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(k, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != k.size() || id < INT32_MIN || id > INT32_MAX)
      bad_field("logit_bias", fmt::format("keys must be token ids, got \"{}\"", k));
    if (!b.is_number()) bad_field("logit_bias", fmt::format("values must be numbers, got {} for token {}", b.dump(), k));
    out.push_back({int32_t(id), float(b.get<double>())});
  }
  return out;
}

}  // namespace

void map_reasoning_effort(ojson& body) {
  auto it = body.find("reasoning_effort");
  if (it == body.end() || !it->is_string()) return;
  const std::string e = it->get<std::string>();
  if (e == "minimal") *it = "low";
  else if (e == "xhigh") *it = "max";
}

GenParams parse_gen_params(const ojson& body, Api api, const std::string& completion_tokens_field) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  check_fields(body, api);
  GenParams g;
  if (auto m = body.find("model"); m != body.end()) {
    if (!m->is_string()) bad_field("model", "must be a string");
    g.model = m->get<std::string>();
  }
  if (const ojson* u = field(body, "user"); u && !u->is_string()) bad_field("user", "must be a string");
  g.stream = get_bool(body, "stream").value_or(false);
  if (const ojson* so = field(body, "stream_options")) {
    if (!so->is_object()) bad_field("stream_options", "must be an object");
    if (!g.stream) bad_field("stream_options", "is only allowed when 'stream' is true");
    for (const auto& [k, v] : so->items())
      if (k != "include_usage" && k != "continuous_usage_stats")
        bad_field("stream_options", fmt::format("has an unsupported key '{}'", k));
    g.include_usage = get_bool(*so, "include_usage").value_or(false);
    g.continuous_usage = get_bool(*so, "continuous_usage_stats").value_or(false);
  }
  // n copies cost n engine requests; 16 keeps one HTTP request from filling the engine.
  g.n = int(get_int(body, "n", 1, 16).value_or(1));
  // The budget and the name the client gave it, which every later error about it uses
  // (Request::max_tokens_field): max_completion_tokens wins over max_tokens in chat.
  Request& r = g.request;
  // The Responses API has no other budget field: its name stands even when the field is absent (the
  // rest of the context then; a prompt too long for it is refused naming the budget).
  if (completion_tokens_field != "max_completion_tokens") r.max_tokens_field = completion_tokens_field;
  auto mt = get_int(body, "max_tokens", INT32_MIN, INT32_MAX);
  if (api == Api::kChat) {
    if (auto mct = get_int(body, "max_completion_tokens", INT32_MIN, INT32_MAX, completion_tokens_field)) {
      mt = mct;
      r.max_tokens_field = completion_tokens_field;
    }
  }
  if (mt) {
    if (*mt < 0) bad_field(r.max_tokens_field, fmt::format("must be >= 0, got {}", *mt));
    g.max_tokens = int(*mt);
  }
  SamplingParams& s = r.sampling;
  s.temperature = get_number(body, "temperature").value_or(1.0f);  // OpenAI's default, not greedy
  s.top_p = get_number(body, "top_p").value_or(1.0f);
  const int64_t top_k = get_int(body, "top_k", INT32_MIN, INT32_MAX).value_or(0);
  s.top_k = top_k == -1 ? 0 : int32_t(top_k);  // vLLM: -1 (or 0) = off
  s.min_p = get_number(body, "min_p").value_or(0.0f);
  s.presence_penalty = get_number(body, "presence_penalty").value_or(0.0f);
  s.frequency_penalty = get_number(body, "frequency_penalty").value_or(0.0f);
  s.repetition_penalty = get_number(body, "repetition_penalty").value_or(1.0f);
  s.min_tokens = int32_t(get_int(body, "min_tokens", 0, INT32_MAX).value_or(0));
  if (s.min_tokens > 0 && g.max_tokens && *g.max_tokens == 0) bad_field("min_tokens", fmt::format("needs {} > 0", r.max_tokens_field));
  if (const ojson* lb = field(body, "logit_bias")) s.logit_bias = parse_logit_bias(*lb);
  const auto seed = get_int(body, "seed", INT64_MIN, INT64_MAX);
  s.seed = seed ? uint64_t(*seed) : random_seed();
  r.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
  g.keep_special = !get_bool(body, "skip_special_tokens").value_or(true);
  if (const ojson* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad_field("stop_token_ids", "must be an array of token ids");
    for (const auto& x : *ids) {
      if (!x.is_number_integer() || x.get<int64_t>() < INT32_MIN || x.get<int64_t>() > INT32_MAX)
        bad_field("stop_token_ids", "must be an array of token ids");
      r.stop_token_ids.push_back(int32_t(x.get<int64_t>()));
    }
  }
  if (const ojson* st = field(body, "stop")) {
    if (st->is_string()) {
      r.stop.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      for (const auto& x : *st) {
        if (!x.is_string()) bad_field("stop", "must be a string or an array of strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      bad_field("stop", "must be a string or an array of strings");
    }
    r.stop.erase(std::remove(r.stop.begin(), r.stop.end(), std::string()), r.stop.end());
  }
  if (api == Api::kChat) {
    const bool logprobs = get_bool(body, "logprobs").value_or(false);
    const auto top = get_int(body, "top_logprobs", 0, INT32_MAX);
    if (top && *top > 0 && !logprobs) bad_field("top_logprobs", "requires 'logprobs' to be true");
    s.logprobs = logprobs ? int32_t(top.value_or(0)) : -1;
    g.parallel_tool_calls = get_bool(body, "parallel_tool_calls").value_or(true);
  } else {
    if (auto lp = get_int(body, "logprobs", 0, INT32_MAX)) s.logprobs = int32_t(*lp);
    g.echo = get_bool(body, "echo").value_or(false);
    // The prompt's own logprobs come with its echo (lm-evaluation-harness's loglikelihood).
    if (g.echo && s.logprobs >= 0) s.prompt_logprobs = s.logprobs;
    if (const ojson* sfx = field(body, "suffix"); sfx && !(sfx->is_string() && sfx->get<std::string>().empty()))
      bad_field("suffix", "is not supported (no fill-in-the-middle)");
    if (auto bo = get_int(body, "best_of", 1, 16); bo && *bo != g.n)
      bad_field("best_of", fmt::format("must equal n ({}): kestrel returns every sequence it generates, got {}", g.n, *bo));
  }
  return g;
}

}  // namespace kestrel::server
