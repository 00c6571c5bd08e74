// The K3 pre-tokenizer: splits text into the pieces that Moonshot's pat_str (MODEL.md §7) finds,
// in the same order and with the same boundaries as tiktoken's regex (Rust fancy-regex,
// leftmost-first alternation, greedy quantifiers with backtracking).
//
// A hand-written matcher replaces the regex engine because it runs on the server's hot path; each
// alternative is transcribed with its backtracking behaviour worked out in pretokenize.cpp. The
// pattern, for reference (alternatives joined with |):
//   [\p{Han}]+
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//   \p{N}{1,3}
//    ?[^\s\p{L}\p{N}]+[\r\n]*
//   \s*[\r\n]+
//   \s+(?!\S)
//   \s+
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::tok {

// The pattern above as one string (what tiktoken is given as pat_str); documentation and tests use it.
extern const char* const kK3PatStr;

// Calls on_piece(piece) for each match in text, in order. text must be valid UTF-8 (the tokenizer
// sanitizes first). The pieces concatenate to text.
void pretokenize(std::string_view text, const std::function<void(std::string_view)>& on_piece);

// Convenience for tests.
std::vector<std::string> pretokenize(std::string_view text);

}  // namespace kestrel::tok
