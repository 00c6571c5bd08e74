// Fuzz target: the text stream (tokenizer/text_stream.h) on random token streams, plain and chat,
// with a stop string. It must never throw, the streamed deltas must add up to its totals, and the
// stop string must cut the text exactly where it first occurs in the uncut text (and never leak).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tokenizer/text_stream.h"

#include "golden_vocab.h"

using namespace kestrel::tok;

namespace {

const Tokenizer& tok() { return golden_tokenizer(); }

struct Out {
  std::string reasoning, content;
};

Out run(const std::vector<TokenId>& ids, bool chat, bool thinking, FinishCause cause, std::vector<std::string> stop,
        bool* matched) {
  TextStream s = chat ? TextStream::chat(tok(), thinking, {}, std::move(stop)) : TextStream::plain(tok(), std::move(stop));
  Out o;
  auto add = [&](const TextDelta& d) {
    o.reasoning += d.reasoning;
    o.content += d.content;
  };
  for (TokenId id : ids) add(s.push(id));
  add(s.finish(cause));
  if (o.content != s.content() || o.reasoning != s.reasoning() || !s.done()) std::abort();
  *matched = s.stop_matched();
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static const std::vector<TokenId> vocab = [] {
    std::vector<TokenId> v;
    for (const char* s : {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"}) v.push_back(tok().require_special(s));
    for (TokenId id : tok().encode("think response tools call argument the lazy dog says hello \xC3\xA9 \xE2\x82\xAC ok"))
      v.push_back(id);
    return v;
  }();
  static const char* const stops[] = {"e", "th", "lo ", "\xC3\xA9", "\xE2", "o w", "zzz", "dog say"};
  const bool chat = data[0] & 1, thinking = data[0] & 2;
  const FinishCause cause = (data[0] & 4) ? FinishCause::kLength : FinishCause::kStop;
  const std::string stop = stops[data[1] % 8];
  std::vector<TokenId> ids;
  for (size_t i = 2; i < size; ++i)
    ids.push_back(data[i] < 240 ? vocab[data[i] % vocab.size()] : TokenId(tok().vocab_size() + data[i] % 3));
  bool full_matched = false, matched = false;
  const Out full = run(ids, chat, thinking, cause, {}, &full_matched);
  const Out cut = run(ids, chat, thinking, cause, {stop}, &matched);
  if (full_matched) std::abort();
  const size_t at = full.content.find(stop);
  if (matched != (at != std::string::npos)) std::abort();
  if (cut.content != (matched ? full.content.substr(0, at) : full.content)) std::abort();
  if (cut.content.find(stop) != std::string::npos) std::abort();
  return 0;
}
