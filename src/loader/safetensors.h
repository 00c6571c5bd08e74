// Memory-mapped safetensors files and sharded checkpoints.
//
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
// optional "__metadata__" (string -> string), then the data section; offsets are relative to it.
// Nothing from the file is trusted before it is validated: header length bound, UTF-8 JSON object,
// known dtype, non-negative shape whose byte size equals the offset range, ranges inside the file
// and pairwise disjoint, no duplicate names. A failure throws kestrel::Error naming the file and the
// tensor. Tensors are returned as TensorViews pointing into the read-only mapping (zero copy).
// Like every mmap reader, this assumes nobody truncates a shard while it is mapped: the kernel
// answers a read past the new end with SIGBUS, which no validation can prevent.
//
// A checkpoint directory holds either `model.safetensors` or shards listed by
// `model.safetensors.index.json` ({"weight_map": {tensor: file}}); every index entry must exist in
// the named shard and every tensor of a shard must be listed in the index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"

namespace kestrel {

// Largest header we accept (the reference implementation's bound as well).
inline constexpr uint64_t kMaxSafetensorsHeader = 100ull << 20;

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;  // byte offsets inside the data section
  uint64_t end = 0;
};

// Parses and validates a header. `header` is the JSON text; `data_size` the byte length of the data
// section that follows it. `what` names the file in messages. Exposed separately for the fuzzer.
std::vector<TensorInfo> parse_safetensors_header(std::string_view header, uint64_t data_size,
                                                 const std::string& what,
                                                 std::map<std::string, std::string>* metadata = nullptr);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(std::string_view name) const;
  TensorView view(const TensorInfo& t) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data section
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory (single file or sharded).
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);

  const std::string& dir() const { return dir_; }
  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const Entry* find(std::string_view name) const;
  TensorView view(const Entry& e) const { return e.file->view(*e.info); }
  size_t num_files() const { return files_.size(); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> tensors_;
};

}  // namespace kestrel
