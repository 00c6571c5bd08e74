// K3 output parser state machine. States follow the assistant-message grammar of MODEL.md §7:
// top level (between blocks) -> think / response / tools -> call -> argument | json. Transitions
// happen only on complete markers `<|open|>NAME ATTRS<|sep|>` / `<|close|>NAME<|sep|>`.
#include "tokenizer/parser.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "tokenizer/json_py.h"

namespace kestrel::tok {
namespace {

constexpr size_t kMaxHeaderBytes = 4096;  // longer "headers" are text, not markers

struct Marker {
  std::string name;
  std::vector<std::pair<std::string, std::string>> attrs;
};

std::string unescape_attr(std::string_view v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    if (v.compare(i, 6, "&quot;") == 0) {
      out.push_back('"');
      i += 6;
    } else if (v.compare(i, 5, "&amp;") == 0) {
      out.push_back('&');
      i += 5;
    } else {
      out.push_back(v[i++]);
    }
  }
  return out;
}

// Parses `name( key="value")*`; nullopt when the text does not have that shape.
std::optional<Marker> parse_header(const std::string& h) {
  Marker m;
  size_t i = 0;
  while (i < h.size() && h[i] != ' ') ++i;
  m.name = h.substr(0, i);
  if (m.name.empty()) return std::nullopt;
  for (char c : m.name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return std::nullopt;
  while (i < h.size()) {
    if (h[i] != ' ') return std::nullopt;
    ++i;
    const size_t eq = h.find("=\"", i);
    if (eq == std::string::npos || eq == i) return std::nullopt;
    const std::string key = h.substr(i, eq - i);
    if (key.find_first_of(" \"") != std::string::npos) return std::nullopt;
    const size_t q = h.find('"', eq + 2);
    if (q == std::string::npos) return std::nullopt;
    m.attrs.emplace_back(key, unescape_attr(std::string_view(h).substr(eq + 2, q - eq - 2)));
    i = q + 1;
  }
  return m;
}

const std::string* attr(const Marker& m, const char* key) {
  for (const auto& [k, v] : m.attrs)
    if (k == key) return &v;
  return nullptr;
}

void add_call_delta(ParseDelta& d, size_t index, std::optional<std::string> name, const std::string& args) {
  if (!d.tool_calls.empty() && d.tool_calls.back().index == index && !name) {
    d.tool_calls.back().arguments += args;
    return;
  }
  d.tool_calls.push_back({index, std::move(name), args});
}

}  // namespace

OutputParser::OutputParser(const Tokenizer& tok, bool thinking, std::vector<std::string> known_tools,
                           bool keep_special)
    : tok_(&tok),
      known_tools_(std::move(known_tools)),
      keep_special_(keep_special),
      open_(tok.require_special("<|open|>")),
      close_(tok.require_special("<|close|>")),
      sep_(tok.require_special("<|sep|>")),
      terminators_(end_of_turn_ids(tok)),
      where_(thinking ? Where::kThink : Where::kResponse) {}

std::vector<TokenId> end_of_turn_ids(const Tokenizer& tok) {
  std::vector<TokenId> ids;
  for (const char* t : {"<|end_of_msg|>", "[EOS]", "[EOT]"})
    if (auto id = tok.special_id(t)) ids.push_back(*id);
  return ids;
}

void OutputParser::error(std::string msg) { out_.errors.push_back(std::move(msg)); }

ParseDelta OutputParser::push(const std::vector<TokenId>& ids) {
  ParseDelta d;
  for (TokenId id : ids) {
    ParseDelta one = push(id);
    d.reasoning += one.reasoning;
    d.content += one.content;
    for (auto& c : one.tool_calls) add_call_delta(d, c.index, std::move(c.name), c.arguments);
  }
  return d;
}

ParseDelta OutputParser::push(TokenId id) {
  ParseDelta d;
  if (id >= tok_->vocab_size()) {
    error("token id " + std::to_string(id) + " is outside the vocabulary");
    return d;
  }
  if (tok_->is_special(id))
    on_special(id, d);
  else
    on_text(tok_->token_bytes(id), d);
  return d;
}

void OutputParser::on_text(const std::string& bytes, ParseDelta& d) {
  if (header_.active) {
    header_.bytes += bytes;
    if (header_.bytes.size() > kMaxHeaderBytes) abort_header(d);
    return;
  }
  emit_text(utf8_.push(bytes), d);
}

void OutputParser::on_special(TokenId id, ParseDelta& d) {
  if (header_.active) {
    if (id == sep_) {
      Header h = std::move(header_);
      header_ = {};
      if (!apply_marker(h.is_open, h.bytes, d) && keep_special_) {
        // Not a marker of this grammar here: its text, separator included, stays in the output.
        emit_text(std::string(h.is_open ? "<|open|>" : "<|close|>"), d);
        emit_text(utf8_sanitize(h.bytes), d);
        emit_text(tok_->token_bytes(sep_), d);
      }
      return;
    }
    abort_header(d);  // then handle this special afresh
  }
  if (id == open_ || id == close_) {
    flush_utf8(d);
    header_ = {true, id == open_, {}};
    return;
  }
  if (std::find(terminators_.begin(), terminators_.end(), id) != terminators_.end()) {
    flush_utf8(d);  // a stop token: the caller ends generation; it is not part of the text
    return;
  }
  // Any other special (stray <|sep|>, media tokens, reserved): kept as its text, or dropped.
  flush_utf8(d);
  if (keep_special_) emit_text(tok_->token_bytes(id), d);
}

void OutputParser::abort_header(ParseDelta& d) {
  Header h = std::move(header_);
  header_ = {};
  if (keep_special_) emit_text(std::string(h.is_open ? "<|open|>" : "<|close|>"), d);
  emit_text(utf8_.push(h.bytes), d);
}

void OutputParser::flush_utf8(ParseDelta& d) { emit_text(utf8_.finish(), d); }

void OutputParser::emit_args(const std::string& frag, ParseDelta& d) {
  if (frag.empty() || out_.tool_calls.empty()) return;
  out_.tool_calls.back().arguments += frag;
  add_call_delta(d, out_.tool_calls.size() - 1, std::nullopt, frag);
}

void OutputParser::emit_text(const std::string& text, ParseDelta& d) {
  if (text.empty()) return;
  switch (where_) {
    case Where::kThink:
      out_.reasoning += text;
      d.reasoning += text;
      return;
    case Where::kArg:
      if (arg_is_string_) {
        std::string esc;
        py_json_escape_append(esc, text);
        emit_args(esc, d);
      } else {
        arg_raw_ += text;
      }
      return;
    case Where::kJson:
      emit_args(text, d);
      return;
    default:
      // Response text, and any text outside the blocks where the grammar expects none (kept, not
      // dropped: the client sees what the model wrote).
      out_.content += text;
      d.content += text;
      return;
  }
}

void OutputParser::close_argument(ParseDelta& d, bool truncated) {
  flush_utf8(d);
  if (arg_is_string_) {
    if (!truncated) emit_args("\"", d);
  } else if (truncated) {
    emit_args(arg_raw_, d);
  } else {
    nlohmann::ordered_json v = nlohmann::ordered_json::parse(arg_raw_, nullptr, false);
    if (v.is_discarded()) {
      error("tool call " + std::to_string(out_.tool_calls.size() - 1) + ": argument '" + arg_key_ +
            "' is not valid JSON; passed on as a string");
      if (out_.tool_calls.back().error.empty()) out_.tool_calls.back().error = "argument '" + arg_key_ + "' is not valid JSON";
      std::string esc = "\"";
      py_json_escape_append(esc, arg_raw_);
      emit_args(esc + "\"", d);
    } else {
      emit_args(py_json_dumps(v, false), d);
    }
  }
  arg_raw_.clear();
  where_ = Where::kCall;
}

void OutputParser::close_call(ParseDelta& d, bool complete) {
  ParsedToolCall& c = out_.tool_calls.back();
  if (complete) {
    if (!call_has_json_) emit_args(call_has_args_ ? "}" : "{}", d);
    c.complete = true;
    nlohmann::json parsed = nlohmann::json::parse(c.arguments, nullptr, false);
    if ((parsed.is_discarded() || !parsed.is_object()) && c.error.empty()) {
      c.error = "arguments are not a JSON object";
      error("tool call " + std::to_string(out_.tool_calls.size() - 1) + ": arguments are not a JSON object");
    }
  }
  where_ = Where::kTools;
}

bool OutputParser::apply_marker(bool is_open, const std::string& header, ParseDelta& d) {
  const auto m = parse_header(header);
  if (!m) return false;
  const std::string& n = m->name;
  const bool bare = m->attrs.empty();
  if (is_open) {
    if ((n == "think" || n == "response" || n == "tools") && bare &&
        (where_ == Where::kTop || where_ == Where::kThink || where_ == Where::kResponse || where_ == Where::kDone)) {
      // A block opened while another is still open closes it implicitly (tolerated, reported).
      if (where_ == Where::kThink || where_ == Where::kResponse) error("block '" + n + "' opened inside an unclosed block");
      where_ = n == "think" ? Where::kThink : n == "response" ? Where::kResponse : Where::kTools;
      return true;
    }
    if (n == "call" && where_ == Where::kTools) {
      const std::string* tool = attr(*m, "tool");
      if (!tool) return false;
      ParsedToolCall c;
      c.name = *tool;
      if (const std::string* idx = attr(*m, "index")) {
        try {
          size_t used = 0;
          int v = std::stoi(*idx, &used);
          if (used == idx->size()) c.model_index = v;
        } catch (...) {
        }
      }
      if (!known_tools_.empty() && std::find(known_tools_.begin(), known_tools_.end(), c.name) == known_tools_.end()) {
        c.error = "unknown tool '" + c.name + "'";
        error("tool call " + std::to_string(out_.tool_calls.size()) + ": unknown tool '" + c.name + "'");
      }
      out_.tool_calls.push_back(c);
      add_call_delta(d, out_.tool_calls.size() - 1, c.name, "");
      call_has_args_ = call_has_json_ = false;
      where_ = Where::kCall;
      return true;
    }
    if (n == "argument" && where_ == Where::kCall) {
      const std::string* key = attr(*m, "key");
      if (!key) return false;
      const std::string* type = attr(*m, "type");
      arg_key_ = *key;
      arg_is_string_ = !type || *type == "string";
      std::string head = call_has_args_ ? ", \"" : (call_has_json_ ? ", \"" : "{\"");
      if (call_has_json_) error("tool call mixes a json block and arguments");
      py_json_escape_append(head, *key);
      head += "\": ";
      if (arg_is_string_) head += "\"";
      emit_args(head, d);
      call_has_args_ = true;
      arg_raw_.clear();
      where_ = Where::kArg;
      return true;
    }
    if (n == "json" && where_ == Where::kCall) {
      if (call_has_args_ || call_has_json_) error("tool call mixes a json block and arguments");
      call_has_json_ = true;
      where_ = Where::kJson;
      return true;
    }
    return false;
  }
  if (!bare) return false;
  if (n == "think" && where_ == Where::kThink) return (where_ = Where::kTop), true;
  if (n == "response" && where_ == Where::kResponse) return (where_ = Where::kTop), true;
  if (n == "tools" && where_ == Where::kTools) return (where_ = Where::kTop), true;
  if (n == "call" && where_ == Where::kCall) return close_call(d, true), true;
  if (n == "argument" && where_ == Where::kArg) return close_argument(d, false), true;
  if (n == "json" && where_ == Where::kJson) return flush_utf8(d), (where_ = Where::kCall), true;
  if (n == "message" && where_ != Where::kArg && where_ != Where::kJson && where_ != Where::kCall) {
    if (where_ == Where::kThink || where_ == Where::kResponse || where_ == Where::kTools)
      error("message closed inside an unclosed block");
    where_ = Where::kDone;
    return true;
  }
  return false;
}

ParseDelta OutputParser::finish(FinishCause cause) {
  ParseDelta d;
  if (header_.active) {
    error("output ended inside a marker");
    if (keep_special_)
      abort_header(d);
    else
      header_ = {};  // an unfinished marker is markup, not text
  }
  flush_utf8(d);
  const bool in_call = where_ == Where::kCall || where_ == Where::kArg || where_ == Where::kJson;
  if (in_call) {
    if (where_ == Where::kArg) close_argument(d, true);
    ParsedToolCall& c = out_.tool_calls.back();
    c.complete = false;
    if (c.error.empty()) c.error = "truncated";
    error("output ended inside tool call " + std::to_string(out_.tool_calls.size() - 1));
    where_ = Where::kTools;
  }
  const bool any_complete = std::any_of(out_.tool_calls.begin(), out_.tool_calls.end(),
                                        [](const ParsedToolCall& c) { return c.complete; });
  out_.finish_reason = cause == FinishCause::kLength ? "length" : any_complete ? "tool_calls" : "stop";
  return d;
}

}  // namespace kestrel::tok
