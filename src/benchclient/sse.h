// Server-sent events (the WHATWG event-stream format) as OpenAI-compatible servers stream them,
// and the reading of one streamed completion chunk.
//
// SseParser is incremental: bytes arrive in whatever pieces TCP and chunked encoding cut them into,
// so a line, a CRLF pair or an event may straddle two feed() calls.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::bench {

class SseParser {
 public:
  // Feeds bytes; returns the data of every event completed by them (its `data:` lines joined with
  // '\n'). Comments (`:` lines), `event:`, `id:` and `retry:` fields and data-less events are dropped.
  std::vector<std::string> feed(std::string_view bytes);
  // Bytes of an unfinished line or event are pending (a stream that ends here was cut short).
  bool pending() const { return !line_.empty() || has_data_; }

 private:
  void on_line(std::vector<std::string>& out);
  std::string line_;
  std::string data_;
  bool has_data_ = false;
  bool last_cr_ = false;  // the previous byte ended a line with '\r': a following '\n' belongs to it
};

enum class Api { kCompletions, kChat };

// One `data:` payload of a streamed /v1/completions or /v1/chat/completions response.
struct StreamChunk {
  bool done = false;          // the `[DONE]` sentinel
  bool has_choices = false;   // carries a choice (token, role opener or finish)
  bool token = false;         // carries generated output (see interpret_chunk)
  bool finished = false;      // a choice has a finish_reason
  std::string finish_reason;  // its value when a string ("length", "stop", ...)
  std::string text;           // generated text of choice 0
  std::optional<long long> completion_tokens, prompt_tokens;  // from `usage`
  std::string error;          // the server reported an error in-stream, or the payload is not JSON
};

// A chunk counts as a token when choice 0 carries output: completions text (or, with no
// finish_reason, an empty text: a token that decodes to nothing), chat content, reasoning or
// tool calls. Chat's role-only opener and a content-free finish chunk are not tokens: servers
// (ours, OpenAI's) send the opener before any token exists, so counting it would make TTFT the
// time to the response headers. vLLM's own client counts every choice chunk; against vLLM's
// server, which sends the opener with the first token, both rules give the same TTFT.
StreamChunk interpret_chunk(std::string_view payload, Api api);

}  // namespace kestrel::bench
