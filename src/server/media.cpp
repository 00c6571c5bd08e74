// Image input on the server: see media.h.
#include "server/media.h"

#include <fmt/format.h>

#include <cctype>
#include <filesystem>
#include <fstream>

#include "server/openai.h"

namespace kestrel::server {
namespace {

[[noreturn]] void refuse(const std::string& msg) { throw ApiError(400, msg, "messages"); }

bool has_prefix(const std::string& s, std::string_view p) {
  if (s.size() < p.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(s[i])) != p[i]) return false;
  return true;
}

// The URL string of an image content part: chat's {"type": "image_url", "image_url": {"url": U}}
// (or "image_url": U, as the Responses API and some clients send it), {"type": "image", "image": U}.
std::string part_url(const nlohmann::ordered_json& part, size_t index) {
  const nlohmann::ordered_json* v = nullptr;
  if (auto it = part.find("image_url"); it != part.end()) v = &*it;
  else if (auto it2 = part.find("image"); it2 != part.end()) v = &*it2;
  if (v && v->is_object()) {
    if (auto d = v->find("detail"); d != v->end() && !d->is_null()) {
      // "high" is what every image gets (full resolution within the limits); "low" would promise less.
      if (!d->is_string() || (*d != "auto" && *d != "high"))
        refuse(fmt::format("image {}: detail '{}' is not supported (auto, high)", index, d->is_string() ? d->get<std::string>() : d->dump()));
    }
    auto u = v->find("url");
    v = u != v->end() ? &*u : nullptr;
  }
  if (!v || !v->is_string()) refuse(fmt::format("image {}: the part needs image_url.url, a string", index));
  return v->get<std::string>();
}

}  // namespace

int parse_limit_mm_per_prompt(const std::string& s) {
  auto check = [](int64_t n) {
    if (n < 0 || n > 1024) fail("--limit-mm-per-prompt: image count {} outside [0, 1024]", n);
    return int(n);
  };
  const auto j = nlohmann::json::parse(s, nullptr, /*allow_exceptions=*/false);
  if (!j.is_discarded()) {
    if (!j.is_object()) fail("--limit-mm-per-prompt: expected a JSON object such as '{{\"image\": 4}}'");
    int images = 16;
    for (const auto& [k, v] : j.items()) {
      if (!v.is_number_integer()) fail("--limit-mm-per-prompt: '{}' must be an integer", k);
      if (k == "image") images = check(v.get<int64_t>());
      else if (v.get<int64_t>() != 0) fail("--limit-mm-per-prompt: only images are supported, not '{}'", k);
    }
    return images;
  }
  if (s.rfind("image=", 0) == 0) {
    size_t used = 0;
    int64_t n = -1;
    try {
      n = std::stoll(s.substr(6), &used);
    } catch (const std::exception&) {
    }
    if (used == s.size() - 6) return check(n);
  }
  fail("--limit-mm-per-prompt: expected '{{\"image\": N}}' or 'image=N', got '{}'", s);
}

std::vector<uint8_t> base64_decode(std::string_view s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::vector<uint8_t> out;
  out.reserve(s.size() / 4 * 3 + 3);
  uint32_t acc = 0;
  int bits = 0;
  size_t i = 0, pad = 0;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    if (c == '=') {
      ++pad;
      continue;
    }
    const int v = val(c);
    if (v < 0 || pad) fail("invalid base64: unexpected character at offset {}", i);
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
      acc &= (1u << bits) - 1;
    }
  }
  // A leftover of 6 bits cannot encode a byte; 2 or 4 leftover bits must be zero (canonical).
  if (bits == 6 || (bits > 0 && acc != 0) || pad > 2) fail("invalid base64: the data ends in a partial byte");
  return out;
}

std::vector<uint8_t> RequestImages::fetch(const std::string& url, size_t index) const {
  const int64_t room = opt_->max_image_bytes - bytes_;
  auto too_big = [&](int64_t n) {
    refuse(fmt::format("the images of this request exceed {} bytes (image {} brings it to {}; --max-image-bytes-per-request)",
                       opt_->max_image_bytes, index, bytes_ + n));
  };
  if (has_prefix(url, "data:")) {
    const size_t comma = url.find(',');
    if (comma == std::string::npos) refuse(fmt::format("image {}: a data: URL needs a ',' before its data", index));
    const std::string meta = url.substr(5, comma - 5);
    if (meta.size() < 7 || meta.compare(meta.size() - 7, 7, ";base64") != 0)
      refuse(fmt::format("image {}: only base64 data: URLs are accepted (data:image/png;base64,...)", index));
    if (int64_t(url.size() - comma - 1) / 4 * 3 > room + 3) too_big(int64_t(url.size() - comma - 1) / 4 * 3);
    try {
      return base64_decode(std::string_view(url).substr(comma + 1));
    } catch (const Error& e) {
      refuse(fmt::format("image {}: {}", index, e.what()));
    }
  }
  if (has_prefix(url, "http://") || has_prefix(url, "https://"))
    refuse(fmt::format("image {}: image URLs are not fetched (the server makes no network requests); send the image "
                       "inline as a base64 data: URL", index));
  const bool file_url = has_prefix(url, "file://");
  if (!file_url && url.find("://") != std::string::npos)
    refuse(fmt::format("image {}: unsupported URL scheme (data: URLs; file:// with --allowed-local-media-path)", index));
  if (opt_->allowed_local_media_path.empty())
    refuse(fmt::format("image {}: local files are not accepted (the server was not started with "
                       "--allowed-local-media-path); send the image as a base64 data: URL", index));
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path root = fs::canonical(opt_->allowed_local_media_path, ec);
  fs::path given = file_url ? url.substr(7) : url;
  if (given.is_relative()) given = root / given;  // a bare relative path is relative to the allowed directory
  const fs::path path = ec ? fs::path() : fs::canonical(given, ec);
  // Canonical paths (symlinks and .. resolved): inside the allowed directory, component by component.
  auto inside = [&] {
    auto r = root.begin(), p = path.begin();
    for (; r != root.end(); ++r, ++p)
      if (p == path.end() || *r != *p) return false;
    return true;
  };
  if (ec || !fs::is_regular_file(path, ec) || !inside())
    refuse(fmt::format("image {}: not a file under the allowed local media path", index));
  const auto size = fs::file_size(path, ec);
  if (ec) refuse(fmt::format("image {}: cannot read the file", index));
  if (int64_t(size) > room) too_big(int64_t(size));
  std::vector<uint8_t> bytes(size);
  std::ifstream f(path, std::ios::binary);
  if (!f.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(size))) refuse(fmt::format("image {}: cannot read the file", index));
  return bytes;
}

tok::ImagePrompt RequestImages::resolve(const nlohmann::ordered_json& part, size_t index) {
  if (!opt_->vision)
    refuse("this model has no vision tower (its config.json has no vision_config): image input is not supported");
  if (int64_t(index) >= opt_->max_images)
    refuse(fmt::format("this request has more than {} images (--limit-mm-per-prompt)", opt_->max_images));
  const std::vector<uint8_t> bytes = fetch(part_url(part, index), index);
  if (bytes_ + int64_t(bytes.size()) > opt_->max_image_bytes)
    refuse(fmt::format("the images of this request exceed {} bytes (image {} brings it to {}; --max-image-bytes-per-request)",
                       opt_->max_image_bytes, index, bytes_ + int64_t(bytes.size())));
  bytes_ += int64_t(bytes.size());
  try {
    images_.push_back(vision::load_image(bytes, opt_->decode, opt_->preprocess));
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    refuse(fmt::format("image {}: {}", index, e.what()));
  }
  const vision::LoadedImage& li = images_.back();
  return {li.width, li.height, size_t(li.input->num_tokens())};
}

tok::ImageResolver RequestImages::resolver() {
  return [this](const nlohmann::ordered_json& part, size_t index) { return resolve(part, index); };
}

void RequestImages::attach(const tok::ChatPrompt& cp, Request& r) const {
  KCHECK(cp.image_pads.size() == images_.size(), "prompt and images disagree");
  r.media.clear();
  r.images.clear();
  for (size_t i = 0; i < images_.size(); ++i) {
    const auto [a, e] = cp.image_pads[i];
    KCHECK(int64_t(e - a) == images_[i].input->num_tokens(), "image pad run does not match its tokens");
    r.media.push_back({int64_t(a), int64_t(e), images_[i].input->content_hash});
    r.images.push_back(images_[i].input);
  }
}

}  // namespace kestrel::server
