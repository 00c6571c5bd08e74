// `kestrel tokenize`: the tokenizer and the K3 chat format, checkable from outside.
//
//   kestrel tokenize --model DIR [--special] < text       ids, space-separated, one line
//   kestrel tokenize --model DIR --decode < "1 2 3"       the decoded text
//   kestrel tokenize --model DIR --chat < request.json     rendered prompt, then its ids
//   kestrel tokenize --model DIR --jsonl < lines           batch mode for the golden tests: each input
//       line is {"text": str} or {"hex": raw bytes as hex}, optional "special": true; each output
//       line is {"ids": [...], "decoded": str} (decoded = decode(ids), invalid UTF-8 replaced).
//   kestrel tokenize --model DIR --chat --jsonl < lines    the same for chat requests: one request per
//       input line, one {"prompt": str, "ids": [...]} line out (one process for a whole set of requests).
// DIR holds tiktoken.model and tokenizer_config.json.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iostream>
#include <iterator>
#include <sstream>

#include "core/check.h"
#include "server/media.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"
#include "vision/image.h"

namespace kestrel::cli {
namespace {

struct TokenizeOptions {
  std::string model;
  bool decode = false;
  bool chat = false;
  bool jsonl = false;
  bool special = false;
};

std::string read_stdin() {
  std::ios::sync_with_stdio(false);
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

std::string hex_decode(const std::string& h) {
  if (h.size() % 2) fail("hex string has odd length");
  std::string out;
  for (size_t i = 0; i < h.size(); i += 2) {
    auto nib = [&](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      fail("bad hex digit '{}'", c);
    };
    out.push_back(static_cast<char>(nib(h[i]) * 16 + nib(h[i + 1])));
  }
  return out;
}

void print_ids(const std::vector<tok::TokenId>& ids) {
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::cout << line << '\n';
}

// fn(line, line_no) for every non-empty line of stdin (line numbers count the empty ones too).
template <class F>
void each_input_line(F&& fn) {
  std::ios::sync_with_stdio(false);
  std::string line;
  size_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    if (!line.empty()) fn(line, line_no);
  }
}

void run_jsonl(const tok::Tokenizer& t) {
  each_input_line([&](const std::string& line, size_t line_no) {
    nlohmann::json in;
    try {
      in = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      fail("jsonl line {}: {}", line_no, e.what());
    }
    std::string text;
    if (in.contains("hex"))
      text = hex_decode(in.at("hex").get<std::string>());
    else if (in.contains("text") && in["text"].is_string())
      text = in["text"].get<std::string>();
    else
      fail("jsonl line {}: needs \"text\" or \"hex\"", line_no);
    const bool special = in.value("special", false);
    auto ids = t.encode(text, special);
    nlohmann::json out = {{"ids", ids}, {"decoded", t.decode(ids)}};
    std::cout << out.dump() << '\n';
  });
}

// One chat request rendered as the server does it; image parts (data: URLs) are decoded and expanded
// whatever the checkpoint's vision; local files are not read here.
tok::ChatPrompt encode_chat_request(const tok::Tokenizer& t, const std::string& model, const std::string& body) {
  nlohmann::ordered_json req;
  try {
    req = nlohmann::ordered_json::parse(body);
  } catch (const std::exception& e) {
    fail("--chat: request is not JSON: {}", e.what());
  }
  tok::ChatEncoder enc(t);
  server::MediaOptions media;
  media.vision = true;
  media.preprocess = vision::load_preprocess_config(model);
  server::RequestImages images(media);
  return enc.encode_request(req, images.resolver());
}

void run_chat_jsonl(const tok::Tokenizer& t, const std::string& model) {
  each_input_line([&](const std::string& line, size_t line_no) {
    tok::ChatPrompt p;
    try {
      p = encode_chat_request(t, model, line);
    } catch (const std::exception& e) {
      fail("jsonl line {}: {}", line_no, e.what());
    }
    std::cout << nlohmann::json{{"prompt", p.text}, {"ids", p.ids}}.dump() << '\n';
  });
}

void run(const TokenizeOptions& o) {
  const tok::Tokenizer t = tok::Tokenizer::load(o.model);
  if (o.jsonl) return o.chat ? run_chat_jsonl(t, o.model) : run_jsonl(t);
  const std::string input = read_stdin();
  if (o.decode) {
    std::vector<tok::TokenId> ids;
    std::istringstream ss(input);
    std::string w;
    while (ss >> w) {
      if (w.empty() || w.size() > 10 || w.find_first_not_of("0123456789") != std::string::npos)
        fail("--decode expects whitespace-separated token ids, got '{}'", w);
      ids.push_back(static_cast<tok::TokenId>(std::stoull(w)));
    }
    std::cout << t.decode(ids);
    return;
  }
  if (o.chat) {
    const tok::ChatPrompt p = encode_chat_request(t, o.model, input);
    std::cout << p.text << '\n';
    print_ids(p.ids);
    return;
  }
  print_ids(t.encode(input, o.special));
}

}  // namespace

void register_tokenize(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* sub = app.add_subcommand("tokenize", "Encode stdin to token ids (or decode ids, or render a chat request)");
  sub->add_option("--model", opts->model, "Directory with tiktoken.model and tokenizer_config.json")->required();
  auto* dec = sub->add_flag("--decode", opts->decode, "Read token ids, print the decoded text");
  auto* chat = sub->add_flag("--chat", opts->chat, "Read an OpenAI-style chat request (JSON), print the K3 prompt and its ids");
  auto* jsonl = sub->add_flag("--jsonl", opts->jsonl,
                              "Batch mode: JSON lines in, {\"ids\",\"decoded\"} lines out (with --chat: a request per "
                              "line, {\"prompt\",\"ids\"} out)");
  sub->add_flag("--special", opts->special, "Let special-token text in the input become special ids");
  dec->excludes(chat)->excludes(jsonl);
  sub->callback([opts] {
    try {
      run(*opts);
    } catch (const Error& e) {
      std::cerr << "kestrel tokenize: " << e.what() << '\n';
      throw CLI::RuntimeError(1);
    } catch (const std::exception& e) {
      std::cerr << "kestrel tokenize: " << e.what() << '\n';
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace kestrel::cli
