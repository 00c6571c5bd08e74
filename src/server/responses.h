// The Responses API (POST /v1/responses) over the same engine as chat completions: a request body
// is rewritten into a chat-completions body (input items → messages, instructions → a system
// message, function tools → chat tools, reasoning.effort → reasoning_effort, text.format →
// response_format, max_output_tokens → max_completion_tokens), which the chat path encodes and
// runs; the answer is shaped as a Response object — a reasoning item (the model's thinking as
// reasoning_text content), a message item (output_text) and one function_call item per tool call —
// or, streaming, as the Responses event stream (response.created … response.completed, with
// output_item / content_part / *.delta / *.done events in between, each carrying a sequence_number).
// Nothing is stored: `store` must be false or absent, and previous_response_id is refused.
// Fields kestrel does not honour are refused with a 400 naming them (docs/api.md).
#pragma once

#include <memory>
#include <string>

#include "server/job.h"
#include "server/openai.h"

namespace kestrel::server {

// What a Response object repeats of its request, and its identity.
struct ResponsesHead {
  std::string id, model;
  int64_t created = 0;
  json echo = json::object();  // instructions, max_output_tokens, temperature, top_p, tools, tool_choice, ...
};

struct ResponsesRequest {
  ojson chat;  // the equivalent chat-completions body
  ResponsesHead head;
};

// Throws ApiError 400 for a malformed body or a field kestrel does not honour.
ResponsesRequest responses_to_chat(const ojson& body);

// An error about the chat body responses_to_chat wrote, in the names of the Responses request it came
// from: `param` response_format → text (its message's leading "response_format" → "text.format"),
// messages → input, reasoning_effort → reasoning. (The budget is named at its source:
// Request::max_tokens_field is max_output_tokens.)
ApiError responses_error(const ApiError& e);

// The Response object of a finished answer (status completed, incomplete or failed).
json response_object(const ResponsesHead& h, const ChoiceStream& c, const std::string& status);

// The Job shaper that writes Response objects or the Responses event stream.
std::unique_ptr<Shaper> responses_shaper(ResponsesHead head);

}  // namespace kestrel::server
