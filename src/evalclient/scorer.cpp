// Scoring, summaries, tables and the result file of `kestrel eval`: see scorer.h and docs/eval.md.
#include "evalclient/scorer.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/check.h"

namespace kestrel::eval {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {

std::string clip(std::string s, size_t n = 300) {
  if (s.size() > n) s = s.substr(0, n) + "...";
  return s;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Arithmetic rows in effort order (low, medium, high, max), anything else after them by name.
std::vector<std::pair<std::string, Count>> efforts_in_order(const Summary& s) {
  auto rank = [](const std::string& e) {
    const char* order[] = {"none", "low", "medium", "high", "max"};
    for (int i = 0; i < 5; ++i)
      if (e == order[i]) return i;
    return 5;
  };
  std::vector<std::pair<std::string, Count>> v(s.arith_by_effort.begin(), s.arith_by_effort.end());
  std::stable_sort(v.begin(), v.end(), [&](const auto& a, const auto& b) { return rank(a.first) < rank(b.first); });
  return v;
}

double pct(long long a, long long b) { return b > 0 ? 100.0 * double(a) / double(b) : 0.0; }

std::string pct_cell(long long a, long long b) { return b > 0 ? fmt::format("{:.1f}", pct(a, b)) : "-"; }

// Text fields may be null (content of a pure tool-call message); anything else but a string is an error.
std::string text_field(const json& obj, const char* key, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return "";
  if (!it->is_string()) fail("{}: '{}' must be a string or null", where, key);
  return it->get<std::string>();
}

}  // namespace

Response response_from_http(int status, const std::string& body, const std::string& transport_error) {
  Response r;
  if (status == 0) {
    r.error = transport_error.empty() ? "no answer" : transport_error;
    return r;
  }
  if (status != 200) {
    r.error = fmt::format("HTTP {}: {}", status, clip(body));
    return r;
  }
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) {
    r.error = "bad JSON in the response: " + clip(body);
    return r;
  }
  if (!j.is_object() || !j.contains("choices") || !j["choices"].is_array() || j["choices"].empty() ||
      !j["choices"][0].is_object() || !j["choices"][0].contains("message") || !j["choices"][0]["message"].is_object()) {
    r.error = "the response has no choices[0].message: " + clip(body);
    return r;
  }
  const json& choice = j["choices"][0];
  const json& msg = choice["message"];
  try {
    r.finish_reason = text_field(choice, "finish_reason", "choices[0]");
    r.content = text_field(msg, "content", "message");
    // vLLM and we send reasoning_content; some servers only "reasoning".
    r.reasoning_content = text_field(msg, "reasoning_content", "message");
    if (r.reasoning_content.empty()) r.reasoning_content = text_field(msg, "reasoning", "message");
  } catch (const Error& e) {
    r = Response{};
    r.error = std::string("malformed response: ") + e.what();
    return r;
  }
  if (msg.contains("tool_calls") && !msg["tool_calls"].is_null()) {
    if (!msg["tool_calls"].is_array()) {
      r.error = "message.tool_calls is not an array";
      return r;
    }
    for (const json& c : msg["tool_calls"]) {
      ToolCall tc;
      const json* fn = c.is_object() && c.contains("function") && c["function"].is_object() ? &c["function"] : nullptr;
      if (!fn || !fn->contains("name") || !(*fn)["name"].is_string()) {
        tc.problem = "a tool call without function.name";
      } else {
        tc.name = (*fn)["name"].get<std::string>();
        const auto a = fn->find("arguments");
        if (a == fn->end() || !a->is_string())
          tc.problem = "function.arguments is not a string";
        else
          tc.arguments = a->get<std::string>();
      }
      r.tool_calls.push_back(std::move(tc));
    }
  }
  return r;
}

ojson response_to_json(const Response& r) {
  if (!r.ok()) return ojson{{"error", r.error}};
  ojson calls = ojson::array();
  for (const auto& c : r.tool_calls) {
    ojson e{{"name", c.name}, {"arguments", c.arguments}};
    if (!c.problem.empty()) e["problem"] = c.problem;
    calls.push_back(std::move(e));
  }
  return ojson{{"finish_reason", r.finish_reason},
               {"content", r.content},
               {"reasoning_content", r.reasoning_content},
               {"tool_calls", std::move(calls)}};
}

Response response_from_json(const json& j, const std::string& where) {
  if (!j.is_object()) fail("{}: a response must be an object", where);
  Response r;
  if (j.contains("error") && !j["error"].is_null()) {
    r.error = j["error"].is_string() ? j["error"].get<std::string>() : dump(j["error"]);
    if (r.error.empty()) r.error = "error";
    return r;
  }
  r.finish_reason = text_field(j, "finish_reason", where);
  if (r.finish_reason.empty()) fail("{}: 'finish_reason' is missing", where);
  r.content = text_field(j, "content", where);
  r.reasoning_content = text_field(j, "reasoning_content", where);
  if (j.contains("tool_calls") && !j["tool_calls"].is_null()) {
    if (!j["tool_calls"].is_array()) fail("{}: 'tool_calls' must be an array", where);
    for (const json& c : j["tool_calls"]) {
      if (!c.is_object()) fail("{}: each tool call must be an object", where);
      ToolCall tc;
      tc.name = text_field(c, "name", where);
      if (c.contains("arguments") && !c["arguments"].is_string())
        tc.problem = "arguments is not a string";
      else
        tc.arguments = text_field(c, "arguments", where);
      if (c.contains("problem") && c["problem"].is_string()) tc.problem = c["problem"].get<std::string>();
      r.tool_calls.push_back(std::move(tc));
    }
  }
  return r;
}

Verdict score_item(const EvalItem& item, const Response& r) {
  Verdict v;
  v.error = !r.ok();
  switch (item.task) {
    case Task::kPasskey:
    case Task::kArith:
      if (v.error) break;
      v.extracted = last_integer(r.content);
      v.correct = !v.extracted.empty() && v.extracted == item.answer;
      break;
    case Task::kTool: {
      if (v.error) break;
      v.called = r.finish_reason == "tool_calls";
      if (v.called) {
        v.schema_valid = true;
        auto bad = [&](const char* cls, std::string why) {
          if (!v.schema_valid) return;
          v.schema_valid = false;
          v.schema_class = cls;
          v.schema_problem = std::move(why);
        };
        if (r.tool_calls.empty()) bad("no_calls", "finish_reason is tool_calls but no call was made");
        for (size_t i = 0; i < r.tool_calls.size(); ++i) {
          const ToolCall& c = r.tool_calls[i];
          if (!c.problem.empty()) {
            bad("malformed", fmt::format("call {}: {}", i, c.problem));
            continue;
          }
          const auto t = item.tools.find(c.name);
          if (t == item.tools.end()) {
            bad("unknown_tool", fmt::format("call {}: unknown tool '{}'", i, c.name));
            continue;
          }
          const json args = json::parse(c.arguments, nullptr, false);
          if (args.is_discarded()) {
            bad("bad_json", fmt::format("call {} ({}): arguments do not parse as JSON: {}", i, c.name, clip(c.arguments, 120)));
            continue;
          }
          if (!args.is_object()) {
            bad("not_object", fmt::format("call {} ({}): arguments are not a JSON object", i, c.name));
            continue;
          }
          const std::string why = t->second->validate(args);
          if (!why.empty()) bad("schema", fmt::format("call {} ({}): {}", i, c.name, why));
        }
      }
      v.correct = v.called == item.expect_call &&
                  (!item.expect_call || (!r.tool_calls.empty() && r.tool_calls[0].name == item.expect_name));
      break;
    }
    case Task::kChat:
      v.correct = !v.error && (!r.content.empty() || !r.tool_calls.empty());
      break;
    case Task::kImage: {
      if (v.error) break;
      const std::string got = normalize_answer(r.content);
      v.correct = got == item.answer;
      v.extracted = clip(got, 200);
      break;
    }
  }
  return v;
}

Summary summarize(const std::vector<EvalItem>& items, const std::vector<Response>& responses,
                  const std::vector<Verdict>& verdicts) {
  KCHECK(items.size() == responses.size() && items.size() == verdicts.size(), "one response and verdict per item");
  Summary s;
  for (size_t i = 0; i < items.size(); ++i) {
    const EvalItem& it = items[i];
    const Verdict& v = verdicts[i];
    ++s.items;
    if (v.error) {
      ++s.errors;
      if (s.first_errors.size() < 10) s.first_errors.push_back(it.id + ": " + responses[i].error);
    }
    switch (it.task) {
      case Task::kPasskey:
        s.passkey_cells[{it.context_tokens, it.depth}].add(v);
        s.passkey_by_length[it.context_tokens].add(v);
        s.passkey.add(v);
        break;
      case Task::kArith:
        s.arith_by_effort[it.effort].add(v);
        s.arith.add(v);
        break;
      case Task::kTool:
        ++s.tool_n;
        s.tool_errors += v.error;
        s.tool_expected_calls += it.expect_call;
        s.tool_calls += v.called;
        s.tool_schema_valid += v.called && v.schema_valid;
        if (v.called && !v.schema_valid) ++s.tool_schema_failures[v.schema_class];
        s.tool_trigger_correct += v.correct;
        s.tool_trigger_by_kind[it.meta.value("kind", it.expect_call ? std::string("call") : std::string("nofit"))].add(v);
        break;
      case Task::kChat:
        s.chat.add(v);
        break;
      case Task::kImage:
        s.image_by_kind[it.kind].add(v);
        s.image.add(v);
        break;
    }
  }
  return s;
}

std::string format_tables(const Summary& s) {
  std::ostringstream o;
  auto rule = [&](size_t w) { o << std::string(w, '-') << '\n'; };
  if (s.passkey.n > 0) {
    std::set<double> depths;
    for (const auto& [k, c] : s.passkey_cells) depths.insert(k.second);
    o << "Passkey retrieval (% correct; rows: context tokens, columns: depth)\n";
    std::string head = fmt::format("{:>10}", "context");
    for (double d : depths) head += fmt::format(" {:>7}", fmt::format("{:g}", d));
    head += fmt::format(" {:>8} {:>9} {:>7}", "all", "correct", "errors");
    o << head << '\n';
    rule(head.size());
    for (const auto& [len, tot] : s.passkey_by_length) {
      o << fmt::format("{:>10}", len);
      for (double d : depths) {
        const auto it = s.passkey_cells.find({len, d});
        o << fmt::format(" {:>7}", it == s.passkey_cells.end() ? "" : pct_cell(it->second.correct, it->second.n));
      }
      o << fmt::format(" {:>8} {:>9} {:>7}\n", pct_cell(tot.correct, tot.n), fmt::format("{}/{}", tot.correct, tot.n),
                       tot.errors);
    }
    rule(head.size());
    o << fmt::format("{:>10}", "all") << std::string(8 * depths.size(), ' ')
      << fmt::format(" {:>8} {:>9} {:>7}\n\n", pct_cell(s.passkey.correct, s.passkey.n),
                     fmt::format("{}/{}", s.passkey.correct, s.passkey.n), s.passkey.errors);
  }
  if (s.arith.n > 0) {
    o << "Arithmetic (exact match of the last integer)\n";
    const std::string head = fmt::format("{:>10} {:>8} {:>9} {:>7}", "effort", "%", "correct", "errors");
    o << head << '\n';
    rule(head.size());
    for (const auto& [e, c] : efforts_in_order(s))
      o << fmt::format("{:>10} {:>8} {:>9} {:>7}\n", e, pct_cell(c.correct, c.n), fmt::format("{}/{}", c.correct, c.n),
                       c.errors);
    rule(head.size());
    o << fmt::format("{:>10} {:>8} {:>9} {:>7}\n\n", "all", pct_cell(s.arith.correct, s.arith.n),
                     fmt::format("{}/{}", s.arith.correct, s.arith.n), s.arith.errors);
  }
  if (s.tool_n > 0) {
    o << "Tool calls (K2 Vendor Verifier rules)\n";
    o << fmt::format("{:<34} {:>8} {}\n", "schema accuracy (%)", pct_cell(s.tool_schema_valid, s.tool_calls),
                     fmt::format("({}/{} tool_calls responses schema-valid)", s.tool_schema_valid, s.tool_calls));
    o << fmt::format("{:<34} {:>8} {}\n", "trigger accuracy (%)", pct_cell(s.tool_trigger_correct, s.tool_n),
                     fmt::format("({}/{} items)", s.tool_trigger_correct, s.tool_n));
    for (const auto& [kind, c] : s.tool_trigger_by_kind)
      o << fmt::format("{:<34} {:>8} {}\n", fmt::format("  trigger accuracy, {} (%)", kind), pct_cell(c.correct, c.n),
                       fmt::format("({}/{})", c.correct, c.n));
    o << fmt::format("{:<34} {:>8}\n", "items", s.tool_n);
    o << fmt::format("{:<34} {:>8}\n", "items expecting a call", s.tool_expected_calls);
    o << fmt::format("{:<34} {:>8}\n", "responses with tool_calls", s.tool_calls);
    o << fmt::format("{:<34} {:>8}\n", "schema-invalid responses", s.tool_calls - s.tool_schema_valid);
    for (const auto& [cls, n] : s.tool_schema_failures) o << fmt::format("{:<34} {:>8}\n", "  " + cls, n);
    o << fmt::format("{:<34} {:>8}\n\n", "errors", s.tool_errors);
  }
  if (s.chat.n > 0)
    o << fmt::format("Chat: {}/{} answered, {} errors\n\n", s.chat.correct, s.chat.n, s.chat.errors);
  if (s.image.n > 0) {
    o << "Images (exact match of the answer, case and a final '.' ignored)\n";
    const std::string head = fmt::format("{:>10} {:>8} {:>9} {:>7}", "kind", "%", "correct", "errors");
    o << head << '\n';
    rule(head.size());
    for (const auto& [k, c] : s.image_by_kind)
      o << fmt::format("{:>10} {:>8} {:>9} {:>7}\n", k, pct_cell(c.correct, c.n), fmt::format("{}/{}", c.correct, c.n),
                       c.errors);
    rule(head.size());
    o << fmt::format("{:>10} {:>8} {:>9} {:>7}\n\n", "all", pct_cell(s.image.correct, s.image.n),
                     fmt::format("{}/{}", s.image.correct, s.image.n), s.image.errors);
  }
  o << fmt::format("Items: {}, errors: {}", s.items, s.errors);
  for (const auto& e : s.first_errors) o << "\n  " << clip(e, 200);
  return o.str();
}

namespace {

ojson count_json(const Count& c) {
  return ojson{{"n", c.n}, {"correct", c.correct}, {"errors", c.errors}, {"accuracy", c.n ? double(c.correct) / double(c.n) : 0.0}};
}

}  // namespace

ojson summary_json(const Summary& s) {
  ojson j = ojson::object();
  if (s.passkey.n > 0) {
    ojson grid = ojson::array(), by_len = ojson::array();
    for (const auto& [k, c] : s.passkey_cells) {
      ojson e{{"context_tokens", k.first}, {"depth", k.second}};
      e.update(count_json(c));
      grid.push_back(std::move(e));
    }
    for (const auto& [len, c] : s.passkey_by_length) {
      ojson e{{"context_tokens", len}};
      e.update(count_json(c));
      by_len.push_back(std::move(e));
    }
    j["passkey"] = ojson{{"total", count_json(s.passkey)}, {"by_length", std::move(by_len)}, {"grid", std::move(grid)}};
  }
  if (s.arith.n > 0) {
    ojson by = ojson::array();
    for (const auto& [e, c] : efforts_in_order(s)) {
      ojson x{{"effort", e}};
      x.update(count_json(c));
      by.push_back(std::move(x));
    }
    j["arith"] = ojson{{"total", count_json(s.arith)}, {"by_effort", std::move(by)}};
  }
  if (s.tool_n > 0) {
    ojson kinds = ojson::object();
    for (const auto& [k, c] : s.tool_trigger_by_kind) kinds[k] = count_json(c);
    ojson failures = ojson::object();
    for (const auto& [k, n] : s.tool_schema_failures) failures[k] = n;
    j["tool"] = ojson{{"n", s.tool_n},
                      {"errors", s.tool_errors},
                      {"expected_calls", s.tool_expected_calls},
                      {"tool_calls", s.tool_calls},
                      {"schema_valid", s.tool_schema_valid},
                      {"schema_accuracy", s.tool_calls ? double(s.tool_schema_valid) / double(s.tool_calls) : 0.0},
                      {"trigger_correct", s.tool_trigger_correct},
                      {"trigger_accuracy", s.tool_n ? double(s.tool_trigger_correct) / double(s.tool_n) : 0.0},
                      {"trigger_by_kind", std::move(kinds)},
                      {"schema_failures", std::move(failures)}};
  }
  if (s.chat.n > 0) j["chat"] = ojson{{"n", s.chat.n}, {"answered", s.chat.correct}, {"errors", s.chat.errors}};
  if (s.image.n > 0) {
    ojson kinds = ojson::object();
    for (const auto& [k, c] : s.image_by_kind) kinds[k] = count_json(c);
    j["image"] = ojson{{"total", count_json(s.image)}, {"by_kind", std::move(kinds)}};
  }
  j["items"] = s.items;
  j["errors"] = s.errors;
  j["first_errors"] = s.first_errors;
  return j;
}

ojson item_json(const EvalItem& item, const Response& r, const Verdict& v, bool with_response) {
  ojson j{{"id", item.id}, {"task", task_name(item.task)}, {"meta", item.meta}};
  ojson vj = ojson::object();
  vj["error"] = v.error;
  switch (item.task) {
    case Task::kPasskey:
    case Task::kArith:
      vj["answer"] = item.answer;
      vj["extracted"] = v.extracted;
      vj["correct"] = v.correct;
      break;
    case Task::kTool:
      vj["expect_call"] = item.expect_call;
      vj["called"] = v.called;
      vj["schema_valid"] = v.called ? ojson(v.schema_valid) : ojson(nullptr);
      if (!v.schema_problem.empty()) vj["schema_problem"] = v.schema_problem;
      vj["trigger_correct"] = v.correct;
      break;
    case Task::kChat:
      vj["answered"] = v.correct;
      break;
    case Task::kImage:
      vj["answer"] = item.answer;
      vj["extracted"] = v.extracted;
      vj["correct"] = v.correct;
      break;
  }
  j["verdict"] = std::move(vj);
  if (!r.ok()) j["error"] = r.error;
  if (with_response && r.ok()) j["response"] = response_to_json(r);
  return j;
}

std::vector<Response> read_saved_responses(const std::string& path, const std::vector<EvalItem>& items,
                                           std::vector<std::string>* missing) {
  std::ifstream f(path);
  if (!f) fail("cannot read --score-responses file {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  const json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) fail("{}: not valid JSON", path);
  if (!j.is_object() || !j.contains("items") || !j["items"].is_array())
    fail("{}: expected an object with an \"items\" array (a `kestrel eval --save-responses --out` file or "
         "reference/eval_ref.py's output)", path);
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < items.size(); ++i) index[items[i].id] = i;
  std::vector<Response> out(items.size());
  std::vector<bool> seen(items.size(), false);
  const json& arr = j["items"];
  for (size_t k = 0; k < arr.size(); ++k) {
    const std::string where = fmt::format("{}: items[{}]", path, k);
    const json& e = arr[k];
    if (!e.is_object() || !e.contains("id") || !e["id"].is_string()) fail("{}: needs a string \"id\"", where);
    const std::string id = e["id"].get<std::string>();
    const auto it = index.find(id);
    if (it == index.end()) fail("{}: id '{}' is in no --set given", where, id);
    if (seen[it->second]) fail("{}: id '{}' appears twice", where, id);
    seen[it->second] = true;
    if (e.contains("response") && !e["response"].is_null()) {
      out[it->second] = response_from_json(e["response"], where + ".response");
    } else if (e.contains("error") && e["error"].is_string() && !e["error"].get<std::string>().empty()) {
      out[it->second].error = e["error"].get<std::string>();
    } else {
      fail("{}: needs a \"response\" object or an \"error\" string (was the file written with --save-responses?)", where);
    }
  }
  for (size_t i = 0; i < items.size(); ++i)
    if (!seen[i]) {
      missing->push_back(items[i].id);
      out[i].error = "no saved response";
    }
  return out;
}

}  // namespace kestrel::eval
