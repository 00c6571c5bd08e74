// Structured outputs at the server: see structured.h.
#include "server/structured.h"

#include <fmt/format.h>

#include "structured/chat_grammar.h"
#include "structured/constraint.h"

namespace kestrel::server {
namespace {

// A compiler or spec error as a 400 whose param names the request field at fault.
ApiError bad_constraint(const Error& e) {
  const std::string m = e.what();
  const char* param = m.rfind("tools", 0) == 0 || m.find("'tools'") != std::string::npos ? "tools"
                      : m.find("tool_choice") != std::string::npos                    ? "tool_choice"
                                                                                       : "response_format";
  return ApiError(400, m, param);
}

bool present(const ojson& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

}  // namespace

GrammarService::GrammarService(const tok::Tokenizer& tok, StructuredOptions opt) : tok_(tok), opt_(opt) {
  for (int i = 0; i < std::max(1, opt_.compile_threads); ++i) threads_.emplace_back([this] { work(); });
}

GrammarService::~GrammarService() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::optional<OutputConstraint> GrammarService::chat_constraint(const ojson& body, const tok::ChatPrompt& prompt,
                                                                bool ignore_eos) {
  try {
    const OutputConstraint::Format format = structured::response_format_of(body);
    const bool tools = present(body, "tools") && body["tools"].is_array() && !body["tools"].empty();
    const bool forced = present(body, "tool_choice") && !(body["tool_choice"].is_string() &&
                                                         (body["tool_choice"] == "auto" || body["tool_choice"] == "none"));
    if (!prompt.generation_prompt) {
      if (format != OutputConstraint::Format::text || forced)
        throw ApiError(400, "response_format json_object/json_schema and a forced tool_choice need the assistant's "
                            "generation prompt (add_generation_prompt)", format != OutputConstraint::Format::text
                                                                               ? "response_format" : "tool_choice");
      return std::nullopt;
    }
    const bool stated = format != OutputConstraint::Format::text || tools || present(body, "tool_choice");
    if (!stated && ignore_eos) return std::nullopt;
    structured::ChatGrammarSpec spec = structured::chat_grammar_spec(body, prompt.thinking);
    if (present(body, "parallel_tool_calls")) {
      if (!body["parallel_tool_calls"].is_boolean()) throw ApiError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls");
      if (!body["parallel_tool_calls"].get<bool>()) spec.max_calls = 1;
    }
    return structured::constraint_of(spec, format);
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    throw bad_constraint(e);
  }
}

std::optional<OutputConstraint> GrammarService::completion_constraint(const ojson& body) {
  try {
    const OutputConstraint::Format format = structured::response_format_of(body);
    if (format == OutputConstraint::Format::text) return std::nullopt;
    ojson only = {{"response_format", body["response_format"]}};  // tools mean nothing here
    const structured::ChatGrammarSpec spec = structured::chat_grammar_spec(only, false);
    return structured::document_constraint(format, spec.response_schema ? *spec.response_schema : ojson());
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    throw bad_constraint(e);
  }
}

void GrammarService::set_completion(std::optional<OutputConstraint>& c, const ojson& body, bool server_default) {
  bool on = server_default;
  if (present(body, "complete_within_max_tokens")) {
    if (!body["complete_within_max_tokens"].is_boolean())
      throw ApiError(400, "'complete_within_max_tokens' must be a boolean", "complete_within_max_tokens");
    on = body["complete_within_max_tokens"].get<bool>();
  }
  // Only where the answer can be nothing but the JSON: with tools allowed beside it the mask would
  // also force a tool call closed, sending arguments the model did not mean.
  const bool tools = c && !c->tools.empty() && c->tool_choice != OutputConstraint::ToolChoice::none;
  if (c) c->complete_within_max_tokens = on && c->format != OutputConstraint::Format::text && !tools;
}

std::shared_ptr<structured::GrammarCache> GrammarService::cache(int64_t vocab_size) {
  {
    std::lock_guard<std::mutex> lk(cache_mu_);
    if (cache_ && cache_vocab_ == vocab_size) return cache_;
  }
  // The vocabulary trie is built outside the lock (I/O threads calling find() never wait for it).
  auto vocab = std::make_shared<const structured::TokenVocab>(tok_, size_t(vocab_size));
  auto fresh = std::make_shared<structured::GrammarCache>(vocab, opt_.cache_entries, structured::SchemaOptions{},
                                                          opt_.limits);
  std::lock_guard<std::mutex> lk(cache_mu_);
  if (!cache_ || cache_vocab_ != vocab_size) cache_ = std::move(fresh), cache_vocab_ = vocab_size;
  return cache_;
}

std::shared_ptr<const structured::CompiledGrammar> GrammarService::find(const OutputConstraint& c, int64_t vocab_size) {
  std::shared_ptr<structured::GrammarCache> cache;
  {
    std::lock_guard<std::mutex> lk(cache_mu_);
    if (cache_ && cache_vocab_ == vocab_size) cache = cache_;
  }
  if (!cache) return nullptr;  // the vocabulary is built on a worker, with the first compile
  try {
    return structured::find(*cache, c);
  } catch (const Error& e) {
    throw bad_constraint(e);
  }
}

void GrammarService::compile_async(OutputConstraint c, int64_t vocab_size, Done done) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back([this, c = std::move(c), vocab_size, done = std::move(done)] {
      std::shared_ptr<const structured::CompiledGrammar> g;
      std::optional<ApiError> err;
      try {
        g = structured::compile(*cache(vocab_size), c);
      } catch (const ApiError& e) {
        err = e;
      } catch (const Error& e) {
        err = bad_constraint(e);
      } catch (const std::exception& e) {
        err = ApiError(500, std::string("grammar compilation failed: ") + e.what());
      }
      done(std::move(g), std::move(err));
    });
  }
  cv_.notify_one();
}

structured::GrammarCache::Stats GrammarService::stats() const {
  std::lock_guard<std::mutex> lk(cache_mu_);
  return cache_ ? cache_->stats() : structured::GrammarCache::Stats{};
}

void GrammarService::work() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace kestrel::server
