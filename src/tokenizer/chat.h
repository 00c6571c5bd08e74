// K3 chat encoding ("XTML", MODEL.md §7): OpenAI-style chat requests -> prompt token ids.
//
// The prompt is built as a list of segments, each encoded on its own (no BPE merge across a
// boundary). Only structural segments (<|open|>, <|close|>, <|sep|>, <|end_of_msg|>, image prompts)
// may produce special ids; tag names, attribute text and every piece of user/tool/assistant text
// are encoded with specials disallowed, so request text can never inject control tokens.
// docs/tokenizer.md lists every interpretation of the spec made here.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::tok {

// One image's prompt expansion (MODEL.md §6): `<|media_begin|>image {W}x{H}<|media_content|>` +
// num_pads × `<|media_pad|>` + `<|media_end|>`. W,H = original upload size.
struct ImagePrompt {
  int width = 0;
  int height = 0;
  size_t num_pads = 0;
};

struct ChatSegment {
  std::string text;
  bool allow_special = false;
  int image = -1;  // >= 0: this segment is the expansion of that image (in render order)
};

struct ChatPrompt {
  std::string text;                 // rendered prompt (the segments concatenated)
  std::vector<TokenId> ids;         // segment-wise encoding
  std::vector<ChatSegment> segments;
  bool thinking = true;             // generation starts inside <|open|>think<|sep|>
  bool generation_prompt = true;    // the prompt ends with the assistant opening (add_generation_prompt)
  std::vector<std::string> tool_names;  // declared tools, for validating parsed calls
  std::optional<std::string> forced_tool;  // tool_choice named a function
  size_t num_images = 0;            // image parts rendered, each expanded from its ImagePrompt
  // Per image, in order: the token range [first, second) of its <|media_pad|> run in `ids` (the
  // positions that receive its vision rows; a request's MediaSpans).
  std::vector<std::pair<size_t, size_t>> image_pads;
};

// Called for each image content part (`image_url`, `image`, `input_image`) in render order with the
// part's JSON and its index (0, 1, ...); returns its expansion or throws (kestrel::Error: a 400).
using ImageResolver = std::function<ImagePrompt(const nlohmann::ordered_json& part, size_t index)>;

// A malformed chat request: kestrel::Error with the request field at fault ("messages", "tools",
// "tool_choice", "response_format", "reasoning_effort", "thinking", "chat_template_kwargs"), which the
// server reports as the 400's `param`.
class ChatRequestError : public Error {
 public:
  ChatRequestError(std::string field, const std::string& msg) : Error(msg), field(std::move(field)) {}
  std::string field;
};

class ChatEncoder {
 public:
  explicit ChatEncoder(const Tokenizer& tok);

  // request: the JSON body of /v1/chat/completions (messages, tools, tool_choice, response_format,
  // reasoning_effort, thinking / chat_template_kwargs). Image parts are expanded by `images` (one
  // call per part, in render order); without a resolver an image part is an error — a prompt never
  // carries an image the model would not see. Malformed requests raise ChatRequestError (a
  // kestrel::Error) with a message fit for a 400 response and the field it is about.
  ChatPrompt encode_request(const nlohmann::ordered_json& request, const ImageResolver& images = {}) const;
  // The same with the prompts given up front: one per image part, in render order (tests, fuzzing).
  ChatPrompt encode_request(const nlohmann::ordered_json& request, const std::vector<ImagePrompt>& images) const;

 private:
  const Tokenizer* tok_;
};

}  // namespace kestrel::tok
