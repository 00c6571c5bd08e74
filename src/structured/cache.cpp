// GrammarCache (cache.h). The map key is the full canonical text, prefixed by its 64-bit FNV-1a hash
// and the vocabulary's fingerprint, so lookups hash a short prefix first and collisions are
// impossible (the text is compared).
#include "structured/cache.h"

#include <fmt/format.h>

#include "core/check.h"

namespace kestrel::structured {
namespace {

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string options_key(const SchemaOptions& o, const SchemaLimits& l) {
  return fmt::format("ws={} strict={} depth={} enum={} rep={} props={} states={} nodes={} stack={}", o.max_whitespace,
                     o.strict_objects, l.max_schema_depth, l.max_enum_values, l.max_repeat, l.max_properties,
                     l.max_states, l.max_nfa_nodes, l.max_stack_depth);
}

}  // namespace

GrammarCache::GrammarCache(std::shared_ptr<const TokenVocab> vocab, size_t max_entries, SchemaOptions opt,
                           SchemaLimits limits)
    : vocab_(std::move(vocab)), max_entries_(std::max<size_t>(1, max_entries)), opt_(opt), limits_(limits) {}

std::string GrammarCache::chat_key(const ChatGrammarSpec& s) {
  ojson k = ojson::object();
  k["thinking"] = s.thinking;
  k["response"] = s.response_schema ? *s.response_schema : ojson();
  ojson tools = ojson::array();
  for (const auto& t : s.tools) tools.push_back(ojson{{"name", t.name}, {"parameters", t.parameters}});
  k["tools"] = tools;
  k["choice"] = int(s.tool_choice);
  k["named"] = s.named_tool;
  k["max_calls"] = s.max_calls;
  return k.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

namespace {
std::string json_text(const ojson& schema) { return "json " + schema.dump(-1, ' ', false, ojson::error_handler_t::replace); }
}  // namespace

std::shared_ptr<const CompiledGrammar> GrammarCache::json_schema(const ojson& schema) {
  return get(json_text(schema), [&] { return compile_json_schema(vocab_, schema, opt_, limits_); });
}

std::shared_ptr<const CompiledGrammar> GrammarCache::chat(const ChatGrammarSpec& spec) {
  return get("chat " + chat_key(spec), [&] { return compile_chat_grammar(vocab_, spec, opt_, limits_); });
}

std::shared_ptr<const CompiledGrammar> GrammarCache::find_json_schema(const ojson& schema) { return find(json_text(schema)); }
std::shared_ptr<const CompiledGrammar> GrammarCache::find_chat(const ChatGrammarSpec& spec) {
  return find("chat " + chat_key(spec));
}

std::string GrammarCache::full_key(const std::string& text) const {
  const std::string full = text + " | " + options_key(opt_, limits_);
  return fmt::format("{:016x}:{:016x}:", fnv1a(full), vocab_->fingerprint()) + full;
}

std::shared_ptr<const CompiledGrammar> GrammarCache::find(const std::string& text) {
  const std::string key = full_key(text);
  Result result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    result = it->second.result;
    if (result.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return nullptr;
    ++stats_.hits;
    lru_.splice(lru_.begin(), lru_, it->second.pos);
  }
  return result.get();
}

std::shared_ptr<const CompiledGrammar> GrammarCache::get(
    const std::string& text, const std::function<std::shared_ptr<const CompiledGrammar>()>& compile) {
  const std::string key = full_key(text);
  std::promise<std::shared_ptr<const CompiledGrammar>> promise;
  Result result;
  bool mine = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it != map_.end()) {
      ++stats_.hits;
      lru_.splice(lru_.begin(), lru_, it->second.pos);
      result = it->second.result;
    } else {
      ++stats_.misses;
      mine = true;
      lru_.push_front(key);
      result = promise.get_future().share();
      map_.emplace(key, Entry{result, lru_.begin()});
      while (map_.size() > max_entries_) {
        map_.erase(lru_.back());
        lru_.pop_back();
      }
      stats_.entries = map_.size();
    }
  }
  if (mine) {
    // Compile outside the lock; concurrent requests for the key wait on the shared future.
    try {
      promise.set_value(compile());
    } catch (const Error&) {
      promise.set_exception(std::current_exception());  // a refusal is cached like a result
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = map_.find(key);
        if (it != map_.end()) {
          lru_.erase(it->second.pos);
          map_.erase(it);
          stats_.entries = map_.size();
        }
      }
      promise.set_exception(std::current_exception());
    }
  }
  return result.get();
}

GrammarCache::Stats GrammarCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace kestrel::structured
