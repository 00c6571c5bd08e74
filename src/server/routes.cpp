// Routes: see routes.h.
#include "server/routes.h"

#include <fmt/format.h>
#if defined(__GLIBC__)
#include <malloc.h>  // mallinfo2: /debug/integrity's heap_bytes
#endif

#include <algorithm>
#include <climits>
#include <ctime>
#include <tuple>

#include "server/chat_page.h"
#include "server/job.h"
#include "server/media.h"
#include "server/params.h"
#include "server/responses.h"

namespace kestrel::server {
namespace {

// %XX escapes of a path segment (model ids may hold '/').
std::string url_decode(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
      out += char(hex(s[i + 1]) * 16 + hex(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A batch of completions prompts costs prompts × n engine requests; this bounds one HTTP request.
constexpr size_t kMaxChoices = 256;

// The completions `prompt`: a string, a list of ids, or a batch (a list of strings or of id lists).
std::vector<std::pair<std::string, std::vector<int32_t>>> completion_prompts(const ojson& body, const tok::Tokenizer& tok) {
  auto p = body.find("prompt");
  if (p == body.end() || p->is_null()) throw ApiError(400, "'prompt' is required", "prompt");
  const char* shape = "'prompt' must be a string, a list of token ids, or a list of those (a batch)";
  auto ids_of = [&](const ojson& a) {
    std::vector<int32_t> out;
    for (const auto& x : a) {
      if (!x.is_number_integer()) throw ApiError(400, shape, "prompt");
      // Ids are checked against the vocabulary by the engine's validate(); beyond int32 they saturate.
      out.push_back(int32_t(std::clamp<int64_t>(x.get<int64_t>(), INT32_MIN, INT32_MAX)));
    }
    return out;
  };
  std::vector<std::pair<std::string, std::vector<int32_t>>> out;  // (text, ids); text empty for id prompts
  auto text = [&](const std::string& s) {
    std::vector<int32_t> ids;
    for (tok::TokenId id : tok.encode(s, false)) ids.push_back(int32_t(id));
    out.push_back({s, std::move(ids)});
  };
  if (p->is_string()) {
    text(p->get<std::string>());
  } else if (p->is_array() && !p->empty() && std::all_of(p->begin(), p->end(), [](const ojson& x) { return x.is_number_integer(); })) {
    out.push_back({"", ids_of(*p)});
  } else if (p->is_array() && !p->empty()) {
    for (const auto& x : *p) {
      if (x.is_string()) text(x.get<std::string>());
      else if (x.is_array() && !x.empty()) out.push_back({"", ids_of(x)});
      else throw ApiError(400, shape, "prompt");
    }
  } else {
    throw ApiError(400, shape, "prompt");
  }
  return out;
}

// max_tokens absent: the rest of the context (validate() refuses a prompt that leaves none); 0: one
// token is generated and dropped (the prompt is still run: its logprobs, echo).
void set_max_tokens(Request& r, const GenParams& g, int64_t max_model_len, ChoiceOptions& o) {
  const int64_t rest = max_model_len - int64_t(r.prompt.size());
  r.max_tokens = g.max_tokens ? *g.max_tokens : int32_t(std::clamp<int64_t>(rest, 1, INT32_MAX));
  if (r.max_tokens == 0) {
    r.max_tokens = 1;
    o.discard_output = true;
  }
}

}  // namespace

Router::Router(const ServerOptions& opt, Engine& engine, const tok::Tokenizer& tok)
    : opt_(opt), engine_(engine), tok_(tok), encoder_(tok), metrics_(opt.served_model_name), grammars_(tok, opt.structured) {}

void Router::handle(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  try {
    route(req, conn);
  } catch (const tok::ChatRequestError& e) {  // /tokenize with messages
    conn->record().error = e.what();
    conn->reply(400, error_body(400, e.what(), e.field));
  } catch (const ApiError& e) {
    conn->record().error = e.what();
    // A full queue or a loading engine: the client may retry, and is told when.
    const std::string retry = e.status == 429 ? "Retry-After: 1\r\n" : e.status == 503 ? "Retry-After: 5\r\n" : "";
    conn->reply(e.status, error_body(e.status, e.what(), e.param), "application/json", retry);
  } catch (const Error& e) {
    conn->record().error = e.what();
    conn->reply(400, error_body(400, e.what()));
  } catch (const std::exception& e) {
    conn->record().error = std::string("internal error: ") + e.what();
    conn->reply(500, error_body(500, std::string("internal error: ") + e.what()));
  }
}

bool Router::knows_model(const std::string& name) const {
  return name == opt_.served_model_name ||
         std::find(opt_.model_aliases.begin(), opt_.model_aliases.end(), name) != opt_.model_aliases.end();
}

json Router::model_card() const {
  return {{"id", opt_.served_model_name},
          {"object", "model"},
          {"created", int64_t(std::time(nullptr))},
          {"owned_by", "kestrel"},
          {"root", opt_.model_aliases.empty() ? opt_.served_model_name : opt_.model_aliases.front()},
          {"parent", nullptr},
          {"max_model_len", engine_.max_model_len()}};
}

void Router::route(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  std::string target = req.target;
  if (auto q = target.find('?'); q != std::string::npos) target.resize(q);
  auto need = [&](const char* method) {
    if (req.method != method) throw ApiError(405, fmt::format("method {} not allowed on {}", req.method, target));
  };
  // The chat page is public: it asks for the API key itself and sends it with each request.
  if (target == "/" || target == "/index.html") {
    need("GET");
    return conn->reply(200, chat_page_html(), "text/html; charset=utf-8", "Cache-Control: no-cache\r\n");
  }
  const bool protected_path = target.rfind("/v1/", 0) == 0 || target.rfind("/debug/", 0) == 0 ||
                              target == "/tokenize" || target == "/detokenize" || target == "/tokenizer_info";
  if (protected_path && !opt_.api_key.empty()) {
    const std::string want = "Bearer " + opt_.api_key;
    const std::string& got = req.authorization;
    // Constant-time comparison: the key's bytes do not leak through response timing.
    unsigned diff = got.size() != want.size();
    for (size_t i = 0; i < want.size(); ++i) diff |= unsigned(i < got.size() ? got[i] : 0) ^ unsigned(want[i]);
    if (diff) throw ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)");
  }
  if (target == "/health") {
    need("GET");
    const bool ok = engine_.ready() && !draining_;
    return conn->reply(ok ? 200 : 503, ok ? "" : error_body(503, unavailable()));
  }
  if (target == "/metrics") {
    need("GET");
    return conn->reply(200, metrics_.render(engine_.stats()), "text/plain; version=0.0.4; charset=utf-8");
  }
  if (target == "/debug/integrity" && opt_.debug_routes) {
    // The engine's bookkeeping checked now (soak tests: after a drain every page is free or the
    // prefix cache's); 500 with the first violation.
    need("GET");
    IntegrityReport r;
    try {
      r = engine_.check_integrity();
    } catch (const Error& e) {
      throw ApiError(500, std::string("integrity check failed: ") + e.what());
    }
    json j{{"ok", true},          {"requests", r.requests},       {"running", r.running},
           {"waiting", r.waiting}, {"pages_total", r.pages_total}, {"pages_free", r.pages_free},
           {"pages_cached", r.pages_cached}, {"pages_held", r.pages_held}, {"slots_total", r.slots_total},
           {"slots_free", r.slots_free}, {"checkpoints", r.checkpoints}};
#if defined(__GLIBC__)
    // The bytes the C allocator has handed out and not had back (all arenas, plus mmapped blocks): exact
    // to the byte, where RSS moves in pages and hides a small leak in the allocator's free space for a
    // long time (the soak tests bound its growth per request; tests/py/test_soak.py).
    const struct mallinfo2 mi = mallinfo2();
    j["heap_bytes"] = mi.uordblks + mi.hblkhd;
#endif
    return conn->reply(200, dumps(j));
  }
  if (target == "/v1/models") {
    need("GET");
    return conn->reply(200, dumps(json{{"object", "list"}, {"data", json::array({model_card()})}}));
  }
  if (target.rfind("/v1/models/", 0) == 0) {
    need("GET");
    const std::string id = url_decode(target.substr(11));
    if (!knows_model(id)) throw ApiError(404, fmt::format("The model `{}` does not exist.", id), "model");
    return conn->reply(200, dumps(model_card()));
  }
  if (target == "/tokenizer_info") {  // vLLM's; lm-evaluation-harness's tokenizer_backend=remote reads it
    need("GET");
    auto special = [&](const char* name) { return tok_.special_id(name) ? json(name) : json(nullptr); };
    return conn->reply(200, dumps(json{{"tokenizer_class", "TikTokenTokenizer"},
                                       {"eos_token", special("<|end_of_msg|>")},
                                       {"bos_token", special("[BOS]")},
                                       {"pad_token", nullptr},
                                       {"model_max_length", engine_.max_model_len()},
                                       {"vocab_size", tok_.vocab_size()}}));
  }
  if (target.rfind("/v1/responses/", 0) == 0)
    throw ApiError(404, "responses are not stored (kestrel answers 'store': false); nothing to retrieve");
  const bool gen = target == "/v1/chat/completions" || target == "/v1/completions" || target == "/v1/responses";
  if (!gen && target != "/tokenize" && target != "/detokenize") throw ApiError(404, "no route for " + target);
  need("POST");
  ojson body = ojson::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) throw ApiError(400, "request body is not valid JSON");
  if (!body.is_object()) throw ApiError(400, "request body must be a JSON object");
  if (target == "/tokenize") return tokenize(body, *conn);
  if (target == "/detokenize") return detokenize(body, *conn);
  if (!engine_.ready()) throw ApiError(503, unavailable());
  if (draining_) throw ApiError(503, "shutting down");
  if (target == "/v1/responses") return responses(body, conn);
  generate(body, target == "/v1/chat/completions" ? Api::kChat : Api::kCompletion, conn);
}

void Router::check_model(const ojson& body) const {
  auto it = body.find("model");
  if (it == body.end()) return;
  if (!it->is_string()) throw ApiError(400, "'model' must be a string", "model");
  if (!knows_model(it->get<std::string>()))
    throw ApiError(404, fmt::format("The model `{}` does not exist.", it->get<std::string>()), "model");
}

void Router::tokenize(const ojson& body, Connection& conn) {
  check_model(body);
  std::vector<tok::TokenId> ids;
  if (body.contains("messages")) {
    ojson b = body;
    map_reasoning_effort(b);
    RequestImages images(opt_.media);  // image parts count their tokens (decoded, as a generation would)
    ids = encoder_.encode_request(b, images.resolver()).ids;
  } else {
    auto p = body.find("prompt");
    if (p == body.end() || !p->is_string()) throw ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt");
    ids = tok_.encode(p->get<std::string>(), false);
  }
  conn.reply(200, dumps(json{{"count", ids.size()}, {"max_model_len", engine_.max_model_len()}, {"tokens", ids}}));
}

void Router::detokenize(const ojson& body, Connection& conn) {
  check_model(body);
  auto t = body.find("tokens");
  if (t == body.end() || !t->is_array()) throw ApiError(400, "'tokens' must be an array of token ids", "tokens");
  std::vector<tok::TokenId> ids;
  for (const auto& x : *t) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= int64_t(tok_.vocab_size()))
      throw ApiError(400, "'tokens' must be an array of token ids in the vocabulary", "tokens");
    ids.push_back(tok::TokenId(x.get<int64_t>()));
  }
  conn.reply(200, dumps(json{{"prompt", tok_.decode(ids)}}));
}

Router::Prepared Router::prepare(ojson& body, Api api, const std::string& completion_tokens_field) {
  Prepared p;
  map_reasoning_effort(body);
  p.g = parse_gen_params(body, api, completion_tokens_field);
  check_model(body);
  const GenParams& g = p.g;
  ChoiceOptions base;
  base.stop = g.request.stop;
  base.logprobs = g.logprobs();
  base.keep_special = g.keep_special;
  base.single_tool_call = !g.parallel_tool_calls;
  // One engine request per choice: choice j of a prompt draws with seed + j (n distinct but
  // reproducible streams).
  auto add = [&](const Request& r0, const ChoiceOptions& o0) {
    for (int j = 0; j < g.n; ++j) {
      Request r = r0;
      r.sampling.seed += uint64_t(j);
      ChoiceOptions o = o0;
      set_max_tokens(r, g, engine_.max_model_len(), o);
      p.requests.push_back(std::move(r));
      p.options.push_back(std::move(o));
    }
  };
  if (api == Api::kChat) {
    auto m = body.find("messages");
    if (m == body.end() || !m->is_array() || m->empty())
      throw ApiError(400, "'messages' must be a non-empty array", "messages");
    RequestImages images(opt_.media);
    tok::ChatPrompt cp;
    try {
      cp = encoder_.encode_request(body, images.resolver());
    } catch (const tok::ChatRequestError& e) {  // as an ApiError: the Responses API renames its field
      throw ApiError(400, e.what(), e.field);
    }
    Request r = g.request;
    r.prompt.assign(cp.ids.begin(), cp.ids.end());
    images.attach(cp, r);
    ChoiceOptions o = base;
    o.thinking = cp.thinking;
    o.tools = cp.tool_names;
    r.constraint = GrammarService::chat_constraint(body, cp, r.ignore_eos);
    GrammarService::set_completion(r.constraint, body, opt_.structured.complete_within_max_tokens);
    add(r, o);
  } else {
    // One constraint for every prompt of a batch (it depends on the body only).
    std::optional<OutputConstraint> constraint = GrammarService::completion_constraint(body);
    GrammarService::set_completion(constraint, body, opt_.structured.complete_within_max_tokens);
    const auto prompts = completion_prompts(body, tok_);
    if (prompts.size() * size_t(g.n) > kMaxChoices)
      throw ApiError(400, fmt::format("{} prompts × n = {} exceeds the {} sequences one request may ask for",
                                      prompts.size(), g.n, kMaxChoices), "prompt");
    for (const auto& [text, ids] : prompts) {
      Request r = g.request;
      r.prompt = ids;
      r.constraint = constraint;
      ChoiceOptions o = base;
      if (g.echo) {
        o.echo_ids = ids;
        const bool in_vocab = std::all_of(ids.begin(), ids.end(), [&](int32_t t) { return t >= 0 && size_t(t) < tok_.vocab_size(); });
        if (!text.empty()) o.echo = text;
        else if (in_vocab) o.echo = tok_.decode(std::vector<tok::TokenId>(ids.begin(), ids.end()));
      }
      add(r, o);
    }
  }
  return p;
}

void Router::generate(ojson& body, Api api, const std::shared_ptr<Connection>& conn) {
  Prepared p = prepare(body, api);
  ResponseHead head;
  head.api = api;
  head.id = random_id(api == Api::kChat ? "chatcmpl-" : "cmpl-");
  head.model = opt_.served_model_name;
  head.created = int64_t(std::time(nullptr));
  head.include_usage = p.g.include_usage;
  head.continuous_usage = p.g.continuous_usage;
  head.n = p.g.n;
  const std::string id = head.id;
  auto job = std::make_shared<Job>(engine_, metrics_, jobs_, api, id, openai_shaper(std::move(head)), p.g.stream, p.g.n);
  start_when_compiled(std::move(job), std::move(p.requests), std::move(p.options), conn);
}

void Router::responses(const ojson& body, const std::shared_ptr<Connection>& conn) {
  ResponsesRequest rr = responses_to_chat(body);
  // Errors about the chat body it became name the Responses fields the client sent (responses_error).
  try {
    Prepared p = prepare(rr.chat, Api::kChat, "max_output_tokens");
    rr.head.model = opt_.served_model_name;
    const std::string id = rr.head.id;
    auto job = std::make_shared<Job>(engine_, metrics_, jobs_, Api::kChat, id, responses_shaper(std::move(rr.head)),
                                     p.g.stream, 1);
    start_when_compiled(std::move(job), std::move(p.requests), std::move(p.options), conn, /*responses=*/true);
  } catch (const ApiError& e) {
    throw responses_error(e);
  }
}

// Where start_when_compiled stands: the job, its requests and options, and the next request to look at.
struct Router::Starting {
  // The connection's pending response while a grammar compiles: only notes that the client left.
  struct Compiling : Pending {
    std::atomic<bool> abandoned{false};
    void abandon() override { abandoned = true; }
  };
  std::shared_ptr<Job> job;
  std::vector<Request> requests;
  std::vector<ChoiceOptions> options;
  size_t next = 0;
  std::shared_ptr<Compiling> pending;  // set once a compile had to wait
  bool responses = false;              // a Responses request: errors in its names (responses_error)
};

void Router::start_when_compiled(std::shared_ptr<Job> job, std::vector<Request> requests,
                                 std::vector<ChoiceOptions> options, const std::shared_ptr<Connection>& conn,
                                 bool responses) {
  auto st = std::make_shared<Starting>();
  st->responses = responses;
  st->job = std::move(job);
  st->requests = std::move(requests);
  st->options = std::move(options);
  continue_start(std::move(st), conn);
}

void Router::continue_start(std::shared_ptr<Starting> st, const std::shared_ptr<Connection>& conn) {
  // Cached grammars attach at once; the choices of one body share one constraint, so after the
  // first compile the rest are cache hits (a hit that the cache has dropped meanwhile compiles again).
  for (; st->next < st->requests.size(); ++st->next) {
    Request& r = st->requests[st->next];
    if (!r.constraint || r.constraint->grammar) continue;
    // A refusal found in the cache throws ApiError: before anything was held, handle() answers it;
    // after, the callback below does.
    if ((r.constraint->grammar = grammars_.find(*r.constraint, engine_.vocab_size()))) continue;
    if (!st->pending) {
      st->pending = std::make_shared<Starting::Compiling>();
      conn->hold(st->pending);
    }
    OutputConstraint c = *r.constraint;
    grammars_.compile_async(std::move(c), engine_.vocab_size(),
                            [this, conn, st](std::shared_ptr<const structured::CompiledGrammar> g,
                                             std::optional<ApiError> err) {
      conn->post([this, conn, st, g = std::move(g), err = std::move(err)] {
        if (st->pending->abandoned) return;  // the client left while the grammar compiled
        try {
          if (err) throw *err;
          if (draining_) throw ApiError(503, "shutting down");
          st->requests[st->next].constraint->grammar = g;
          continue_start(st, conn);
        } catch (const ApiError& err) {
          const ApiError e = st->responses ? responses_error(err) : err;
          conn->reply(e.status, error_body(e.status, e.what(), e.param));
        } catch (const Error& e) {
          conn->reply(400, error_body(400, e.what()));
        } catch (const std::exception& e) {
          conn->reply(500, error_body(500, std::string("internal error: ") + e.what()));
        }
      });
    });
    return;
  }
  st->job->start(conn, std::move(st->requests), std::move(st->options), tok_);
}

}  // namespace kestrel::server
