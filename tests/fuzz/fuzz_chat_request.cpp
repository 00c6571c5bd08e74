// Fuzz target: the chat encoder's JSON input. Any byte string is offered as a request body; the
// encoder must either render it or raise kestrel::Error (a 400), never crash or throw anything
// else. The first byte optionally selects image prompts so the expansion path is covered too.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/check.h"
#include "tokenizer/chat.h"

#include "golden_vocab.h"

using namespace kestrel::tok;

namespace {
const Tokenizer& tok() { return golden_tokenizer(); }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::vector<ImagePrompt> images;
  if (data[0] & 1) images = {{64, 32, 2}};
  const auto req = nlohmann::ordered_json::parse(data + 1, data + size, nullptr, false);
  if (req.is_discarded()) return 0;
  try {
    ChatPrompt p = ChatEncoder(tok()).encode_request(req, images);
    if (tok().decode(p.ids) != utf8_sanitize(p.text)) std::abort();  // ids must decode to the rendered text
  } catch (const kestrel::Error&) {
  }
  return 0;
}
