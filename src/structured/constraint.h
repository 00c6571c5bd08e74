// The request vocabulary's OutputConstraint (request/request.h) to and from the compiler's specs, and
// its compilation through a GrammarCache: the one way a front end (the server, `kestrel generate`, the
// tests) turns a stated constraint into the grammar the engine runs.
//
//   OutputConstraint c = constraint_of(chat_grammar_spec(body, prompt.thinking), format_of(body));
//   c.grammar = compile(cache, c);       // or find(cache, c) first where blocking is not allowed
#pragma once

#include <memory>

#include "request/request.h"
#include "structured/cache.h"
#include "structured/chat_grammar.h"

namespace kestrel::structured {

// The response_format of a request body: text (absent, null or "text"), json_object or json_schema.
// Malformed: kestrel::Error.
OutputConstraint::Format response_format_of(const ojson& body);

// A chat constraint from the compiler's spec (schemas as JSON text, in their key order).
OutputConstraint constraint_of(const ChatGrammarSpec& spec, OutputConstraint::Format format);
// A document constraint (one JSON value valid against `schema`; json_object: {"type": "object"}).
OutputConstraint document_constraint(OutputConstraint::Format format, const ojson& schema);

// Back to the compiler's forms (kestrel::Error when a schema text is not JSON).
ChatGrammarSpec chat_spec(const OutputConstraint& c);   // c.chat
ojson document_schema(const OutputConstraint& c);       // !c.chat

// The compiled grammar (cached; compiles when missing, which may take up to the cache's limits).
// Compiler errors are kestrel::Error naming the keyword and its place.
std::shared_ptr<const CompiledGrammar> compile(GrammarCache& cache, const OutputConstraint& c);
// Without blocking: the cached grammar, nullptr when it is not compiled yet (a cached refusal throws).
std::shared_ptr<const CompiledGrammar> find(GrammarCache& cache, const OutputConstraint& c);

}  // namespace kestrel::structured
