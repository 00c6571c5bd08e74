// TextStream and StopMatcher: see text_stream.h.
#include "tokenizer/text_stream.h"

#include <algorithm>

namespace kestrel::tok {

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

TextStream::TextStream(const Tokenizer& tok, std::vector<std::string> stop) : tok_(&tok), stop_(std::move(stop)) {}

TextStream TextStream::plain(const Tokenizer& tok, std::vector<std::string> stop, bool keep_special) {
  TextStream s(tok, std::move(stop));
  s.decoder_.emplace(tok);
  s.keep_special_ = keep_special;
  return s;
}

TextStream TextStream::chat(const Tokenizer& tok, bool thinking, std::vector<std::string> tools,
                            std::vector<std::string> stop, bool keep_special) {
  TextStream s(tok, std::move(stop));
  s.parser_.emplace(tok, thinking, std::move(tools), keep_special);
  s.keep_special_ = keep_special;
  return s;
}

const std::vector<ParsedToolCall>& TextStream::tool_calls() const {
  static const std::vector<ParsedToolCall> none;
  return parser_ ? parser_->result().tool_calls : none;
}

void TextStream::add_content(const std::string& text, TextDelta& d) {
  if (text.empty()) return;
  const std::string c = stop_.push(text);
  d.content += c;
  content_ += c;
}

void TextStream::absorb(ParseDelta&& pd, TextDelta& d) {
  d.reasoning += pd.reasoning;
  reasoning_ += pd.reasoning;
  add_content(pd.content, d);
  if (stop_.matched()) return;  // nothing after a stop string counts
  for (ToolCallDelta& tc : pd.tool_calls) d.tool_calls.push_back(std::move(tc));
}

void TextStream::end(std::string reason) {
  done_ = true;
  finish_reason_ = std::move(reason);
}

TextDelta TextStream::push(TokenId id) {
  TextDelta d;
  if (done_) return d;
  if (parser_)
    absorb(parser_->push(id), d);
  else if (id < tok_->vocab_size() && (keep_special_ || !tok_->is_special(id)))
    add_content(decoder_->push(id), d);
  if (stop_.matched()) end("stop");
  return d;
}

TextDelta TextStream::finish(FinishCause cause) {
  TextDelta d;
  if (done_) return d;
  std::string reason = cause == FinishCause::kLength ? "length" : "stop";
  if (parser_) {
    absorb(parser_->finish(cause), d);
    reason = parser_->result().finish_reason;  // length, stop, or tool_calls when a call closed
  } else {
    add_content(decoder_->finish(), d);
  }
  if (stop_.matched()) {
    reason = "stop";
  } else {
    const std::string tail = stop_.flush();
    d.content += tail;
    content_ += tail;
  }
  end(std::move(reason));
  return d;
}

}  // namespace kestrel::tok
