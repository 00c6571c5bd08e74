// Server log: see log.h.
#include "server/log.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

#include "core/check.h"

namespace kestrel::server::log {
namespace {

std::atomic<int> g_level{int(Level::info)};
std::atomic<bool> g_access{true};
std::mutex g_mu;

const char* name(Level l) {
  switch (l) {
    case Level::debug: return "debug";
    case Level::info: return "info";
    case Level::warning: return "warning";
    case Level::error: return "error";
  }
  return "?";
}

std::string now_iso() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                     tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

}  // namespace

Level parse_level(const std::string& s) {
  if (s == "debug") return Level::debug;
  if (s == "info") return Level::info;
  if (s == "warning" || s == "warn") return Level::warning;
  if (s == "error") return Level::error;
  fail("--log-level must be debug, info, warning or error, got '{}'", s);
}

void set_level(Level l) { g_level = int(l); }
void set_access_log(bool on) { g_access = on; }
bool enabled(Level l) { return int(l) >= g_level.load(); }
bool access_log_enabled() { return g_access.load(); }

void write(Level l, nlohmann::ordered_json fields) {
  if (!enabled(l)) return;
  nlohmann::ordered_json line = {{"ts", now_iso()}, {"level", name(l)}};
  for (auto& [k, v] : fields.items()) line[k] = std::move(v);
  const std::string s = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard<std::mutex> lk(g_mu);
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

}  // namespace kestrel::server::log
