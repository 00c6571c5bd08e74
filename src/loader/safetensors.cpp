// Validating safetensors reader. See safetensors.h for the format and the checks.
//
// Duplicate keys: nlohmann::json keeps the last of two equal keys silently, so the header is parsed
// with a callback that records every top-level key and rejects repeats before the DOM hides them.
#include "loader/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"

namespace kestrel {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Multiplies with overflow detection.
bool mul_overflow(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

TensorInfo parse_entry(const std::string& name, const json& e, uint64_t data_size, const std::string& what) {
  auto bad = [&](const std::string& why) -> Error {
    return Error(fmt::format("{}: tensor '{}': {}", what, name, why));
  };
  if (!e.is_object()) throw bad("entry is not a JSON object");
  for (const auto& [k, v] : e.items())
    if (k != "dtype" && k != "shape" && k != "data_offsets") throw bad(fmt::format("unexpected field '{}'", k));
  if (!e.contains("dtype") || !e["dtype"].is_string()) throw bad("missing or non-string 'dtype'");
  if (!e.contains("shape") || !e["shape"].is_array()) throw bad("missing or non-array 'shape'");
  if (!e.contains("data_offsets") || !e["data_offsets"].is_array() || e["data_offsets"].size() != 2)
    throw bad("'data_offsets' must be an array of two integers");
  TensorInfo t;
  t.name = name;
  const std::string dt = e["dtype"].get<std::string>();
  if (!dtype_from_safetensors(dt, &t.dtype)) throw bad(fmt::format("unknown dtype '{}'", dt));
  const json& shape = e["shape"];
  if (shape.size() > size_t(kMaxDims)) throw bad(fmt::format("rank {} exceeds {}", shape.size(), kMaxDims));
  uint64_t numel = 1;
  std::vector<int64_t> dims;
  for (const json& d : shape) {
    if (!d.is_number_unsigned()) throw bad("shape entries must be non-negative integers");
    const uint64_t v = d.get<uint64_t>();
    if (v > uint64_t(std::numeric_limits<int64_t>::max()) || mul_overflow(numel, v, &numel))
      throw bad("shape is too large");
    dims.push_back(int64_t(v));
  }
  t.shape = Shape::of(dims);
  for (const json& o : e["data_offsets"])
    if (!o.is_number_unsigned()) throw bad("data_offsets must be non-negative integers");
  t.begin = e["data_offsets"][0].get<uint64_t>();
  t.end = e["data_offsets"][1].get<uint64_t>();
  if (t.end < t.begin) throw bad(fmt::format("data_offsets [{}, {}] end before begin", t.begin, t.end));
  uint64_t nbytes;
  if (mul_overflow(numel, dtype_size(t.dtype), &nbytes)) throw bad("byte size overflows");
  if (t.end - t.begin != nbytes)
    throw bad(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}] cover {}", t.shape.str(), dt,
                          nbytes, t.begin, t.end, t.end - t.begin));
  if (t.end > data_size)
    throw bad(fmt::format("data_offsets [{}, {}] run past the end of the data section ({} bytes): file truncated?",
                          t.begin, t.end, data_size));
  return t;
}

}  // namespace

std::vector<TensorInfo> parse_safetensors_header(std::string_view header, uint64_t data_size, const std::string& what,
                                                 std::map<std::string, std::string>* metadata) {
  std::set<std::string> seen;
  std::string dup;
  auto cb = [&](int d, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && d == 1 && dup.empty()) {
      const std::string k = parsed.get<std::string>();
      if (!seen.insert(k).second) dup = k;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(header.begin(), header.end(), cb);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", what, e.what());
  }
  if (!dup.empty()) fail("{}: tensor '{}' appears twice in the header", what, dup);
  if (!j.is_object()) fail("{}: header is not a JSON object", what);

  std::vector<TensorInfo> out;
  for (const auto& [name, e] : j.items()) {
    if (name == "__metadata__") {
      if (!e.is_object()) fail("{}: __metadata__ must be an object of strings", what);
      for (const auto& [k, v] : e.items()) {
        if (!v.is_string()) fail("{}: __metadata__ value for '{}' is not a string", what, k);
        if (metadata) (*metadata)[k] = v.get<std::string>();
      }
      continue;
    }
    out.push_back(parse_entry(name, e, data_size, what));
  }
  // Disjointness: sort by begin and compare neighbours (empty tensors occupy no bytes).
  std::vector<const TensorInfo*> order;
  for (const auto& t : out)
    if (t.end > t.begin) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i]->begin < order[i - 1]->end)
      fail("{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", what, order[i - 1]->name, order[i - 1]->begin,
           order[i - 1]->end, order[i]->name, order[i]->begin, order[i]->end);
  }
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("{}: cannot stat: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail("{}: file is {} bytes, too short for a safetensors header length", path, size);
  }
  map_ = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail("{}: mmap failed: {}", path, std::strerror(errno));
  }
  map_size_ = size;
  const auto* bytes = static_cast<const uint8_t*>(map_);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxSafetensorsHeader)
    fail("{}: header length {} exceeds the {} byte limit (corrupt file?)", path, n, kMaxSafetensorsHeader);
  if (n > size - 8) fail("{}: header length {} runs past the end of the {}-byte file (truncated?)", path, n, size);
  const std::string_view header(reinterpret_cast<const char*>(bytes + 8), n);
  data_ = bytes + 8 + n;
  tensors_ = parse_safetensors_header(header, size - 8 - n, path, &metadata_);
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

TensorView SafetensorsFile::view(const TensorInfo& t) const {
  return TensorView(const_cast<uint8_t*>(data_ + t.begin), t.dtype, t.shape);
}

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) fail("{}: not a directory", dir);
  const fs::path index = root / "model.safetensors.index.json";
  const fs::path single = root / "model.safetensors";

  auto add_file = [&](const std::string& path) -> SafetensorsFile* {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
    return files_.back().get();
  };

  if (fs::exists(index, ec)) {
    json j;
    {
      std::ifstream in(index);
      if (!in) fail("{}: cannot read", index.string());
      try {
        j = json::parse(in);
      } catch (const json::exception& e) {
        fail("{}: not valid JSON: {}", index.string(), e.what());
      }
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail("{}: missing object 'weight_map'", index.string());
    std::map<std::string, std::vector<std::string>> by_file;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) fail("{}: weight_map entry '{}' is not a file name", index.string(), name);
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        fail("{}: weight_map entry '{}' names '{}', which is not a plain file name in the directory", index.string(),
             name, f);
      by_file[f].push_back(name);
    }
    // Existence first: a missing shard is the root cause and must not hide behind the
    // consequences it has for other shards.
    for (const auto& [f, names] : by_file)
      if (!fs::exists(root / f, ec))
        fail("{}: shard '{}' listed for tensor '{}' does not exist", index.string(), f, names.front());
    for (const auto& [f, names] : by_file) {
      SafetensorsFile* sf = add_file((root / f).string());
      std::set<std::string> listed(names.begin(), names.end());
      for (const auto& n : names) {
        const TensorInfo* t = sf->find(n);
        if (!t) fail("{}: tensor '{}' is listed in the index but missing from shard '{}'", index.string(), n, f);
        tensors_.emplace(n, Entry{sf, t});
      }
      for (const auto& t : sf->tensors())
        if (!listed.count(t.name))
          fail("{}: shard '{}' holds tensor '{}', which the index does not list", index.string(), f, t.name);
    }
  } else if (fs::exists(single, ec)) {
    SafetensorsFile* sf = add_file(single.string());
    for (const auto& t : sf->tensors()) tensors_.emplace(t.name, Entry{sf, &t});
  } else {
    fail("{}: no model.safetensors.index.json or model.safetensors found", dir);
  }
}

const Checkpoint::Entry* Checkpoint::find(std::string_view name) const {
  auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

}  // namespace kestrel
