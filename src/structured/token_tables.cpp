// CompiledGrammar: the per-state token tables (see matcher.h for what they mean).
//
// tabulate(q) walks the vocabulary trie depth-first with one closed configuration per depth, starting
// from the stack [q] over the unknown caller (frame 0). At depth d:
//   - the configuration popped into frame 0 ("ended"): q's rule can finish after d bytes; remember d;
//   - the configuration is empty: every token below dies inside q's rule. Those with a remembered
//     finish point k on the path are uncertain, keyed by their rest [k, n); the others are rejected.
//     The subtree is skipped;
//   - otherwise a token ending here is accepted.
// Accepted sets larger than 1/32 of the vocabulary are stored as bitsets (OR'd word by word at run
// time), smaller ones as id lists. Uncertain rests go into a preorder trie per state.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <queue>

#include "core/check.h"
#include "structured/matcher.h"

namespace kestrel::structured {

using detail::Closer;
using detail::Config;
using detail::FramePool;
using detail::FrameDistances;
using detail::StackDistance;

namespace {

// min_accept[q]: the fewest tokens that take state q to an accepting state of q's rule, counting
//   - a token whose bytes the rule's own automaton reads from q to q' (no call, no return) as one step;
//   - a special-token edge as one step;
//   - a call edge as the callee's min_accept from its start plus the return state's.
// Every such path is a sequence of tokens the matcher accepts, so min_accept is an upper bound on the
// tokens that finish the rule (exact up to tokens that straddle rule boundaries). It is the least
// fixed point of A(q) = 0 if accepting, else min over those edges, found by Knuth's generalisation of
// Dijkstra (every right-hand side is >= each of its inputs, so a state popped with its current value is
// final). Token edges come from one walk of the vocabulary trie per state through the rule's automaton
// (one table lookup per trie node, pruned at dead bytes; the token tables walk the trie per state too,
// with whole configurations, which costs far more).
//
// The matcher refuses a call that would stack more than max_stack_depth frames, so a frame with room for
// only h more frames above it can use only paths whose calls nest at most h deep: near[h] (h = 0, 1, ...)
// is that distance, the same fixed point with a call costing the callee's near[h − 1] from its start (none
// for h = 0) plus the return state's near[h]. It falls with h and reaches min_accept once h covers the
// deepest nesting a shortest path needs (a shortest derivation repeats no rule along a branch, so at most
// the rule count); near holds the levels before that, each only the states where it differs.
struct Distances {
  std::vector<uint32_t> unlimited;
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> near;
};

Distances compute_min_accept(const Grammar& g, const TokenVocab& vocab, const std::vector<uint8_t>& reach,
                             uint32_t max_depth, std::chrono::steady_clock::time_point deadline) {
  const size_t S = g.states.size();
  const auto& trie = vocab.trie();
  // Reverse edges: unit edges (a token or a special read) and call edges, by the states they read.
  std::vector<std::vector<uint32_t>> unit_into(S);
  struct CallDep {
    uint32_t from, start, ret;
  };
  std::vector<CallDep> calls;
  std::vector<std::vector<uint32_t>> calls_into(S);
  std::vector<uint32_t> at(vocab.max_token_bytes() + 1), targets;
  for (uint32_t q = 0; q < S; ++q) {
    if (!reach[q]) continue;
    const Grammar::State& s = g.states[q];
    if (s.has_bytes) {
      targets.clear();
      at[0] = q;
      for (uint32_t i = 1; i < trie.size();) {
        const TokenVocab::TrieNode& n = trie[i];
        const uint32_t from = at[n.depth - 1];
        const uint32_t t = g.states[from].has_bytes ? g.step(from, n.byte) : kDead;
        if (t == kDead) {
          i = n.end;
          continue;
        }
        at[n.depth] = t;
        if (n.token != kNoToken) targets.push_back(t);
        ++i;
      }
      std::sort(targets.begin(), targets.end());
      targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
      for (uint32_t t : targets) unit_into[t].push_back(q);
    }
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i) unit_into[g.specials[i].next].push_back(q);
    for (uint32_t i = s.calls_begin; i < s.calls_end; ++i) {
      const CallDep d{q, g.rules[g.calls[i].rule].start, g.calls[i].ret};
      calls_into[d.start].push_back(uint32_t(calls.size()));
      if (d.ret != d.start) calls_into[d.ret].push_back(uint32_t(calls.size()));
      calls.push_back(d);
    }
  }
  constexpr uint32_t kInf = StackDistance::kInf;
  // callee: null, the fixed point itself (unlimited); else a call costs callee[start] + A[ret], where
  // callee is the level below (>= A pointwise, so the right-hand sides still never fall below a popped value).
  auto solve = [&](const std::vector<uint32_t>* callee) {
    std::vector<uint32_t> A(S, kInf);
    using Item = std::pair<uint32_t, uint32_t>;  // (value, state)
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> pq;
    for (uint32_t q = 0; q < S; ++q)
      if (g.states[q].accepting) A[q] = 0, pq.push({0, q});
    auto relax = [&](uint32_t q, uint32_t v) {
      if (v < A[q]) A[q] = v, pq.push({v, q});
    };
    while (!pq.empty()) {
      const auto [v, x] = pq.top();
      pq.pop();
      if (v != A[x]) continue;
      for (uint32_t q : unit_into[x]) relax(q, std::min(kInf, v + 1));
      for (uint32_t i : calls_into[x]) {
        const CallDep& d = calls[i];
        const uint32_t start = callee ? (*callee)[d.start] : A[d.start];
        if (start < kInf && A[d.ret] < kInf) relax(d.from, std::min(kInf, start + A[d.ret]));
      }
    }
    return A;
  };
  Distances out;
  out.unlimited = solve(nullptr);
  std::vector<uint32_t> below(S, kInf);  // the level under h = 0: no call fits
  // Headroom max_depth - 1 is the most a frame (depth >= 1) ever has.
  for (uint32_t h = 0; h < max_depth; ++h) {
    // A level per nesting a shortest path needs: many for a deep chain of required objects, each one
    // Dijkstra over the states, so the compile's time limit covers them too.
    if (std::chrono::steady_clock::now() > deadline)
      fail("grammar compilation took longer than the time limit (distances, nesting level {})", h);
    std::vector<uint32_t> level = solve(&below);
    if (level == below) break;  // the fixed point: every level above is the same
    std::vector<std::pair<uint32_t, uint32_t>> differs;
    for (uint32_t q = 0; q < S; ++q)
      if (reach[q] && level[q] != out.unlimited[q]) differs.push_back({q, level[q]});
    if (differs.empty()) break;  // min_accept from here on
    out.near.push_back(std::move(differs));
    below = std::move(level);
  }
  return out;
}

}  // namespace

CompiledGrammar::CompiledGrammar(std::shared_ptr<const TokenVocab> vocab, Grammar grammar, uint32_t max_stack_depth,
                                 std::chrono::steady_clock::time_point deadline)
    : vocab_(std::move(vocab)), g_(std::move(grammar)), max_depth_(max_stack_depth) {
  KCHECK(max_depth_ >= 1, "max_stack_depth must be positive");
  const auto t0 = std::chrono::steady_clock::now();
  for (const Grammar::SpecialEdge& e : g_.specials)
    if (!vocab_->is_special(e.id)) fail("grammar terminal {} is not a special token of the vocabulary", e.id);
  // Reachable states: from the root start through byte/special edges, call returns and callee starts.
  const size_t S = g_.states.size();
  std::vector<uint8_t> reach(S, 0);
  std::vector<uint32_t> work = {g_.rules[g_.root].start};
  reach[work[0]] = 1;
  // A matcher is terminated when its configuration ended and every frame is a state with no way on;
  // its bottom frame is always a root-rule state, which after an ordinary token is a byte edge's
  // target or (popped into) a call's return state: if no such state is an accepting dead end, no
  // ordinary token can terminate a matcher (bytes_may_terminate()).
  auto final_root = [&](uint32_t t) {
    const Grammar::State& st = g_.states[t];
    return st.rule == g_.root && st.accepting && !st.has_bytes && st.specials_begin == st.specials_end &&
           st.calls_begin == st.calls_end;
  };
  while (!work.empty()) {
    const uint32_t q = work.back();
    work.pop_back();
    const Grammar::State& s = g_.states[q];
    auto visit = [&](uint32_t t) {
      if (t != kDead && !reach[t]) reach[t] = 1, work.push_back(t);
    };
    if (s.has_bytes)
      for (int b = 0; b < 256; ++b) {
        const uint32_t t = g_.step(q, uint8_t(b));
        if (t != kDead && final_root(t)) bytes_may_terminate_ = true;
        visit(t);
      }
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i) visit(g_.specials[i].next);
    for (uint32_t i = s.calls_begin; i < s.calls_end; ++i) {
      if (final_root(g_.calls[i].ret)) bytes_may_terminate_ = true;
      visit(g_.calls[i].ret);
      visit(g_.rules[g_.calls[i].rule].start);
    }
  }
  // The root rule pops only into the bottom (the document's end), after which nothing can follow:
  // its states need no uncertain tokens unless some rule calls the root.
  for (const Grammar::Call& c : g_.calls) root_called_ = root_called_ || c.rule == g_.root;
  for (const TokenVocab::TrieNode& n : vocab_->trie()) ordinary_tokens_ += n.token != kNoToken;
  {
    Distances d = compute_min_accept(g_, *vocab_, reach, max_depth_, deadline);
    min_accept_ = std::move(d.unlimited);
    near_accept_ = std::move(d.near);
  }
  {
    size_t one_byte = 0;  // one-byte tokens: all 256 make min_accept drop by at most one per byte read
    for (const TokenVocab::TrieNode& n : vocab_->trie()) one_byte += n.depth == 1 && n.token != kNoToken;
    every_byte_a_token_ = one_byte == 256;
  }
  tables_.resize(S);
  FramePool pool;
  std::vector<Config> levels;
  for (uint32_t q = 0; q < S; ++q) {
    if (!reach[q]) continue;
    if (std::chrono::steady_clock::now() > deadline)
      fail("grammar compilation took longer than the time limit (token tables, state {} of {})", q, S);
    tabulate(q, pool, levels);
  }
  stats_.states = S;
  stats_.rules = g_.rules.size();
  stats_.bitsets = bitsets_.size() / std::max<size_t>(1, vocab_->mask_words());
  stats_.accepted_list_ids = lists_.size();
  stats_.uncertain_tokens = sfx_tokens_.size();
  stats_.suffix_nodes = sfx_.size();
  stats_.memory_bytes = bitsets_.size() * 4 + lists_.size() * 4 + sfx_.size() * sizeof(SfxNode) +
                        sfx_tokens_.size() * 4 + after_.size() * sizeof(After) + tables_.size() * sizeof(Table) +
                        g_.trans.size() * 4 +
                        g_.states.size() * sizeof(Grammar::State);
  stats_.precompute_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void CompiledGrammar::tabulate(uint32_t q, FramePool& pool, std::vector<Config>& levels) {
  const auto& trie = vocab_->trie();
  const size_t maxd = vocab_->max_token_bytes() + 1;
  if (levels.size() < maxd) levels.resize(maxd);
  pool.reset();
  StackDistance dist;
  dist.reset(0);  // relative to the unknown caller: what finishes q's frame
  // Unlimited depth: the matcher uses these amounts only where no frame is within near_levels() of its
  // limit after any token (Matcher::tables_exact).
  const detail::FrameDistances unlimited{&min_accept_, nullptr, UINT32_MAX};
  // Unlimited height here: the matcher compares max_height with its remaining depth instead.
  Closer closer(g_, pool, UINT32_MAX);
  closer.begin(levels[0]);
  closer.add(levels[0], pool.get(q, FramePool::kBottom));

  std::vector<uint32_t> accepted, left;                  // left[i]: what finishes the frame after accepted[i]
  std::vector<std::pair<uint32_t, uint16_t>> uncertain;  // (token, rest offset)
  std::vector<uint16_t> pops;                            // finish points on the current path
  uint32_t max_depth = 1;
  uint32_t max_after = 0;
  for (uint32_t i = 1; i < trie.size();) {
    const TokenVocab::TrieNode& n = trie[i];
    const uint16_t d = n.depth;
    while (!pops.empty() && pops.back() >= d) pops.pop_back();
    Config& c = levels[d];
    closer.step(levels[d - 1], n.byte, c);
    for (uint32_t f : c.frames) max_depth = std::max(max_depth, pool.depth(f));
    if (c.empty()) {
      if (!pops.empty())
        for (uint32_t j = i; j < n.end; ++j)
          if (trie[j].token != kNoToken)
            for (uint16_t k : pops) uncertain.push_back({trie[j].token, k});
      i = n.end;
      continue;
    }
    if (c.ended && (root_called_ || g_.states[q].rule != g_.root)) pops.push_back(d);
    if (n.token != kNoToken) {
      accepted.push_back(n.token);
      left.push_back(dist.config(pool, unlimited, c));
      max_after = std::max(max_after, left.back());
    }
    ++i;
  }

  Table& t = tables_[q];
  t.computed = true;
  t.max_height = max_depth - 1;
  t.max_after = max_after;
  t.min_after = left.empty() ? 0 : *std::min_element(left.begin(), left.end());
  {
    // Usually few accepted tokens leave other than the most common amount (in a string: those that
    // close it, or end inside an escape or a UTF-8 sequence); a quarter of them at most are kept, else
    // the matcher walks.
    std::vector<uint32_t> sorted = left;
    std::sort(sorted.begin(), sorted.end());
    size_t best = 0;
    for (size_t i = 0, j = 0; i < sorted.size(); i = j) {
      while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
      if (j - i > best) best = j - i, t.base_after = sorted[i];
    }
    t.after_stored = accepted.size() - best <= accepted.size() / 4 + 64;
    t.after_begin = uint32_t(after_.size());
    if (t.after_stored)
      for (size_t i = 0; i < accepted.size(); ++i)
        if (left[i] != t.base_after) after_.push_back({accepted[i], left[i]});
    std::sort(after_.begin() + t.after_begin, after_.end(), [](const After& a, const After& b) { return a.left > b.left; });
    t.after_end = uint32_t(after_.size());
  }
  t.all_ordinary = ordinary_tokens_ > 0 && accepted.size() == ordinary_tokens_;  // each trie token once
  const size_t words = vocab_->mask_words();
  if (accepted.size() * 32 > vocab_->vocab_size()) {
    t.bitset = uint32_t(bitsets_.size() / words);
    bitsets_.resize(bitsets_.size() + words, 0);
    uint32_t* w = bitsets_.data() + size_t(t.bitset) * words;
    for (uint32_t id : accepted) mask_set(w, id);
  } else {
    std::sort(accepted.begin(), accepted.end());
    t.list_begin = uint32_t(lists_.size());
    lists_.insert(lists_.end(), accepted.begin(), accepted.end());
    t.list_end = uint32_t(lists_.size());
  }

  // Rest trie: sort by rest bytes, then emit preorder nodes along the common prefixes.
  t.sfx_begin = uint32_t(sfx_.size());
  if (!uncertain.empty()) {
    auto rest = [&](const std::pair<uint32_t, uint16_t>& u) {
      return std::string_view(vocab_->bytes(u.first)).substr(u.second);
    };
    std::sort(uncertain.begin(), uncertain.end(), [&](const auto& a, const auto& b) {
      const auto ra = rest(a), rb = rest(b);
      return ra != rb ? ra < rb : a.first < b.first;
    });
    uncertain.erase(std::unique(uncertain.begin(), uncertain.end(),
                                [&](const auto& a, const auto& b) { return a.first == b.first && rest(a) == rest(b); }),
                    uncertain.end());
    sfx_.push_back({0, 0, 0, 0, 0});  // root
    std::vector<uint32_t> path = {uint32_t(sfx_.size() - 1)};
    std::string_view prev;
    for (const auto& u : uncertain) {
      const std::string_view r = rest(u);
      size_t lcp = 0;
      while (lcp < prev.size() && lcp < r.size() && prev[lcp] == r[lcp]) ++lcp;
      if (lcp == r.size() && r.size() == prev.size() && path.size() == r.size() + 1) {
        // Same rest as the previous token: extend its token range.
        sfx_tokens_.push_back(u.first);
        sfx_[path.back()].tok_end = uint32_t(sfx_tokens_.size());
        continue;
      }
      while (path.size() > lcp + 1) {
        sfx_[path.back()].end = uint32_t(sfx_.size());
        path.pop_back();
      }
      for (size_t k = lcp; k < r.size(); ++k) {
        const uint32_t at = uint32_t(sfx_tokens_.size());
        sfx_.push_back({0, at, at, uint16_t(k + 1), uint8_t(r[k])});
        path.push_back(uint32_t(sfx_.size() - 1));
      }
      sfx_tokens_.push_back(u.first);
      sfx_[path.back()].tok_begin = uint32_t(sfx_tokens_.size() - 1);
      sfx_[path.back()].tok_end = uint32_t(sfx_tokens_.size());
      prev = r;
    }
    while (!path.empty()) {
      sfx_[path.back()].end = uint32_t(sfx_.size());
      path.pop_back();
    }
  }
  t.sfx_end = uint32_t(sfx_.size());
}

}  // namespace kestrel::structured
