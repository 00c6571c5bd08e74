// The model's vocabulary as the structured-output matcher sees it: a byte trie of every ordinary
// token, built once per tokenizer and shared by every grammar compiled against it.
//
// Layout: the trie is an array in preorder (children in byte order), so the subtree of node i is the
// contiguous range [i, nodes[i].end); a walk that finds a prefix dead skips its subtree in O(1).
// Node 0 is the root (no byte). A node carries the id of the token whose bytes end there, if any
// (byte strings are unique among base tokens, tokenizer.h). Special tokens are not in the trie: a
// grammar names them as terminals by id, never as text.
//
// Masks are uint32 words over `vocab_size()` ids, bit (id % 32) of word (id / 32); vocab_size() is the
// model's logit count, which may exceed the tokenizer's (ids beyond it are never allowed).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace kestrel::structured {

using TokenId = tok::TokenId;
constexpr uint32_t kNoToken = UINT32_MAX;

class TokenVocab {
 public:
  struct TrieNode {
    uint32_t end = 0;          // one past the last node of this subtree (preorder)
    uint32_t token = kNoToken; // token whose bytes end here
    uint16_t depth = 0;        // bytes from the root
    uint8_t byte = 0;          // the byte leading into this node (unused at the root)
  };

  // vocab_size: number of logits (0 = the tokenizer's size); must be >= the tokenizer's size.
  explicit TokenVocab(const tok::Tokenizer& tok, size_t vocab_size = 0);

  const tok::Tokenizer& tokenizer() const { return *tok_; }
  size_t vocab_size() const { return vocab_size_; }
  size_t mask_words() const { return (vocab_size_ + 31) / 32; }
  const std::vector<TrieNode>& trie() const { return trie_; }
  // Length in bytes of the longest ordinary token.
  size_t max_token_bytes() const { return max_token_bytes_; }
  // The most bytes a token of node i's subtree has beyond node i (0 for a leaf): how far a walk that
  // reaches node i can still go, which bounds what reading on can change (Matcher's budget walk).
  uint16_t bytes_below(uint32_t i) const { return below_[i]; }
  bool is_special(TokenId id) const { return tok_->is_special(id); }
  bool in_vocab(TokenId id) const { return id < tok_->vocab_size(); }
  // An ordinary token: one in the trie (a base token with bytes). Every other id is a special token,
  // an id without bytes or one beyond the tokenizer: a grammar reads none of them as text.
  bool is_ordinary(TokenId id) const {
    return id < vocab_size_ && ((ordinary_[id >> 5] >> (id & 31)) & 1u);
  }
  // Bytes of an ordinary token (special ids give their names; unused by the matcher).
  const std::string& bytes(TokenId id) const { return tok_->token_bytes(id); }
  std::optional<TokenId> special(std::string_view name) const { return tok_->special_id(name); }
  // Identifies the vocabulary (token bytes and specials) for cache keys.
  uint64_t fingerprint() const { return fingerprint_; }

 private:
  const tok::Tokenizer* tok_;
  size_t vocab_size_;
  size_t max_token_bytes_ = 0;
  uint64_t fingerprint_ = 0;
  std::vector<TrieNode> trie_;
  std::vector<uint32_t> ordinary_;  // mask words: the trie's tokens
  std::vector<uint16_t> below_;     // per trie node (bytes_below)
};

// Mask helpers (words of 32 ids).
inline void mask_set(uint32_t* words, TokenId id) { words[id >> 5] |= 1u << (id & 31); }
inline bool mask_test(const uint32_t* words, TokenId id) { return (words[id >> 5] >> (id & 31)) & 1u; }

}  // namespace kestrel::structured
