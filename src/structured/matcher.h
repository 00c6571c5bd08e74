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
  // The fewest tokens from state q to the end of its rule, an upper bound (token_tables.cpp).
  uint32_t min_accept(uint32_t q) const { return min_accept_[q]; }
  // The same for a frame with room for only `headroom` more frames above it (the stack limit refuses
  // deeper calls); StackDistance::kInf when nothing fits. min_accept once headroom >= near_levels().
  uint32_t near_accept(uint32_t q, uint32_t headroom) const {
    return detail::FrameDistances{&min_accept_, &near_accept_, headroom}.at(q, 0);
  }
  // The headrooms below which some state's distance differs from min_accept (0: none; every shortest
  // path fits wherever the matcher is).
  uint32_t near_levels() const { return uint32_t(near_accept_.size()); }
  // What finishes each frame of this grammar's matchers, by state and depth (stacks.h).
  detail::FrameDistances frame_distances() const { return {&min_accept_, &near_accept_, max_depth_}; }
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
    uint32_t max_after = 0;         // most units needed to finish the state's frame after an accepted token
    uint32_t min_after = 0;         // fewest, over the accepted tokens
    uint32_t base_after = 0;        // what most accepted tokens leave
    // The accepted tokens that leave other than base_after, most first (after_): with them a budget
    // mask is a lookup. Not stored (after_stored false) when they are many; the matcher then walks.
    uint32_t after_begin = 0, after_end = 0;
    bool after_stored = false;
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
  std::vector<uint32_t> min_accept_;  // per state (min_accept)
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> near_accept_;  // per headroom: (state, distance) where it differs
  bool every_byte_a_token_ = false;   // each of the 256 bytes is a token of its own
  std::vector<uint32_t> bitsets_;   // mask_words() words each
  std::vector<uint32_t> lists_;
  std::vector<SfxNode> sfx_;
  std::vector<uint32_t> sfx_tokens_;
  struct After {
    uint32_t token, left;  // an accepted token and what finishes the frame after it
  };
  std::vector<After> after_;
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

  // Advances by one token; false (state unchanged) when the token is not allowed (exactly the tokens
  // fill_mask sets; near the stack limit, only those after which the document can still be finished).
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

  // ---- Budget: finishing within a token budget (docs/structured-outputs.md, "Finishing within
  // max_tokens"). Distances count tokens along paths the matcher accepts (CompiledGrammar::min_accept,
  // summed over a stack's frames, plus the stop token a document with stop tokens still needs): an
  // upper bound on the tokens that finish the document, and from any configuration some allowed token
  // lowers it by at least one (the first step of its shortest path).
  static constexpr uint32_t kNoBudget = UINT32_MAX;
  // The tokens that complete the document from here along its shortest path (0 once terminated).
  uint32_t min_completion();
  // The mask for a request that may still generate `budget` tokens, this one included: the tokens
  // after which the document can still be completed within budget - 1 units. When the tables show
  // that no allowed token can push the completion past that (the common case, far from the end) this
  // is fill_mask(words) plus a bound per top state; otherwise an exact walk of the vocabulary.
  // When even that leaves nothing (min_completion() > budget: the request started with too small a
  // budget, or the vocabulary lacks a one-byte token the shortest completion needs), the plain mask.
  // kNoBudget: fill_mask(words).
  bool fill_mask(uint32_t* words, uint32_t budget);
  // free_text(), and no token (ordinary or special) can leave more than budget - 1 to complete,
  // so sampling without a mask keeps the request within its budget.
  bool free_text(uint32_t budget);

  // The current configuration as a value: equal keys within one matcher mean equal configurations
  // (stacks are hash-consed in the matcher's pool, which rollback keeps), so a search over token
  // sequences can merge the paths that reach one configuration (the budget tests' breadth-first
  // search for the true fewest tokens).
  std::vector<uint32_t> configuration_key() const;

  // Undoes the last k accepted tokens (k <= num_accepted()).
  void rollback(size_t k);
  size_t num_accepted() const { return history_.size() - 1; }
  void reset();

  const CompiledGrammar& compiled() const { return *cg_; }

 private:
  const detail::Config& top() const { return history_.back(); }
  // ub (optional): raised to the most any token set here leaves to complete (min_completion's measure).
  // limit (optional): set only the tokens after which min_completion() <= limit.
  void walk_suffixes(uint32_t q, uint32_t parent, uint32_t* words, bool& any, uint32_t* ub,
                     uint32_t limit = kNoBudget);
  int fill_mask_budget_tables(uint32_t* words, uint32_t limit);  // exact from the tables; -1: walk instead
  bool fill_mask_tables(uint32_t* words, uint32_t* ub);
  bool fill_mask_within(uint32_t* words, uint32_t limit);  // exact: min_completion after the token <= limit
  // The exact vocabulary walk of fill_mask_exhaustive and fill_mask_within (matcher.cpp): `words` cleared, then
  // every token whose bytes the current configuration accepts is offered to node(trie index, configuration
  // after it) → kKeep (set it, descend), kPass (descend) or kCut (skip the subtree); each special terminal of
  // the top to special(configuration after it); the stop tokens where the document may end.
  enum class Walk { kKeep, kPass, kCut };
  template <class Node, class Special>
  bool walk_vocabulary(uint32_t* words, Node node, Special special);
  uint32_t left_after_specials();   // the most min_completion after any special edge of the top
  uint32_t dist(const detail::Config& c) { return dist_.config(pool_, fd_, c); }
  uint32_t below(uint32_t parent) { return dist_.frame(pool_, fd_, parent); }  // what finishes the stack from parent down
  // Whether frame f's token tables (and their amounts, computed without a depth limit) are exact: no
  // frame after any token from f comes within near_levels() of the stack limit. Otherwise fill_mask
  // walks the vocabulary from the real configuration.
  bool tables_exact(uint32_t f) const {
    return uint64_t(pool_.depth(f)) + cg_->tables_[pool_.state(f)].max_height + cg_->near_levels() <=
           cg_->max_stack_depth();
  }
  // Some frame of the current configuration is not tables_exact: masks and accept() then allow only
  // tokens after which the document can still be finished within the stack limit.
  bool near_limit() const {
    for (uint32_t f : top().frames)
      if (!tables_exact(f)) return true;
    return false;
  }

  std::shared_ptr<const CompiledGrammar> cg_;
  std::vector<TokenId> stop_;
  detail::FramePool pool_;
  std::vector<detail::Config> history_;  // history_[0]: initial configuration
  std::vector<uint8_t> stopped_;          // per history entry: a stop token was accepted
  std::vector<detail::Config> levels_;   // scratch per trie depth
  detail::Config scratch_;
  std::vector<uint64_t> seen_pairs_;
  std::vector<uint32_t> frame_words_;  // one frame's budget mask (fill_mask_budget_tables)
  detail::StackDistance dist_;  // over pool_, reset with it
  detail::FrameDistances fd_;   // cg_->frame_distances()
};

}  // namespace kestrel::structured
