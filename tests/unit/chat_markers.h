// The K3 chat format's control markers as text (MODEL.md's chat format), for writing prompts and model
// outputs in tests. One definition: the tests that spell outputs with them share a unity translation unit in
// CI's build (KESTREL_UNITY), where per-file copies would be ambiguous.
#pragma once

#include <string>

namespace kestrel::chat_markers {

inline const std::string O = "<|open|>", C = "<|close|>", S = "<|sep|>", END = "<|end_of_msg|>";

}  // namespace kestrel::chat_markers
