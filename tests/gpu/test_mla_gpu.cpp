// MLA attention (naive prefill, absorbed decode, sparse) and the DSA indexer on the GPU against their CPU
// twins in kernels/cpu/mla_ops.h (the code the CPU layers run), at nano and mini (one TP8 rank) shapes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "gpu_ref.h"
#include "harness.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/mla_ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/norm.h"

namespace kestrel::gputest {
namespace {

const cpu::MlaDims kNano{4, 32, 16, 32, 64}, kMini{12, 128, 64, 128, 512};

// A random ascending selection of `count` distinct positions out of [0, visible), −1 padded to Ksel.
std::vector<int32_t> rand_sel(int64_t visible, int64_t count, int64_t Ksel, Rng& r) {
  std::vector<int32_t> all(static_cast<size_t>(visible));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t i = 0; i < count; ++i) std::swap(all[size_t(i)], all[size_t(i + int64_t(r.next() % uint64_t(visible - i)))]);
  std::vector<int32_t> s(all.begin(), all.begin() + count);
  std::sort(s.begin(), s.end());
  s.resize(size_t(Ksel), -1);
  return s;
}

// Latent rows look like the model's: ĉ is RMSNorm output (|x| ~ 1), k_pe a raw projection.
std::vector<uint16_t> rand_latent(int64_t S, const cpu::MlaDims& d, Rng& r) {
  return rand_bf16(size_t(S * d.cw()), r, -1.5f, 1.5f);
}

TEST(GpuMla, NaivePrefill) {
  need_gpu();
  struct Case {
    cpu::MlaDims d;
    int64_t T, pos0, Ksel;  // Ksel > 0: sparse with that many slots
    const char* what;
  };
  Rng rng(41);
  for (Case c : {Case{kNano, 5, 0, 0, "nano"}, Case{kNano, 3, 70, 0, "nano"}, Case{kNano, 4, 100, 64, "nano sparse"},
                 Case{kMini, 64, 0, 0, "mini"}, Case{kMini, 8, 2040, 0, "mini"},
                 Case{kMini, 4, 8188, 2048, "mini sparse 8K"}, Case{kMini, 2, 8190, 0, "mini dense 8K"}}) {
    const auto& d = c.d;
    const int64_t S = c.pos0 + c.T;
    const auto q = rand_bf16(size_t(c.T * d.Hm * d.qk()), rng, -1.0f, 1.0f);
    const auto kv = rand_bf16(size_t(S * d.Hm * (d.N + d.Dv)), rng, -1.0f, 1.0f);
    const auto lat = rand_latent(S, d, rng);
    std::vector<int32_t> sel;
    for (int64_t t = 0; c.Ksel && t < c.T; ++t) {
      const int64_t vis = c.pos0 + t + 1, cnt = std::min(vis, c.Ksel - int64_t(t % 3) * 7);
      auto s = rand_sel(vis, cnt, c.Ksel, rng);
      sel.insert(sel.end(), s.begin(), s.end());
    }
    std::vector<uint16_t> ref(size_t(c.T * d.Hm * d.Dv));
    cpu::mla_attn_naive(d, q.data(), kv.data(), lat.data(), c.Ksel ? sel.data() : nullptr, c.Ksel, c.T, c.pos0,
                        ref.data());
    auto dq = upload(q);
    auto dkv = upload(kv);
    auto dl = upload(lat);
    auto ds = upload(sel);
    auto dout = poisoned<uint16_t>(ref.size());
    cuda::mla_attn_naive(d, dq.p(), dkv.p(), dl.p(), c.Ksel ? ds.p() : nullptr, c.Ksel, c.T, c.pos0, dout.p(), nullptr);
    sync();
    check_bf16("mla_attn_naive", fmt::format("{} Hm={} T={} S={}{}", c.what, d.Hm, c.T, S, c.Ksel ? " sel" : ""),
               dout.get(), ref, {2e-3, 2 * kBf16Ulp, 5e-3});
  }
}

// Absorbed decode: B requests, each with its own cache buffer (varlen), dense or sparse.
TEST(GpuMla, AbsorbedDecode) {
  need_gpu();
  struct Case {
    cpu::MlaDims d;
    std::vector<int64_t> lens;
    int64_t Ksel;
    const char* what;
  };
  Rng rng(42);
  cuda::GemmLt lt;
  for (const Case& c : {Case{kNano, {1, 17, 100}, 0, "nano"}, Case{kNano, {90, 200}, 64, "nano sparse"},
                        Case{kMini, {1, 700, 2048, 8192}, 0, "mini"}, Case{kMini, {37}, 0, "mini"},
                        Case{kMini, {8192, 3000, 2100}, 2048, "mini sparse"},
                        Case{kMini, std::vector<int64_t>(16, 1500), 0, "mini B=16"}}) {
    const auto& d = c.d;
    const int64_t B = int64_t(c.lens.size());
    const auto q = rand_bf16(size_t(B * d.Hm * d.qk()), rng, -1.0f, 1.0f);
    const auto kvb = rand_bf16(size_t(d.Hm * (d.N + d.Dv) * d.C), rng, -0.08f, 0.08f);
    std::vector<uint16_t> ref(size_t(B * d.Hm * d.Dv));
    std::vector<Dev<uint16_t>> caches;
    std::vector<const uint16_t*> ptrs;
    std::vector<int32_t> lens, sel;
    int64_t max_keys = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t S = c.lens[size_t(b)];
      const auto lat = rand_latent(S, d, rng);
      const int32_t* sel_row = nullptr;
      if (c.Ksel) {
        const int64_t cnt = std::min(S, c.Ksel - (b % 2) * 5);
        auto s = rand_sel(S, cnt, c.Ksel, rng);
        sel.insert(sel.end(), s.begin(), s.end());
        sel_row = sel.data() + b * c.Ksel;
        max_keys = std::max(max_keys, cnt);
      } else {
        max_keys = std::max(max_keys, S);
      }
      cpu::mla_attn_absorbed(d, q.data() + b * d.Hm * d.qk(), kvb.data(), lat.data(), sel_row, c.Ksel, 1, S - 1,
                             ref.data() + b * d.Hm * d.Dv);
      caches.push_back(upload(lat));
      ptrs.push_back(caches.back().p());
      lens.push_back(int32_t(S));
    }
    auto dq = upload(q);
    auto dkvb = upload(kvb);
    auto dsel = upload(sel);
    auto dlens = upload(lens);
    Dev<const uint16_t*> dptrs{cuda::DeviceBuffer(ptrs.size() * sizeof(void*)), ptrs.size()};
    dptrs.buf.copy_from_host(ptrs.data(), ptrs.size() * sizeof(void*));
    const cuda::MlaDecodeBatch bt{dptrs.p(), dlens.p(), c.Ksel ? dsel.p() : nullptr, c.Ksel, B, max_keys};
    cuda::DeviceBuffer ws(cuda::mla_decode_workspace_bytes(d, B, max_keys));
    auto dout = poisoned<uint16_t>(ref.size());
    cuda::mla_decode_absorbed(lt, d, dq.p(), dkvb.p(), bt, ws.data(), dout.p(), nullptr);
    sync();
    check_bf16("mla_decode_absorbed", fmt::format("{} Hm={} B={} keys<={}{}", c.what, d.Hm, B, max_keys,
                                                  c.Ksel ? " sel" : ""),
               dout.get(), ref, {2e-3, 2 * kBf16Ulp, 5e-3});
  }
}

TEST(GpuIndexer, KeyNorm) {
  need_gpu();
  Rng rng(43);
  for (auto [T, Di, bias] : {std::tuple{5, 32, false}, std::tuple{64, 128, true}, std::tuple{300, 128, false}}) {
    const auto kraw = rand_bf16(size_t(T * Di), rng, -2.0f, 3.0f);
    const auto w = rand_bf16(size_t(Di), rng, 0.5f, 1.5f), b = rand_bf16(size_t(Di), rng, -0.2f, 0.2f);
    std::vector<uint16_t> ref(size_t(T * Di));
    cpu::indexer_key_norm(kraw.data(), w.data(), bias ? b.data() : nullptr, T, Di, ref.data());
    auto dk = upload(kraw);
    auto dw = upload(w);
    auto db = upload(b);
    auto dout = poisoned<uint16_t>(ref.size());
    cuda::indexer_key_norm(dk.p(), dw.p(), bias ? db.p() : nullptr, T, Di, dout.p(), nullptr);
    sync();
    check_bf16("indexer_key_norm", fmt::format("T={} Di={}{}", T, Di, bias ? " bias" : ""), dout.get(), ref,
               {1e-6, kBf16Ulp, 1e-3});
  }
}

// Selection must equal the CPU's exactly, ties included: `dup` copies key rows so that many positions
// score exactly alike (ties at the threshold go to the lower position on both sides).
TEST(GpuIndexer, SelectTopk) {
  need_gpu();
  struct Case {
    int64_t Hi, Di, Ki, T, pos0;
    int dup;  // every key s ≥ dup copies key s % dup (0: all distinct)
    const char* what;
  };
  Rng rng(44);
  for (Case c : {Case{2, 32, 64, 5, 0, 0, "nano all visible"}, Case{2, 32, 64, 4, 100, 0, "nano"},
                 Case{2, 32, 64, 6, 61, 0, "nano crossing topk"}, Case{2, 32, 64, 3, 300, 7, "nano ties"},
                 Case{32, 128, 2048, 3, 2046, 0, "mini crossing topk"}, Case{32, 128, 2048, 4, 8188, 0, "mini 8K"},
                 Case{32, 128, 2048, 2, 5000, 1000, "mini ties"}, Case{32, 128, 2048, 64, 4000, 0, "mini prefill"}}) {
    const int64_t S = c.pos0 + c.T;
    const auto qi = rand_bf16(size_t(c.T * c.Hi * c.Di), rng, -1.0f, 1.0f);
    auto keys = rand_bf16(size_t(S * c.Di), rng, -2.0f, 2.0f);
    if (c.dup)
      for (int64_t s = c.dup; s < S; ++s)
        std::copy_n(keys.begin() + (s % c.dup) * c.Di, c.Di, keys.begin() + s * c.Di);
    const auto hw = rand_f32(size_t(c.T * c.Hi), rng, -1.0f, 2.0f);
    std::vector<int32_t> ref(size_t(c.T * c.Ki));
    cpu::indexer_select_topk(qi.data(), keys.data(), hw.data(), c.T, c.pos0, c.Hi, c.Di, c.Ki, ref.data());
    auto dq = upload(qi);
    auto dk = upload(keys);
    auto dh = upload(hw);
    auto dscores = poisoned<float>(size_t(c.T * S));
    auto dsel = poisoned<int32_t>(ref.size());
    // Poison as a large positive: an index never written would show as a mismatch.
    std::vector<int32_t> junk(ref.size(), 0x7fffffff);
    dsel.buf.copy_from_host(junk.data(), junk.size() * 4);
    cuda::indexer_select(dq.p(), dk.p(), dh.p(), c.T, c.pos0, c.Hi, c.Di, c.Ki, dscores.p(), S, dsel.p(), nullptr);
    sync();
    const auto got = dsel.get();
    check_exact("indexer_select (top-k ids)",
                fmt::format("{} Hi={} Di={} k={} T={} S={}", c.what, c.Hi, c.Di, c.Ki, c.T, S), got.data(), ref.data(),
                ref.size() * 4);
  }
}

}  // namespace
}  // namespace kestrel::gputest
