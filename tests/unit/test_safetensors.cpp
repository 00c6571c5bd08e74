// safetensors reader: valid files read back exactly; every corruption gives its own message.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include <fmt/format.h>
#include <unistd.h>

#include "core/check.h"
#include "loader/safetensors.h"

namespace kestrel {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// Each test process (ctest runs them in parallel) and each test gets its own directory: rewriting a
// file that another process has memory-mapped would crash that process with SIGBUS. (GoogleTest's ::testing,
// spelled out: in CI's unity build a file batched before this one may declare kestrel::testing.)
fs::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return fs::path(::testing::TempDir()) / fmt::format("kestrel_st_{}_{}", ::getpid(), info ? info->name() : "none");
}

std::string write_raw(const std::string& name, const std::string& header, const std::string& data,
                      int64_t len_override = -1) {
  const fs::path dir = test_dir();
  fs::create_directories(dir);
  const std::string path = (dir / name).string();
  std::ofstream out(path, std::ios::binary);
  uint64_t n = len_override >= 0 ? uint64_t(len_override) : header.size();
  for (int i = 0; i < 8; ++i) out.put(char((n >> (8 * i)) & 0xff));
  out << header << data;
  return path;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_error(const std::string& header, const std::string& data, std::initializer_list<const char*> fragments,
                  int64_t len_override = -1) {
  const std::string path = write_raw("bad.safetensors", header, data, len_override);
  const std::string msg = error_of([&] { SafetensorsFile f(path); });
  ASSERT_FALSE(msg.empty()) << "accepted: " << header;
  EXPECT_NE(msg.find(path), std::string::npos) << "message names the file: " << msg;
  for (const char* f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << msg << "\nwant: " << f;
}

TEST(Safetensors, ReadsValidFileExactly) {
  std::mt19937 rng(5);
  std::string data(24 + 6, '\0');
  for (char& c : data) c = char(rng());
  json h = {{"a", {{"dtype", "BF16"}, {"shape", {3, 4}}, {"data_offsets", {0, 24}}}},
            {"b", {{"dtype", "U8"}, {"shape", {2, 3}}, {"data_offsets", {24, 30}}}},
            {"empty", {{"dtype", "F32"}, {"shape", {0, 5}}, {"data_offsets", {30, 30}}}},
            {"__metadata__", {{"format", "pt"}}}};
  const std::string path = write_raw("ok.safetensors", h.dump(), data);
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const TensorInfo* a = f.find("a");
  ASSERT_NE(a, nullptr);
  const TensorView v = f.view(*a);
  EXPECT_EQ(v.dtype, DType::bf16);
  EXPECT_EQ(v.shape, (Shape{3, 4}));
  EXPECT_EQ(std::memcmp(v.data, data.data(), 24), 0);
  const TensorView b = f.view(*f.find("b"));
  EXPECT_EQ(std::memcmp(b.data, data.data() + 24, 6), 0);
  EXPECT_EQ(f.find("nope"), nullptr);
}

TEST(Safetensors, RejectsTinyAndTruncatedFiles) {
  const fs::path dir = test_dir();
  fs::create_directories(dir);
  const std::string tiny = (dir / "tiny.safetensors").string();
  std::ofstream(tiny, std::ios::binary) << "abc";
  EXPECT_NE(error_of([&] { SafetensorsFile f(tiny); }).find("too short"), std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsFile f((dir / "missing.safetensors").string()); }).find("cannot open"),
            std::string::npos);
  // Data section shorter than the offsets promise: a truncated shard.
  json h = {{"a", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}}};
  expect_error(h.dump(), std::string(10, 'x'), {"tensor 'a'", "past the end of the data section", "truncated"});
}

TEST(Safetensors, RejectsAbsurdHeaderLength) {
  expect_error("{}", "", {"header length", "exceeds"}, int64_t(1) << 40);
  expect_error("{}", "", {"header length 1000 runs past the end"}, 1000);
}

TEST(Safetensors, RejectsBadJson) {
  expect_error("{\"a\": [", "", {"not valid JSON"});
  expect_error("[1,2,3]", "", {"not a JSON object"});
  expect_error("{\"a\": 5}", "", {"tensor 'a'", "not a JSON object"});
  std::string bad_utf8 = "{\"a\xff\": 1}";
  expect_error(bad_utf8, "", {"not valid JSON"});
}

TEST(Safetensors, RejectsUnknownDtypeAndWrongShape) {
  json h = {{"w", {{"dtype", "F4_E2M1"}, {"shape", {2}}, {"data_offsets", {0, 1}}}}};
  expect_error(h.dump(), "x", {"tensor 'w'", "unknown dtype 'F4_E2M1'"});
  h = {{"w", {{"dtype", "BF16"}, {"shape", {2, 3}}, {"data_offsets", {0, 10}}}}};
  expect_error(h.dump(), std::string(10, 'x'), {"tensor 'w'", "needs 12 bytes", "cover 10"});
  h = {{"w", {{"dtype", "BF16"}, {"shape", {-2, 3}}, {"data_offsets", {0, 12}}}}};
  expect_error(h.dump(), std::string(12, 'x'), {"tensor 'w'", "non-negative integers"});
  h = {{"w", {{"dtype", "BF16"}, {"shape", {uint64_t(1) << 62, 1u << 20}}, {"data_offsets", {0, 12}}}}};
  expect_error(h.dump(), std::string(12, 'x'), {"tensor 'w'", "too large"});
  h = {{"w", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {4, 2}}}}};
  expect_error(h.dump(), std::string(12, 'x'), {"tensor 'w'", "end before begin"});
  h = {{"w", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {0}}}}};
  expect_error(h.dump(), std::string(12, 'x'), {"tensor 'w'", "data_offsets"});
  h = {{"w", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {0, 2}}, {"extra", 1}}}};
  expect_error(h.dump(), std::string(12, 'x'), {"tensor 'w'", "unexpected field 'extra'"});
}

TEST(Safetensors, RejectsOverlappingRangesAndDuplicates) {
  json h = {{"a", {{"dtype", "U8"}, {"shape", {8}}, {"data_offsets", {0, 8}}}},
            {"b", {{"dtype", "U8"}, {"shape", {8}}, {"data_offsets", {4, 12}}}}};
  expect_error(h.dump(), std::string(12, 'x'), {"'a' [0, 8]", "'b' [4, 12]", "overlap"});
  const std::string dup = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                          R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  expect_error(dup, "xx", {"tensor 'a' appears twice"});
}

TEST(Safetensors, HeaderParserSurvivesRandomBytes) {
  // Cheap in-process fuzz on top of the libFuzzer target: random mutations of a valid header must
  // either parse or throw kestrel::Error, nothing else.
  const std::string base = json({{"a", {{"dtype", "BF16"}, {"shape", {3, 4}}, {"data_offsets", {0, 24}}}},
                                 {"b", {{"dtype", "U8"}, {"shape", {6}}, {"data_offsets", {24, 30}}}}})
                               .dump();
  std::mt19937 rng(99);
  int parsed = 0, rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string h = base;
    const int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) h[rng() % h.size()] = char(rng() % 128);
    try {
      parse_safetensors_header(h, 30, "fuzz");
      ++parsed;
    } catch (const Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_EQ(parsed + rejected, 20000);
}

}  // namespace
}  // namespace kestrel
