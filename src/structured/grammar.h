// Grammars for constrained decoding: recursive transition networks over bytes and special tokens.
//
// A grammar is a set of rules; each rule is a deterministic automaton whose edges read a byte, read a
// special token (a terminal by id, never spelled as text), or *call* another rule (run that rule to
// one of its accepting states, then continue at the edge's return state). Recursion ($ref cycles,
// nested JSON values) is calls; everything regular inside a rule is determinised, so within a rule
// one byte leads to at most one state. Nondeterminism remains only between calls (a nullable call
// next to a byte edge, alternatives that are rules): the matcher follows a set of stacks.
//
// GrammarBuilder builds rules as Thompson NFAs (fragments with epsilon edges), then per rule:
// subset construction, minimisation, a byte-class map; across rules: removal of states that cannot
// reach acceptance (so a matcher never walks into a dead end), and a check that no rule reaches a
// call to itself without reading input (left recursion would make the stack closure infinite).
// Every size is bounded by BuildLimits; exceeding one is a kestrel::Error.
#pragma once

#include <array>
#include <bitset>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "structured/vocab.h"

namespace kestrel::structured {

constexpr uint32_t kDead = UINT32_MAX;

struct Grammar {
  struct State {
    uint32_t rule = 0;
    uint32_t trans = 0;  // offset of this state's row in `trans` (one entry per byte class of its rule)
    uint32_t calls_begin = 0, calls_end = 0;
    uint32_t specials_begin = 0, specials_end = 0;
    uint16_t cmap = 0;   // byte-class map of its rule
    bool accepting = false;
    bool has_bytes = false;  // some byte leads somewhere
  };
  struct Rule {
    std::string name;
    uint32_t start = 0;
  };
  struct Call {
    uint32_t rule;
    uint32_t ret;  // state of the caller's rule to continue at once the callee accepts
  };
  struct SpecialEdge {
    TokenId id;
    uint32_t next;
  };

  std::vector<State> states;
  std::vector<Rule> rules;
  std::vector<std::array<uint8_t, 256>> cmaps;
  std::vector<uint32_t> trans;  // next state or kDead
  std::vector<Call> calls;
  std::vector<SpecialEdge> specials;
  uint32_t root = 0;  // the rule a document is

  uint32_t step(uint32_t q, uint8_t b) const {
    const State& s = states[q];
    return trans[s.trans + cmaps[s.cmap][b]];
  }
  // Whether `bytes` (with no special tokens) is a complete document: a plain recogniser, used to
  // filter enum literals and by tests. Exponential blow-up is impossible: stacks are deduplicated.
  bool recognizes(std::string_view bytes, size_t max_depth = 256) const;
  std::string describe() const;  // debugging dump
};

struct BuildLimits {
  size_t max_nfa_nodes = 2'000'000;
  size_t max_states = 200'000;  // DFA states over all rules
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

class GrammarBuilder {
 public:
  struct Frag {
    uint32_t in = 0, out = 0;
  };

  explicit GrammarBuilder(BuildLimits limits = {}) : limits_(limits) {}

  // Declares a rule (its body comes later, so rules may call each other before they are built).
  uint32_t add_rule(std::string name);
  void set_body(uint32_t rule, Frag body);
  bool has_body(uint32_t rule) const { return bodies_[rule].has_value(); }
  size_t num_rules() const { return names_.size(); }
  size_t num_nodes() const { return nodes_.size(); }

  // Fragments. Each call makes fresh nodes; a fragment may be used once (use a generator to repeat).
  Frag empty();
  Frag nothing();                           // the empty language
  Frag literal(std::string_view bytes);
  Frag byte_range(uint8_t lo, uint8_t hi);
  Frag byte_set(const std::bitset<256>& set);
  Frag special(TokenId id);
  Frag call(uint32_t rule);
  Frag seq(Frag a, Frag b);
  // An epsilon edge from a's end to b's start (for hand-made junctions).
  void link(Frag a, Frag b) { eps(a.out, b.in); }
  Frag seq(std::initializer_list<Frag> parts);
  Frag alt(const std::vector<Frag>& alternatives);
  Frag opt(Frag f);
  Frag star(Frag f);
  Frag plus(const std::function<Frag()>& gen);
  // gen() repeated min..max times (max nullopt = unbounded).
  Frag repeat(const std::function<Frag()>& gen, size_t min, std::optional<size_t> max);

  // Determinises, minimises and trims; `root` is the document rule. Errors: no accepting document,
  // left recursion, limits.
  Grammar build(uint32_t root);

  void check_deadline() const;

 private:
  struct Edge {
    uint8_t lo, hi;
    uint32_t to;
  };
  struct SpecialE {
    TokenId id;
    uint32_t to;
  };
  struct CallE {
    uint32_t rule, to;
  };
  struct Node {
    std::vector<uint32_t> eps;
    std::vector<Edge> bytes;
    std::vector<SpecialE> specials;
    std::vector<CallE> calls;
  };
  uint32_t node();
  void eps(uint32_t from, uint32_t to) { nodes_[from].eps.push_back(to); }

  BuildLimits limits_;
  std::vector<Node> nodes_;
  std::vector<std::string> names_;
  std::vector<std::optional<Frag>> bodies_;
};

}  // namespace kestrel::structured
