// GrammarBuilder: Thompson fragments -> per-rule DFAs (subset construction, then minimisation by
// signature refinement) -> one Grammar with byte-class rows, trimmed to productive states.
//
// Subset construction treats a call of rule X like a symbol: the calls of one subset to the same rule
// merge into one call whose return state is the union of the targets, so alternatives that both
// start with, say, a string stay one path until they differ. Minimisation merges states with equal
// futures (equal acceptance, byte rows, special and call edges up to the partition), which both
// shrinks the grammar and lets equal states share one precomputed token table.
#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "core/check.h"
#include "structured/grammar.h"

namespace kestrel::structured {
namespace {

struct VecHash {
  size_t operator()(const std::vector<uint32_t>& v) const {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ v.size();
    for (uint32_t x : v) h = (h ^ x) * 0x100000001B3ull + (h >> 29);
    return size_t(h);
  }
};

// A rule's DFA before it joins the global grammar.
struct LState {
  std::vector<std::pair<std::pair<uint8_t, uint8_t>, uint32_t>> bytes;  // disjoint sorted intervals -> local state
  std::vector<std::pair<TokenId, uint32_t>> specials;                   // sorted by id
  std::vector<std::pair<uint32_t, uint32_t>> calls;                     // (rule, local state), sorted
  bool accepting = false;
};

}  // namespace

uint32_t GrammarBuilder::node() {
  if (nodes_.size() >= limits_.max_nfa_nodes)
    fail("grammar too large: more than {} automaton nodes (limit)", limits_.max_nfa_nodes);
  nodes_.emplace_back();
  return uint32_t(nodes_.size() - 1);
}

void GrammarBuilder::check_deadline() const {
  if (std::chrono::steady_clock::now() > limits_.deadline) fail("grammar compilation took longer than the time limit");
}

uint32_t GrammarBuilder::add_rule(std::string name) {
  names_.push_back(std::move(name));
  bodies_.emplace_back();
  return uint32_t(names_.size() - 1);
}

void GrammarBuilder::set_body(uint32_t rule, Frag body) {
  KCHECK(rule < bodies_.size() && !bodies_[rule], "rule {} has a body already", rule);
  bodies_[rule] = body;
}

GrammarBuilder::Frag GrammarBuilder::empty() {
  const uint32_t a = node();
  return {a, a};
}
GrammarBuilder::Frag GrammarBuilder::nothing() { return {node(), node()}; }

GrammarBuilder::Frag GrammarBuilder::literal(std::string_view bytes) {
  const uint32_t in = node();
  uint32_t cur = in;
  for (char c : bytes) {
    const uint32_t nx = node();
    nodes_[cur].bytes.push_back({uint8_t(c), uint8_t(c), nx});
    cur = nx;
  }
  return {in, cur};
}

GrammarBuilder::Frag GrammarBuilder::byte_range(uint8_t lo, uint8_t hi) {
  const uint32_t a = node(), b = node();
  nodes_[a].bytes.push_back({lo, hi, b});
  return {a, b};
}

GrammarBuilder::Frag GrammarBuilder::byte_set(const std::bitset<256>& set) {
  const uint32_t a = node(), b = node();
  for (int lo = 0; lo < 256;) {
    if (!set[lo]) {
      ++lo;
      continue;
    }
    int hi = lo;
    while (hi + 1 < 256 && set[hi + 1]) ++hi;
    nodes_[a].bytes.push_back({uint8_t(lo), uint8_t(hi), b});
    lo = hi + 1;
  }
  return {a, b};
}

GrammarBuilder::Frag GrammarBuilder::special(TokenId id) {
  const uint32_t a = node(), b = node();
  nodes_[a].specials.push_back({id, b});
  return {a, b};
}

GrammarBuilder::Frag GrammarBuilder::call(uint32_t rule) {
  KCHECK(rule < names_.size(), "call of an undeclared rule {}", rule);
  const uint32_t a = node(), b = node();
  nodes_[a].calls.push_back({rule, b});
  return {a, b};
}

GrammarBuilder::Frag GrammarBuilder::seq(Frag a, Frag b) {
  eps(a.out, b.in);
  return {a.in, b.out};
}

GrammarBuilder::Frag GrammarBuilder::seq(std::initializer_list<Frag> parts) {
  KCHECK(parts.size() > 0, "empty sequence");
  Frag f = *parts.begin();
  for (auto it = parts.begin() + 1; it != parts.end(); ++it) f = seq(f, *it);
  return f;
}

GrammarBuilder::Frag GrammarBuilder::alt(const std::vector<Frag>& alternatives) {
  if (alternatives.empty()) return nothing();
  if (alternatives.size() == 1) return alternatives[0];
  const uint32_t in = node(), out = node();
  for (const Frag& f : alternatives) {
    eps(in, f.in);
    eps(f.out, out);
  }
  return {in, out};
}

GrammarBuilder::Frag GrammarBuilder::opt(Frag f) {
  const uint32_t in = node(), out = node();
  eps(in, f.in);
  eps(f.out, out);
  eps(in, out);
  return {in, out};
}

GrammarBuilder::Frag GrammarBuilder::star(Frag f) {
  const uint32_t in = node(), out = node();
  eps(in, f.in);
  eps(f.out, in);
  eps(in, out);
  return {in, out};
}

GrammarBuilder::Frag GrammarBuilder::plus(const std::function<Frag()>& gen) { return seq(gen(), star(gen())); }

GrammarBuilder::Frag GrammarBuilder::repeat(const std::function<Frag()>& gen, size_t min, std::optional<size_t> max) {
  KCHECK(!max || *max >= min, "repeat {}..{}", min, *max);
  Frag f = empty();
  for (size_t i = 0; i < min; ++i) f = seq(f, gen());
  if (!max) return seq(f, star(gen()));
  // Optional tail nested (a(b(c)?)?)? so each optional copy needs the previous one.
  if (*max > min) {
    Frag tail = opt(gen());
    for (size_t i = min + 1; i < *max; ++i) tail = opt(seq(gen(), tail));
    f = seq(f, tail);
  }
  return f;
}

Grammar GrammarBuilder::build(uint32_t root) {
  const size_t R = names_.size();
  KCHECK(root < R, "root rule {}", root);
  for (size_t r = 0; r < R; ++r)
    if (!bodies_[r]) fail("internal: rule '{}' has no body", names_[r]);

  // ---- per-rule subset construction
  std::vector<std::vector<LState>> dfas(R);
  size_t total_states = 0;
  std::vector<uint32_t> stack;
  std::vector<uint8_t> seen(nodes_.size(), 0);
  auto closure = [&](std::vector<uint32_t> set) {
    std::vector<uint32_t> out;
    stack = std::move(set);
    while (!stack.empty()) {
      const uint32_t n = stack.back();
      stack.pop_back();
      if (seen[n]) continue;
      seen[n] = 1;
      out.push_back(n);
      for (uint32_t e : nodes_[n].eps) stack.push_back(e);
    }
    for (uint32_t n : out) seen[n] = 0;
    std::sort(out.begin(), out.end());
    return out;
  };
  for (size_t r = 0; r < R; ++r) {
    const Frag body = *bodies_[r];
    std::unordered_map<std::vector<uint32_t>, uint32_t, VecHash> ids;
    std::vector<std::vector<uint32_t>> sets;
    auto intern = [&](std::vector<uint32_t> s) -> uint32_t {
      auto it = ids.find(s);
      if (it != ids.end()) return it->second;
      if (++total_states > limits_.max_states)
        fail("grammar too large: more than {} automaton states (limit)", limits_.max_states);
      const uint32_t id = uint32_t(sets.size());
      ids.emplace(s, id);
      sets.push_back(std::move(s));
      return id;
    };
    intern(closure({body.in}));
    std::vector<LState>& dfa = dfas[r];
    for (size_t i = 0; i < sets.size(); ++i) {
      if ((i & 255) == 0) check_deadline();
      const std::vector<uint32_t> set = sets[i];
      LState st;
      st.accepting = std::binary_search(set.begin(), set.end(), body.out);
      // Bytes: elementary intervals between all edge boundaries.
      std::vector<int> cuts;
      for (uint32_t n : set)
        for (const Edge& e : nodes_[n].bytes) {
          cuts.push_back(e.lo);
          cuts.push_back(e.hi + 1);
        }
      std::sort(cuts.begin(), cuts.end());
      cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
      if (!cuts.empty()) {
        std::vector<std::vector<uint32_t>> targets(cuts.size());
        for (uint32_t n : set)
          for (const Edge& e : nodes_[n].bytes) {
            const size_t a = std::lower_bound(cuts.begin(), cuts.end(), int(e.lo)) - cuts.begin();
            const size_t b = std::lower_bound(cuts.begin(), cuts.end(), int(e.hi) + 1) - cuts.begin();
            for (size_t k = a; k < b; ++k) targets[k].push_back(e.to);
          }
        for (size_t k = 0; k + 1 < cuts.size(); ++k) {
          if (targets[k].empty()) continue;
          const uint32_t to = intern(closure(std::move(targets[k])));
          st.bytes.push_back({{uint8_t(cuts[k]), uint8_t(cuts[k + 1] - 1)}, to});
        }
      }
      std::map<TokenId, std::vector<uint32_t>> sp;
      std::map<uint32_t, std::vector<uint32_t>> cl;
      for (uint32_t n : set) {
        for (const SpecialE& e : nodes_[n].specials) sp[e.id].push_back(e.to);
        for (const CallE& e : nodes_[n].calls) cl[e.rule].push_back(e.to);
      }
      for (auto& [id, t] : sp) st.specials.push_back({id, intern(closure(std::move(t)))});
      for (auto& [rule, t] : cl) st.calls.push_back({rule, intern(closure(std::move(t)))});
      dfa.push_back(std::move(st));
    }
  }

  // ---- per-rule minimisation (signature refinement; dead = UINT32_MAX stays itself)
  for (size_t r = 0; r < R; ++r) {
    std::vector<LState>& dfa = dfas[r];
    const size_t n = dfa.size();
    std::vector<uint32_t> cls(n, 0), next_cls(n);
    size_t num = 1;
    for (;;) {
      check_deadline();
      std::map<std::vector<uint32_t>, uint32_t> sig_ids;
      std::vector<uint32_t> sig;
      for (size_t q = 0; q < n; ++q) {
        const LState& s = dfa[q];
        sig.clear();
        sig.push_back(cls[q]);
        sig.push_back(s.accepting);
        // Byte intervals mapped to classes, adjacent equal targets merged.
        uint32_t last_to = kDead;
        int last_hi = -2;
        for (const auto& [iv, to] : s.bytes) {
          const uint32_t c = cls[to];
          if (c == last_to && iv.first == last_hi + 1) {
            sig.back() = iv.second;
          } else {
            sig.push_back(0xFFFF0000u);
            sig.push_back(iv.first);
            sig.push_back(c);
            sig.push_back(iv.second);
          }
          last_to = c;
          last_hi = iv.second;
        }
        sig.push_back(0xFFFF0001u);
        for (const auto& [id, to] : s.specials) {
          sig.push_back(id);
          sig.push_back(cls[to]);
        }
        sig.push_back(0xFFFF0002u);
        for (const auto& [rule, to] : s.calls) {
          sig.push_back(rule);
          sig.push_back(cls[to]);
        }
        auto [it, fresh] = sig_ids.emplace(sig, uint32_t(sig_ids.size()));
        next_cls[q] = it->second;
      }
      const size_t new_num = sig_ids.size();
      cls.swap(next_cls);
      if (new_num == num) break;
      num = new_num;
    }
    // Rebuild with the start state's class first (class ids follow first appearance: q = 0 has class 0).
    std::vector<LState> min(num);
    std::vector<uint8_t> done(num, 0);
    for (size_t q = 0; q < n; ++q) {
      const uint32_t c = cls[q];
      if (done[c]) continue;
      done[c] = 1;
      LState s = dfa[q];
      for (auto& b : s.bytes) b.second = cls[b.second];
      for (auto& sp : s.specials) sp.second = cls[sp.second];
      for (auto& cl : s.calls) cl.second = cls[cl.second];
      min[c] = std::move(s);
    }
    KCHECK(cls[0] == 0, "minimisation renumbered the start state");
    dfa = std::move(min);
  }

  // ---- global assembly
  Grammar g;
  g.root = root;
  std::vector<uint32_t> base(R);
  size_t count = 0;
  for (size_t r = 0; r < R; ++r) {
    base[r] = uint32_t(count);
    count += dfas[r].size();
  }
  g.states.resize(count);
  std::map<std::array<uint8_t, 256>, uint16_t> cmap_ids;
  for (size_t r = 0; r < R; ++r) {
    g.rules.push_back({names_[r], base[r]});
    std::vector<int> cuts = {0, 256};
    for (const LState& s : dfas[r])
      for (const auto& [iv, to] : s.bytes) {
        cuts.push_back(iv.first);
        cuts.push_back(iv.second + 1);
      }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::array<uint8_t, 256> cmap{};
    for (size_t k = 0; k + 1 < cuts.size(); ++k)
      for (int b = cuts[k]; b < cuts[k + 1]; ++b) cmap[b] = uint8_t(k);
    const size_t ncls = cuts.size() - 1;
    auto [it, fresh] = cmap_ids.emplace(cmap, uint16_t(g.cmaps.size()));
    if (fresh) {
      if (g.cmaps.size() >= 65535) fail("grammar too large: too many byte-class maps");
      g.cmaps.push_back(cmap);
    }
    for (size_t q = 0; q < dfas[r].size(); ++q) {
      const LState& s = dfas[r][q];
      Grammar::State& gs = g.states[base[r] + q];
      gs.rule = uint32_t(r);
      gs.cmap = it->second;
      gs.accepting = s.accepting;
      gs.trans = uint32_t(g.trans.size());
      g.trans.resize(g.trans.size() + ncls, kDead);
      for (const auto& [iv, to] : s.bytes)
        for (size_t k = 0; k < ncls; ++k)
          if (cuts[k] >= iv.first && cuts[k] <= iv.second) g.trans[gs.trans + k] = base[r] + to;
      gs.specials_begin = uint32_t(g.specials.size());
      for (const auto& [id, to] : s.specials) g.specials.push_back({id, base[r] + to});
      gs.specials_end = uint32_t(g.specials.size());
      gs.calls_begin = uint32_t(g.calls.size());
      for (const auto& [rule, to] : s.calls) g.calls.push_back({rule, base[r] + to});
      gs.calls_end = uint32_t(g.calls.size());
    }
  }
  dfas.clear();

  // ---- trim: keep only productive states (those from which a complete rule match is reachable)
  const size_t S = g.states.size();
  std::vector<uint8_t> prod(S, 0);
  std::vector<std::vector<uint32_t>> preds(S);  // byte and special predecessors
  std::vector<std::vector<std::pair<uint32_t, uint32_t>>> calls_of_rule(R), calls_by_ret(S);  // (caller, other)
  for (uint32_t q = 0; q < S; ++q) {
    const Grammar::State& s = g.states[q];
    const size_t ncls = (q + 1 < S && g.states[q + 1].trans >= s.trans ? g.states[q + 1].trans : g.trans.size()) - s.trans;
    for (size_t k = 0; k < ncls; ++k)
      if (g.trans[s.trans + k] != kDead) preds[g.trans[s.trans + k]].push_back(q);
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i) preds[g.specials[i].next].push_back(q);
    for (uint32_t i = s.calls_begin; i < s.calls_end; ++i) {
      calls_of_rule[g.calls[i].rule].push_back({q, g.calls[i].ret});
      calls_by_ret[g.calls[i].ret].push_back({q, g.calls[i].rule});
    }
  }
  std::vector<uint32_t> work;
  for (uint32_t q = 0; q < S; ++q)
    if (g.states[q].accepting) prod[q] = 1, work.push_back(q);
  std::vector<uint8_t> is_start(S, 0);
  for (size_t r = 0; r < R; ++r) is_start[g.rules[r].start] = 1;
  while (!work.empty()) {
    const uint32_t q = work.back();
    work.pop_back();
    auto mark = [&](uint32_t p) {
      if (!prod[p]) prod[p] = 1, work.push_back(p);
    };
    for (uint32_t p : preds[q]) mark(p);
    if (is_start[q])
      for (size_t r = 0; r < R; ++r)
        if (g.rules[r].start == q)
          for (const auto& [caller, ret] : calls_of_rule[r])
            if (prod[ret]) mark(caller);
    for (const auto& [caller, rule] : calls_by_ret[q])
      if (prod[g.rules[rule].start]) mark(caller);
  }
  if (!prod[g.rules[root].start]) fail("the schema admits no value");
  for (uint32_t q = 0; q < S; ++q) {
    Grammar::State& s = g.states[q];
    const size_t end = q + 1 < S ? g.states[q + 1].trans : g.trans.size();
    s.has_bytes = false;
    for (size_t k = s.trans; k < end; ++k) {
      if (g.trans[k] != kDead && !prod[g.trans[k]]) g.trans[k] = kDead;
      s.has_bytes = s.has_bytes || g.trans[k] != kDead;
    }
  }
  // Compact special and call edges, dropping dead ones.
  std::vector<Grammar::SpecialEdge> sp;
  std::vector<Grammar::Call> cl;
  for (uint32_t q = 0; q < S; ++q) {
    Grammar::State& s = g.states[q];
    const uint32_t sb = uint32_t(sp.size()), cb = uint32_t(cl.size());
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i)
      if (prod[g.specials[i].next]) sp.push_back(g.specials[i]);
    for (uint32_t i = s.calls_begin; i < s.calls_end; ++i)
      if (prod[g.calls[i].ret] && prod[g.rules[g.calls[i].rule].start]) cl.push_back(g.calls[i]);
    s.specials_begin = sb, s.specials_end = uint32_t(sp.size());
    s.calls_begin = cb, s.calls_end = uint32_t(cl.size());
  }
  g.specials = std::move(sp);
  g.calls = std::move(cl);

  // ---- left recursion: a rule that can reach a call of itself without reading anything.
  std::vector<uint8_t> nullable(R, 0);
  auto reach_without_input = [&](size_t r, std::vector<uint32_t>* called) {
    // States of rule r reachable from its start through calls of nullable rules only.
    std::vector<uint32_t> todo = {g.rules[r].start};
    std::set<uint32_t> vis = {g.rules[r].start};
    bool acc = false;
    while (!todo.empty()) {
      const uint32_t q = todo.back();
      todo.pop_back();
      acc = acc || g.states[q].accepting;
      for (uint32_t i = g.states[q].calls_begin; i < g.states[q].calls_end; ++i) {
        if (called) called->push_back(g.calls[i].rule);
        if (nullable[g.calls[i].rule] && vis.insert(g.calls[i].ret).second) todo.push_back(g.calls[i].ret);
      }
    }
    return acc;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < R; ++r)
      if (!nullable[r] && reach_without_input(r, nullptr)) nullable[r] = 1, changed = true;
  }
  std::vector<std::vector<uint32_t>> left(R);
  for (size_t r = 0; r < R; ++r) reach_without_input(r, &left[r]);
  std::vector<uint8_t> color(R, 0);  // 0 new, 1 on path, 2 done
  std::vector<uint32_t> path;
  std::function<void(uint32_t)> dfs = [&](uint32_t r) {
    color[r] = 1;
    path.push_back(r);
    for (uint32_t c : left[r]) {
      if (color[c] == 1) {
        std::string cyc;
        for (size_t i = std::find(path.begin(), path.end(), c) - path.begin(); i < path.size(); ++i)
          cyc += g.rules[path[i]].name + " -> ";
        fail("recursion that reads no input: {}{}", cyc, g.rules[c].name);
      }
      if (color[c] == 0) dfs(c);
    }
    path.pop_back();
    color[r] = 2;
  };
  for (size_t r = 0; r < R; ++r)
    if (color[r] == 0) dfs(uint32_t(r));
  return g;
}

bool Grammar::recognizes(std::string_view bytes, size_t max_depth) const {
  // Configurations: stacks of states (bottom first); closure expands calls and pops.
  using Stack = std::vector<uint32_t>;
  std::set<Stack> cur;
  bool ended = false;
  std::function<void(std::set<Stack>&, Stack, bool&)> add = [&](std::set<Stack>& out, Stack s, bool& end) {
    if (s.empty()) {
      end = true;
      return;
    }
    if (s.size() > max_depth || !out.insert(s).second) return;
    const State& st = states[s.back()];
    for (uint32_t i = st.calls_begin; i < st.calls_end; ++i) {
      Stack t = s;
      t.back() = calls[i].ret;
      t.push_back(rules[calls[i].rule].start);
      add(out, std::move(t), end);
    }
    if (st.accepting) {
      Stack t = s;
      t.pop_back();
      add(out, std::move(t), end);
    }
  };
  add(cur, Stack{rules[root].start}, ended);
  for (char c : bytes) {
    std::set<Stack> nx;
    ended = false;
    for (const Stack& s : cur) {
      const uint32_t t = step(s.back(), uint8_t(c));
      if (t == kDead) continue;
      Stack u = s;
      u.back() = t;
      add(nx, std::move(u), ended);
    }
    cur.swap(nx);
    if (cur.empty()) return false;
  }
  return ended;
}

std::string Grammar::describe() const {
  std::string out;
  for (size_t r = 0; r < rules.size(); ++r) {
    out += fmt::format("rule {} '{}' start {}\n", r, rules[r].name, rules[r].start);
  }
  for (size_t q = 0; q < states.size(); ++q) {
    const State& s = states[q];
    out += fmt::format("  {}{} (rule {}):", q, s.accepting ? "*" : "", s.rule);
    for (int b = 0; b < 256; ++b) {
      const uint32_t t = step(uint32_t(q), uint8_t(b));
      if (t == kDead) continue;
      int e = b;
      while (e + 1 < 256 && step(uint32_t(q), uint8_t(e + 1)) == t) ++e;
      out += e == b ? fmt::format(" {:02x}->{}", b, t) : fmt::format(" {:02x}-{:02x}->{}", b, e, t);
      b = e;
    }
    for (uint32_t i = s.specials_begin; i < s.specials_end; ++i)
      out += fmt::format(" <{}>->{}", specials[i].id, specials[i].next);
    for (uint32_t i = s.calls_begin; i < s.calls_end; ++i)
      out += fmt::format(" call {}->{}", rules[calls[i].rule].name, calls[i].ret);
    out += "\n";
  }
  return out;
}

}  // namespace kestrel::structured
