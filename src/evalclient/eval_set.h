// Evaluation sets for `kestrel eval`: JSONL files, one request per line, in the shared format of
// docs/eval.md ({"id", "task", "request", "expect", "meta"}).
//
// Loading checks everything the scorer will rely on, so a malformed set stops the run before any
// request is sent, with the file and line: a known task, an OpenAI chat request with messages, an
// integer answer for passkey/arith, a non-empty string answer and meta.kind for image items (issue #21:
// questions about one picture, answered in a word or a number), call/name for tool items, the meta
// fields the tables group by,
// and every declared tool's `function.parameters` compiled as a JSON Schema (an unsupported keyword
// there is an error of the set, not a wrong answer of the model). Ids must be unique across all sets
// of a run, because saved responses are matched to items by id.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "evalclient/json_schema.h"

namespace kestrel::eval {

enum class Task { kPasskey, kArith, kTool, kChat, kImage };
const char* task_name(Task t);

struct EvalItem {
  std::string id;
  Task task = Task::kChat;
  std::string where;  // "file:line", for messages
  nlohmann::ordered_json request, expect, meta;
  // passkey / arith: the expected integer, normalised (normalize_integer); image: the expected answer,
  // normalised (normalize_answer).
  std::string answer;
  // tool: whether a call is expected, and of which tool.
  bool expect_call = false;
  std::string expect_name;
  // tool: the declared tools' parameter schemas by function name.
  std::map<std::string, std::shared_ptr<const JsonSchema>> tools;
  // Grouping keys for the tables: passkey context_tokens and depth; arith effort; image meta.kind.
  long long context_tokens = 0;
  double depth = 0;
  std::string effort;
  std::string kind;
};

// Reads one JSONL file (blank lines skipped). limit > 0: only its first `limit` items.
// Throws kestrel::Error naming file:line for anything malformed.
std::vector<EvalItem> load_eval_set(const std::string& path, int limit = 0);

// Parses one line (exposed for tests and the fuzz target). Throws kestrel::Error.
EvalItem parse_eval_item(const std::string& line, const std::string& where);

// Throws when two items share an id.
void check_unique_ids(const std::vector<EvalItem>& items);

// "-007" -> "-7", "-0" -> "0", "+5" -> "5"; "" when s is not an optional sign and digits.
std::string normalize_integer(const std::string& s);

// The last integer (-?[0-9]+, leftmost-longest matches scanned left to right as a regex search
// would) in `text`, normalised; "" when there is none.
std::string last_integer(const std::string& text);

// Image answers (docs/eval.md): ASCII whitespace trimmed at both ends, ASCII letters lower-cased, one
// trailing '.' dropped (then trimmed again): " Red." -> "red".
std::string normalize_answer(const std::string& s);

// The request body sent for an item: its `request`, plus model, "stream": false, temperature 0
// unless the request sets one, and `seed` when given (>= 0).
std::string request_body(const EvalItem& item, const std::string& model, long long seed);

}  // namespace kestrel::eval
