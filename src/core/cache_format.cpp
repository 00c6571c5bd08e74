// Cache-format checks and CLI spellings (the formats and their bytes are in cache_format.h).
#include "core/cache_format.h"

#include "core/check.h"

namespace kestrel {

void check_index_key_format(IndexKeyFormat f, int64_t Di) {
  if (f == IndexKeyFormat::mxfp4 && Di % 32 != 0)
    fail("cache: MXFP4 index keys need index_head_dim % 32 == 0, got {}", Di);
}

LatentFormat parse_latent_format(const std::string& s) {
  if (s == "bf16") return LatentFormat::bf16;
  if (s == "fp8") return LatentFormat::fp8;
  fail("latent cache dtype must be bf16 or fp8, got '{}'", s);
}

IndexKeyFormat parse_index_key_format(const std::string& s) {
  if (s == "bf16") return IndexKeyFormat::bf16;
  if (s == "fp8") return IndexKeyFormat::fp8;
  if (s == "mxfp4") return IndexKeyFormat::mxfp4;
  fail("index-key cache dtype must be bf16, fp8 or mxfp4, got '{}'", s);
}

KdaStateDtype parse_kda_state_dtype(const std::string& s) {
  if (s == "f32" || s == "fp32" || s == "float32") return KdaStateDtype::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return KdaStateDtype::f16;
  fail("KDA state dtype must be f32 or f16, got '{}'", s);
}

const char* format_name(LatentFormat f) { return f == LatentFormat::bf16 ? "bf16" : "fp8"; }
const char* format_name(IndexKeyFormat f) {
  return f == IndexKeyFormat::bf16 ? "bf16" : f == IndexKeyFormat::fp8 ? "fp8" : "mxfp4";
}
const char* format_name(KdaStateDtype f) { return f == KdaStateDtype::f32 ? "f32" : "f16"; }

}  // namespace kestrel
