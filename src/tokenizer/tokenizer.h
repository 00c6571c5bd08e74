// Byte-level BPE tokenizer for Kimi K3 (MODEL.md §7), exact to Moonshot's tiktoken-based one.
//
// Files: `tiktoken.model` (one `base64(bytes) rank` per line; rank = id) and
// `tokenizer_config.json`, whose `added_tokens_decoder` names the special tokens. Specials occupy
// the 256 slots right after the base ids; unnamed slots are `<|reserved_token_{id}|>`. No id is
// hard-coded anywhere: callers look them up by name.
//
// Encoding follows Moonshot's wrapper around tiktoken: the (UTF-8-sanitized) text is cut into
// 400,000-character chunks, each chunk into runs of at most 25,000 consecutive whitespace or
// non-whitespace characters (Python str.isspace()), and each part is encoded on its own: special
// tokens recognised (if allowed), the rest pre-tokenized and byte-pair merged.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/utf8.h"

namespace kestrel::tok {

using TokenId = uint32_t;

class Tokenizer {
 public:
  static constexpr size_t kNumReservedSpecial = 256;
  static constexpr size_t kMaxEncodeChars = 400'000;
  static constexpr size_t kMaxSameClassRun = 25'000;

  // Loads DIR/tiktoken.model and DIR/tokenizer_config.json (the latter optional: without it every
  // special slot gets its reserved name).
  static Tokenizer load(const std::string& dir);
  // From file contents; config_json may be empty.
  static Tokenizer from_strings(std::string_view tiktoken_model, std::string_view config_json);
  // From explicit tables (tests): ranks[i] is the byte string of id i; specials maps name -> id.
  static Tokenizer from_ranks(std::vector<std::string> ranks,
                              const std::vector<std::pair<std::string, TokenId>>& specials);

  // Encodes text. Invalid UTF-8 is first replaced (each maximal ill-formed subpart -> U+FFFD).
  // allow_special: special-token text becomes the special id; otherwise it is ordinary text.
  std::vector<TokenId> encode(std::string_view text, bool allow_special = false) const;
  void encode_append(std::string_view text, bool allow_special, std::vector<TokenId>& out) const;

  // Raw bytes of the ids concatenated (special ids give their name). Fails on an unknown id.
  std::string decode_bytes(const std::vector<TokenId>& ids) const;
  // decode_bytes with invalid UTF-8 replaced, as tiktoken's decode(errors="replace").
  std::string decode(const std::vector<TokenId>& ids) const;

  // Bytes of one id (special ids give their name). Fails on an unknown id.
  const std::string& token_bytes(TokenId id) const;

  size_t num_base_tokens() const { return num_base_; }
  size_t vocab_size() const { return id_bytes_.size(); }
  bool is_special(TokenId id) const { return id >= num_base_ && id < id_bytes_.size(); }
  std::optional<TokenId> special_id(std::string_view name) const;
  // special_id or a kestrel::Error naming the token.
  TokenId require_special(std::string_view name) const;
  // Id of a base token whose bytes are exactly `bytes`, if any.
  std::optional<TokenId> base_id(std::string_view bytes) const;

 private:
  Tokenizer() = default;
  void build_index();
  void encode_ordinary_part(std::string_view text, std::vector<TokenId>& out) const;
  void encode_part(std::string_view text, bool allow_special, std::vector<TokenId>& out) const;
  void bpe(std::string_view piece, std::vector<TokenId>& out) const;
  uint32_t rank_of(const char* p, size_t n) const;

  size_t num_base_ = 0;
  std::vector<std::string> id_bytes_;  // base bytes, then special names
  // Open-addressing hash of base byte strings -> id (UINT32_MAX = empty).
  std::vector<uint32_t> slots_;
  uint64_t mask_ = 0;
  std::unordered_map<std::string, TokenId> specials_;
  // Specials grouped by first byte, longest first, for scanning text.
  std::vector<std::vector<TokenId>> specials_by_first_{256};
};

// Incremental detokenizer for streaming: emits only complete UTF-8 text and holds back the bytes of
// a character that later tokens may finish. Concatenated output == Tokenizer::decode(all ids).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(&tok) {}
  std::string push(TokenId id);
  std::string finish();

 private:
  const Tokenizer* tok_;
  Utf8Stream utf8_;
};

}  // namespace kestrel::tok
