// The request vocabulary: what one generation request is, what comes back for it, and how it ends.
// Every layer speaks these types directly — the OpenAI server and `kestrel generate` build a Request,
// the runtime engine validates it once and keeps it, the scheduler stores what it needs from it, the
// sampler reads its SamplingParams, and events flow back as TokenEvents. Plain data, no tensors, no
// threads; the abstract engine the front ends code against is request/engine.h.
//
// Adding a request field: add it here (Request or SamplingParams), check it in validate(), and honour
// it where it acts (sampler, engine loop, text stream); nothing translates it on the way.
//
// Stopping, settled once for every front end:
//   - max_tokens generated tokens (finish length; validate() keeps prompt + max_tokens within the
//     context, so the context never runs out first);
//   - a stop token (finish stop; that token is the event's token and the last one): any of the
//     engine's end-of-sequence ids (the config's eos_token_id plus the tokenizer's end-of-turn
//     specials <|end_of_msg|>, [EOS], [EOT]) or of the request's stop_token_ids. ignore_eos turns
//     ALL of them off — generation then ends only at max_tokens, a stop string or a cancel. Before
//     sampling.min_tokens output tokens the sampler never draws a stop id (its logit is −inf) — except
//     where an output constraint allows nothing but an end: the grammar wins there (the engine's
//     held_stops; docs/structured-outputs.md, "min_tokens");
//   - a stop string: text-level, matched by the consumer's text stream (tokenizer/text_stream.h),
//     which then cancels the request; the engine only knows ids.
//   A stop token's text is never part of the output text.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"

namespace kestrel {

namespace structured {
class CompiledGrammar;  // structured/matcher.h: a grammar with its token tables over the model's vocabulary
}

using RequestId = uint64_t;

// The sampler's knobs (runtime/sampler.h applies them; vLLM's order and meanings).
struct SamplingParams {
  // (token, bias) pairs added to the raw logits before anything else (OpenAI's logit_bias): distinct
  // ids in the vocabulary, bias in [-100, 100].
  std::vector<std::pair<int32_t, float>> logit_bias;
  int32_t min_tokens = 0;           // >= 0: no stop id can be drawn before this many output tokens
  float temperature = 0.0f;         // [0, 2]; 0 = greedy
  int32_t top_k = 0;                // >= 0; 0 = off
  float top_p = 1.0f;               // (0, 1]
  float min_p = 0.0f;               // [0, 1]; 0 = off
  float repetition_penalty = 1.0f;  // (0, 10]; 1 = off (prompt and output tokens)
  float presence_penalty = 0.0f;    // [-2, 2] (output tokens)
  float frequency_penalty = 0.0f;   // [-2, 2] (output tokens)
  uint64_t seed = 0;                // draw i comes from (seed, i): the same seed gives the same tokens
  int32_t logprobs = -1;            // < 0: none; n in [0, 20]: the sampled token's logprob + the n most likely
  // < 0: none; n in [0, 20]: for every prompt position after the first, the prompt token's logprob
  // given the tokens before it + the n most likely (the completions API's echo; vLLM's
  // prompt_logprobs). Such a request never starts from a prefix-cache hit: every position is computed.
  int32_t prompt_logprobs = -1;
};

// Tokens [start, end) of the prompt are one image's <|media_pad|> run — exactly its num_tokens() pads, not
// the <|media_begin|>…<|media_content|> frame around them (validate() checks the length) — with the image's
// content hash; prefix-cache keys include it, so equal placeholders of different images never share a block.
struct MediaSpan {
  int64_t start = 0;
  int64_t end = 0;
  uint64_t content_hash = 0;
};

// One image of a request, preprocessed (MODEL.md §6 "Preprocess"): resized and padded to an even grid of
// 14-px patches, scaled to [-1, 1], cut into patches. The front end (decode + preprocess) fills it; the engine
// runs the vision tower over it at prefill and writes its (grid_h/2)·(grid_w/2) output rows, in order, into
// the prompt's <|media_pad|> positions of the matching MediaSpan (image i ↔ media[i]).
struct ImageInput {
  int32_t grid_h = 0;          // patches along the height, even
  int32_t grid_w = 0;          // patches along the width, even
  // f32 [grid_h·grid_w, 3·14·14]: patches row-major over the grid; inside a patch (channel, y, x), the
  // layout of the patch-embedding Conv2d weight [vt_hidden, 3, 14, 14].
  std::vector<float> patches;
  uint64_t content_hash = 0;   // of the encoded image bytes (the MediaSpan's hash)
  int64_t num_tokens() const { return int64_t(grid_h / 2) * (grid_w / 2); }
};

// Structured output (docs/structured-outputs.md): what the generated tokens must spell. The front end
// states it from the API request (`response_format`, `tools`, `tool_choice`, the thinking switch) and
// compiles it once (structured::GrammarCache, off its I/O threads); the engine runs one Matcher per
// request over `grammar` and masks the logits of every constrained step before sampling, so the
// output is a sentence of the grammar: JSON valid against the schema, calls of declared tools only
// with valid arguments, no tools section where none may open. Ends: a chat grammar ends with its own
// <|end_of_msg|>; a document grammar (bare JSON) with an end-of-sequence id, allowed only where the
// document may end. A terminated grammar ends the request (finish stop) even under ignore_eos.
struct ToolDecl {
  std::string name;        // non-empty, unique within the request
  std::string parameters;  // its JSON Schema as JSON text (empty: no arguments)
};
struct OutputConstraint {
  enum class Format : uint8_t { text, json_object, json_schema };
  enum class ToolChoice : uint8_t { automatic, none, required, named };
  bool chat = true;        // the K3 chat-output grammar (MODEL.md §7); false: one JSON document
  bool thinking = true;    // chat: the prompt opened the think section (free text until it closes)
  Format format = Format::text;
  std::string schema;      // json_schema: the schema as JSON text (json_object: {"type": "object"})
  std::vector<ToolDecl> tools;
  ToolChoice tool_choice = ToolChoice::automatic;
  std::string named_tool;  // tool_choice named: one of `tools`
  size_t max_calls = 8;    // calls in one tools section (1 when parallel_tool_calls is false)
  // Budget-aware completion (docs/structured-outputs.md, "Finishing within max_tokens"): the masks keep
  // the output completable within the request's max_tokens, so it always ends complete and valid; a
  // request whose shortest complete output is longer than max_tokens is refused (param max_tokens).
  // The server sets it for json_object / json_schema unless the request or the server opts out.
  bool complete_within_max_tokens = false;
  // The compiled form of all of the above over the engine's vocabulary (never null when submitted).
  std::shared_ptr<const structured::CompiledGrammar> grammar;
};

struct Request {
  std::vector<int32_t> prompt;             // token ids, non-empty, each < the model's vocabulary
  SamplingParams sampling;
  int32_t max_tokens = 16;                 // tokens to generate at most, >= 1
  // How the client spelled max_tokens ("max_tokens", chat's "max_completion_tokens", the Responses API's
  // "max_output_tokens"): every error about the budget (validate(), the structured-output minimum at
  // submit) names this field, so a client is told about the field it actually sent.
  std::string max_tokens_field = "max_tokens";
  std::vector<int32_t> stop_token_ids;     // besides the engine's end-of-sequence ids
  std::vector<std::string> stop;           // stop strings (at most 16, non-empty): the text stream's
  bool ignore_eos = false;                 // no token id ends the request (see the header)
  std::vector<MediaSpan> media;            // image placeholders in the prompt
  // The images behind `media`, same count and order (empty for a text-only request).
  std::vector<std::shared_ptr<const ImageInput>> images;
  std::optional<OutputConstraint> constraint;  // structured output (above); none: unconstrained
  // Debug hook (`generate --dump-logits`): every position's logits once, in position order (prompt
  // positions, then each generated token fed back), on the engine thread. Costs a full lm_head per
  // position and keeps the logits on the host.
  std::function<void(int64_t pos, std::span<const float> row /* f32 [V] */)> on_logits;
};

enum class FinishReason : uint8_t {
  none,       // more tokens follow
  stop,       // a stop token was generated (it is this event's token)
  length,     // max_tokens reached
  cancelled,  // cancel() or engine shutdown
  error,      // the engine failed; TokenEvent::error says why (the engine then refuses requests)
};
const char* finish_reason_name(FinishReason r);  // "none", "stop", "length", "cancelled", "error"

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
};

// One prompt position's logprobs (SamplingParams::prompt_logprobs): its token given the ones before.
struct PromptLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;  // most likely first, ties by lower id
};

// One generated token, or a token-less end. Every accepted request gets exactly one event with
// finish != none (its last token, or a token-less event for a cancellation or failure).
struct TokenEvent {
  RequestId id = 0;
  int32_t index = -1;                 // output index of `token`; −1 for a token-less event
  int32_t token = -1;
  float logprob = 0.0f;               // of `token`, when sampling.logprobs >= 0
  std::vector<TokenLogprob> top_logprobs;
  int32_t prompt_tokens = 0;          // the request's first event only: its prompt length
  int32_t cached_prompt_tokens = 0;   // the first event only: prompt tokens the prefix cache served
  // The first event only, when sampling.prompt_logprobs >= 0: prompt positions 1 .. P−1 in order.
  std::vector<PromptLogprob> prompt_logprobs;
  FinishReason finish = FinishReason::none;
  std::string error;                  // finish == error

  bool finished() const { return finish != FinishReason::none; }
};

// Engine state and counters. The scheduler keeps the admission, step and prefix-cache counters; the
// engine adds queue lengths, pages, token totals and executor time.
struct EngineStats {
  int64_t running = 0, waiting = 0;         // requests holding a state slot / accepted, not yet running
  int32_t pages_total = 0, pages_used = 0;  // used = not free (cached prefix pages included)
  int32_t pages_held = 0;                   // not reclaimable: held by requests (0 when idle)
  int64_t steps = 0, admitted = 0, preemptions = 0, finished = 0, cancelled = 0;
  int64_t prefix_queries = 0;               // admissions that looked up the prefix cache
  int64_t prefix_query_tokens = 0;          // prompt tokens looked up (vLLM's prefix_cache_queries)
  int64_t prefix_hits = 0;                  // admissions that restored a checkpoint
  int64_t prefix_hit_tokens = 0;            // prompt tokens served from the cache (vLLM's prefix_cache_hits)
  int64_t prefill_tokens = 0, decode_tokens = 0;     // scheduled positions
  int64_t prompt_tokens = 0, generation_tokens = 0;  // accepted prompts; tokens sampled
  int64_t tokens_forwarded = 0;             // positions actually computed (prefill incl. recompute + decodes)
  double busy_seconds = 0.0;                // time spent in forward steps
  // DSpark speculation (vLLM's vllm:spec_decode_num_* counters): verification steps, draft tokens
  // proposed, draft tokens accepted. Mean acceptance length = 1 + accepted / drafts.
  int64_t spec_drafts = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0;
  // Async scheduling (run-ahead, docs/serving.md): steps planned and launched before the previous step's
  // tokens were known (included in `steps`).
  int64_t ahead_steps = 0;

  // vLLM's kv_cache_usage: cached prefix pages nobody holds are reclaimable, so they count as free.
  double kv_usage() const { return pages_total ? double(pages_held) / double(pages_total) : 0.0; }
};

// What validate() checks a request against (the engine's model and memory plan).
struct RequestLimits {
  int64_t vocab_size = 0;     // > 0
  int64_t max_model_len = 0;  // prompt + max_tokens at most
  std::string context_note;   // appended to context-length errors: why max_model_len is what it is
};

// A request that cannot be served as asked. `field` names the request field at fault ("prompt",
// "max_tokens", "temperature", ...), so a front end can point at its own spelling of it.
class RequestError : public Error {
 public:
  RequestError(std::string field, const std::string& msg) : Error(msg), field(std::move(field)) {}
  std::string field;
};

// The one check of a request: prompt ids in the vocabulary, the context length, every parameter's
// range, stop ids and strings, media spans, the output constraint's consistency (fields
// "response_format", "tools", "tool_choice"). Throws RequestError naming the first bad field. (That
// the compiled grammar matches the model's vocabulary is the engine's check at submit.)
void validate(const Request& r, const RequestLimits& limits);

}  // namespace kestrel
