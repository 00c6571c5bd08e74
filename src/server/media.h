// Image input on the server (issue #21): the one place a request's image content parts are checked,
// fetched (inline data: URLs; local files only under --allowed-local-media-path; never the network),
// limited, decoded and preprocessed (vision/image.h), and attached to the engine Request as MediaSpans
// + ImageInputs. The chat encoder calls the resolver once per image part, in render order, so the
// images and the <|media_pad|> runs of the prompt line up by construction. /v1/chat/completions,
// /v1/responses (input_image, converted to a chat image_url part by responses.h) and /tokenize use it.
//
// Every refusal is an ApiError 400 naming `messages`: a checkpoint without a vision tower, more images
// than --limit-mm-per-prompt, more encoded bytes than --max-image-bytes-per-request, an http(s) URL,
// a local file that is not allowed, bad base64, and every decode error (corrupt, truncated,
// unsupported format, a header over --max-image-pixels: a decompression bomb costs only its header).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "request/request.h"
#include "tokenizer/chat.h"
#include "vision/image.h"

namespace kestrel::server {

struct MediaOptions {
  bool vision = false;                        // the checkpoint has a vision tower (config.json vision_config)
  int max_images = 16;                        // per request (--limit-mm-per-prompt '{"image": N}')
  int64_t max_image_bytes = int64_t(32) << 20;  // encoded image bytes per request, summed
  vision::DecodeLimits decode;                // max_pixels per image
  vision::PreprocessConfig preprocess;        // the resize rule (preprocessor_config.json, flags)
  std::string allowed_local_media_path;       // empty: file:// URLs and paths are refused
};

// vLLM's --limit-mm-per-prompt: JSON '{"image": N}' (other modalities only with 0, since only images
// are supported), or the older 'image=N'. Returns N; throws kestrel::Error otherwise.
int parse_limit_mm_per_prompt(const std::string& s);

// Strict base64 (RFC 4648, standard alphabet, '=' padding optional, ASCII whitespace skipped); throws
// kestrel::Error on any other character or a dangling bit group.
std::vector<uint8_t> base64_decode(std::string_view s);

// The images of one request, collected while its prompt is rendered.
class RequestImages {
 public:
  explicit RequestImages(const MediaOptions& o) : opt_(&o) {}
  // For ChatEncoder::encode_request; throws ApiError 400 for a refused image.
  tok::ImageResolver resolver();
  // Request::media (the pad runs of `cp`, each with its image's content hash) and Request::images.
  void attach(const tok::ChatPrompt& cp, Request& r) const;
  size_t size() const { return images_.size(); }

 private:
  tok::ImagePrompt resolve(const nlohmann::ordered_json& part, size_t index);
  std::vector<uint8_t> fetch(const std::string& url, size_t index) const;

  const MediaOptions* opt_;
  std::vector<vision::LoadedImage> images_;
  int64_t bytes_ = 0;
};

}  // namespace kestrel::server
