// validate() and names: see request.h.
#include "request/request.h"

#include <fmt/format.h>

#include <algorithm>

namespace kestrel {
namespace {

[[noreturn]] void bad(const std::string& field, const std::string& msg) { throw RequestError(field, msg); }

// lo_open: the range excludes lo. NaN is never in range.
void range(const char* field, float x, double lo, double hi, bool lo_open = false) {
  if (!(lo_open ? double(x) > lo : double(x) >= lo) || !(double(x) <= hi))
    bad(field, fmt::format("'{}' must be in {}{}, {}], got {}", field, lo_open ? "(" : "[", lo, hi, x));
}

void validate_constraint(const OutputConstraint& c) {
  using F = OutputConstraint::Format;
  using TC = OutputConstraint::ToolChoice;
  if (c.format == F::json_schema && c.schema.empty()) bad("response_format", "response_format json_schema needs a schema");
  if (c.format != F::json_schema && !c.schema.empty())
    bad("response_format", "a schema is given but the response format is not json_schema");
  for (size_t i = 0; i < c.tools.size(); ++i) {
    if (c.tools[i].name.empty()) bad("tools", fmt::format("tools[{}] has an empty function name", i));
    for (size_t j = 0; j < i; ++j)
      if (c.tools[j].name == c.tools[i].name)
        bad("tools", fmt::format("tools[{}] and tools[{}] are both named '{}'", j, i, c.tools[i].name));
  }
  if ((c.tool_choice == TC::required || c.tool_choice == TC::named) && c.tools.empty())
    bad("tool_choice", "tool_choice 'required' or a named function needs at least one tool");
  if (c.tool_choice == TC::named &&
      std::none_of(c.tools.begin(), c.tools.end(), [&](const ToolDecl& t) { return t.name == c.named_tool; }))
    bad("tool_choice", fmt::format("tool_choice names '{}', which is not among the declared tools", c.named_tool));
  if (c.tool_choice != TC::named && !c.named_tool.empty()) bad("tool_choice", "a tool is named but tool_choice is not a function");
  if (c.max_calls < 1) bad("tools", "max_calls must be >= 1");
  if (!c.chat) {
    if (c.format == F::text) bad("response_format", "a document constraint needs response_format json_object or json_schema");
    if (!c.tools.empty() || c.tool_choice != TC::automatic) bad("tools", "tools need the chat format (/v1/chat/completions)");
  }
  if (!c.grammar) bad("response_format", "the output constraint was not compiled");
}

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::none: return "none";
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::cancelled: return "cancelled";
    case FinishReason::error: return "error";
  }
  return "?";
}

void validate(const Request& r, const RequestLimits& limits) {
  KCHECK(limits.vocab_size > 0 && limits.max_model_len > 0, "request limits not set");
  const SamplingParams& s = r.sampling;
  range("temperature", s.temperature, 0.0, 2.0);
  range("top_p", s.top_p, 0.0, 1.0, /*lo_open=*/true);
  if (s.top_k < 0) bad("top_k", fmt::format("'top_k' must be >= 0 (0 = off), got {}", s.top_k));
  range("min_p", s.min_p, 0.0, 1.0);
  range("repetition_penalty", s.repetition_penalty, 0.0, 10.0, /*lo_open=*/true);
  range("presence_penalty", s.presence_penalty, -2.0, 2.0);
  range("frequency_penalty", s.frequency_penalty, -2.0, 2.0);
  if (s.logprobs > 20) bad("logprobs", fmt::format("'logprobs' may ask for at most 20 alternatives, got {}", s.logprobs));
  if (s.prompt_logprobs > 20)
    bad("prompt_logprobs", fmt::format("'prompt_logprobs' may ask for at most 20 alternatives, got {}", s.prompt_logprobs));
  const std::string& mt = r.max_tokens_field;
  if (r.max_tokens < 1) bad(mt, fmt::format("'{}' must be >= 1, got {}", mt, r.max_tokens));
  if (s.min_tokens < 0 || s.min_tokens > r.max_tokens)
    bad("min_tokens", fmt::format("'min_tokens' must be in [0, {} = {}], got {}", mt, r.max_tokens, s.min_tokens));
  if (s.logit_bias.size() > 4096)
    bad("logit_bias", fmt::format("'logit_bias' may hold at most 4096 entries, got {}", s.logit_bias.size()));
  std::vector<int32_t> biased;
  for (const auto& [t, b] : s.logit_bias) {
    if (t < 0 || t >= limits.vocab_size)
      bad("logit_bias", fmt::format("'logit_bias' token {} is outside the vocabulary [0, {})", t, limits.vocab_size));
    if (!(b >= -100.0f && b <= 100.0f))
      bad("logit_bias", fmt::format("'logit_bias' values must be in [-100, 100], got {} for token {}", b, t));
    biased.push_back(t);
  }
  std::sort(biased.begin(), biased.end());
  if (auto d = std::adjacent_find(biased.begin(), biased.end()); d != biased.end())
    bad("logit_bias", fmt::format("'logit_bias' names token {} twice", *d));

  if (r.prompt.empty()) bad("prompt", "the prompt is empty");
  for (int32_t t : r.prompt)
    if (t < 0 || t >= limits.vocab_size)
      bad("prompt", fmt::format("prompt token {} is outside the vocabulary [0, {})", t, limits.vocab_size));
  const int64_t P = int64_t(r.prompt.size()), mml = limits.max_model_len;
  if (P >= mml)
    bad("prompt", fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} tokens. "
                              "Please reduce the length of the input.{}", mml, P, limits.context_note));
  if (P + r.max_tokens > mml)
    bad(mt, fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                        "({} in the prompt, {} for the completion). Please reduce the length of the input "
                        "or of {}.{}", mml, P + r.max_tokens, P, r.max_tokens, mt, limits.context_note));

  for (int32_t t : r.stop_token_ids)
    if (t < 0 || t >= limits.vocab_size)
      bad("stop_token_ids", fmt::format("stop token id {} is outside the vocabulary [0, {})", t, limits.vocab_size));
  if (r.stop.size() > 16) bad("stop", fmt::format("'stop' may hold at most 16 strings, got {}", r.stop.size()));
  for (const std::string& st : r.stop)
    if (st.empty()) bad("stop", "stop strings must not be empty");
  for (const MediaSpan& m : r.media)
    if (m.start < 0 || m.end <= m.start || m.end > P)
      bad("media", fmt::format("media span [{}, {}) outside the {}-token prompt", m.start, m.end, P));
  // Images, when given, match the media spans one to one: image i fills span i's positions.
  if (!r.images.empty() && r.images.size() != r.media.size())
    bad("images", fmt::format("{} images for {} media spans", r.images.size(), r.media.size()));
  for (size_t i = 0; i < r.images.size(); ++i) {
    const ImageInput* im = r.images[i].get();
    if (!im || im->grid_h <= 0 || im->grid_w <= 0 || im->grid_h % 2 || im->grid_w % 2 ||
        im->patches.size() != size_t(im->grid_h) * size_t(im->grid_w) * 3 * 14 * 14)
      bad("images", fmt::format("image {} is not a preprocessed even grid of 14-px patches", i));
    if (im->num_tokens() != r.media[i].end - r.media[i].start)
      bad("images", fmt::format("image {} has {} tokens but its media span [{}, {}) holds {}", i, im->num_tokens(),
                                r.media[i].start, r.media[i].end, r.media[i].end - r.media[i].start));
  }
  if (r.constraint) validate_constraint(*r.constraint);
}

}  // namespace kestrel
