// Fuzz target: the JSON Schema validator of `kestrel eval` (src/evalclient/json_schema.h). The input
// is a schema, a newline, and an instance. Any schema must either be refused with kestrel::Error or
// validate any instance without crashing, hanging or throwing; validation must be deterministic.
// Patterns are disabled: std::regex backtracks exponentially on some patterns (a slow case of the
// library, not a bug of ours), which libFuzzer would report as a hang.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/check.h"
#include "evalclient/json_schema.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nl = in.find('\n');
  if (nl == std::string::npos) return 0;
  const auto schema = nlohmann::json::parse(in.substr(0, nl), nullptr, false);
  const auto instance = nlohmann::json::parse(in.substr(nl + 1), nullptr, false);
  if (schema.is_discarded() || instance.is_discarded()) return 0;
  kestrel::eval::SchemaOptions opt;
  opt.allow_patterns = false;
  try {
    const kestrel::eval::JsonSchema s(schema, opt);
    const std::string a = s.validate(instance);
    if (s.validate(instance) != a) std::abort();
    // A schema always accepts or rejects itself too (schemas are JSON values).
    (void)s.validate(schema);
  } catch (const kestrel::Error&) {
  }
  return 0;
}
