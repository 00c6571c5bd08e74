// The golden test vocabulary (tests/data/tok_golden), loaded once, for the tokenizer fuzz targets.
// Found relative to this header so the targets run from any working directory.
#pragma once

#include <string>

#include "tokenizer/tokenizer.h"

inline const kestrel::tok::Tokenizer& golden_tokenizer() {
  static const kestrel::tok::Tokenizer t = [] {
    std::string dir = __FILE__;
    dir = dir.substr(0, dir.rfind('/'));
    return kestrel::tok::Tokenizer::load(dir + "/../data/tok_golden");
  }();
  return t;
}
