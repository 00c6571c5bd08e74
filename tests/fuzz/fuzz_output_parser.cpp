// Fuzz target: the output parser on random token streams. Input bytes map to token ids biased
// toward the structural specials and tag-name pieces, so marker paths are reached quickly. The
// parser must never throw, and the streamed deltas must add up to its final result.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tokenizer/parser.h"

#include "golden_vocab.h"

using namespace kestrel::tok;

namespace {
const Tokenizer& tok() { return golden_tokenizer(); }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const std::vector<TokenId> vocab = [] {
    std::vector<TokenId> v;
    for (const char* s : {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]", "<|media_pad|>"})
      v.push_back(tok().require_special(s));
    for (TokenId id : tok().encode("think response tools call argument json message key=\"k\" type=\"string\" "
                                   "type=\"number\" tool=\"f\" index=\"1\" {\"a\": [1, 2.5, \"x\"]} true null \xC3\xA9 \xE2\x82\xAC"))
      v.push_back(id);
    return v;
  }();
  const bool thinking = data[0] & 1;
  const FinishCause cause = (data[0] & 2) ? FinishCause::kLength : FinishCause::kStop;
  OutputParser p(tok(), thinking, (data[0] & 4) ? std::vector<std::string>{"f"} : std::vector<std::string>{});
  std::string reasoning, content;
  std::vector<std::string> args;
  auto add = [&](const ParseDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
    for (const auto& c : d.tool_calls) {
      if (args.size() <= c.index) args.resize(c.index + 1);
      args[c.index] += c.arguments;
    }
  };
  for (size_t i = 1; i < size; ++i) {
    const uint8_t b = data[i];
    TokenId id;
    if (b < 200)
      id = vocab[b % vocab.size()];
    else if (i + 1 < size)
      id = static_cast<TokenId>((b - 200) * 256 + data[++i]) % (tok().vocab_size() + 2);  // incl. out-of-range ids
    else
      id = b;
    add(p.push(id));
  }
  add(p.finish(cause));
  const ParsedOutput& r = p.result();
  if (r.reasoning != reasoning || r.content != content || args.size() != r.tool_calls.size()) std::abort();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i] != r.tool_calls[i].arguments) std::abort();
  return 0;
}
