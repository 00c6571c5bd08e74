// SSE parsing and streamed-chunk interpretation: see sse.h.
#include "benchclient/sse.h"

#include <nlohmann/json.hpp>

namespace kestrel::bench {

std::vector<std::string> SseParser::feed(std::string_view bytes) {
  std::vector<std::string> out;
  for (char c : bytes) {
    if (c == '\n' && last_cr_) {  // second half of a CRLF already ended the line
      last_cr_ = false;
      continue;
    }
    last_cr_ = false;
    if (c == '\r' || c == '\n') {
      last_cr_ = c == '\r';
      on_line(out);
      line_.clear();
    } else {
      line_ += c;
    }
  }
  return out;
}

void SseParser::on_line(std::vector<std::string>& out) {
  if (line_.empty()) {  // a blank line dispatches the event
    if (has_data_) out.push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line_[0] == ':') return;  // comment (keep-alive pings)
  std::string_view field = line_, value;
  if (const size_t colon = line_.find(':'); colon != std::string::npos) {
    field = std::string_view(line_).substr(0, colon);
    value = std::string_view(line_).substr(colon + 1);
    if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
  }
  if (field == "data") {
    if (has_data_) data_ += '\n';
    data_ += value;
    has_data_ = true;
  }
}

StreamChunk interpret_chunk(std::string_view payload, Api api) {
  StreamChunk c;
  if (payload == "[DONE]") {
    c.done = true;
    return c;
  }
  const nlohmann::json j = nlohmann::json::parse(payload, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    c.error = "malformed stream chunk: " + std::string(payload.substr(0, 200));
    return c;
  }
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    const auto msg = e->is_object() ? e->find("message") : e->end();
    c.error = "server error in stream: " +
              (msg != e->end() && msg->is_string() ? msg->get<std::string>() : e->dump());
    return c;
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    if (auto ct = u->find("completion_tokens"); ct != u->end() && ct->is_number_integer())
      c.completion_tokens = ct->get<long long>();
    if (auto pt = u->find("prompt_tokens"); pt != u->end() && pt->is_number_integer())
      c.prompt_tokens = pt->get<long long>();
  }
  auto ch = j.find("choices");
  if (ch == j.end() || !ch->is_array() || ch->empty() || !(*ch)[0].is_object()) return c;
  const nlohmann::json& choice = (*ch)[0];
  c.has_choices = true;
  if (auto f = choice.find("finish_reason"); f != choice.end() && !f->is_null()) {
    c.finished = true;
    if (f->is_string()) c.finish_reason = f->get<std::string>();
  }
  auto str = [](const nlohmann::json& o, const char* key) -> const std::string* {
    auto it = o.find(key);
    return it != o.end() && it->is_string() ? it->get_ptr<const std::string*>() : nullptr;
  };
  if (api == Api::kCompletions) {
    if (const std::string* t = str(choice, "text")) {
      c.text = *t;
      c.token = !t->empty() || !c.finished;
    }
  } else if (auto d = choice.find("delta"); d != choice.end() && d->is_object()) {
    const std::string* content = str(*d, "content");
    // Servers name reasoning `reasoning_content` (vLLM, ours) or `reasoning` (ours sends both).
    const std::string* reasoning = str(*d, "reasoning_content");
    if (!reasoning) reasoning = str(*d, "reasoning");
    if (reasoning) c.text += *reasoning;
    if (content) c.text += *content;
    auto tc = d->find("tool_calls");
    c.token = !c.text.empty() || (tc != d->end() && tc->is_array() && !tc->empty());
  }
  return c;
}

}  // namespace kestrel::bench
