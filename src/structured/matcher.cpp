// Matcher: configurations per accepted token, masks from the precomputed tables (matcher.h).
#include "structured/matcher.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace kestrel::structured {

using detail::Closer;
using detail::Config;
using detail::FramePool;

Matcher::Matcher(std::shared_ptr<const CompiledGrammar> grammar, std::vector<TokenId> stop_tokens)
    : cg_(std::move(grammar)), stop_(std::move(stop_tokens)) {
  KCHECK(cg_ != nullptr, "null grammar");
  fd_ = cg_->frame_distances();
  for (TokenId id : stop_)
    if (id >= cg_->vocab().vocab_size()) fail("stop token {} is outside the vocabulary", id);
  levels_.resize(cg_->vocab().max_token_bytes() + 2);
  reset();
}

void Matcher::reset() {
  pool_.reset();
  dist_.reset(stop_.empty() ? 0 : 1);  // a document with stop tokens ends by accepting one
  history_.assign(1, Config{});
  stopped_.assign(1, 0);
  Closer closer(cg_->grammar(), pool_, cg_->max_stack_depth());
  closer.begin(history_[0]);
  const Grammar& g = cg_->grammar();
  closer.add(history_[0], pool_.get(g.rules[g.root].start, FramePool::kBottom));
}

bool Matcher::is_terminated() const {
  if (stopped_.back()) return true;
  if (!top().ended) return false;
  const Grammar& g = cg_->grammar();
  for (uint32_t f : top().frames) {
    const Grammar::State& s = g.states[pool_.state(f)];
    if (s.has_bytes || s.specials_begin != s.specials_end || s.calls_begin != s.calls_end) return false;
  }
  return stop_.empty();  // with stop tokens, the end is only reached by accepting one
}

bool Matcher::token_may_terminate(TokenId id) const {
  // is_terminated() after an ordinary token: with stop tokens only a stop token ends the matcher.
  if (!cg_->vocab().is_ordinary(id) || std::find(stop_.begin(), stop_.end(), id) != stop_.end()) return true;
  return stop_.empty() && cg_->bytes_may_terminate();
}

bool Matcher::free_text() const {
  if (stopped_.back()) return false;
  for (uint32_t f : top().frames) {
    // Near the nesting limit fill_mask takes the exhaustive path, which may refuse what the table accepts.
    if (cg_->tables_[pool_.state(f)].all_ordinary && tables_exact(f)) return true;
  }
  return false;
}

void Matcher::rollback(size_t k) {
  KCHECK(k <= num_accepted(), "rollback of {} tokens, only {} accepted", k, num_accepted());
  history_.resize(history_.size() - k);
  stopped_.resize(stopped_.size() - k);
}

bool Matcher::accept(TokenId id) {
  if (stopped_.back() || id >= cg_->vocab().vocab_size() || !cg_->vocab().in_vocab(id)) return false;
  const Grammar& g = cg_->grammar();
  Closer closer(g, pool_, cg_->max_stack_depth());
  Config next;
  if (cg_->vocab().is_special(id)) {
    closer.step_special(top(), id, next);
    if (next.empty() && !next.ended) {
      if (top().ended && std::find(stop_.begin(), stop_.end(), id) != stop_.end()) {
        history_.push_back(top());
        stopped_.push_back(1);
        return true;
      }
      return false;
    }
  } else {
    const std::string& bytes = cg_->vocab().bytes(id);
    if (bytes.empty()) return false;
    Config cur = top();
    for (char c : bytes) {
      closer.step(cur, uint8_t(c), next);
      if (next.empty()) return false;
      std::swap(cur, next);
    }
    next = std::move(cur);
  }
  // Near the stack limit the masks allow only tokens after which the document can still be finished
  // (fill_mask_exhaustive); the same rule here keeps a mask exact: bit set <=> accept() takes the token.
  if (near_limit() && dist(next) >= detail::StackDistance::kInf) return false;
  history_.push_back(std::move(next));
  stopped_.push_back(0);
  return true;
}

bool Matcher::accept_bytes(std::string_view bytes) {
  if (stopped_.back()) return false;
  Closer closer(cg_->grammar(), pool_, cg_->max_stack_depth());
  Config cur = top(), next;
  for (char c : bytes) {
    closer.step(cur, uint8_t(c), next);
    if (next.empty()) return false;
    std::swap(cur, next);
  }
  history_.push_back(std::move(cur));
  stopped_.push_back(0);
  return true;
}

void Matcher::walk_suffixes(uint32_t q, uint32_t parent, uint32_t* words, bool& any, uint32_t* ub, uint32_t limit) {
  const CompiledGrammar::Table& t = cg_->tables_[q];
  if (t.sfx_begin == t.sfx_end || parent == FramePool::kBottom) return;
  Closer closer(cg_->grammar(), pool_, cg_->max_stack_depth());
  closer.begin(levels_[0]);
  closer.add(levels_[0], parent);
  const auto& sfx = cg_->sfx_;
  const auto& toks = cg_->sfx_tokens_;
  for (uint32_t i = t.sfx_begin + 1; i < t.sfx_end;) {
    const CompiledGrammar::SfxNode& n = sfx[i];
    Config& c = levels_[n.depth];
    closer.step(levels_[n.depth - 1], n.byte, c);
    if (c.empty()) {
      i = n.end;
      continue;
    }
    if (n.tok_begin != n.tok_end && (limit == kNoBudget || dist(c) <= limit)) {
      for (uint32_t k = n.tok_begin; k < n.tok_end; ++k) mask_set(words, toks[k]);
      any = true;
    }
    if (ub && n.tok_begin != n.tok_end) *ub = std::max(*ub, dist(c));
    ++i;
  }
}

bool Matcher::fill_mask(uint32_t* words) { return fill_mask_tables(words, nullptr); }

bool Matcher::fill_mask_tables(uint32_t* words, uint32_t* ub) {
  const size_t nw = mask_words();
  std::memset(words, 0, nw * sizeof(uint32_t));
  if (stopped_.back()) return false;
  const Config& cfg = top();
  for (uint32_t f : cfg.frames)
    if (!tables_exact(f)) {
      if (ub) *ub = detail::StackDistance::kInf;  // no bound from the tables here: the caller walks exactly
      return fill_mask_exhaustive(words);
    }

  bool any = false;
  const Grammar& g = cg_->grammar();
  // Accepted sets, once per distinct top state.
  seen_pairs_.clear();
  for (uint32_t f : cfg.frames) {
    const uint32_t q = pool_.state(f);
    seen_pairs_.push_back(uint64_t(q) << 32 | pool_.parent(f));
  }
  std::sort(seen_pairs_.begin(), seen_pairs_.end());
  seen_pairs_.erase(std::unique(seen_pairs_.begin(), seen_pairs_.end()), seen_pairs_.end());
  uint32_t last_q = kDead;
  for (uint64_t p : seen_pairs_) {
    const uint32_t q = uint32_t(p >> 32);
    if (ub) {
      // An accepted token leaves q's frame at most max_after units from its end; the frames below are untouched.
      const CompiledGrammar::Table& t = cg_->tables_[q];
      if (t.bitset != UINT32_MAX || t.list_begin != t.list_end)
        *ub = std::max(*ub, std::min(detail::StackDistance::kInf,
                                     t.max_after + below(uint32_t(p))));
    }
    if (q == last_q) continue;
    last_q = q;
    const CompiledGrammar::Table& t = cg_->tables_[q];
    if (t.bitset != UINT32_MAX) {
      const uint32_t* b = cg_->bitsets_.data() + size_t(t.bitset) * nw;
      for (size_t i = 0; i < nw; ++i) words[i] |= b[i];
      any = true;
    } else if (t.list_begin != t.list_end) {
      for (uint32_t i = t.list_begin; i < t.list_end; ++i) mask_set(words, cg_->lists_[i]);
      any = true;
    }
  }
  // Uncertain tokens, per distinct (state, caller).
  for (uint64_t p : seen_pairs_) walk_suffixes(uint32_t(p >> 32), uint32_t(p), words, any, ub);
  if (ub) *ub = std::max(*ub, left_after_specials());  // stop tokens leave 0
  // Special-token terminals and stop tokens.
  for (uint32_t f : cfg.frames) {
    const Grammar::State& s = g.states[pool_.state(f)];
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i) mask_set(words, g.specials[i].id), any = true;
  }
  if (cfg.ended)
    for (TokenId id : stop_) mask_set(words, id), any = true;
  return any;
}

template <class Node, class Special>
bool Matcher::walk_vocabulary(uint32_t* words, Node node, Special special) {
  const size_t nw = mask_words();
  std::memset(words, 0, nw * sizeof(uint32_t));
  if (stopped_.back()) return false;
  bool any = false;
  const Grammar& g = cg_->grammar();
  Closer closer(g, pool_, cg_->max_stack_depth());
  const auto& trie = cg_->vocab().trie();
  levels_[0] = top();
  for (uint32_t i = 1; i < trie.size();) {
    const TokenVocab::TrieNode& n = trie[i];
    Config& c = levels_[n.depth];
    closer.step(levels_[n.depth - 1], n.byte, c);
    if (c.empty()) {
      i = n.end;
      continue;
    }
    const Walk w = node(i, c);
    if (w == Walk::kCut) {
      i = n.end;
      continue;
    }
    if (n.token != kNoToken && w == Walk::kKeep) mask_set(words, n.token), any = true;
    ++i;
  }
  for (uint32_t f : top().frames) {
    const Grammar::State& s = g.states[pool_.state(f)];
    for (uint32_t k = s.specials_begin; k < s.specials_end; ++k) {
      closer.step_special(top(), g.specials[k].id, scratch_);
      if (special(scratch_)) mask_set(words, g.specials[k].id), any = true;
    }
  }
  if (top().ended)
    for (TokenId id : stop_) mask_set(words, id), any = true;  // nothing left after a stop token
  return any;
}

bool Matcher::fill_mask_exhaustive(uint32_t* words) {
  // Near the stack limit, only tokens after which the document can still be finished within it: a token
  // may lead where only a deeper value would continue (its distance is then kInf), and the mask after it
  // would be empty. So no mask is ever empty before the end. Where the tables are exact every
  // configuration after a token can be finished (this is then the tables' reference, unfiltered).
  const bool near = near_limit();
  auto finishable = [&](const Config& c) { return !near || dist(c) < detail::StackDistance::kInf; };
  return walk_vocabulary(
      words, [&](uint32_t, const Config& c) { return finishable(c) ? Walk::kKeep : Walk::kPass; }, finishable);
}

}  // namespace kestrel::structured

namespace kestrel::structured {

// ---- Budget ------------------------------------------------------------------------------------------

uint32_t Matcher::min_completion() {
  if (stopped_.back()) return 0;
  return dist(top());
}

std::vector<uint32_t> Matcher::configuration_key() const {
  std::vector<uint32_t> key = top().frames;
  std::sort(key.begin(), key.end());  // the closure's order depends on the path, the set does not
  key.push_back(uint32_t(top().ended) | uint32_t(stopped_.back()) << 1 | uint32_t(top().truncated) << 2);
  return key;
}

uint32_t Matcher::left_after_specials() {
  const Grammar& g = cg_->grammar();
  Closer closer(g, pool_, cg_->max_stack_depth());
  uint32_t most = 0;
  for (uint32_t f : top().frames) {
    const Grammar::State& s = g.states[pool_.state(f)];
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i) {
      closer.step_special(top(), g.specials[i].id, scratch_);
      most = std::max(most, dist(scratch_));
    }
  }
  return most;
}

bool Matcher::fill_mask(uint32_t* words, uint32_t budget) {
  if (budget == kNoBudget) return fill_mask(words);
  const uint32_t limit = budget > 0 ? budget - 1 : 0;
  uint32_t ub = 0;
  const bool any = fill_mask_tables(words, &ub);
  if (!any || ub <= limit) return any;
  const int exact = fill_mask_budget_tables(words, limit);
  if (exact > 0 || (exact < 0 && fill_mask_within(words, limit))) return true;
  return fill_mask(words);
}

int Matcher::fill_mask_budget_tables(uint32_t* words, uint32_t limit) {
  const Config& cfg = top();
  const uint32_t depth_limit = cg_->max_stack_depth();
  for (uint32_t f : cfg.frames)
    if (!tables_exact(f)) return -1;
  const size_t nw = mask_words();
  std::memset(words, 0, nw * sizeof(uint32_t));
  frame_words_.resize(nw);
  bool any = false;
  seen_pairs_.clear();
  for (uint32_t f : cfg.frames) seen_pairs_.push_back(uint64_t(pool_.state(f)) << 32 | pool_.parent(f));
  std::sort(seen_pairs_.begin(), seen_pairs_.end());
  seen_pairs_.erase(std::unique(seen_pairs_.begin(), seen_pairs_.end()), seen_pairs_.end());
  // A token's distance after it is the least over the frames it goes through, and through one frame it is
  // what finishes that frame after the token (the table's) plus what finishes the stack below it: so a
  // token is allowed iff some frame lets it through within the limit.
  for (uint64_t p : seen_pairs_) {
    const CompiledGrammar::Table& t = cg_->tables_[uint32_t(p >> 32)];
    if (t.bitset == UINT32_MAX && t.list_begin == t.list_end) continue;
    const uint32_t rest = below(uint32_t(p));
    if (rest > limit || t.min_after > limit - rest) continue;  // no accepted token fits
    const uint32_t k = limit - rest;
    if (k < t.max_after && !t.after_stored) return -1;
    any = true;
    if (k < t.max_after && k < t.base_after) {
      // Few fit: those of the exceptions (least last) that leave at most k.
      for (uint32_t i = t.after_end; i-- > t.after_begin && cg_->after_[i].left <= k;) mask_set(words, cg_->after_[i].token);
      continue;
    }
    // Most or all fit: the accepted set, less (per frame, then merged) the exceptions that leave more.
    uint32_t* w = k >= t.max_after ? words : frame_words_.data();
    if (w != words) std::memset(w, 0, nw * sizeof(uint32_t));
    if (t.bitset != UINT32_MAX) {
      const uint32_t* b = cg_->bitsets_.data() + size_t(t.bitset) * nw;
      for (size_t i = 0; i < nw; ++i) w[i] |= b[i];
    } else {
      for (uint32_t i = t.list_begin; i < t.list_end; ++i) mask_set(w, cg_->lists_[i]);
    }
    if (w == words) continue;
    for (uint32_t i = t.after_begin; i < t.after_end && cg_->after_[i].left > k; ++i) {
      const TokenId id = cg_->after_[i].token;
      w[id >> 5] &= ~(1u << (id & 31));
    }
    for (size_t i = 0; i < nw; ++i) words[i] |= w[i];
  }
  for (uint64_t p : seen_pairs_) walk_suffixes(uint32_t(p >> 32), uint32_t(p), words, any, nullptr, limit);
  const Grammar& g = cg_->grammar();
  Closer closer(g, pool_, depth_limit);
  for (uint32_t f : cfg.frames) {
    const Grammar::State& s = g.states[pool_.state(f)];
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i) {
      closer.step_special(top(), g.specials[i].id, scratch_);
      if (dist(scratch_) <= limit) mask_set(words, g.specials[i].id), any = true;
    }
  }
  if (cfg.ended)
    for (TokenId id : stop_) mask_set(words, id), any = true;  // nothing left after a stop token
  return any ? 1 : 0;
}

bool Matcher::free_text(uint32_t budget) {
  if (!free_text()) return false;
  if (budget == kNoBudget) return true;
  const uint32_t limit = budget > 0 ? budget - 1 : 0;
  bool bounded = false;
  for (uint32_t f : top().frames) {
    const CompiledGrammar::Table& t = cg_->tables_[pool_.state(f)];
    // Every ordinary token is accepted from this frame, so none leaves more than this to finish.
    if (t.all_ordinary && tables_exact(f) && t.max_after + below(pool_.parent(f)) <= limit) {
      bounded = true;
      break;
    }
  }
  return bounded && left_after_specials() <= limit;
}

bool Matcher::fill_mask_within(uint32_t* words, uint32_t limit) {
  const TokenVocab& vocab = cg_->vocab();
  const bool prune = cg_->every_byte_a_token_;
  return walk_vocabulary(
      words,
      [&](uint32_t i, const Config& c) {
        const uint32_t d = dist(c);
        // With every byte a token, one more byte lowers the distance by at most one (that byte's token
        // then the rest of the path is a path; calling and closing never go below the stack they came
        // from), so no token in this subtree, at most bytes_below(i) bytes longer, comes back within the limit.
        if (prune && uint64_t(d) > uint64_t(limit) + vocab.bytes_below(i)) return Walk::kCut;
        return d <= limit ? Walk::kKeep : Walk::kPass;
      },
      [&](const Config& c) { return dist(c) <= limit; });
}

}  // namespace kestrel::structured
