// Loading and checking evaluation sets: see eval_set.h.
#include "evalclient/eval_set.h"

#include <fmt/format.h>

#include <fstream>
#include <set>

#include "core/check.h"

namespace kestrel::eval {

using ojson = nlohmann::ordered_json;

const char* task_name(Task t) {
  switch (t) {
    case Task::kPasskey: return "passkey";
    case Task::kArith: return "arith";
    case Task::kTool: return "tool";
    case Task::kChat: return "chat";
    case Task::kImage: return "image";
  }
  return "?";
}

std::string normalize_answer(const std::string& s) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  auto trim = [&](std::string t) {
    size_t a = 0, b = t.size();
    while (a < b && space(t[a])) ++a;
    while (b > a && space(t[b - 1])) --b;
    return t.substr(a, b - a);
  };
  std::string t = trim(s);
  if (!t.empty() && t.back() == '.') t = trim(t.substr(0, t.size() - 1));
  for (char& c : t)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return t;
}

std::string normalize_integer(const std::string& s) {
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
  if (i == s.size()) return "";
  for (size_t j = i; j < s.size(); ++j)
    if (s[j] < '0' || s[j] > '9') return "";
  while (i + 1 < s.size() && s[i] == '0') ++i;
  std::string digits = s.substr(i);
  if (digits == "0") return "0";
  return neg ? "-" + digits : digits;
}

std::string last_integer(const std::string& text) {
  auto digit = [&](size_t k) { return k < text.size() && text[k] >= '0' && text[k] <= '9'; };
  std::string last;
  size_t i = 0;
  while (i < text.size()) {
    size_t start = i;
    if (text[i] == '-' && digit(i + 1)) {
      ++i;
    } else if (!digit(i)) {
      ++i;
      continue;
    }
    while (digit(i)) ++i;
    last = text.substr(start, i - start);
  }
  return last.empty() ? "" : normalize_integer(last);
}

namespace {

std::string expect_integer(const ojson& expect, const std::string& where) {
  const auto it = expect.find("answer");
  if (it == expect.end()) fail("{}: expect.answer is missing", where);
  std::string s;
  if (it->is_string())
    s = it->get<std::string>();
  else if (it->is_number_integer())
    s = it->dump();
  else
    fail("{}: expect.answer must be an integer or a string of one", where);
  const std::string n = normalize_integer(s);
  if (n.empty()) fail("{}: expect.answer '{}' is not an integer", where, s);
  return n;
}

}  // namespace

EvalItem parse_eval_item(const std::string& line, const std::string& where) {
  const ojson j = ojson::parse(line, nullptr, false);
  if (j.is_discarded()) fail("{}: not valid JSON", where);
  if (!j.is_object()) fail("{}: an item must be a JSON object", where);
  EvalItem it;
  it.where = where;
  auto str = [&](const char* k) {
    const auto f = j.find(k);
    if (f == j.end() || !f->is_string() || f->get<std::string>().empty())
      fail("{}: '{}' must be a non-empty string", where, k);
    return f->get<std::string>();
  };
  it.id = str("id");
  const std::string task = str("task");
  if (task == "passkey")
    it.task = Task::kPasskey;
  else if (task == "arith")
    it.task = Task::kArith;
  else if (task == "tool")
    it.task = Task::kTool;
  else if (task == "chat")
    it.task = Task::kChat;
  else if (task == "image")
    it.task = Task::kImage;
  else
    fail("{}: unknown task '{}' (expected passkey, arith, tool, chat or image)", where, task);
  const std::string at = fmt::format("{} ({})", where, it.id);

  if (!j.contains("request") || !j["request"].is_object()) fail("{}: 'request' must be an object", at);
  it.request = j["request"];
  if (!it.request.contains("messages") || !it.request["messages"].is_array() || it.request["messages"].empty())
    fail("{}: request.messages must be a non-empty array", at);
  it.expect = j.value("expect", ojson::object());
  it.meta = j.value("meta", ojson::object());
  if (!it.expect.is_object()) fail("{}: 'expect' must be an object", at);
  if (!it.meta.is_object()) fail("{}: 'meta' must be an object", at);

  if (it.request.contains("tools")) {
    const ojson& tools = it.request["tools"];
    if (!tools.is_array()) fail("{}: request.tools must be an array", at);
    for (size_t i = 0; i < tools.size(); ++i) {
      const ojson& t = tools[i];
      if (!t.is_object() || !t.contains("function") || !t["function"].is_object() || !t["function"].contains("name") ||
          !t["function"]["name"].is_string())
        fail("{}: request.tools[{}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", at, i);
      const std::string name = t["function"]["name"].get<std::string>();
      // A function without parameters takes none: the empty object schema admits any object, as
      // OpenAI treats a missing `parameters`.
      const nlohmann::json params = t["function"].contains("parameters")
                                        ? nlohmann::json(t["function"]["parameters"])
                                        : nlohmann::json::object();
      try {
        it.tools[name] = std::make_shared<const JsonSchema>(params);
      } catch (const Error& e) {
        fail("{}: tool '{}': {}", at, name, e.what());
      }
    }
  }

  switch (it.task) {
    case Task::kPasskey: {
      it.answer = expect_integer(it.expect, at);
      const auto c = it.meta.find("context_tokens");
      const auto d = it.meta.find("depth");
      if (c == it.meta.end() || !c->is_number_integer()) fail("{}: meta.context_tokens must be an integer", at);
      if (d == it.meta.end() || !d->is_number()) fail("{}: meta.depth must be a number", at);
      it.context_tokens = c->get<long long>();
      it.depth = d->get<double>();
      break;
    }
    case Task::kArith: {
      it.answer = expect_integer(it.expect, at);
      const auto e = it.meta.find("effort");
      if (e != it.meta.end() && e->is_string())
        it.effort = e->get<std::string>();
      else if (it.request.contains("reasoning_effort") && it.request["reasoning_effort"].is_string())
        it.effort = it.request["reasoning_effort"].get<std::string>();
      else
        it.effort = "default";
      break;
    }
    case Task::kTool: {
      const auto c = it.expect.find("call");
      if (c == it.expect.end() || !c->is_boolean()) fail("{}: expect.call must be true or false", at);
      it.expect_call = c->get<bool>();
      if (it.tools.empty()) fail("{}: a tool item needs request.tools", at);
      if (it.expect_call) {
        const auto n = it.expect.find("name");
        if (n == it.expect.end() || !n->is_string()) fail("{}: expect.name must name the tool to call", at);
        it.expect_name = n->get<std::string>();
        if (!it.tools.count(it.expect_name)) fail("{}: expect.name '{}' is not a declared tool", at, it.expect_name);
      }
      break;
    }
    case Task::kChat: break;
    case Task::kImage: {
      const auto a = it.expect.find("answer");
      if (a == it.expect.end() || !a->is_string() || normalize_answer(a->get<std::string>()).empty())
        fail("{}: expect.answer must be a non-empty string", at);
      it.answer = normalize_answer(a->get<std::string>());
      const auto k = it.meta.find("kind");
      if (k == it.meta.end() || !k->is_string() || k->get<std::string>().empty())
        fail("{}: meta.kind must be a non-empty string (the table's row)", at);
      it.kind = k->get<std::string>();
      break;
    }
  }
  return it;
}

std::vector<EvalItem> load_eval_set(const std::string& path, int limit) {
  std::ifstream f(path);
  if (!f) fail("cannot read eval set {}", path);
  std::vector<EvalItem> items;
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (limit > 0 && int(items.size()) >= limit) break;
    items.push_back(parse_eval_item(line, fmt::format("{}:{}", path, n)));
  }
  if (f.bad()) fail("error reading eval set {}", path);
  if (items.empty()) fail("eval set {} holds no items", path);
  return items;
}

void check_unique_ids(const std::vector<EvalItem>& items) {
  std::set<std::string> seen;
  for (const auto& it : items)
    if (!seen.insert(it.id).second) fail("{}: id '{}' appears twice (ids must be unique across all sets)", it.where, it.id);
}

std::string request_body(const EvalItem& item, const std::string& model, long long seed) {
  ojson j = item.request;
  j["model"] = model;
  j["stream"] = false;
  if (!j.contains("temperature")) j["temperature"] = 0.0;
  if (seed >= 0) j["seed"] = seed;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace kestrel::eval
