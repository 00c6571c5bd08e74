// Token-level matching of a Grammar over a model vocabulary: the compiled (immutable, shared) form
// with its precomputed token tables, and the per-request Matcher that fills logit masks.
//
// Precomputation (CompiledGrammar), after xgrammar's "adaptive token mask cache": for every state q,
// walk the vocabulary trie from a stack holding only q (the stack below it unknown). A token whose
// bytes can all be read while staying inside q's rule (or rules it calls) is *accepted* whatever the
// stack below; one that dies everywhere without ever leaving q's rule is *rejected* whatever the stack
// below; one that can only survive by finishing q's rule after k of its bytes is *uncertain*, and
// what decides it is whether the caller accepts the rest, bytes [k, n). Uncertain tokens are stored by
// that rest in a small trie per state. At run time the mask is: the union of the accepted sets of the
// stack tops (a bitset OR or a short list), plus the uncertain rests that the actual caller
// configurations accept (a trie walk that stops at the first dead byte), plus special-token edges,
// plus the stop tokens when the document may end. For JSON the uncertain rests are things like `,`
// `}` `"]` after a string's closing quote: a few hundred trie nodes, almost all dead at once.
//
// The Matcher keeps its configurations as a stack (one per accepted token), so rollback(k) is popping
// k entries (speculative decoding); it is single-threaded, one per request. A CompiledGrammar is
// read-only after construction and may be shared across threads.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "structured/grammar.h"
#include "structured/stacks.h"
#include "structured/vocab.h"

namespace kestrel::structured {

class CompiledGrammar {
 public:
  // Precomputes the token tables of every reachable state. max_stack_depth bounds the matcher's
  // stacks (nesting of calls); deadline bounds the precomputation (kestrel::Error past it).
  CompiledGrammar(std::shared_ptr<const TokenVocab> vocab, Grammar grammar, uint32_t max_stack_depth,
                  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max());

  const Grammar& grammar() const { return g_; }
  const TokenVocab& vocab() const { return *vocab_; }
  uint32_t max_stack_depth() const { return max_depth_; }

  struct Stats {
    size_t states = 0, rules = 0, bitsets = 0, accepted_list_ids = 0, uncertain_tokens = 0, suffix_nodes = 0;
    size_t memory_bytes = 0;
    double precompute_ms = 0;
  };
  const Stats& stats() const { return stats_; }
  // Whether accepting an ordinary token can ever leave a matcher of this grammar (without stop
  // tokens) terminated: only if a byte edge, or a call's return after one, reaches an accepting state
  // of the root rule with no way on. False for the grammars that end on a special token (the chat
  // grammar's <|end_of_msg|>).
  bool bytes_may_terminate() const { return bytes_may_terminate_; }

 private:
  friend class Matcher;
  struct SfxNode {
    uint32_t end;                   // one past the subtree (preorder)
    uint32_t tok_begin, tok_end;    // tokens whose rest is exactly this node's bytes
    uint16_t depth;
    uint8_t byte;
  };
  struct Table {
    uint32_t bitset = UINT32_MAX;   // index of a bitset of accepted tokens, or UINT32_MAX
    uint32_t list_begin = 0, list_end = 0;  // accepted tokens as ids (when not a bitset)
    uint32_t sfx_begin = 0, sfx_end = 0;    // uncertain tokens: trie of their rests (node sfx_begin = root)
    uint32_t max_height = 0;        // frames pushed above the state while reading any token
    bool computed = false;
    bool all_ordinary = false;      // every ordinary token is accepted (free text)
  };
  void tabulate(uint32_t q, detail::FramePool& pool, std::vector<detail::Config>& levels);

  std::shared_ptr<const TokenVocab> vocab_;
  Grammar g_;
  uint32_t max_depth_;
  bool root_called_ = false;
  bool bytes_may_terminate_ = false;
  std::vector<Table> tables_;
  std::vector<uint32_t> bitsets_;   // mask_words() words each
  std::vector<uint32_t> lists_;
  std::vector<SfxNode> sfx_;
  std::vector<uint32_t> sfx_tokens_;
  size_t ordinary_tokens_ = 0;  // tokens in the vocabulary trie
  Stats stats_;
};

class Matcher {
 public:
  // stop_tokens: ids allowed (and accepted) only where the document may end; accepting one
  // terminates the matcher. Ids the grammar itself reads as special terminals are not stop tokens.
  explicit Matcher(std::shared_ptr<const CompiledGrammar> grammar, std::vector<TokenId> stop_tokens = {});

  // Sets the bits of every allowed token in `words` (mask_words() uint32 words, cleared first).
  // Returns false when nothing is allowed (terminated, or a dead end at the nesting limit).
  bool fill_mask(uint32_t* words);
  // The same by walking the whole vocabulary from the current configuration (no tables): the
  // reference the tables are tested against, and the path taken near the nesting limit.
  bool fill_mask_exhaustive(uint32_t* words);
  size_t mask_words() const { return cg_->vocab().mask_words(); }

  // Advances by one token; false (state unchanged) when the token is not allowed.
  bool accept(TokenId id);
  // Advances by raw bytes (no special tokens), e.g. to force a known prefix; false = not allowed.
  bool accept_bytes(std::string_view bytes);
  // The document is complete here (the stop token would be allowed).
  bool can_end() const { return !stopped_.back() && top().ended; }
  // A stop token was accepted, or the document is complete and nothing more can follow.
  bool is_terminated() const;
  // Whether accepting `id` (where allowed) may leave the matcher terminated, from the token alone: a
  // special token or a stop token may; an ordinary one only without stop tokens and when the grammar
  // can end on bytes (CompiledGrammar::bytes_may_terminate). False lets an engine take an allowed
  // ordinary token without stepping the matcher at once (runtime/constraints.h defers the step).
  bool token_may_terminate(TokenId id) const;
  // Free text here: every ordinary token is allowed next (the mask would differ from "all" only in
  // special tokens). An engine may then sample without a mask and check the token with accept()
  // (reasoning-aware structured output: the think section costs no mask).
  bool free_text() const;
  // Undoes the last k accepted tokens (k <= num_accepted()).
  void rollback(size_t k);
  size_t num_accepted() const { return history_.size() - 1; }
  void reset();

  const CompiledGrammar& compiled() const { return *cg_; }

 private:
  const detail::Config& top() const { return history_.back(); }
  void walk_suffixes(uint32_t q, uint32_t parent, uint32_t* words, bool& any);

  std::shared_ptr<const CompiledGrammar> cg_;
  std::vector<TokenId> stop_;
  detail::FramePool pool_;
  std::vector<detail::Config> history_;  // history_[0]: initial configuration
  std::vector<uint8_t> stopped_;          // per history entry: a stop token was accepted
  std::vector<detail::Config> levels_;   // scratch per trie depth
  detail::Config scratch_;
  std::vector<uint64_t> seen_pairs_;
};

}  // namespace kestrel::structured
