// Draft caches and per-request drafting for the serving engine's speculation: see spec_executor.h.
#include "runtime/spec_executor.h"

#include <algorithm>

#include "core/check.h"
#include "runtime/spec_decode.h"

namespace kestrel::runtime {

SpecDrafter::SpecDrafter(const SpecServing& s, int32_t num_pages, int block_size, bool host_caches)
    : s_(s), block_size_(block_size), host_(host_caches) {
  KCHECK(s_.draft && s_.draft->cfg, "speculation without a draft");
  const DraftConfig& dc = *s_.draft->cfg;
  if (s_.num_speculative_tokens < 1 || s_.num_speculative_tokens > dc.block_size)
    fail("num_speculative_tokens {} must be in 1..{} (the draft's block size)", s_.num_speculative_tokens,
         dc.block_size);
  const model::MlaCacheView v =
      model::MlaCacheView::make(s_.draft->mla_cfg, LatentFormat::bf16, IndexKeyFormat::bf16, block_size);
  if (host_caches)
    latent_.assign(size_t(dc.num_hidden_layers),
                   std::vector<uint8_t>(size_t(int64_t(num_pages) * block_size * v.latent_token_bytes())));
}

std::vector<model::MlaCacheView> SpecDrafter::views(std::span<const cache::PageId> table) {
  const DraftConfig& dc = *s_.draft->cfg;
  std::vector<model::MlaCacheView> out(size_t(dc.num_hidden_layers));
  for (size_t l = 0; l < out.size(); ++l) {
    out[l] = model::MlaCacheView::make(s_.draft->mla_cfg, LatentFormat::bf16, IndexKeyFormat::bf16, block_size_);
    out[l].latent = latent_.empty() ? nullptr : latent_[l].data();
    out[l].block_table = table;
  }
  return out;
}

void SpecDrafter::inject(std::span<const cache::PageId> table, int64_t pos0, const uint16_t* taps, int64_t T) {
  if (T <= 0) return;
  KCHECK(host_, "SpecDrafter: no host caches (the draft runs on the GPU)");
  s_.draft->inject(views(table), pos0, taps, T);
}

SpecDrafter::Block SpecDrafter::draft_block(RequestId id, std::span<const cache::PageId> table, int64_t ctx,
                                            int32_t anchor, int gamma, const SamplingParams& params,
                                            uint64_t out_index, const float* base) {
  const model::Draft& d = *s_.draft;
  KCHECK(gamma >= 1 && gamma <= d.cfg->block_size, "draft block of {} tokens (block size {})", gamma,
         d.cfg->block_size);
  Block b;
  std::vector<int32_t> all(size_t(d.cfg->block_size));
  int64_t vocab = 0;
  auto pick = [&](int i, std::span<const float> lg) -> int32_t {
    vocab = int64_t(lg.size());
    if (i >= gamma) return int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin());  // not verified
    if (b.q.empty()) b.q.assign(size_t(gamma) * lg.size(), 0.0);
    double* qi = b.q.data() + size_t(i) * lg.size();
    if (s_.oracle) {
      const int32_t t = s_.oracle(id, int64_t(out_index) + i);
      if (t >= 0) {
        qi[t] = 1.0;
        return t;
      }
    }
    return draft_pick(params, s_.draft_greedy, out_index, i, lg, qi);
  };
  if (base) {
    d.draft_from_base(base, anchor, s_.draft_topk, pick, all.data());
  } else {
    KCHECK(host_, "SpecDrafter: no host caches (the draft runs on the GPU)");
    d.draft(views(table), ctx, anchor, s_.draft_topk, pick, all.data());
  }
  KCHECK(vocab > 0 && b.q.size() == size_t(gamma * vocab), "the draft produced no distributions");
  b.tokens.assign(all.begin(), all.begin() + gamma);
  return b;
}

}  // namespace kestrel::runtime
