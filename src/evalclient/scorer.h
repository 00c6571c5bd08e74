// Scoring for `kestrel eval` (rules: docs/eval.md), shared by the endpoint mode and the offline
// `--score-responses` mode, so the engine and the PyTorch reference are judged by one scorer.
//
// A Response is one answer flattened to what scoring needs — the shape both `--save-responses` and
// reference/eval_ref.py write: {"finish_reason", "content", "reasoning_content", "tool_calls":
// [{"name", "arguments"}]} — or an error (HTTP status, timeout, unparseable body). Errors are counted
// per task and make passkey/arith/trigger answers wrong; they never stop a run.
//
// Tool calls are scored as Moonshot's K2 Vendor Verifier does: a response "calls" when its
// finish_reason is "tool_calls"; it is schema-valid when it carries at least one call and every call
// names a declared tool whose `parameters` schema accepts the call's `arguments` string parsed as a
// JSON object. Schema accuracy = schema-valid / calls; trigger accuracy = (calls == expected call,
// and the first call's name is the expected one when a call is expected) over all items.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "evalclient/eval_set.h"

namespace kestrel::eval {

struct ToolCall {
  std::string name, arguments;
  std::string problem;  // non-empty: the call was malformed on the wire (e.g. arguments not a string)
};

struct Response {
  std::string error;  // non-empty: no usable answer (transport/HTTP/format error)
  std::string finish_reason, content, reasoning_content;
  std::vector<ToolCall> tool_calls;
  bool ok() const { return error.empty(); }
};

// From an OpenAI chat completion: status 0 means no HTTP answer (`transport_error` says why).
Response response_from_http(int status, const std::string& body, const std::string& transport_error);

// The flat shape above; from_json throws kestrel::Error for a malformed object (with `where`).
nlohmann::ordered_json response_to_json(const Response& r);
Response response_from_json(const nlohmann::json& j, const std::string& where);

struct Verdict {
  bool error = false;
  // passkey / arith: the last integer of content ("" if none) and whether it equals the answer;
  // image: content normalised (normalize_answer, clipped to 200 bytes).
  std::string extracted;
  bool correct = false;  // passkey/arith/image: the answer; tool: trigger correct; chat: answered
  // tool
  bool called = false;        // finish_reason == "tool_calls"
  bool schema_valid = false;  // meaningful when called
  std::string schema_problem; // why not schema-valid: "unknown tool 'x'", "arguments do not parse", ...
  std::string schema_class;   // "no_calls" | "unknown_tool" | "bad_json" | "not_object" | "schema" | "malformed"
};

Verdict score_item(const EvalItem& item, const Response& r);

struct Count {
  long long n = 0, correct = 0, errors = 0;
  void add(const Verdict& v) { ++n, correct += v.correct, errors += v.error; }
};

struct Summary {
  // passkey: by (context_tokens, depth), by context_tokens, all
  std::map<std::pair<long long, double>, Count> passkey_cells;
  std::map<long long, Count> passkey_by_length;
  Count passkey;
  std::map<std::string, Count> arith_by_effort;
  Count arith;
  // tool
  long long tool_n = 0, tool_errors = 0, tool_expected_calls = 0, tool_calls = 0, tool_schema_valid = 0,
            tool_trigger_correct = 0;
  std::map<std::string, long long> tool_schema_failures;  // by schema_class
  std::map<std::string, Count> tool_trigger_by_kind;      // meta.kind: call / nofit
  Count chat;                                             // correct = answered
  std::map<std::string, Count> image_by_kind;             // meta.kind: colour, shape, count, ...
  Count image;
  long long items = 0, errors = 0;
  std::vector<std::string> first_errors;  // "id: error", at most 10
};

Summary summarize(const std::vector<EvalItem>& items, const std::vector<Response>& responses,
                  const std::vector<Verdict>& verdicts);

// The tables printed by `kestrel eval` (only the tasks present), without a trailing newline.
std::string format_tables(const Summary& s);

nlohmann::ordered_json summary_json(const Summary& s);

// One per-item record of the result file: id, task, meta, the verdict, and with `with_response`
// the response (or its error) — the records `--score-responses` reads back.
nlohmann::ordered_json item_json(const EvalItem& item, const Response& r, const Verdict& v, bool with_response);

// Reads the "items" of a result file (ours or reference/eval_ref.py's) into responses for `items`,
// matched by id. Items absent from the file are reported in `missing` (their slots get an error).
// Throws kestrel::Error for a malformed file, a response without id, or an id no set has.
std::vector<Response> read_saved_responses(const std::string& path, const std::vector<EvalItem>& items,
                                           std::vector<std::string>* missing);

}  // namespace kestrel::eval
