// Host-side arithmetic of PagedMlaCache (the per-token byte counts of cache/layout.h) and the check that
// the GPU format enums name the same formats as the cache's.
#include "kernels/cuda/paged.h"

#include "cache/layout.h"

namespace kestrel::cuda {

static_assert(int(PagedLatentFormat::bf16) == int(cache::LatentFormat::bf16));
static_assert(int(PagedLatentFormat::fp8) == int(cache::LatentFormat::fp8));
static_assert(int(PagedKeyFormat::fp8) == int(cache::IndexKeyFormat::fp8));
static_assert(int(PagedKeyFormat::mxfp4) == int(cache::IndexKeyFormat::mxfp4));
static_assert(int(PagedKeyFormat::bf16) == int(cache::IndexKeyFormat::bf16));

int64_t PagedMlaCache::latent_token_bytes() const {
  return latent_format == PagedLatentFormat::bf16 ? (C + R) * 2 : C + (C + 127) / 128 * 4 + R * 2;
}

int64_t PagedMlaCache::key_token_bytes() const {
  switch (key_format) {
    case PagedKeyFormat::bf16: return Di * 2;
    case PagedKeyFormat::fp8: return Di + 4;
    case PagedKeyFormat::mxfp4: return Di / 2 + Di / 32;
  }
  return 0;
}

}  // namespace kestrel::cuda
