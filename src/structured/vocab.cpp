// Token trie construction: sort the ordinary tokens' byte strings, then emit nodes in preorder by
// walking the sorted list with the common prefix of neighbours (a prefix sorts before its
// extensions, so every node is emitted before its descendants).
#include "structured/vocab.h"

#include <algorithm>
#include <numeric>

#include "core/check.h"

namespace kestrel::structured {

TokenVocab::TokenVocab(const tok::Tokenizer& tok, size_t vocab_size)
    : tok_(&tok), vocab_size_(vocab_size ? vocab_size : tok.vocab_size()) {
  if (vocab_size_ < tok.vocab_size())
    fail("structured outputs: vocab_size {} is smaller than the tokenizer's {}", vocab_size_, tok.vocab_size());
  const size_t n = tok.num_base_tokens();
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return tok.token_bytes(a) < tok.token_bytes(b); });

  // FNV-1a over every token's bytes and the special names, in id order.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::string_view s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xFF) * 1099511628211ull;  // separator
  };
  for (size_t id = 0; id < tok.vocab_size(); ++id) mix(tok.token_bytes(TokenId(id)));
  h ^= vocab_size_ * 0x9E3779B97F4A7C15ull;
  fingerprint_ = h;

  trie_.push_back({});  // root
  std::vector<uint32_t> path = {0};  // node index at each depth of the current path
  std::string prev;
  for (uint32_t id : order) {
    const std::string& s = tok.token_bytes(id);
    if (s.empty()) continue;
    if (s.size() > 65535) fail("structured outputs: token {} is longer than 65535 bytes", id);
    max_token_bytes_ = std::max(max_token_bytes_, s.size());
    size_t lcp = 0;
    while (lcp < prev.size() && lcp < s.size() && prev[lcp] == s[lcp]) ++lcp;
    // Close the nodes of the previous path deeper than the common prefix.
    while (path.size() > lcp + 1) {
      trie_[path.back()].end = uint32_t(trie_.size());
      path.pop_back();
    }
    for (size_t d = lcp; d < s.size(); ++d) {
      TrieNode node;
      node.byte = static_cast<uint8_t>(s[d]);
      node.depth = static_cast<uint16_t>(d + 1);
      path.push_back(uint32_t(trie_.size()));
      trie_.push_back(node);
    }
    KCHECK(trie_[path.back()].token == kNoToken, "duplicate token bytes (id {})", id);
    trie_[path.back()].token = id;
    prev = s;
  }
  while (!path.empty()) {
    trie_[path.back()].end = uint32_t(trie_.size());
    path.pop_back();
  }
  // Children before parents (reverse preorder); a node's children are the subtrees tiling (i, end).
  below_.assign(trie_.size(), 0);
  for (size_t i = trie_.size(); i-- > 0;)
    for (uint32_t j = uint32_t(i) + 1; j < trie_[i].end; j = trie_[j].end)
      below_[i] = std::max<uint16_t>(below_[i], uint16_t(below_[j] + 1));
  ordinary_.assign(mask_words(), 0);
  for (const TrieNode& n : trie_)
    if (n.token != kNoToken) ordinary_[n.token >> 5] |= 1u << (n.token & 31);
}

}  // namespace kestrel::structured
