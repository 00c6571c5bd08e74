// DSpark's batched KDA keep on the GPU (issue #19; model/cuda/speculative.cpp keep_verified_batch):
//  1. GpuSpec.CopyRowsMultiMatchesTwin: kernels/cuda/rows.h copy_rows_multi (several arrays of different row
//     sizes, one index map, one launch) against its CPU twin bit for bit, the rows it must not write left as
//     they were (no checkpoint needed).
//  2. GpuSpec.KeepVerifiedBatchedEqualsPerSequence: on the nano checkpoint of KESTREL_GPU_CKPTS (hidden 256),
//     B = 1, 3, 5 requests prefilled on their own slots, then ONE verify forward of all of them (blocks of 2..5
//     rows); from the same pools, keep_verified per sequence (two copies per KDA layer and sequence, the old
//     path) and keep_verified_batch (one launch) must leave every KDA layer's recurrent state and conv history
//     bit for bit the same, and each kept slot must hold exactly the trace row of its position — for positions
//     0 (only the anchor kept), the block's last (all accepted) and mixed ones. A batched keep that did nothing
//     fails: some positions differ from the forward's final state, which the pools hold before the keep.
//  3. GpuSpec.ProfileSumsPhasesOfSpeculativeSteps: runtime/spec_profile.h (KESTREL_SPEC_PROFILE) over marks
//     recorded after a sync, as the executor's last ones are: its summary (every 2 steps) names each phase with
//     its count, skips a step without verify sequences, and reads events the stream has not reached yet.
//  4. GpuSpec.MarkovGreedyMatchesTwin: kernels/cuda/dspark.h dspark_markov_greedy (the vocabulary split over
//     CTAs, two launches a step) against a host twin of model::Draft::markov_logits + first maximum, token for
//     token: r = 32 (16-byte rows) and 12 (the scalar path), V a multiple of the CTA's 1024 tokens and not,
//     one and several requests, and planted ties (a base row with two equal maxima and W2 rows of zeros).
// Kept apart from test_spec_gpu.cpp (already past the ~600-line guide); same GpuSpec.* filter.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dspark.h"
#include "kernels/cuda/rows.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "loader/weights.h"
#include "model/cuda/cache.h"
#include "model/cuda/cuda_model.h"
#include "runtime/spec_profile.h"

namespace kestrel::gputest {
namespace {

TEST(GpuSpec, CopyRowsMultiMatchesTwin) {
  Rng r(11);
  // Three arrays of 48-, 16- and 4096-byte rows (a conv history, a tiny one, a state): 9 rows each.
  const std::vector<int64_t> bytes{48, 16, 4096};
  const int64_t rows = 9;
  const std::vector<int32_t> src_idx{7, 0, 3, 3}, dst_idx{2, 8, 5, 0};  // a source row read twice
  const int64_t n = int64_t(src_idx.size());
  std::vector<std::vector<uint8_t>> src_h, dst_h;
  std::vector<Dev<uint8_t>> src_d, dst_d;
  for (int64_t b : bytes) {
    src_h.push_back(rand_u8(size_t(rows * b), r, 0, 255));
    dst_h.push_back(rand_u8(size_t(rows * b), r, 0, 255));
    src_d.push_back(upload(src_h.back()));
    dst_d.push_back(upload(dst_h.back()));
  }
  std::vector<cuda::RowArrays> tab_d, tab_h;
  for (size_t a = 0; a < bytes.size(); ++a) {
    tab_d.push_back({src_d[a].p(), dst_d[a].p(), bytes[a]});
    tab_h.push_back({src_h[a].data(), dst_h[a].data(), bytes[a]});
  }
  std::vector<uint8_t> tab_bytes(tab_d.size() * sizeof(cuda::RowArrays));
  std::memcpy(tab_bytes.data(), tab_d.data(), tab_bytes.size());
  auto dtab = upload(tab_bytes);
  auto dsrc = upload(src_idx), ddst = upload(dst_idx);
  cuda::copy_rows_multi(reinterpret_cast<const cuda::RowArrays*>(dtab.p()), int64_t(tab_d.size()), 4096, dsrc.p(),
                        ddst.p(), n, nullptr);
  sync();
  const std::vector<std::vector<uint8_t>> before = dst_h;
  cuda::cpu_copy_rows_multi(tab_h.data(), int64_t(tab_h.size()), src_idx.data(), dst_idx.data(), n);
  for (size_t a = 0; a < bytes.size(); ++a) {
    const std::vector<uint8_t> got = dst_d[a].get();
    check_exact("copy_rows_multi", fmt::format("array {}: {} rows of {} B", a, n, bytes[a]), got.data(),
                dst_h[a].data(), got.size());
    EXPECT_NE(before[a], dst_h[a]) << "the twin wrote nothing: the case tests nothing";
  }
}

TEST(GpuSpec, MarkovGreedyMatchesTwin) {
  Rng rng(23);
  struct Case {
    int64_t n, V, r, Nb, steps;
  };
  for (const Case& c : {Case{1, 12256, 32, 8, 7}, Case{3, 2048, 32, 8, 8}, Case{2, 1000, 12, 4, 3},
                        Case{5, 3000, 64, 8, 7}}) {
    const std::string shape = fmt::format("n={} V={} r={} steps={}", c.n, c.V, c.r, c.steps);
    std::vector<float> base = rand_f32(size_t(c.n * c.Nb * c.V), rng, -4.0f, 4.0f);
    std::vector<uint16_t> w1 = rand_bf16(size_t(c.V * c.r), rng, -1.0f, 1.0f);
    std::vector<uint16_t> w2 = rand_bf16(size_t(c.V * c.r), rng, -1.0f, 1.0f);
    std::vector<int32_t> anchors(size_t(c.n));
    for (int64_t b = 0; b < c.n; ++b) anchors[size_t(b)] = int32_t((b * 7919 + 13) % c.V);
    // Ties: W2 rows 5 and 9 zero and request 0's step-0 base equal and largest there, so its pick must be 5
    // (the first maximum) whatever the CTA split.
    for (int64_t k = 0; k < c.r; ++k) w2[size_t(5 * c.r + k)] = w2[size_t(9 * c.r + k)] = 0;
    base[5] = base[9] = 1e6f;
    auto d_base = upload(base);
    auto d_w1 = upload(w1), d_w2 = upload(w2);
    auto d_anchors = upload(anchors);
    Dev<int32_t> d_ids = poisoned<int32_t>(size_t(c.n * c.steps));
    auto ws = upload(std::vector<uint8_t>(cuda::dspark_markov_greedy_workspace_bytes(c.n, c.V)));
    cuda::dspark_markov_greedy(d_base.p(), c.Nb, d_w1.p(), d_w2.p(), d_anchors.p(), c.n, c.V, c.r, c.steps, d_ids.p(),
                               ws.p(), nullptr);
    sync();
    const std::vector<int32_t> got = d_ids.get();
    // The twin: model::Draft::markov_logits' sum (over k in order, FP32, multiply then add: the host build has no
    // FMA contraction) and std::max_element's first maximum.
    std::vector<int32_t> ref(size_t(c.n * c.steps));
    std::vector<float> e(size_t(c.r)), lg(size_t(c.V));
    const std::vector<float> w1f = to_f32(w1), w2f = to_f32(w2);
    for (int64_t b = 0; b < c.n; ++b) {
      int32_t prev = anchors[size_t(b)];
      for (int64_t i = 0; i < c.steps; ++i) {
        for (int64_t k = 0; k < c.r; ++k) e[size_t(k)] = w1f[size_t(prev * c.r + k)];
        for (int64_t v = 0; v < c.V; ++v) {
          float s = 0.0f;
          for (int64_t k = 0; k < c.r; ++k) s += w2f[size_t(v * c.r + k)] * e[size_t(k)];
          lg[size_t(v)] = base[size_t((b * c.Nb + i) * c.V + v)] + s;
        }
        prev = int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin());
        ref[size_t(b * c.steps + i)] = prev;
      }
    }
    EXPECT_EQ(got, ref) << shape;
    EXPECT_EQ(got[0], 5) << shape << ": the planted tie goes to the lower id";
  }
}

struct KeepNano {
  ModelConfig cfg;
  std::unique_ptr<Checkpoint> ckpt;
  ModelWeights w;
  std::unique_ptr<model::CudaModel> gm;
};
KeepNano* keep_nano() {
  static KeepNano* s = []() -> KeepNano* {
    for (const std::string& d : gpu_ckpt_dirs()) {
      auto* p = new KeepNano;
      p->cfg = load_config(d);
      if (p->cfg.text.hidden_size != 256) {
        delete p;
        continue;
      }
      p->ckpt = std::make_unique<Checkpoint>(d);
      p->w = bind_weights(p->cfg, *p->ckpt);
      p->gm = std::make_unique<model::CudaModel>(p->cfg, p->w);
      return p;
    }
    return static_cast<KeepNano*>(nullptr);
  }();
  return s;
}

// Every KDA layer's recurrent pool then conv pool, bytes, concatenated (slots+1 rows each).
std::vector<uint8_t> read_pools(const model::CudaCache& cc) {
  sync();
  const int64_t slots = int64_t(cc.num_slots) + 1, sb = cc.layout.kda_recurrent_bytes, cb = cc.layout.kda_conv_bytes;
  std::vector<uint8_t> h;
  for (size_t L = 0; L < cc.kda_S.size(); ++L) {
    if (!cc.kda_S[L]) continue;
    const size_t at = h.size();
    h.resize(at + size_t(slots * (sb + cb)));
    KCUDA_CHECK(cudaMemcpy(h.data() + at, cc.kda_S[L], size_t(slots * sb), cudaMemcpyDeviceToHost));
    KCUDA_CHECK(cudaMemcpy(h.data() + at + slots * sb, cc.kda_conv[L], size_t(slots * cb), cudaMemcpyDeviceToHost));
  }
  return h;
}
void write_pools(model::CudaCache& cc, const std::vector<uint8_t>& h) {
  sync();
  const int64_t slots = int64_t(cc.num_slots) + 1, sb = cc.layout.kda_recurrent_bytes, cb = cc.layout.kda_conv_bytes;
  size_t at = 0;
  for (size_t L = 0; L < cc.kda_S.size(); ++L) {
    if (!cc.kda_S[L]) continue;
    KCUDA_CHECK(cudaMemcpy(cc.kda_S[L], h.data() + at, size_t(slots * sb), cudaMemcpyHostToDevice));
    KCUDA_CHECK(cudaMemcpy(cc.kda_conv[L], h.data() + at + slots * sb, size_t(slots * cb), cudaMemcpyHostToDevice));
    at += size_t(slots * (sb + cb));
  }
  sync();
}
// What the keep must leave: `before` with each verify sequence k's slot rows replaced by its trace row t[k].
std::vector<uint8_t> expected_pools(const model::CudaCache& cc, std::vector<uint8_t> h, const std::vector<int64_t>& t) {
  const int64_t slots = int64_t(cc.num_slots) + 1, sb = cc.layout.kda_recurrent_bytes, cb = cc.layout.kda_conv_bytes;
  size_t at = 0;
  for (size_t L = 0; L < cc.kda_S.size(); ++L) {
    if (!cc.kda_S[L]) continue;
    for (size_t k = 0; k < cc.verify.size(); ++k) {
      const model::CudaCache::VerifySeq& vs = cc.verify[k];
      const int64_t row = vs.row0 + t[k];
      KCUDA_CHECK(cudaMemcpy(h.data() + at + vs.slot * sb, cc.trace_S[L] + row * sb, size_t(sb), cudaMemcpyDeviceToHost));
      KCUDA_CHECK(cudaMemcpy(h.data() + at + slots * sb + vs.slot * cb, cc.trace_conv[L] + row * cb, size_t(cb),
                             cudaMemcpyDeviceToHost));
    }
    at += size_t(slots * (sb + cb));
  }
  return h;
}

TEST(GpuSpec, KeepVerifiedBatchedEqualsPerSequence) {
  KeepNano* S = keep_nano();
  ASSERT_TRUE(S != nullptr) << "KESTREL_GPU_CKPTS holds no nano checkpoint (hidden 256): run through "
                               "bench/gpu/run.sh spec";
  model::CudaModel& gm = *S->gm;
  const int64_t V = S->cfg.text.vocab_size;
  const std::vector<int64_t> lens{4, 2, 5, 3, 4};  // each verify block's rows (1 + γ)
  // Per B, the kept positions to try: only the anchor, every block whole, mixed.
  const std::vector<std::vector<std::vector<int64_t>>> keeps{
      {{0}, {3}, {1}},
      {{0, 1, 4}, {3, 0, 2}, {0, 0, 0}, {3, 1, 4}},
      {{3, 1, 4, 2, 3}, {0, 0, 0, 0, 0}, {2, 1, 0, 1, 3}, {1, 0, 3, 2, 0}}};
  const int page = 16, pages_per_seq = 4;
  int cases = 0;
  for (const auto& per_b : keeps) {
    const int64_t B = int64_t(per_b.front().size());
    auto cache = gm.new_cache(int32_t(B * pages_per_seq), int32_t(B + 2),
                              CacheFormats{page, LatentFormat::bf16, IndexKeyFormat::bf16, KdaStateDtype::f32});
    model::CudaCache& cc = *cache;
    const size_t nb = size_t(B);
    std::vector<std::vector<int32_t>> tables(nb), prompts(nb), blocks(nb);
    std::vector<model::CudaSeq> verify;
    for (int64_t b = 0; b < B; ++b) {
      for (int p = 0; p < pages_per_seq; ++p) tables[size_t(b)].push_back(int32_t(b * pages_per_seq + p));
      const int64_t P = 10 + 3 * b;  // prompt tokens
      const int64_t ids = std::min<int64_t>(V, 1000);
      for (int64_t i = 0; i < P; ++i) prompts[size_t(b)].push_back(int32_t((i * 7919 + 31 * b + 13) % ids));
      for (int64_t i = 0; i < lens[size_t(b)]; ++i) blocks[size_t(b)].push_back(int32_t((i * 104729 + 17 * b + 5) % ids));
      const int32_t slot = int32_t(b + 1);  // slot 0 stays untouched: the keep must not write there
      model::CudaSeq q{prompts[size_t(b)], 0, slot, tables[size_t(b)], model::CudaSeq::Logits::last};
      gm.forward_batch(cc, std::span<const model::CudaSeq>(&q, 1));
      model::CudaSeq v{blocks[size_t(b)], P, slot, tables[size_t(b)], model::CudaSeq::Logits::all};
      v.verify = true;
      verify.push_back(v);
    }
    gm.forward_batch(cc, verify);
    ASSERT_EQ(int64_t(cc.verify.size()), B) << "the verify forward recorded another number of verify sequences";
    const std::vector<uint8_t> before = read_pools(cc);
    for (const std::vector<int64_t>& t : per_b) {
      const std::string shape = fmt::format("B={} keep {}", B, fmt::join(t, ","));
      write_pools(cc, before);
      for (int64_t k = 0; k < B; ++k) gm.keep_verified(cc, k, t[size_t(k)]);
      const std::vector<uint8_t> per_seq = read_pools(cc);
      write_pools(cc, before);
      gm.keep_verified_batch(cc, t);
      const std::vector<uint8_t> batched = read_pools(cc);
      ASSERT_EQ(batched.size(), per_seq.size());
      check_exact("keep_verified_batch vs per seq", shape, batched.data(), per_seq.data(), batched.size());
      const std::vector<uint8_t> want = expected_pools(cc, before, t);
      check_exact("keep_verified_batch vs trace", shape, batched.data(), want.data(), batched.size());
      bool partial = false;  // a position before the block's last: the kept state is not the forward's final one
      for (int64_t k = 0; k < B; ++k) partial = partial || t[size_t(k)] < lens[size_t(k)] - 1;
      if (partial) {
        EXPECT_NE(want, before) << shape << ": the trace rows equal the final states: the case tests nothing";
      }
      ++cases;
    }
  }
  note(fmt::format("{:<28} {:<34} {} cases bit-exact", "keep_verified_batch", "nano B=1,3,5", cases));
}

TEST(GpuSpec, ProfileSumsPhasesOfSpeculativeSteps) {
  cudaStream_t st = nullptr;
  KCUDA_CHECK(cudaStreamCreate(&st));
  auto dbuf = poisoned<uint8_t>(size_t(1) << 24);  // 16 MB: a device memset keeps the stream busy a little
  testing::internal::CaptureStderr();
  {
    runtime::SpecProfile p(st, 2);
    for (int step = 0; step < 3; ++step) {
      p.begin_step();
      KCUDA_CHECK(cudaMemsetAsync(dbuf.p(), step, size_t(1) << 24, st));
      p.mark("phase.one");
      p.mark("phase.two");
      p.mark("phase.two");  // twice in a step: counted once
      KCUDA_CHECK(cudaMemsetAsync(dbuf.p(), step + 1, size_t(1) << 24, st));  // the last mark follows queued work
      p.mark("phase.three");
      p.end_step(step == 1 ? 0 : 3, 21);  // step 1 verified nothing: not summed
    }
  }  // two summed steps: one report at the second, none left at destruction
  const std::string err = testing::internal::GetCapturedStderr();
  KCUDA_CHECK(cudaStreamDestroy(st));
  note(fmt::format("{:<28} {:<34} {} bytes of summary", "spec profile", "3 steps, every 2", err.size()));
  EXPECT_NE(err.find("spec-profile #1: 2 speculative steps, 3.00 verify sequences"), std::string::npos) << err;
  EXPECT_EQ(err.find("spec-profile #2"), std::string::npos) << err;
  for (const char* ph : {"phase.one", "phase.two", "phase.three"}) {
    const size_t at = err.find(std::string("  ") + ph);
    ASSERT_NE(at, std::string::npos) << ph << " missing:\n" << err;
    const std::string line = err.substr(at, err.find('\n', at) - at);
    int64_t count = -1;
    std::sscanf(line.c_str() + 2 + std::strlen(ph), "%ld", &count);
    EXPECT_EQ(count, 2) << line;
  }
}

}  // namespace
}  // namespace kestrel::gputest
