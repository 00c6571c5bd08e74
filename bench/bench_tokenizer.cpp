// Tokenizer throughput benchmark: encode (and decode) MB/s on long texts, single thread.
//
//   bench_tokenizer --model DIR FILE...     (texts from bench/make_bench_text.py)
// For each file: the best of several full encodes (specials off, as the chat encoder encodes user
// text), the pre-tokenizer alone, and decode. Results go to bench/RESULTS.md by hand.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "core/check.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"

using namespace kestrel::tok;
using Clock = std::chrono::steady_clock;

template <typename F>
double best_seconds(int reps, F&& f) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  if (argc < 4 || std::string(argv[1]) != "--model") {
    std::fprintf(stderr, "usage: bench_tokenizer --model DIR FILE...\n");
    return 2;
  }
  try {
    const Tokenizer tok = Tokenizer::load(argv[2]);
    (void)tok.encode("warm up the Unicode tables");
    for (int i = 3; i < argc; ++i) {
      std::ifstream f(argv[i], std::ios::binary);
      if (!f) kestrel::fail("cannot open {}", argv[i]);
      std::stringstream ss;
      ss << f.rdbuf();
      const std::string text = ss.str();
      const double mb = text.size() / 1e6;
      std::vector<TokenId> ids;
      const double t_enc = best_seconds(5, [&] { ids = tok.encode(text); });
      size_t pieces = 0;
      const double t_pre = best_seconds(5, [&] {
        pieces = 0;
        pretokenize(text, [&](std::string_view) { ++pieces; });
      });
      std::string back;
      const double t_dec = best_seconds(5, [&] { back = tok.decode(ids); });
      if (back != text) kestrel::fail("{}: decode(encode(text)) != text", argv[i]);
      std::printf("%s: %.2f MB, %zu tokens (%.2f bytes/token), %zu pieces\n", argv[i], mb, ids.size(),
                  text.size() / double(ids.size()), pieces);
      std::printf("  encode      %8.1f MB/s  (%.3f s)\n", mb / t_enc, t_enc);
      std::printf("  pretokenize %8.1f MB/s  (%.3f s)\n", mb / t_pre, t_pre);
      std::printf("  decode      %8.1f MB/s  (%.3f s)\n", mb / t_dec, t_dec);
    }
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
