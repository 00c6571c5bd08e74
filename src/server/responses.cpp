// The Responses API: see responses.h.
#include "server/responses.h"

#include <fmt/format.h>

#include <cstring>
#include <ctime>
#include <set>

namespace kestrel::server {
namespace {

// Passed to the chat body as they are (the chat path checks them).
const std::set<std::string, std::less<>> kPassThrough = {
    "model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "min_tokens",
    "skip_special_tokens", "complete_within_max_tokens"};
// Rewritten below.
const std::set<std::string, std::less<>> kMapped = {"input", "instructions", "max_output_tokens", "tools", "tool_choice",
                                                     "reasoning", "text", "store", "metadata", "truncation"};

// Message content (a string, or input_text / output_text parts) as chat text parts.
ojson content_of(const ojson& c, const std::string& where) {
  if (c.is_string()) return c;
  if (!c.is_array()) bad_field(where, "content must be a string or an array of content parts");
  ojson parts = ojson::array();
  for (const auto& p : c) {
    const std::string type = p.is_object() && p.contains("type") && p["type"].is_string() ? p["type"].get<std::string>() : "";
    if ((type == "input_text" || type == "output_text") && p.contains("text") && p["text"].is_string()) {
      parts.push_back({{"type", "text"}, {"text", p["text"]}});
    } else if (type == "input_image") {
      // {"type": "input_image", "image_url": URL, "detail"?}: the chat API's image_url part, checked and
      // decoded with the chat path's images (server/media.h).
      if (p.contains("file_id")) bad_field(where, "input_image with a file_id is not supported (no file storage); send image_url");
      if (!p.contains("image_url") || !p["image_url"].is_string()) bad_field(where, "input_image needs a string 'image_url'");
      ojson img = {{"url", p["image_url"]}};
      if (p.contains("detail")) img["detail"] = p["detail"];
      parts.push_back({{"type", "image_url"}, {"image_url", std::move(img)}});
    } else {
      bad_field(where, fmt::format("content part type '{}' is not supported (input_text, output_text, input_image)", type));
    }
  }
  return parts;
}

std::string str(const ojson& o, const char* k, const std::string& where) {
  if (!o.contains(k) || !o[k].is_string()) bad_field(where, fmt::format("needs a string '{}'", k));
  return o[k].get<std::string>();
}

// Input items → chat messages. Reasoning items become the reasoning_content of the assistant turn
// that follows them; function_call items join that turn's tool_calls.
ojson messages_of(const ojson& input, const ojson* instructions) {
  ojson msgs = ojson::array();
  if (instructions) msgs.push_back({{"role", "system"}, {"content", *instructions}});
  if (input.is_string()) {
    msgs.push_back({{"role", "user"}, {"content", input}});
    return msgs;
  }
  if (!input.is_array() || input.empty()) bad_field("input", "must be a string or a non-empty array of input items");
  std::string reasoning;
  bool turn_open = false;  // the last message is an assistant turn that tool calls may join
  auto assistant = [&]() -> ojson& {
    if (!turn_open) {
      msgs.push_back({{"role", "assistant"}, {"content", ""}});
      turn_open = true;
    }
    ojson& m = msgs.back();
    if (!reasoning.empty()) m["reasoning_content"] = reasoning, reasoning.clear();
    return m;
  };
  for (size_t i = 0; i < input.size(); ++i) {
    const ojson& it = input[i];
    const std::string where = fmt::format("input[{}]", i);
    if (!it.is_object()) bad_field(where, "must be an object");
    const std::string type = it.contains("type") && it["type"].is_string() ? it["type"].get<std::string>() : "message";
    if (type == "message") {
      const std::string role = str(it, "role", where);
      if (role != "user" && role != "system" && role != "developer" && role != "assistant")
        bad_field(where, fmt::format("role '{}' is not one of user, system, developer, assistant", role));
      if (!it.contains("content")) bad_field(where, "needs 'content'");
      if (role == "assistant") {
        ojson& m = assistant();
        ojson c = content_of(it["content"], where);
        if (c.is_string()) c = ojson::array({{{"type", "text"}, {"text", c}}});
        ojson& prev = m["content"];
        if (prev.is_string() && prev.get<std::string>().empty()) prev = ojson::array();
        for (auto& p : c) prev.push_back(p);
      } else {
        msgs.push_back({{"role", role}, {"content", content_of(it["content"], where)}});
        turn_open = false;
      }
    } else if (type == "reasoning") {
      // Its text: reasoning_text content, or else the summary texts.
      std::string text;
      for (const char* k : {"content", "summary"}) {
        if (!text.empty() || !it.contains(k) || !it[k].is_array()) continue;
        for (const auto& p : it[k])
          if (p.is_object() && p.contains("text") && p["text"].is_string()) text += p["text"].get<std::string>();
      }
      if (turn_open) {  // reasoning after a message of the same turn: a new turn
        turn_open = false;
      }
      reasoning += text;
    } else if (type == "function_call") {
      ojson& m = assistant();
      if (!m.contains("tool_calls")) m["tool_calls"] = ojson::array();
      m["tool_calls"].push_back({{"id", str(it, "call_id", where)},
                                 {"type", "function"},
                                 {"function", {{"name", str(it, "name", where)}, {"arguments", str(it, "arguments", where)}}}});
    } else if (type == "function_call_output") {
      const ojson& out = it.contains("output") ? it["output"] : ojson();
      ojson content = out.is_string() ? out : content_of(out, where);
      msgs.push_back({{"role", "tool"}, {"tool_call_id", str(it, "call_id", where)}, {"content", content}});
      turn_open = false;
    } else {
      bad_field(where, fmt::format("item type '{}' is not supported (message, reasoning, function_call, function_call_output)", type));
    }
  }
  return msgs;
}

}  // namespace

ResponsesRequest responses_to_chat(const ojson& body) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  for (const auto& [k, v] : body.items())
    if (!kPassThrough.count(k) && !kMapped.count(k) && !v.is_null())
      throw ApiError(400, fmt::format("unsupported parameter '{}' in responses: kestrel does not implement it "
                                      "(docs/api.md lists what it does)", k), k);
  ResponsesRequest rr;
  ojson& chat = rr.chat;
  json& echo = rr.head.echo;
  for (const auto& [k, v] : body.items())
    if (kPassThrough.count(k) && !v.is_null()) chat[k] = v;
  if (body.contains("store") && !body["store"].is_null() && body["store"] != false)
    bad_field("store", "must be false: kestrel stores no responses");
  if (body.contains("truncation") && !body["truncation"].is_null() && body["truncation"] != "disabled")
    bad_field("truncation", "must be 'disabled': a prompt beyond the context is refused, never truncated");
  const ojson* instructions = nullptr;
  if (body.contains("instructions") && !body["instructions"].is_null()) {
    if (!body["instructions"].is_string()) bad_field("instructions", "must be a string");
    instructions = &body["instructions"];
  }
  if (!body.contains("input") || body["input"].is_null()) bad_field("input", "is required");
  chat["messages"] = messages_of(body["input"], instructions);
  if (body.contains("max_output_tokens") && !body["max_output_tokens"].is_null()) {
    chat["max_completion_tokens"] = body["max_output_tokens"];
    echo["max_output_tokens"] = body["max_output_tokens"];
  }
  json tools = json::array();
  if (body.contains("tools") && !body["tools"].is_null()) {
    if (!body["tools"].is_array()) bad_field("tools", "must be an array");
    ojson ct = ojson::array();
    for (size_t i = 0; i < body["tools"].size(); ++i) {
      const ojson& t = body["tools"][i];
      if (!t.is_object() || t.value("type", "") != "function")
        bad_field("tools", fmt::format("tools[{}]: only function tools are supported", i));
      ojson fn = {{"name", str(t, "name", fmt::format("tools[{}]", i))}};
      for (const char* k : {"description", "parameters", "strict"})
        if (t.contains(k) && !t[k].is_null()) fn[k] = t[k];
      ct.push_back({{"type", "function"}, {"function", fn}});
      tools.push_back(json::parse(t.dump()));
    }
    if (!ct.empty()) chat["tools"] = ct;
  }
  echo["tools"] = tools;
  echo["tool_choice"] = "auto";
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const ojson& tc = body["tool_choice"];
    if (tc.is_string()) {
      chat["tool_choice"] = tc;
    } else if (tc.is_object() && tc.value("type", "") == "function" && tc.contains("name") && tc["name"].is_string()) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", tc["name"]}}}};
    } else {
      bad_field("tool_choice", "must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}");
    }
    echo["tool_choice"] = json::parse(tc.dump());
  }
  json reasoning = {{"effort", nullptr}, {"summary", nullptr}};
  if (body.contains("reasoning") && !body["reasoning"].is_null()) {
    const ojson& r = body["reasoning"];
    if (!r.is_object()) bad_field("reasoning", "must be an object");
    for (const auto& [k, v] : r.items()) {
      if (v.is_null()) continue;
      if (k != "effort") bad_field("reasoning", fmt::format("key '{}' is not supported (effort)", k));
    }
    if (r.contains("effort") && !r["effort"].is_null()) {
      chat["reasoning_effort"] = r["effort"];
      reasoning["effort"] = json::parse(r["effort"].dump());
    }
  }
  echo["reasoning"] = reasoning;
  json text = {{"format", {{"type", "text"}}}};
  if (body.contains("text") && !body["text"].is_null()) {
    const ojson& t = body["text"];
    if (!t.is_object()) bad_field("text", "must be an object");
    for (const auto& [k, v] : t.items())
      if (k != "format" && !v.is_null()) bad_field("text", fmt::format("key '{}' is not supported (format)", k));
    if (t.contains("format") && !t["format"].is_null()) {
      const ojson& f = t["format"];
      const std::string type = f.is_object() ? f.value("type", "") : "";
      if (type == "json_schema") {
        ojson js = {{"name", f.value("name", "response")}};
        for (const char* k : {"schema", "strict", "description"})
          if (f.contains(k)) js[k] = f[k];
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", js}};
      } else if (type == "json_object" || type == "text") {
        chat["response_format"] = {{"type", type}};
      } else {
        bad_field("text", "format.type must be text, json_object or json_schema");
      }
      text["format"] = json::parse(f.dump());
    }
  }
  echo["text"] = text;
  if (body.contains("metadata") && !body["metadata"].is_null()) {
    if (!body["metadata"].is_object()) bad_field("metadata", "must be an object");
    echo["metadata"] = json::parse(body["metadata"].dump());
  }
  for (const char* k : {"temperature", "top_p", "parallel_tool_calls", "user"})
    if (body.contains(k)) echo[k] = json::parse(body[k].dump());
  echo["instructions"] = instructions ? json(instructions->get<std::string>()) : json(nullptr);
  rr.head.id = random_id("resp_");
  rr.head.created = int64_t(std::time(nullptr));
  return rr;
}

ApiError responses_error(const ApiError& e) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"response_format", "text"}, {"messages", "input"}, {"reasoning_effort", "reasoning"}};
  std::string param = e.param, msg = e.what();
  for (const auto& [chat, responses] : kNames)
    if (param == chat) param = responses;
  if (msg.rfind("response_format", 0) == 0) msg = "text.format" + msg.substr(std::strlen("response_format"));
  return ApiError(e.status, msg, param);
}

json response_object(const ResponsesHead& h, const ChoiceStream& c, const std::string& status) {
  json output = json::array();
  const std::string tail = h.id.substr(5);
  if (!c.reasoning().empty())
    output.push_back({{"type", "reasoning"}, {"id", "rs_" + tail}, {"summary", json::array()},
                      {"content", json::array({{{"type", "reasoning_text"}, {"text", c.reasoning()}}})},
                      {"status", status == "in_progress" ? "in_progress" : "completed"}});
  const json calls = c.tool_calls_message();
  if (!c.content().empty() || calls.empty())
    output.push_back({{"type", "message"}, {"id", "msg_" + tail}, {"role", "assistant"},
                      {"status", status == "completed" ? "completed" : status == "in_progress" ? "in_progress" : "incomplete"},
                      {"content", json::array({{{"type", "output_text"}, {"text", c.content()}, {"annotations", json::array()},
                                                {"logprobs", json::array()}}})}});
  for (const auto& call : calls) {
    const std::string call_id = call["id"];
    output.push_back({{"type", "function_call"}, {"id", "fc_" + call_id.substr(5)}, {"call_id", call_id},
                      {"name", call["function"]["name"]}, {"arguments", call["function"]["arguments"]},
                      {"status", "completed"}});
  }
  json r = {{"id", h.id}, {"object", "response"}, {"created_at", h.created}, {"model", h.model}, {"status", status},
            {"error", nullptr}, {"incomplete_details", nullptr}, {"output", output},
            {"parallel_tool_calls", h.echo.value("parallel_tool_calls", true)},
            {"temperature", h.echo.value("temperature", json(1.0))}, {"top_p", h.echo.value("top_p", json(1.0))},
            {"max_output_tokens", h.echo.value("max_output_tokens", json(nullptr))},
            {"previous_response_id", nullptr}, {"store", false}, {"truncation", "disabled"}, {"background", false},
            {"metadata", h.echo.value("metadata", json::object())}, {"user", h.echo.value("user", json(nullptr))}};
  for (const char* k : {"instructions", "tools", "tool_choice", "reasoning", "text"}) r[k] = h.echo.value(k, json(nullptr));
  if (status == "incomplete") r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  if (status != "in_progress") {
    const int in = c.prompt_tokens(), out = c.completion_tokens();
    r["usage"] = {{"input_tokens", in}, {"input_tokens_details", {{"cached_tokens", c.cached_tokens()}, {"cache_write_tokens", 0}}},
                  {"output_tokens", out}, {"output_tokens_details", {{"reasoning_tokens", c.reasoning_tokens()}}},
                  {"total_tokens", in + out}};
  } else {
    r["usage"] = nullptr;
  }
  return r;
}

namespace {

std::string status_of(const ChoiceStream& c) {
  const std::string& f = c.finish_reason();
  if (f == "error" || f == "abort") return "failed";
  return f == "length" ? "incomplete" : "completed";
}

// The event stream: one item open at a time (reasoning, then the message, then each call).
class ResponsesShaper : public Shaper {
 public:
  explicit ResponsesShaper(ResponsesHead h) : h_(std::move(h)) {}

  void begin(Connection& conn, const std::vector<ChoiceStream>& choices) override {
    conn.stream_begin();
    emit(conn, "response.created", {{"response", response_object(h_, choices[0], "in_progress")}});
    emit(conn, "response.in_progress", {{"response", response_object(h_, choices[0], "in_progress")}});
  }

  void delta(Connection& conn, size_t, const std::vector<ChoiceStream>& choices, const ChoiceStream::Delta& d) override {
    if (!d.error.empty()) {
      close_item(conn);
      json r = response_object(h_, choices[0], "failed");
      r["error"] = {{"code", "server_error"}, {"message", d.error}};
      emit(conn, "response.failed", {{"response", r}});
      failed_ = true;
      return;
    }
    if (!d.reasoning.empty()) {
      if (kind_ != Kind::reasoning) {
        close_item(conn);
        open_item(conn, Kind::reasoning, "rs_" + h_.id.substr(5),
                  {{"type", "reasoning"}, {"summary", json::array()}, {"content", json::array()}, {"status", "in_progress"}});
        emit(conn, "response.content_part.added", part_event({{"type", "reasoning_text"}, {"text", ""}}));
      }
      text_ += d.reasoning;
      emit(conn, "response.reasoning_text.delta", with_item({{"content_index", 0}, {"delta", d.reasoning}}));
    }
    if (!d.content.empty()) {
      if (kind_ != Kind::message) {
        close_item(conn);
        open_item(conn, Kind::message, "msg_" + h_.id.substr(5),
                  {{"type", "message"}, {"role", "assistant"}, {"content", json::array()}, {"status", "in_progress"}});
        emit(conn, "response.content_part.added", part_event(output_text("")));
      }
      text_ += d.content;
      emit(conn, "response.output_text.delta",
           with_item({{"content_index", 0}, {"delta", d.content}, {"logprobs", json::array()}}));
    }
    for (const auto& tc : d.tool_calls) {
      if (tc.contains("id")) {
        close_item(conn);
        const std::string call_id = tc["id"];
        name_ = tc["function"].value("name", "");
        open_item(conn, Kind::call, "fc_" + call_id.substr(5),
                  {{"type", "function_call"}, {"call_id", call_id}, {"name", name_}, {"arguments", ""}, {"status", "in_progress"}});
        call_id_ = call_id;
      }
      const std::string frag = tc["function"].value("arguments", "");
      if (frag.empty() || kind_ != Kind::call) continue;
      text_ += frag;
      emit(conn, "response.function_call_arguments.delta", with_item({{"delta", frag}}));
    }
  }

  void end(Connection& conn, const std::vector<ChoiceStream>& choices) override {
    if (!failed_) {
      close_item(conn);
      // An answer with no text and no call still has its (empty) message item, as the object does.
      if (!message_seen_ && choices[0].content().empty() && choices[0].tool_calls_message().empty()) {
        open_item(conn, Kind::message, "msg_" + h_.id.substr(5),
                  {{"type", "message"}, {"role", "assistant"}, {"content", json::array()}, {"status", "in_progress"}});
        emit(conn, "response.content_part.added", part_event(output_text("")));
        close_item(conn);
      }
      const std::string status = status_of(choices[0]);
      emit(conn, status == "completed" ? "response.completed" : "response.incomplete",
           {{"response", response_object(h_, choices[0], status)}});
    }
    conn.stream_end();
  }

  void body(Connection& conn, const std::vector<ChoiceStream>& choices) override {
    conn.reply(200, dumps(response_object(h_, choices[0], status_of(choices[0]))));
  }

 private:
  enum class Kind { none, reasoning, message, call };

  void emit(Connection& conn, const std::string& type, json ev) {
    ev["type"] = type;
    ev["sequence_number"] = seq_++;
    conn.stream_event(dumps(ev), type);
  }
  static json output_text(const std::string& t) {
    return {{"type", "output_text"}, {"text", t}, {"annotations", json::array()}, {"logprobs", json::array()}};
  }
  json with_item(json ev) const {
    ev["item_id"] = item_id_;
    ev["output_index"] = index_;
    return ev;
  }
  json part_event(json part) const { return with_item({{"content_index", 0}, {"part", std::move(part)}}); }

  void open_item(Connection& conn, Kind k, const std::string& id, json item) {
    kind_ = k;
    message_seen_ = message_seen_ || k == Kind::message;
    item_id_ = id;
    item["id"] = id;
    item_ = item;
    text_.clear();
    emit(conn, "response.output_item.added", {{"output_index", index_}, {"item", item}});
  }

  void close_item(Connection& conn) {
    if (kind_ == Kind::none) return;
    json item = item_;
    item["status"] = "completed";
    if (kind_ == Kind::reasoning) {
      json part = {{"type", "reasoning_text"}, {"text", text_}};
      emit(conn, "response.reasoning_text.done", with_item({{"content_index", 0}, {"text", text_}}));
      emit(conn, "response.content_part.done", part_event(part));
      item["content"] = json::array({part});
    } else if (kind_ == Kind::message) {
      emit(conn, "response.output_text.done", with_item({{"content_index", 0}, {"text", text_}, {"logprobs", json::array()}}));
      emit(conn, "response.content_part.done", part_event(output_text(text_)));
      item["content"] = json::array({output_text(text_)});
    } else {
      emit(conn, "response.function_call_arguments.done", with_item({{"arguments", text_}, {"name", name_}}));
      item["arguments"] = text_;
    }
    emit(conn, "response.output_item.done", {{"output_index", index_}, {"item", item}});
    ++index_;
    kind_ = Kind::none;
  }

  ResponsesHead h_;
  int64_t seq_ = 0;
  int index_ = 0;  // output index of the open item (or of the next one)
  Kind kind_ = Kind::none;
  std::string item_id_, text_, name_, call_id_;
  json item_;
  bool failed_ = false, message_seen_ = false;
};

}  // namespace

std::unique_ptr<Shaper> responses_shaper(ResponsesHead head) { return std::make_unique<ResponsesShaper>(std::move(head)); }

}  // namespace kestrel::server
