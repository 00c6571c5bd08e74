// K3 chat encoder. Structure follows MODEL.md §7's grammar; the exact texts of the internal system
// messages and the tool-result re-sorting follow Moonshot's reference encoder as read in NeMo's
// kimi_k3/encoding.py (see docs/tokenizer.md for each choice made where neither speaks).
#include "tokenizer/chat.h"

#include <algorithm>
#include <map>
#include <typeinfo>

#include "core/check.h"
#include "tokenizer/json_py.h"
#include "tokenizer/unicode_class.h"

namespace kestrel::tok {
namespace {

using ojson = nlohmann::ordered_json;

// A malformed request, naming the request field at fault.
template <class... A>
[[noreturn]] void bad(const char* field, fmt::format_string<A...> f, A&&... a) {
  throw ChatRequestError(field, fmt::format(f, std::forward<A>(a)...));
}

// Runs f; an error the shared helpers (content parts, tool calls, tool declarations) throw names `field`.
// Errors of other kinds (an image resolver's own, with its status) pass through as they are.
template <class F>
void about(const char* field, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    if (typeid(e) != typeid(Error)) throw;
    throw ChatRequestError(field, e.what());
  }
}

constexpr const char* kOpen = "<|open|>";
constexpr const char* kClose = "<|close|>";
constexpr const char* kSep = "<|sep|>";
constexpr const char* kEndOfMsg = "<|end_of_msg|>";

std::string escape_attr(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out.push_back(c);
  }
  return out;
}

// True when s has a character that is not whitespace in Python's sense (str.strip() non-empty).
bool has_non_space(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    Utf8Step st = utf8_step(p + i, s.size() - i);
    if (!(char_class(st.cp) & kPySpace)) return true;
    i += st.len;
  }
  return false;
}

std::string str_field(const ojson& obj, const char* key, const char* what) {
  if (!obj.contains(key) || obj[key].is_null()) return {};
  if (!obj[key].is_string()) fail("{}: '{}' must be a string", what, key);
  return obj[key].get<std::string>();
}

// XTML type name of a JSON value (reference: bool before number; ints and floats are "number").
const char* xtml_type(const ojson& v) {
  if (v.is_boolean()) return "boolean";
  if (v.is_null()) return "null";
  if (v.is_number()) return "number";
  if (v.is_string()) return "string";
  if (v.is_object()) return "object";
  return "array";
}

class Builder {
 public:
  Builder(const ImageResolver& images) : images_(images) {}

  std::vector<ChatSegment> segs;
  size_t num_images = 0;

  void control(std::string t) {
    if (!t.empty()) segs.push_back({std::move(t), true});
  }
  void text(std::string t) {
    if (!t.empty()) segs.push_back({std::move(t), false});
  }
  void open(const std::string& tag, const std::vector<std::pair<std::string, std::string>>& attrs = {}) {
    control(kOpen);
    text(tag);
    // Each attribute is four ordinary segments: ` key`, `="`, the escaped value, `"`.
    for (const auto& [k, v] : attrs) {
      text(" " + k);
      text("=\"");
      text(escape_attr(v));
      text("\"");
    }
    control(kSep);
  }
  void close(const std::string& tag) {
    control(kClose);
    text(tag);
    control(kSep);
  }
  void end_of_msg() { control(kEndOfMsg); }

  void internal_system(const std::string& type, const std::string& body) {
    open("message", {{"role", "system"}, {"type", type}});
    text(body);
    close("message");
    end_of_msg();
  }

  void image(const ojson& part) {
    const size_t index = num_images++;
    if (!images_) fail("this request has image content, which is not accepted here (no image decoder on this path)");
    const ImagePrompt ip = images_(part, index);
    if (ip.width <= 0 || ip.height <= 0 || ip.num_pads == 0) fail("image {} has an empty expansion", index);
    std::string s = "<|media_begin|>image " + std::to_string(ip.width) + "x" + std::to_string(ip.height) +
                    "<|media_content|>";
    s.reserve(s.size() + ip.num_pads * 13 + 16);
    for (size_t i = 0; i < ip.num_pads; ++i) s += "<|media_pad|>";
    s += "<|media_end|>";
    segs.push_back({std::move(s), true, int(index)});
  }

  // message content: string, null, or an array of parts (text / image).
  void content(const ojson& c, const char* what) {
    if (c.is_null()) return;
    if (c.is_string()) {
      text(c.get<std::string>());
      return;
    }
    if (!c.is_array()) fail("{}: content must be a string, null or an array of parts", what);
    for (const auto& part : c) {
      if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
        fail("{}: each content part needs a string 'type'", what);
      const std::string type = part["type"].get<std::string>();
      if (type == "text") {
        text(str_field(part, "text", what));
      } else if (type == "image_url" || type == "image" || type == "input_image") {
        image(part);
      } else {
        fail("{}: unsupported content part type '{}'", what, type);
      }
    }
  }

 private:
  const ImageResolver& images_;
};

std::string tools_body(const ojson& tools, bool dynamic) {
  const std::string js = py_json_dumps(deep_sort(tools), true);
  if (dynamic)
    return "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
           "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
           "```json\n" + js + "\n```";
  return "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" + js + "\n```";
}

void declare_tools(Builder& b, const ojson& tools, bool dynamic) {
  b.open("message", {{"role", "system"}, {"type", "tool-declare"}});
  b.text(tools_body(tools, dynamic));
  b.close("message");
  b.end_of_msg();
}

const ojson& call_function(const ojson& call) {
  if (call.contains("function") && call["function"].is_object()) return call["function"];
  return call;
}

std::string call_name(const ojson& call, size_t i) {
  const ojson& fn = call_function(call);
  if (!fn.contains("name") || !fn["name"].is_string())
    fail("assistant tool_calls[{}]: function.name must be a string", i);
  return fn["name"].get<std::string>();
}

void assistant_body(Builder& b, const ojson& m, bool thinking, size_t mi) {
  const std::string what = "messages[" + std::to_string(mi) + "]";
  if (thinking) {
    b.open("think");
    ojson r = m.contains("reasoning_content") && !m["reasoning_content"].is_null() ? m["reasoning_content"]
              : m.contains("reasoning") ? m["reasoning"] : ojson();
    if (!r.is_null()) {
      if (!r.is_string()) fail("{}: reasoning_content must be a string", what);
      if (has_non_space(r.get_ref<const std::string&>())) b.text(r.get<std::string>());
    }
    b.close("think");
  }
  b.open("response");
  if (m.contains("content")) b.content(m["content"], what.c_str());
  b.close("response");

  if (!m.contains("tool_calls") || m["tool_calls"].is_null()) return;
  const ojson& calls = m["tool_calls"];
  if (!calls.is_array()) fail("{}: tool_calls must be an array", what);
  if (calls.empty()) return;
  b.open("tools");
  for (size_t i = 0; i < calls.size(); ++i) {
    const ojson& call = calls[i];
    if (!call.is_object()) fail("{}: tool_calls[{}] must be an object", what, i);
    const std::string name = call_name(call, i);
    b.open("call", {{"tool", name}, {"index", std::to_string(i + 1)}});
    const ojson& fn = call_function(call);
    ojson args = fn.contains("arguments") ? fn["arguments"] : ojson();
    std::optional<std::string> json_block;
    if (args.is_null()) {
      args = ojson::object();
    } else if (args.is_string()) {
      const std::string& s = args.get_ref<const std::string&>();
      if (!has_non_space(s)) {
        args = ojson::object();
      } else {
        ojson parsed = ojson::parse(s, nullptr, false);
        if (parsed.is_discarded()) {
          json_block = s;  // unparseable: carried verbatim in a json block
          args = ojson::object();
        } else if (!parsed.is_object()) {
          fail("{}: tool_calls[{}] arguments must be a JSON object", what, i);
        } else {
          args = std::move(parsed);
        }
      }
    } else if (!args.is_object()) {
      fail("{}: tool_calls[{}] arguments must be a JSON object or a string", what, i);
    }
    if (json_block) {
      b.open("json", {{"type", "object"}});
      b.text(*json_block);
      b.close("json");
    } else {
      for (auto it = args.begin(); it != args.end(); ++it) {
        b.open("argument", {{"key", it.key()}, {"type", xtml_type(it.value())}});
        b.text(it.value().is_string() ? it.value().get<std::string>() : py_json_dumps(it.value(), false));
        b.close("argument");
      }
    }
    b.close("call");
  }
  b.close("tools");
}

struct ToolResult {
  const ojson* msg;
  std::string name;
  size_t index;
};

bool read_bool_like(const ojson& v, const char* what) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_object() && v.contains("type") && v["type"].is_string()) {
    const std::string t = v["type"].get<std::string>();
    if (t == "enabled") return true;
    if (t == "disabled") return false;
  }
  fail("{} must be a boolean or {{\"type\": \"enabled\"|\"disabled\"}}", what);
}

}  // namespace

ChatEncoder::ChatEncoder(const Tokenizer& tok) : tok_(&tok) {}

ChatPrompt ChatEncoder::encode_request(const ojson& req, const std::vector<ImagePrompt>& images) const {
  ImageResolver r = [&](const ojson&, size_t i) -> ImagePrompt {
    if (i >= images.size()) fail("the request has more images than image prompts ({})", images.size());
    return images[i];
  };
  ChatPrompt p = encode_request(req, r);
  if (p.num_images != images.size())
    fail("{} image prompts were given but the request has {} images", images.size(), p.num_images);
  return p;
}

ChatPrompt ChatEncoder::encode_request(const ojson& req, const ImageResolver& images) const {
  if (!req.is_object()) bad("messages", "the chat request must be a JSON object");
  if (!req.contains("messages") || !req["messages"].is_array()) bad("messages", "the chat request needs a 'messages' array");
  const ojson& messages = req["messages"];
  const ojson kwargs = req.contains("chat_template_kwargs") && req["chat_template_kwargs"].is_object()
                           ? req["chat_template_kwargs"] : ojson::object();
  if (req.contains("chat_template_kwargs") && !req["chat_template_kwargs"].is_null() && !req["chat_template_kwargs"].is_object())
    bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
  // The K3 template reads only the thinking switch, the effort and add_generation_prompt; another key (a
  // Jinja variable of some other model's template) would be accepted and ignored, so it is refused (null:
  // absent).
  for (const auto& [k, v] : kwargs.items())
    if (k != "thinking" && k != "enable_thinking" && k != "thinking_effort" && k != "add_generation_prompt" &&
        !v.is_null())
      bad("chat_template_kwargs", "unsupported chat_template_kwargs key '{}': the K3 chat format takes thinking "
          "(enable_thinking), thinking_effort and add_generation_prompt", k);
  ChatPrompt out;

  // Thinking switch and effort.
  bool thinking = true;
  about("thinking", [&] {
    if (req.contains("thinking") && !req["thinking"].is_null()) thinking = read_bool_like(req["thinking"], "'thinking'");
  });
  about("chat_template_kwargs", [&] {
    for (const char* k : {"thinking", "enable_thinking"})
      if (kwargs.contains(k) && !kwargs[k].is_null()) thinking = read_bool_like(kwargs[k], "chat_template_kwargs.thinking");
  });
  std::optional<std::string> effort;
  if (req.contains("reasoning_effort") && !req["reasoning_effort"].is_null()) {
    if (!req["reasoning_effort"].is_string()) bad("reasoning_effort", "'reasoning_effort' must be a string");
    const std::string e = req["reasoning_effort"].get<std::string>();
    if (e == "none")
      thinking = false;
    else
      effort = e;
  }
  const char* effort_field = "reasoning_effort";
  if (kwargs.contains("thinking_effort") && !kwargs["thinking_effort"].is_null()) {
    if (!kwargs["thinking_effort"].is_string())
      bad("chat_template_kwargs", "chat_template_kwargs.thinking_effort must be a string");
    effort = kwargs["thinking_effort"].get<std::string>();
    effort_field = "chat_template_kwargs";
  }
  if (thinking && effort && *effort != "low" && *effort != "medium" && *effort != "high" && *effort != "max")
    bad(effort_field, "unsupported reasoning effort '{}'; supported: low, medium, high, max", *effort);
  out.thinking = thinking;

  Builder b(images);

  // Tools.
  ojson tools = req.contains("tools") && !req["tools"].is_null() ? req["tools"] : ojson::array();
  if (!tools.is_array()) bad("tools", "'tools' must be an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    // OpenAI's other tool types (custom: free-form input; hosted tools) are not functions: rendered as one,
    // such a tool would be called with JSON arguments it never asked for.
    if (t.is_object() && t.contains("type") && !t["type"].is_null() && t["type"] != "function")
      bad("tools", "tools[{}]: only function tools are supported, got type {}", i, t["type"].dump());
    const ojson& fn = t.is_object() && t.contains("function") ? t["function"] : t;
    if (!fn.is_object() || !fn.contains("name") || !fn["name"].is_string()) bad("tools", "tools[{}] needs function.name", i);
    out.tool_names.push_back(fn["name"].get<std::string>());
  }
  if (!tools.empty()) about("tools", [&] { declare_tools(b, tools, false); });

  if (thinking && effort)
    b.internal_system("thinking-effort",
                      "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                      "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                      "Now the system is invoked with `thinking_effort=" + *effort + "`.");

  // Messages. Tool results are matched to the latest assistant's tool_calls by tool_call_id.
  const ojson* last_calls = nullptr;
  size_t tool_counter = 0;
  size_t mi = 0;
  about("messages", [&] {
  while (mi < messages.size()) {
    const ojson& m = messages[mi];
    const std::string what = "messages[" + std::to_string(mi) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) fail("{}: needs a string 'role'", what);
    const std::string role = m["role"].get<std::string>();
    const std::string name = str_field(m, "name", what.c_str());
    if (role == "user" || (role == "system" && !(m.contains("tools") && m["tools"].is_array() && !m["tools"].empty())) ||
        role == "developer") {
      std::vector<std::pair<std::string, std::string>> attrs = {{"role", role == "user" ? "user" : "system"}};
      if (!name.empty()) attrs.emplace_back("name", name);
      b.open("message", attrs);
      if (m.contains("content")) b.content(m["content"], what.c_str());
      b.close("message");
      b.end_of_msg();
      ++mi;
    } else if (role == "system") {
      declare_tools(b, m["tools"], true);
      ++mi;
    } else if (role == "assistant") {
      last_calls = m.contains("tool_calls") && m["tool_calls"].is_array() ? &m["tool_calls"] : nullptr;
      tool_counter = 0;
      std::vector<std::pair<std::string, std::string>> attrs = {{"role", "assistant"}};
      if (!name.empty()) attrs.emplace_back("name", name);
      b.open("message", attrs);
      assistant_body(b, m, thinking, mi);
      b.close("message");
      b.end_of_msg();
      ++mi;
    } else if (role == "tool") {
      // The run of consecutive tool messages.
      size_t end = mi;
      while (end < messages.size() && messages[end].is_object() && messages[end].value("role", "") == "tool") ++end;
      std::map<std::string, std::pair<size_t, std::string>> by_id;  // id -> (1-based position, name)
      if (last_calls)
        for (size_t i = 0; i < last_calls->size(); ++i) {
          const ojson& c = (*last_calls)[i];
          if (!c.is_object() || !c.contains("id") || c["id"].is_null()) continue;
          const std::string id = c["id"].is_string() ? c["id"].get<std::string>() : c["id"].dump();
          if (!by_id.count(id)) by_id.emplace(id, std::make_pair(i + 1, call_name(c, i)));
        }
      std::vector<ToolResult> run;
      bool all_matched = true;
      for (size_t k = mi; k < end; ++k) {
        const ojson& t = messages[k];
        ++tool_counter;
        const ojson idv = t.contains("tool_call_id") ? t["tool_call_id"] : (t.contains("id") ? t["id"] : ojson());
        std::string id = idv.is_string() ? idv.get<std::string>() : (idv.is_null() ? "" : idv.dump());
        auto it = idv.is_null() ? by_id.end() : by_id.find(id);
        if (it != by_id.end()) {
          run.push_back({&t, it->second.second, it->second.first});
          continue;
        }
        all_matched = false;
        std::string tname = str_field(t, "tool", "tool message");
        if (tname.empty()) tname = str_field(t, "name", "tool message");
        if (tname.empty() && last_calls && tool_counter <= last_calls->size())
          tname = call_name((*last_calls)[tool_counter - 1], tool_counter - 1);
        if (tname.empty())
          fail("messages[{}]: tool message needs a tool_call_id matching a preceding tool call, or a name", k);
        run.push_back({&t, tname, tool_counter});
      }
      if (all_matched)
        std::stable_sort(run.begin(), run.end(), [](const ToolResult& a, const ToolResult& c) { return a.index < c.index; });
      else {
        // Partly matched runs keep their order and are numbered by position in the run, as the
        // reference does; names of matched entries still come from their calls.
        size_t base = tool_counter - run.size();
        for (size_t k = 0; k < run.size(); ++k) run[k].index = base + k + 1;
      }
      for (const ToolResult& r : run) {
        b.open("message", {{"role", "tool"}, {"tool", r.name}, {"index", std::to_string(r.index)}});
        if (r.msg->contains("content")) b.content((*r.msg)["content"], "tool message");
        b.close("message");
        b.end_of_msg();
      }
      mi = end;
    } else {
      fail("{}: unsupported role '{}'", what, role);
    }
  }
  });

  // tool_choice.
  if (req.contains("tool_choice") && !req["tool_choice"].is_null()) {
    const ojson& tc = req["tool_choice"];
    auto required = [&] {
      b.internal_system("tool-choice",
                        "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.");
    };
    if (tc.is_string()) {
      const std::string s = tc.get<std::string>();
      if (s == "required")
        required();
      else if (s == "none")
        b.internal_system("tool-choice",
                          "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.");
      else if (s != "auto")
        bad("tool_choice", "unsupported tool_choice '{}'", s);
    } else if (tc.is_object()) {
      const ojson& fn = tc.contains("function") ? tc["function"] : tc;
      if (!fn.is_object() || !fn.contains("name") || !fn["name"].is_string())
        bad("tool_choice", "tool_choice object needs function.name (a function named among the tools)");
      const std::string fname = fn["name"].get<std::string>();
      if (std::find(out.tool_names.begin(), out.tool_names.end(), fname) == out.tool_names.end())
        bad("tool_choice", "tool_choice names '{}', which is not among the declared tools", fname);
      out.forced_tool = fname;
      required();
    } else {
      bad("tool_choice", "tool_choice must be a string or an object");
    }
  }

  // response_format.
  if (req.contains("response_format") && !req["response_format"].is_null()) {
    const ojson& rf = req["response_format"];
    std::string type = rf.is_object() && rf.contains("type") && rf["type"].is_string() ? rf["type"].get<std::string>()
                       : rf.is_string() ? rf.get<std::string>() : "";
    const std::string head =
        "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";
    if (type == "json_object") {
      b.internal_system("response-format", "The system is invoked with `response_format=json_object`.\n" + head);
    } else if (type == "json_schema") {
      ojson schema;
      if (rf.is_object() && rf.contains("json_schema") && !rf["json_schema"].is_null()) {
        const ojson& js = rf["json_schema"];
        if (js.is_object() && js.contains("schema"))
          schema = js["schema"];
        else if (js.is_object() && js.contains("json_schema"))
          schema = js["json_schema"];
        else
          schema = js;
      }
      b.internal_system("response-format", "The system is invoked with `response_format=json_schema`.\n" + head +
                                               "\nThe JSON data must match the following schema:\n```json\n" +
                                               py_json_dumps(deep_sort(schema), true) + "\n```");
    } else if (type != "text") {
      bad("response_format", "unsupported response_format type '{}'", type);
    }
  }

  bool gen = true;
  if (req.contains("add_generation_prompt") && req["add_generation_prompt"].is_boolean())
    gen = req["add_generation_prompt"].get<bool>();
  if (kwargs.contains("add_generation_prompt") && kwargs["add_generation_prompt"].is_boolean())
    gen = kwargs["add_generation_prompt"].get<bool>();
  out.generation_prompt = gen;
  if (gen) {
    b.open("message", {{"role", "assistant"}});
    b.open(thinking ? "think" : "response");
  }
  out.num_images = b.num_images;
  out.segments = std::move(b.segs);
  std::optional<TokenId> pad;
  if (out.num_images > 0 && !(pad = tok_->special_id("<|media_pad|>")))
    bad("messages", "the tokenizer has no <|media_pad|> token: this model takes no image input");
  for (const auto& s : out.segments) {
    out.text += s.text;
    const size_t before = out.ids.size();
    tok_->encode_append(s.text, s.allow_special, out.ids);
    if (s.image < 0) continue;
    // The pads are one run inside the segment: <|media_begin|>, "image WxH", <|media_content|>, pads, <|media_end|>.
    size_t a = before;
    while (a < out.ids.size() && out.ids[a] != *pad) ++a;
    size_t e = a;
    while (e < out.ids.size() && out.ids[e] == *pad) ++e;
    if (a == e) bad("messages", "image {} expanded to no <|media_pad|> tokens", s.image);
    out.image_pads.emplace_back(a, e);
  }
  return out;
}

}  // namespace kestrel::tok
