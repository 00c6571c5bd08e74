// Errors and argument checks.
//
// kestrel reports every failure of outside input (checkpoints, configs, requests) and every broken
// precondition as a kestrel::Error carrying a readable message; the CLI and the server turn it into
// a message and a non-zero exit or an error response. Nothing on these paths aborts the process.
// KCHECK is for invariants and arguments; its message carries the file and line.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace kestrel {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace kestrel

#define KCHECK(cond, ...)                                                                          \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      throw ::kestrel::Error(::fmt::format("{}:{}: check failed: {}: {}", __FILE__, __LINE__, #cond, \
                                           ::fmt::format(__VA_ARGS__)));                           \
  } while (0)
