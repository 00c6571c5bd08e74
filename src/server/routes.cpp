// Routes: see routes.h.
#include "server/routes.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <ctime>
#include <tuple>

#include "server/job.h"

namespace kestrel::server {

Router::Router(const ServerOptions& opt, Engine& engine, const tok::Tokenizer& tok)
    : opt_(opt), engine_(engine), tok_(tok), encoder_(tok), metrics_(opt.served_model_name), grammars_(tok, opt.structured) {}

void Router::handle(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  try {
    route(req, conn);
  } catch (const ApiError& e) {
    conn->reply(e.status, error_body(e.status, e.what(), e.param));
  } catch (const Error& e) {
    conn->reply(400, error_body(400, e.what()));
  } catch (const std::exception& e) {
    conn->reply(500, error_body(500, std::string("internal error: ") + e.what()));
  }
}

void Router::route(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  std::string target = req.target;
  if (auto q = target.find('?'); q != std::string::npos) target.resize(q);
  auto need = [&](const char* method) {
    if (req.method != method) throw ApiError(405, fmt::format("method {} not allowed on {}", req.method, target));
  };
  const bool protected_path = target.rfind("/v1/", 0) == 0 || target == "/tokenize" || target == "/detokenize";
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
    return conn->reply(ok ? 200 : 503, ok ? "" : error_body(503, draining_ ? "shutting down" : "model is loading"));
  }
  if (target == "/metrics") {
    need("GET");
    return conn->reply(200, metrics_.render(engine_.stats()), "text/plain; version=0.0.4; charset=utf-8");
  }
  if (target == "/v1/models") {
    need("GET");
    json m = {{"id", opt_.served_model_name},
              {"object", "model"},
              {"created", int64_t(std::time(nullptr))},
              {"owned_by", "kestrel"},
              {"root", opt_.served_model_name},
              {"max_model_len", engine_.max_model_len()}};
    return conn->reply(200, dumps(json{{"object", "list"}, {"data", json::array({m})}}));
  }
  const bool gen = target == "/v1/chat/completions" || target == "/v1/completions";
  if (!gen && target != "/tokenize" && target != "/detokenize") throw ApiError(404, "no route for " + target);
  need("POST");
  ojson body = ojson::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) throw ApiError(400, "request body is not valid JSON");
  if (!body.is_object()) throw ApiError(400, "request body must be a JSON object");
  if (target == "/tokenize") return tokenize(body, *conn);
  if (target == "/detokenize") return detokenize(body, *conn);
  if (!engine_.ready()) throw ApiError(503, draining_ ? "shutting down" : "model is loading");
  if (draining_) throw ApiError(503, "shutting down");
  generate(body, target == "/v1/chat/completions" ? Api::kChat : Api::kCompletion, conn);
}

void Router::check_model(const ojson& body) const {
  auto it = body.find("model");
  if (it == body.end() || it->is_null()) return;
  if (!it->is_string()) throw ApiError(400, "'model' must be a string", "model");
  if (it->get<std::string>() != opt_.served_model_name)
    throw ApiError(404, fmt::format("The model `{}` does not exist.", it->get<std::string>()), "model");
}

void Router::tokenize(const ojson& body, Connection& conn) {
  check_model(body);
  std::vector<tok::TokenId> ids;
  if (body.contains("messages")) {
    ids = encoder_.encode_request(body).ids;
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

void Router::generate(const ojson& body, Api api, const std::shared_ptr<Connection>& conn) {
  GenParams g = parse_gen_params(body, api);
  check_model(body);
  Request& r = g.request;
  bool thinking = false;
  std::vector<std::string> tools;
  if (api == Api::kChat) {
    auto m = body.find("messages");
    if (m == body.end() || !m->is_array() || m->empty())
      throw ApiError(400, "'messages' must be a non-empty array", "messages");
    tok::ChatPrompt p = encoder_.encode_request(body);
    r.prompt.assign(p.ids.begin(), p.ids.end());
    thinking = p.thinking;
    tools = p.tool_names;
    r.constraint = GrammarService::chat_constraint(body, p, r.ignore_eos);
  } else {
    r.constraint = GrammarService::completion_constraint(body);
    for (const char* f : {"suffix"})
      if (body.contains(f) && !body[f].is_null()) throw ApiError(400, fmt::format("'{}' is not supported", f), f);
    if (body.contains("echo") && body["echo"].is_boolean() && body["echo"].get<bool>())
      throw ApiError(400, "'echo' is not supported", "echo");
    auto p = body.find("prompt");
    if (p == body.end()) throw ApiError(400, "'prompt' is required", "prompt");
    const ojson* one = &*p;
    if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) one = &(*p)[0];
    if (one->is_string()) {
      for (tok::TokenId id : tok_.encode(one->get<std::string>(), false)) r.prompt.push_back(int32_t(id));
    } else if (one->is_array() && !one->empty() &&
               std::all_of(one->begin(), one->end(), [](const ojson& x) { return x.is_number_integer(); })) {
      // Ids are checked against the vocabulary by the engine's validate(); beyond int32 they saturate.
      for (const auto& x : *one)
        r.prompt.push_back(int32_t(std::clamp<int64_t>(x.get<int64_t>(), INT32_MIN, INT32_MAX)));
    } else {
      throw ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those (batches "
                          "are not supported)", "prompt");
    }
  }
  // No max_tokens: the rest of the context (validate() refuses a prompt that leaves none).
  const int64_t rest = engine_.max_model_len() - int64_t(r.prompt.size());
  r.max_tokens = g.max_tokens ? *g.max_tokens : int32_t(std::clamp<int64_t>(rest, 1, INT32_MAX));

  ResponseHead head;
  head.api = api;
  head.id = random_id(api == Api::kChat ? "chatcmpl-" : "cmpl-");
  head.model = opt_.served_model_name;
  head.created = int64_t(std::time(nullptr));
  head.include_usage = g.include_usage;
  auto job = std::make_shared<Job>(engine_, metrics_, jobs_, std::move(head), g.stream);
  if (r.constraint && !(r.constraint->grammar = grammars_.find(*r.constraint, engine_.vocab_size())))
    return start_when_compiled(std::move(job), std::move(r), g.n, thinking, std::move(tools), conn);
  job->start(conn, r, g.n, tok_, thinking, tools);
}

namespace {
// The connection's pending response while a grammar compiles: only notes that the client left.
struct Compiling : Pending {
  std::atomic<bool> abandoned{false};
  void abandon() override { abandoned = true; }
};
}  // namespace

void Router::start_when_compiled(std::shared_ptr<Job> job, Request r, int n, bool thinking,
                                 std::vector<std::string> tools, const std::shared_ptr<Connection>& conn) {
  auto pending = std::make_shared<Compiling>();
  conn->hold(pending);
  OutputConstraint c = *r.constraint;
  auto state = std::make_shared<std::tuple<std::shared_ptr<Job>, Request, std::vector<std::string>>>(
      std::move(job), std::move(r), std::move(tools));
  grammars_.compile_async(std::move(c), engine_.vocab_size(),
                          [this, conn, pending, state, n, thinking](std::shared_ptr<const structured::CompiledGrammar> g,
                                                                    std::optional<ApiError> err) {
    conn->post([this, conn, pending, state, n, thinking, g = std::move(g), err = std::move(err)] {
      if (pending->abandoned) return;  // the client left while the grammar compiled
      auto& [job, r, tools] = *state;
      try {
        if (err) throw *err;
        if (draining_) throw ApiError(503, "shutting down");
        r.constraint->grammar = g;
        job->start(conn, r, n, tok_, thinking, tools);
      } catch (const ApiError& e) {
        conn->reply(e.status, error_body(e.status, e.what(), e.param));
      } catch (const Error& e) {
        conn->reply(400, error_body(400, e.what()));
      } catch (const std::exception& e) {
        conn->reply(500, error_body(500, std::string("internal error: ") + e.what()));
      }
    });
  });
}

}  // namespace kestrel::server
