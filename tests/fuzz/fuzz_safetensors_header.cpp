// libFuzzer target: the safetensors header parser. Input = [8-byte data size][header JSON bytes].
// Any input must either parse or raise kestrel::Error; a crash, hang or sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "core/check.h"
#include "loader/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t data_size;
  std::memcpy(&data_size, data, 8);
  data_size &= (uint64_t(1) << 40) - 1;
  const std::string_view header(reinterpret_cast<const char*>(data + 8), size - 8);
  try {
    const auto tensors = kestrel::parse_safetensors_header(header, data_size, "fuzz");
    for (const auto& t : tensors) {
      if (t.end > data_size || t.end < t.begin) __builtin_trap();  // validated invariants must hold
    }
  } catch (const kestrel::Error&) {
  }
  return 0;
}
