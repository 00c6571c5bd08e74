// A process-wide cache of compiled grammars for one vocabulary, keyed by a hash of the canonical
// request text (the schema as compact JSON in its own key order — order matters: properties are
// generated in declaration order — plus the options), so a schema sent with every request is compiled
// once. Thread-safe: concurrent requests for the same key wait for one compilation. Failures are
// cached too (the same bad or adversarial schema costs its compile-time limit once, then is a cached
// 400). Least recently used entries beyond `max_entries` are dropped (grammars in use stay alive
// through their shared_ptr).
#pragma once

#include <functional>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "structured/chat_grammar.h"
#include "structured/json_schema_grammar.h"

namespace kestrel::structured {

class GrammarCache {
 public:
  GrammarCache(std::shared_ptr<const TokenVocab> vocab, size_t max_entries = 256, SchemaOptions opt = {},
               SchemaLimits limits = {});

  // The compiled grammar, or the compiler's kestrel::Error (rethrown, also from cache).
  std::shared_ptr<const CompiledGrammar> json_schema(const ojson& schema);
  std::shared_ptr<const CompiledGrammar> chat(const ChatGrammarSpec& spec);
  // Without waiting: the compiled grammar if it is cached and done (a cached refusal is rethrown),
  // nullptr if it is not cached or still compiling. For callers that must not block (I/O threads),
  // which hand a miss to a worker calling chat() / json_schema().
  std::shared_ptr<const CompiledGrammar> find_json_schema(const ojson& schema);
  std::shared_ptr<const CompiledGrammar> find_chat(const ChatGrammarSpec& spec);

  struct Stats {
    size_t hits = 0, misses = 0, entries = 0;
  };
  Stats stats() const;
  const TokenVocab& vocab() const { return *vocab_; }

  // The cache key of a spec (canonical text); exposed for tests.
  static std::string chat_key(const ChatGrammarSpec& spec);

 private:
  using Result = std::shared_future<std::shared_ptr<const CompiledGrammar>>;
  std::string full_key(const std::string& text) const;
  std::shared_ptr<const CompiledGrammar> find(const std::string& text);
  std::shared_ptr<const CompiledGrammar> get(const std::string& key,
                                             const std::function<std::shared_ptr<const CompiledGrammar>()>& compile);

  std::shared_ptr<const TokenVocab> vocab_;
  size_t max_entries_;
  SchemaOptions opt_;
  SchemaLimits limits_;
  mutable std::mutex mu_;
  std::list<std::string> lru_;  // most recent first
  struct Entry {
    Result result;
    std::list<std::string>::iterator pos;
  };
  std::unordered_map<std::string, Entry> map_;
  Stats stats_;
};

}  // namespace kestrel::structured
