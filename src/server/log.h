// The server's log: one JSON object per line on stdout, so a person can read it and a collector can
// parse it without a grammar. Two kinds of line:
//   - access (level info), one per HTTP exchange once it ends:
//     {"ts":"2025-01-02T03:04:05.678Z","level":"info","event":"access","id":"chatcmpl-…",
//      "method":"POST","route":"/v1/chat/completions","status":200,"prompt_tokens":12,
//      "completion_tokens":40,"latency_ms":812.4,"client_disconnect":false,"peer":"127.0.0.1"}
//     with "error" (the message answered) on 4xx/5xx; id is a fresh "req-…" for non-generations;
//   - events (server start, engine failures, connection-level errors) with "event" and "msg".
// --log-level debug|info|warning|error sets the least severe level written; 5xx access lines are
// written at level error, 4xx at warning, the rest at info. --disable-access-log drops the access
// lines of 1xx–4xx answers (5xx stay: they are errors). Thread-safe; a line is written whole.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace kestrel::server::log {

enum class Level { debug = 0, info = 1, warning = 2, error = 3 };

// "debug", "info", "warning" (or "warn"), "error"; kestrel::Error otherwise.
Level parse_level(const std::string& s);
void set_level(Level l);
void set_access_log(bool on);
bool enabled(Level l);
bool access_log_enabled();

// Writes {"ts", "level", fields...} as one line if `l` is enabled.
void write(Level l, nlohmann::ordered_json fields);

}  // namespace kestrel::server::log
